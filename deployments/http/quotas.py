"""Per-key quotas at the coordinator: each planned request of a keyed caller is charged to its key's limits
(``omni_ray.quotas``) in one call to a counter store that every coordinator replica shares, or refused with a 429.

The store is one detached actor per app (``ClusterQuotas``) holding the ledger: a sliding window needs an atomic
read-modify-write, which the GCS key-value store does not offer and an actor running one call at a time does, with
one clock for every replica. A request's lease is released when its response ends, by a call nobody waits for.

When the store does not answer in time (its actor restarting, its node lost) the request is admitted unchecked, with
a warning and ``omni_quota_store_errors_total``: quotas share the cluster fairly between keys, they do not guard it
(the API key does), and refusing every request while a bookkeeping actor restarts would turn its outage into the
app's. A restarted store starts its windows empty.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping

import ray

from deployments import metrics
from omni_ray import env
from omni_ray.api.planning import GenerationPlan
from omni_ray.errors import RateLimitError
from omni_ray.quotas import WINDOW_S, Charge, Decision, KeyLimits, Limit, QuotaLedger, QuotaSettings

logger = logging.getLogger("ray.serve")
COORDINATOR = {"stage": "coordinator"}
STARTUP_TIMEOUT_S = 30.0  # the first call waits for the store's actor to start (a worker process)
CALL_TIMEOUT_S = 1.0  # later calls: past it the request is admitted unchecked
LEASE_GRACE_S = 60.0  # a lease lapses this long after its request's deadline, if no one released it
WARN_EVERY_S = 60.0


class QuotaStore(ABC):
    """Where every coordinator replica's charges are counted."""

    @abstractmethod
    async def acquire(self, key: str, limits: KeyLimits, charge: Charge, lease_s: float) -> Decision: ...

    @abstractmethod
    def release(self, key: str, lease: str) -> None:
        """Ends a lease, without waiting (a cancelled request's cleanup cannot)."""


class MemoryQuotas(QuotaStore):
    """A ledger in this process: for a coordinator outside Serve, and for tests (two coordinators over one of these
    share their counts as replicas over the cluster's store do)."""

    def __init__(self, ledger: QuotaLedger | None = None):
        self.ledger = ledger or QuotaLedger()

    async def acquire(self, key: str, limits: KeyLimits, charge: Charge, lease_s: float) -> Decision:
        return self.ledger.acquire(key, limits, charge, lease_s)

    def release(self, key: str, lease: str) -> None:
        self.ledger.release(key, lease)


@ray.remote(num_cpus=0, max_restarts=-1)
class QuotaLedgerActor:
    """The app's ledger, detached: it outlives the replicas that created it. Its calls run one at a time."""

    def __init__(self):
        self.ledger = QuotaLedger()

    def acquire(self, key: str, limits: KeyLimits, charge: Charge, lease_s: float) -> Decision:
        return self.ledger.acquire(key, limits, charge, lease_s)

    def release(self, key: str, lease: str) -> None:
        self.ledger.release(key, lease)

    def usage(self, key: str) -> dict[str, float]:
        return self.ledger.usage(key)


class ClusterQuotas(QuotaStore):
    """The app's ledger actor (``omni_ray_quotas/<app>`` in the ``omni_ray`` namespace), created by the first
    replica that needs it and found by the others."""

    NAMESPACE = "omni_ray"

    def __init__(self, app_name: str):
        self.actor = QuotaLedgerActor.options(name=self.actor_name(app_name), namespace=self.NAMESPACE,
                                              lifetime="detached", get_if_exists=True).remote()

    @staticmethod
    def actor_name(app_name: str) -> str:
        return f"omni_ray_quotas/{app_name}"

    async def acquire(self, key: str, limits: KeyLimits, charge: Charge, lease_s: float) -> Decision:
        return await self.actor.acquire.remote(key, limits, charge, lease_s)

    def release(self, key: str, lease: str) -> None:
        self.actor.release.remote(key, lease)


