"""Per-key quotas without Ray: the settings' two syntaxes, the ledger's sliding windows and Retry-After values on a fake
clock, concurrency leases released or lapsing, one key never charged for another's use, and the coordinator's front
failing open when its store does not answer."""

import asyncio
import logging
import math
from types import SimpleNamespace

import pytest

from deployments.http.quotas import MemoryQuotas, Quotas, QuotaStore
from omni_ray import env
from omni_ray.errors import RateLimitError
from omni_ray.quotas import WINDOW_S, Charge, KeyLimits, Limit, QuotaLedger, QuotaSettings


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def ledger(clock):
    return QuotaLedger(clock)


ONE = Charge(images=1, work=100.0)


def test_both_syntaxes_give_the_same_settings_and_a_key_takes_the_default_where_it_sets_nothing():
    lines = """
        # a Secret's file: one entry a line
        default: rpm=60, ipm=120, concurrent=4, work=2e6
        key1: rpm=10
    """
    as_json = '{"default": {"rpm": 60, "ipm": 120, "concurrent": 4, "work": 2000000}, "key1": {"rpm": 10}}'
    one_line = "default:rpm=60,ipm=120,concurrent=4,work=2000000;key1:rpm=10"
    settings = QuotaSettings.parse(lines, num_keys=2)
    assert settings == QuotaSettings.parse(as_json, 2) == QuotaSettings.parse(one_line, 2)
    assert settings.for_key("key0") == KeyLimits(rpm=60, ipm=120, concurrent=4, work=2e6)
    assert settings.for_key("key1") == KeyLimits(rpm=10, ipm=120, concurrent=4, work=2e6)
    assert QuotaSettings.parse("key0: ipm=5").for_key("key1").is_empty  # no default: key1 is unlimited
    assert QuotaSettings.parse("").is_empty


@pytest.mark.parametrize("text, message", [
    ("key2: rpm=1", "'key2' names no key: OMNI_RAY_API_KEY has 2 key(s), key0..key1"),
    ("sk-secret: rpm=1", "neither 'default' nor a key's name"),
    ("key0: rpm=0", "key0.rpm: Input should be greater than 0"),
    ("key0: rpm=fast", "key0.rpm: 'fast' is not a number"),
    ("key0: tpm=5", "key0.tpm: Extra inputs are not permitted"),
    ("key0 rpm=5", "expected 'name: rpm=60"),
    ("key0: rpm=1; key0: ipm=2", "'key0' given more than once"),
    ('{"key0": 5}', "JSON must be an object of objects"),
])
def test_a_bad_setting_is_an_error_naming_the_entry(text, message):
    with pytest.raises(ValueError, match="key limits: ") as err:
        QuotaSettings.parse(text, num_keys=2)
    assert message in str(err.value)


def test_requests_per_minute_is_a_sliding_window_and_retry_after_is_when_the_oldest_leaves(ledger, clock):
    limits = KeyLimits(rpm=3)
    for _ in range(3):
        assert ledger.acquire("key0", limits, ONE, 600).admitted
        clock.now += 10  # admitted at 1000, 1010, 1020
    refused = ledger.acquire("key0", limits, ONE, 600)  # at 1030
    assert (refused.limit, refused.retry_after_s, refused.used, refused.allowed) == (Limit.RPM, 30.0, 3, 3)
    clock.now += 29.5
    assert ledger.acquire("key0", limits, ONE, 600).retry_after_s == pytest.approx(0.5)  # refusals are not counted
    clock.now += 0.5  # the first one leaves the window
    assert ledger.acquire("key0", limits, ONE, 600).admitted
    assert not ledger.acquire("key0", limits, ONE, 600).admitted


