"""Live settings without a cluster (issue 49): what each deployment's ``user_config`` may change and how a refusal
reads (``omni_ray.live_settings``); a change taking effect in a running engine between two steps; a deployment's
``reconfigure`` that refuses without raising and keeps its settings (``deployments.live``); the coordinator's quotas
and admission margins changed live; ``/health`` from the routers' replica sets through a reconfigure's moment
without one (``deployments.health``); the adapters' copy answering, at once, while the store does not
(``MirroredAdapters``); and ``python -m deployments.check`` finding a bad key before a deploy."""

from __future__ import annotations

import asyncio

import pytest
from conftest import REPO

from deployments import check
from deployments.health import GRACE_S, ReplicaWatch
from deployments.http.adapters import Adapter, MirroredAdapters
from deployments.http.api_keys import ApiKeys
from deployments.live import LiveDeployment
from omni_ray.config import load_config
from omni_ray.engine.async_engine import AsyncEngine
from omni_ray.engine.builders import build_dit_core, create_policy
from omni_ray.live_settings import CoordinatorLive, DiTLive, EncoderLive, LiveSettingsError, VAELive
from omni_ray.records import DenoiseParams, DenoiseRequest
from testing import coordinator
from testing.coordinator import MemoryAdapters
from testing.reference import PromptEncoder

BODY = {"prompt": "a cat", "size": "64x64", "num_inference_steps": 2}


@pytest.fixture(scope="module")
def config(tiny_dir):
    return load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir),
                       overrides={"dit": {"max_batch_tokens": 4096}})


# --- what may change, and how a refusal reads -------------------------------------------------------------------


def test_a_stage_s_limits_may_be_lowered_live_and_not_raised(config):
    assert DiTLive.parse({"max_batch_size": 2, "max_batch_tokens": 1024}, config.dit).set_fields() == {
        "max_batch_size": 2, "max_batch_tokens": 1024}
    assert DiTLive.parse(None, config.dit).set_fields() == {}  # the preset's values
    applied = DiTLive.parse({"max_batch_tokens": None, "max_paused": 1}, config.dit).applied_to(config.dit)
    assert (applied.max_batch_tokens, applied.max_paused) == (4096, 1)  # null: the preset's
    with pytest.raises(LiveSettingsError, match=r"max_batch_size 9 is above the preset's dit.max_batch_size \(8\)"):
        DiTLive.parse({"max_batch_size": 9}, config.dit)
    with pytest.raises(LiveSettingsError, match="may only be lowered live"):
        VAELive.parse({"max_batch_size": config.vae.max_batch_size + 1}, config.vae)
    assert EncoderLive.parse({"max_num_seqs": 1}, config.encoder).max_num_seqs == 1
    with pytest.raises(LiveSettingsError, match="Encoder: user_config max_num_seqs: Input should be greater than 0"):
        EncoderLive.parse({"max_num_seqs": 0}, config.encoder)


def test_a_key_that_cannot_change_live_is_named_with_the_way_it_can(config):
    with pytest.raises(LiveSettingsError) as refused:
        DiTLive.parse({"max_batch_size": 2, "compile": True}, config.dit)
    message = str(refused.value)
    assert message.startswith("DiT: user_config 'compile' cannot change while the replicas run")
    assert "max_batch_size, max_batch_tokens, max_wait_steps, max_paused, priority_aging_s can" in message
    assert "args.overrides" in message
    with pytest.raises(LiveSettingsError, match="must be a mapping"):
        VAELive.parse([4], config.vae)
    fifo = config.dit.model_copy(update={"scheduling": "fifo", "max_batch_tokens": None})
    with pytest.raises(LiveSettingsError, match="priority scheduling's"):
        DiTLive.parse({"max_paused": 1}, fifo)
    with pytest.raises(LiveSettingsError, match="priority_aging_s: Input should be greater than 0"):
        DiTLive.parse({"priority_aging_s": 0}, config.dit)


def test_the_coordinator_s_quotas_are_checked_as_the_environment_s_are():
    live = CoordinatorLive.parse({"key_limits": {"default": {"rpm": 2}}, "admission_margin": 0.2})
    assert live.quota_settings(2).default.rpm == 2
    assert CoordinatorLive.parse({"key_limits": "key1: ipm=4"}).quota_settings(2).keys["key1"].ipm == 4
    assert CoordinatorLive.parse({"key_limits": {}}).quota_settings(2).is_empty  # quotas off
    with pytest.raises(LiveSettingsError, match="'key5' names no key"):
        CoordinatorLive.parse({"key_limits": {"key5": {"rpm": 1}}}).quota_settings(2)
    with pytest.raises(LiveSettingsError, match="key_limits: key limits: default.rmp"):
        CoordinatorLive.parse({"key_limits": {"default": {"rmp": 1}}})