class Lease:
    """An admitted request's hold on its key's concurrent requests: ended once, however the request ends (as a
    context manager, by ``holding`` a stream, or ``end()``)."""

    def __init__(self, end: Callable[[], None] | None = None):
        self._end = end

    def end(self) -> None:
        end, self._end = self._end, None
        if end is not None:
            end()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.end()

    async def holding(self, stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """``stream``, ending the lease when it ends or is closed (the client gone)."""
        try:
            async for item in stream:
                yield item
        finally:
            self.end()


NO_LEASE = Lease()


class Quotas:
    """The coordinator's quotas: each keyed request charged to its key's limits in the store, or refused."""

    def __init__(self, settings: QuotaSettings | None = None, store: QuotaStore | None = None,
                 make_store: Callable[[], QuotaStore] = MemoryQuotas):
        """``store``: where charges are counted; unset, ``make_store()`` makes it once limits apply."""
        self.start_settings = settings if settings is not None and not settings.is_empty else None
        self.settings = self.start_settings
        self.make_store = make_store
        self.store = store if store is not None or self.settings is None else make_store()
        self.running: Counter[str] = Counter()  # this replica's running requests per key
        self.timeout_s = STARTUP_TIMEOUT_S
        self.warned_at = -math.inf

    def set_settings(self, settings: QuotaSettings | None) -> None:
        """Limits from the next request on (the coordinator's live ``key_limits``); None: the environment's again.
        Running requests keep their leases."""
        self.settings = self.start_settings if settings is None else settings if not settings.is_empty else None
        if self.settings is not None and self.store is None:
            self.store = self.make_store()  # now, not on a request's path

    @classmethod
    def from_env(cls, num_keys: int, store: Callable[[], QuotaStore],
                 environ: Mapping[str, str] = os.environ) -> Quotas:
        """The limits ``OMNI_RAY_KEY_LIMITS`` (or the file ``OMNI_RAY_KEY_LIMITS_FILE``) sets, for a server with
        ``num_keys`` API keys, over ``store()`` (made only when there are limits); none without keys."""
        text = env.key_limits(environ)
        if text is None:
            if environ.get(env.KEY_LIMITS_FILE):
                logger.warning("%s names no file (%s): no per-key quotas", env.KEY_LIMITS_FILE,
                               environ[env.KEY_LIMITS_FILE])
            return cls(make_store=store)
        settings = QuotaSettings.parse(text, num_keys or None)
        if num_keys == 0:
            logger.warning("per-key quotas are set but OMNI_RAY_API_KEY is not: no request is limited")
            return cls(make_store=store)
        if settings.is_empty:
            return cls(make_store=store)
        logger.info("per-key quotas are on: default %s%s", settings.default.model_dump(exclude_none=True),
                    "".join(f"; {name} {limits.model_dump(exclude_none=True)}"
                            for name, limits in sorted(settings.keys.items())))
        return cls(settings, store(), store)

    async def acquire(self, key: str | None, plan: GenerationPlan) -> Lease:
        """Charges the planned request to ``key``'s limits: its lease, to end when the request ends; RateLimitError
        (a 429 with Retry-After) over a limit. Nothing without limits or a key."""
        if self.settings is None or key is None:
            return NO_LEASE
        limits = self.settings.for_key(key)
        if limits.is_empty:
            return NO_LEASE
        charge = Charge(images=plan.request.n * plan.images_per_result,
                        work=float(plan.work_tokens * plan.steps_run * plan.request.n))
        try:
            async with asyncio.timeout(self.timeout_s):  # not wait_for, which can swallow the caller's cancellation
                decision = await self.store.acquire(key, limits, charge, plan.timeout_s + LEASE_GRACE_S)
        except Exception as err:  # fail open: see the module's docstring
            self.timeout_s = CALL_TIMEOUT_S
            self._warn(err)
            return NO_LEASE
        self.timeout_s = CALL_TIMEOUT_S
        if not decision.admitted:
            metrics.quota_refusals.inc(tags={**COORDINATOR, "key": key, "limit": decision.limit.value})
            raise _refusal(key, decision, charge)
        tags = {**COORDINATOR, "key": key}
        metrics.quota_requests.inc(tags=tags)
        metrics.quota_images.inc(charge.images, tags=tags)
        if charge.work > 0:
            metrics.quota_work.inc(charge.work, tags=tags)
        self.running[key] += 1
        metrics.quota_running.set(self.running[key], tags=tags)

        def end() -> None:
            self.running[key] -= 1
            metrics.quota_running.set(self.running[key], tags=tags)
            try:
                self.store.release(key, decision.lease)
            except Exception as err:  # the lease lapses at the request's deadline instead
                self._warn(err)

        return Lease(end)

    def _warn(self, err: Exception) -> None:
        metrics.quota_store_errors.inc(tags=COORDINATOR)
        now = time.monotonic()
        if now - self.warned_at >= WARN_EVERY_S:
            self.warned_at = now
            logger.warning("the quota store did not answer (%s: %s): requests are admitted unchecked until it does",
                           type(err).__name__, err)


def _refusal(key: str, decision: Decision, charge: Charge) -> RateLimitError:
    """OpenAI's wording: what the limit is, what is used and what the request asks for, and when to try again."""
    limit, amount = decision.limit, charge.amount(decision.limit)
    figures = f"Limit {decision.allowed:g}, Used {decision.used:g}, Requested {amount:g}"
    if math.isinf(decision.retry_after_s):
        return RateLimitError(f"Request too large for {key} on {limit.description}: {figures}. Ask for less (fewer "
                              "images, steps or pixels).", limit.error_type, WINDOW_S)
    wait = max(1, math.ceil(decision.retry_after_s))
    when = "when one of them ends" if limit is Limit.CONCURRENT else f"in {wait}s"
    return RateLimitError(f"Rate limit reached for {key} on {limit.description}: {figures}. Please try again {when}.",
                          limit.error_type, decision.retry_after_s)