def test_images_and_work_per_minute_wait_for_as_many_old_requests_as_must_leave(ledger, clock):
    limits = KeyLimits(ipm=5, work=1000)
    for images, work in ((2, 300), (2, 300), (1, 300)):  # at 1000, 1001, 1002
        assert ledger.acquire("key0", limits, Charge(images=images, work=work), 600).admitted
        clock.now += 1
    three = ledger.acquire("key0", limits, Charge(images=3, work=10), 600)  # 5 used: two requests must leave
    assert (three.limit, three.retry_after_s) == (Limit.IPM, WINDOW_S + 1001 - clock.now)
    heavy = ledger.acquire("key0", limits, Charge(images=1, work=500), 600)  # 900 used: two must leave
    assert (heavy.limit, heavy.limit.error_type, heavy.retry_after_s) == (Limit.WORK, "tokens", 58.0)
    both = ledger.acquire("key0", limits, Charge(images=4, work=801), 600)  # ipm frees at 1001, work at 1002
    assert (both.limit, both.retry_after_s) == (Limit.WORK, 59.0)  # the longer wait names the refusal
    never = ledger.acquire("key0", limits, Charge(images=6, work=1), 600)
    assert (never.limit, never.retry_after_s) == (Limit.IPM, math.inf)  # more than the limit itself


def test_a_concurrent_lease_ends_when_released_or_at_its_lapse(ledger, clock):
    limits = KeyLimits(concurrent=2)
    first = ledger.acquire("key0", limits, ONE, lease_s=30)
    second = ledger.acquire("key0", limits, ONE, lease_s=300)
    third = ledger.acquire("key0", limits, ONE, 30)
    assert (third.limit, third.retry_after_s, third.used) == (Limit.CONCURRENT, 1.0, 2)
    ledger.release("key0", first.lease)
    ledger.release("key0", first.lease)  # twice: nothing more
    assert ledger.usage("key0")["concurrent"] == 1
    assert (third := ledger.acquire("key0", limits, ONE, 30)).admitted
    assert not ledger.acquire("key0", limits, ONE, 30).admitted
    clock.now += 31  # the third's holder died without releasing it: it lapses at its request's deadline
    assert ledger.acquire("key0", limits, ONE, 30).admitted
    ledger.release("key0", second.lease)
    assert ledger.usage("key0")["concurrent"] == 1


def test_one_keys_use_never_counts_against_another(ledger, clock):
    tight, loose = KeyLimits(rpm=1, concurrent=1), KeyLimits(rpm=100, concurrent=100)
    assert ledger.acquire("key0", tight, ONE, 60).admitted
    assert not ledger.acquire("key0", tight, ONE, 60).admitted
    for _ in range(50):
        assert ledger.acquire("key1", loose, Charge(images=2, work=5), 60).admitted
    assert ledger.usage("key0") == {"rpm": 1, "ipm": 1, "concurrent": 1, "work": 100}
    assert ledger.usage("key1") == {"rpm": 50, "ipm": 100, "concurrent": 50, "work": 250}
    clock.now += WINDOW_S + 61  # windows emptied and leases lapsed: nothing is left behind
    assert ledger.usage("key1") == dict.fromkeys(("rpm", "ipm", "concurrent", "work"), 0)
    assert not ledger.keys["key1"].spent and not ledger.keys["key1"].leases


def test_settings_from_the_environment_or_a_secrets_file(tmp_path):
    secret = tmp_path / "limits"
    secret.write_text("default: rpm=5\n")
    assert env.key_limits({env.KEY_LIMITS: "key0: rpm=1"}) == "key0: rpm=1"
    assert env.key_limits({env.KEY_LIMITS_FILE: str(secret)}) == "default: rpm=5\n"
    assert env.key_limits({env.KEY_LIMITS_FILE: str(tmp_path / "absent")}) is None  # an optional Secret not made
    assert env.key_limits({}) is None
    with pytest.raises(ValueError, match="not both"):
        env.key_limits({env.KEY_LIMITS: "key0: rpm=1", env.KEY_LIMITS_FILE: str(secret)})
    made = []
    quotas = Quotas.from_env(2, lambda: made.append(1) or MemoryQuotas(), {env.KEY_LIMITS_FILE: str(secret)})
    assert quotas.settings.for_key("key1") == KeyLimits(rpm=5) and made == [1]
    assert Quotas.from_env(0, lambda: made.append(1), {env.KEY_LIMITS: "key3: rpm=5"}).settings is None
    assert Quotas.from_env(2, lambda: made.append(1), {}).settings is None and made == [1]  # no store without limits