# --- taking effect -------------------------------------------------------------------------------------------------


def test_a_lower_step_batch_takes_effect_between_two_steps_of_a_running_engine(config):
    """Six requests in a DiT engine of max_batch_size 8 and a 4096-token budget; once it has stepped all six
    together, the live settings lower the batch to two: every step after the change runs two at most, and all six
    finish."""
    live = DiTLive.parse({"max_batch_size": 2}, config.dit)
    dit = live.applied_to(config.dit)
    embeds = PromptEncoder(config.model).encode(["a red cat"])[0]
    requests = [DenoiseRequest(f"r{i}", DenoiseParams(64, 64, 20, seed=i), embeds) for i in range(6)]
    steps = []  # each step's rows, and "changed" where the change took effect, on the engine's thread
    engine = AsyncEngine(lambda: build_dit_core(config), "dit", on_step=lambda _, batch: steps.append(batch)).start()

    def change(core):
        core.set_limits(max_batch_size=dit.max_batch_size, max_wait_steps=dit.max_wait_steps,
                        policy=create_policy(dit))
        steps.append("changed")

    async def run():
        tasks = [asyncio.create_task(engine.generate(request)) for request in requests]
        while not steps:
            await asyncio.sleep(0.01)
        engine.submit(change)
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(results) == 6 and all(result.latents.shape == (16, 64) for result in results)
    changed = steps.index("changed")
    before, after = steps[:changed], steps[changed + 1:]
    assert before and max(before) > 2 and after and max(after) == 2, steps  # more than two rows before, two after


class Stage(LiveDeployment):
    """A deployment's live half alone: what ``_apply`` was given."""

    live_settings = DiTLive
    stage = "dit"

    def __init__(self, config):
        self._start_live(config)
        self.applied = []

    def _apply(self, live):
        live.applied_to(self.preset)
        self.applied.append(live.set_fields())


def test_reconfigure_refuses_a_bad_user_config_without_raising_and_keeps_its_settings(config):
    stage = Stage(config)
    asyncio.run(stage.reconfigure({"max_batch_size": 4}))
    assert stage.live_stats() == {"live_settings": {"max_batch_size": 4}, "user_config_refused": None}
    for bad in ({"max_batch_size": 2, "dtype": "float16"}, {"max_batch_size": 64}, "max_batch_size=2"):
        asyncio.run(stage.reconfigure(bad))  # Serve would stop the replica were this to raise
        stats = stage.live_stats()
        assert stats["live_settings"] == {"max_batch_size": 4} and stats["user_config_refused"].startswith("DiT: ")
    assert stage.applied == [{"max_batch_size": 4}]  # nothing of a refused one applied
    asyncio.run(stage.reconfigure({}))  # the preset's values back
    assert stage.live_stats() == {"live_settings": {}, "user_config_refused": None}


def test_the_coordinator_s_quotas_and_margins_change_live(config):
    keys = ("sk-a", "sk-b")
    app = coordinator.coordinator(config, api_keys=ApiKeys(keys))
    http = coordinator.TestClient(coordinator.build_api(app))
    keyed = {"Authorization": f"Bearer {keys[0]}"}
    assert all(http.post("/v1/images/generations", json=BODY, headers=keyed).status_code == 200 for _ in range(3))
    asyncio.run(app.reconfigure({"key_limits": {"default": {"rpm": 1}}, "admission_margin_s": 2.0}))
    assert app.stats() == {"live_settings": {"key_limits": {"default": {"rpm": 1}}, "admission_margin_s": 2.0},
                           "user_config_refused": None}
    assert app.admission.margin_s == 2.0 and app.admission.margin == 0.1
    assert http.post("/v1/images/generations", json=BODY, headers=keyed).status_code == 200
    refused = http.post("/v1/images/generations", json=BODY, headers=keyed)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
    asyncio.run(app.reconfigure({"key_limits": {"key9": {"rpm": 5}}}))  # refused: the limits stay
    assert "'key9' names no key" in app.stats()["user_config_refused"]
    assert http.post("/v1/images/generations", json=BODY, headers=keyed).status_code == 429
    asyncio.run(app.reconfigure({}))  # the environment's quotas (none) and margins again
    assert http.post("/v1/images/generations", json=BODY, headers=keyed).status_code == 200
    assert app.admission.margin_s == 0.5