def plan(n=1, layers=0, work_tokens=64, steps=4, timeout_s=30.0):
    """What the quotas read of a GenerationPlan."""
    return SimpleNamespace(request=SimpleNamespace(n=n), images_per_result=layers or 1, work_tokens=work_tokens,
                           steps_run=steps, timeout_s=timeout_s)


def test_a_layered_requests_layers_count_as_images_and_work_is_tokens_times_steps_times_n(clock):
    quotas = Quotas(QuotaSettings.parse("default: ipm=8, work=2000"), MemoryQuotas(QuotaLedger(clock)))
    asyncio.run(quotas.acquire("key0", plan(n=2, layers=3, work_tokens=100, steps=5)))  # 6 images, 1000 work
    usage = quotas.store.ledger.usage("key0")
    assert (usage["ipm"], usage["work"]) == (6, 1000)
    with pytest.raises(RateLimitError) as err:
        asyncio.run(quotas.acquire("key0", plan(n=1, layers=3)))
    assert (err.value.status_code, err.value.code, err.value.error_type) == (429, "rate_limit_exceeded", "requests")
    assert str(err.value) == ("Rate limit reached for key0 on images per minute (IPM): Limit 8, Used 6, "
                              "Requested 3. Please try again in 60s.")
    with pytest.raises(RateLimitError) as err:
        asyncio.run(quotas.acquire("key1", plan(n=1, work_tokens=1000, steps=3)))
    assert str(err.value).startswith("Request too large for key1 on DiT work tokens per minute (TPM): Limit 2000, "
                                     "Used 0, Requested 3000.")
    assert err.value.retry_after_s == WINDOW_S


def test_a_lease_ends_once_and_a_request_without_a_key_or_limits_is_never_charged(clock):
    quotas = Quotas(QuotaSettings.parse("key0: concurrent=1"), MemoryQuotas(QuotaLedger(clock)))
    lease = asyncio.run(quotas.acquire("key0", plan()))
    assert quotas.running["key0"] == 1
    with pytest.raises(RateLimitError, match="concurrent requests: Limit 1, Used 1, Requested 1. Please try again "
                       "when one of them ends"):
        asyncio.run(quotas.acquire("key0", plan()))
    lease.end()
    lease.end()
    assert quotas.running["key0"] == 0 and quotas.store.ledger.usage("key0")["concurrent"] == 0
    for key in (None, "key1"):  # an open server's caller, and a key without limits
        for _ in range(3):
            asyncio.run(quotas.acquire(key, plan()))
    assert set(quotas.store.ledger.keys) == {"key0"}


class BrokenStore(QuotaStore):
    def __init__(self, hang: bool):
        self.hang, self.calls = hang, 0

    async def acquire(self, key, limits, charge, lease_s):
        self.calls += 1
        if self.hang:
            await asyncio.sleep(3600)
        raise ConnectionError("the ledger's actor is gone")

    def release(self, key, lease):
        raise AssertionError("nothing was leased")


@pytest.mark.parametrize("hang", [False, True])
def test_quotas_fail_open_with_one_warning_when_the_store_does_not_answer(hang, caplog, monkeypatch):
    monkeypatch.setattr("deployments.http.quotas.STARTUP_TIMEOUT_S", 0.05)
    monkeypatch.setattr("deployments.http.quotas.CALL_TIMEOUT_S", 0.05)
    store = BrokenStore(hang)
    quotas = Quotas(QuotaSettings.parse("default: rpm=1"), store)
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        for _ in range(3):
            asyncio.run(quotas.acquire("key0", plan())).end()  # admitted, past the limit: unchecked
    assert store.calls == 3
    warnings = [r.message for r in caplog.records if "quota store did not answer" in r.message]
    assert len(warnings) == 1 and ("TimeoutError" if hang else "ConnectionError") in warnings[0]