# --- /health and /v1/models without the cluster on their path ------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_health_counts_a_stage_briefly_without_replicas_as_serving_and_one_gone_as_not():
    clock, counts = Clock(), {"Encoder": 0, "DiT": 0, "VAE": 0}
    watch = ReplicaWatch(lambda: dict(counts), clock)
    assert watch() == ["DiT", "Encoder", "VAE"]  # starting: none has had a replica
    counts.update(Encoder=1, DiT=2, VAE=1)
    assert watch() == []
    counts["DiT"] = 0  # its replicas reconfigured in place: out of the routers' sets for a moment
    clock.now += GRACE_S - 0.5
    assert watch() == []
    counts["DiT"] = 2
    clock.now += 1
    assert watch() == []
    counts["VAE"] = 0  # its last replica replaced, the new one not running yet
    assert watch() == []
    clock.now += GRACE_S
    assert watch() == ["VAE"]
    counts["VAE"] = 1
    assert watch() == []


class Unreachable(MemoryAdapters):
    """A store that stops answering (the GCS down): its reads never return."""

    def __init__(self):
        super().__init__()
        self.down = False
        self.reads = 0

    async def get(self, name):
        self.reads += 1
        if self.down:
            await asyncio.sleep(3600)
        return await super().get(name)

    async def all(self):
        self.reads += 1
        if self.down:
            await asyncio.sleep(3600)
        return await super().all()


def test_the_adapters_copy_answers_at_once_while_the_store_does_not(config):
    clock, store = Clock(), Unreachable()
    mirror = MirroredAdapters(store, clock)
    app = coordinator.coordinator(config, adapters=mirror)
    http = coordinator.TestClient(coordinator.build_api(app))
    asyncio.run(store.add("style", Adapter("/adapters/style", 5)))
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["qwen-image-tiny", "style"]
    assert "X-Omni-Ray-Stale-Seconds" not in http.get("/v1/models").headers
    store.down = True
    clock.now = 30.0
    first = http.get("/v1/models")  # waits READ_TIMEOUT_S for the store, then the copy answers
    assert first.status_code == 200 and [m["id"] for m in first.json()["data"]] == ["qwen-image-tiny", "style"]
    assert first.headers["X-Omni-Ray-Stale-Seconds"] == "30"
    reads = store.reads
    assert http.get("/v1/models/style").json()["id"] == "style"  # the copy, without asking the store
    assert http.post("/v1/images/generations", json={**BODY, "model": "style"}).status_code == 200
    assert asyncio.run(mirror.refresh())["style"].path == "/adapters/style"  # the coordinator's, every second
    assert store.reads == reads + 1 and http.get("/v1/models").headers["X-Omni-Ray-Stale-Seconds"] == "30"
    store.down = False
    clock.now += 1
    asyncio.run(mirror.refresh())  # the store answers: it takes over again
    assert "X-Omni-Ray-Stale-Seconds" not in http.get("/v1/models").headers
    assert store.reads == reads + 3


# --- before a deploy -----------------------------------------------------------------------------------------------


def test_check_names_every_bad_user_config_and_bad_args_before_a_deploy(tiny_dir):
    app = {"name": "omni-ray", "import_path": check.BUILDER,
           "args": {"stage_config": "stage_configs/qwen_image_tiny.yaml", "model": str(tiny_dir)}}
    good = {**app, "deployments": [{"name": "DiT", "user_config": {"max_batch_size": 2}},
                                   {"name": "Coordinator", "user_config": {"admission_margin": 0.2}},
                                   {"name": "Encoder", "num_replicas": 2}]}
    assert check.problems({"applications": [good]}) == []
    bad = {**app, "deployments": [{"name": "VAE", "user_config": {"dtype": "float16"}},
                                  {"name": "Dit", "user_config": {}}]}
    found = check.problems({"applications": [bad, {**app, "name": "two", "args": {"overrides": {"dit": {"x": 1}}}}]})
    assert len(found) == 3, found
    assert found[0].startswith("omni-ray: VAE: user_config 'dtype' cannot change while the replicas run")
    assert found[1].startswith("omni-ray: deployments: no deployment is named 'Dit'")
    assert found[2].startswith("two: args: ") and "dit.x" in found[2]
    assert check.main([str(REPO / "config.yaml")]) == 0
