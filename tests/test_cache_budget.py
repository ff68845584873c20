"""The DiT scheduler's condition-cache budget (Qwen-Image 2.1): requests are admitted while their caches fit
``dit.cache_memory_bytes``, wait otherwise, and the bytes held are reported. Fake runners: no model is loaded."""

import asyncio
import json
import logging

import pytest
import torch
from test_schedulers import FakeRunner, assert_no_trace, request, run, step

from omni_ray.config import ConfigError, load_config
from omni_ray.engine.async_engine import AsyncEngine
from omni_ray.engine.builders import build_dit_core, condition_cache_size
from omni_ray.engine.condition_cache import ConditionCacheSize, condition_tokens
from omni_ray.engine.core import DiTEngineCore
from omni_ray.engine.dit_policy import FifoPolicy, PriorityPolicy
from omni_ray.engine.dit_scheduler import DiTScheduler
from omni_ray.engine.stats import ConditionCacheStats
from omni_ray.errors import EngineError
from omni_ray.families.qwen_image_2_1 import facts as qwen_image21
from omni_ray.records import DenoiseParams, DenoiseRequest, PromptEmbeds


def budgeted(budget, sizes, policy=None, max_batch_size=8):
    """A scheduler whose requests' caches take ``sizes[request id]`` bytes, within ``budget``."""
    return DiTScheduler(max_batch_size=max_batch_size, max_wait_steps=4, policy=policy,
                        cache_bytes=lambda r: sizes[r.request_id], cache_memory_bytes=budget)


def test_a_request_whose_cache_does_not_fit_waits_and_runs_once_another_finishes():
    scheduler, runner = budgeted(100, {"a": 60, "b": 30, "c": 50}), FakeRunner()
    for request_id, steps in [("a", 2), ("b", 3), ("c", 2)]:
        scheduler.add_request(request(request_id, steps))
    # "c" would take the caches to 140 bytes: it waits in the queue (not failed) until "a" is done.
    ids, outputs = step(scheduler, runner)
    assert ids == ["a", "b"] and not any(o.finish_reason == "error" for o in outputs)
    assert scheduler.cache_bytes_held == 90 and scheduler.num_cache_waiting == 1
    assert run(scheduler, runner, 4) == [["a", "b"], ["b", "c"], ["c"], []]
    assert scheduler.cache_bytes_held == 0
    assert_no_trace(scheduler, runner)


def test_an_abort_releases_its_bytes_running_or_waiting():
    scheduler, runner = budgeted(100, {"a": 70, "b": 70, "c": 70}), FakeRunner()
    for request_id in "abc":
        scheduler.add_request(request(request_id, 5))
    assert run(scheduler, runner, 1) == [["a"]] and scheduler.cache_bytes_held == 70
    scheduler.finish_requests(["a", "b"])  # "a" runs and holds its cache; "b" waits and holds nothing
    assert scheduler.cache_bytes_held == 0
    ids, _ = step(scheduler, runner)
    assert ids == ["c"] and runner.batches[-1].freed_ids == ["a"]  # the runner drops "a" as "c" comes in
    assert scheduler.cache_bytes_held == 70


def test_a_failed_request_releases_its_bytes():
    scheduler, runner = budgeted(100, {"bad": 60, "ok": 60}), FakeRunner(fail={"bad"})
    scheduler.add_request(request("bad", 2))
    scheduler.add_request(request("ok", 2))
    ids, outputs = step(scheduler, runner)
    assert ids == ["bad"] and [o.request_id for o in outputs if o.finish_reason == "error"] == ["bad"]
    assert scheduler.cache_bytes_held == 0
    assert run(scheduler, runner, 2) == [["ok"], ["ok"]]
    assert_no_trace(scheduler, runner)


def test_a_request_whose_cache_passes_the_whole_budget_fails_at_once_naming_it():
    scheduler = budgeted(100, {"huge": 101, "ok": 100})
    with pytest.raises(EngineError, match=r"101 bytes.*cache_memory_bytes: 100 bytes"):
        scheduler.add_request(request("huge", 2))
    assert not scheduler.has_requests()
    scheduler.add_request(request("ok", 2))  # the whole budget fits
    assert run(scheduler, FakeRunner(), 2) == [["ok"], ["ok"]]


def test_the_engine_fails_such_a_request_to_its_caller_and_serves_the_others():
    sizes = {"huge": 500, "ok": 10}

    async def main():
        engine = AsyncEngine(lambda: DiTEngineCore(budgeted(100, sizes), FakeRunner()), "dit").start()
        try:
            with pytest.raises(EngineError) as failed:
                await engine.generate(request("huge", 2))
            ok = await engine.generate(request("ok", 2))
            return failed.value, ok, engine.stats  # the snapshot may precede the last step's: not its bytes
        finally:
            engine.shutdown()

    error, ok, stats = asyncio.run(main())
    assert error.stage == "dit" and "500 bytes" in str(error) and "dit.cache_memory_bytes: 100 bytes" in str(error)
    assert ok.latents is not None
    assert stats.requests == 1 and stats.core.condition_cache.budget == 100


def test_the_stats_report_the_bytes_held_the_budget_and_the_requests_waiting_for_room():
    core = DiTEngineCore(budgeted(100, {"a": 40, "b": 40, "c": 40}), FakeRunner())
    assert core.stats().condition_cache == ConditionCacheStats(0, 100, 0)
    for request_id in "abc":
        core.add_request(request(request_id, 2))
    core.step()
    assert core.stats().condition_cache == ConditionCacheStats(bytes=80, budget=100, waiting=1)
    core.step()  # "a" and "b" finish
    assert core.stats().condition_cache.bytes == 0
    core.step()
    assert core.stats().condition_cache == ConditionCacheStats(40, 100, 0)
    counted = DiTEngineCore(DiTScheduler(8, 4, cache_bytes=lambda r: 7), FakeRunner())  # counted, no bound
    counted.add_request(request("a", 2))
    counted.step()
    assert counted.stats().condition_cache == ConditionCacheStats(7, None, 0)
    assert DiTEngineCore(DiTScheduler(8, 4), FakeRunner()).stats().condition_cache is None  # Qwen-Image's


def test_no_request_slips_past_one_waiting_for_room_unless_more_urgent():
    sizes = {"running": 60, "big": 80, "small": 10, "urgent": 30}
    scheduler, runner = budgeted(100, sizes, PriorityPolicy()), FakeRunner()
    scheduler.add_request(request("running", 3, priority=1))
    assert run(scheduler, runner, 1) == [["running"]]
    scheduler.add_request(request("big", 2, priority=1))  # 60 + 80: waits
    scheduler.add_request(request("small", 2, priority=1))  # would fit, but is behind "big" in turn order
    scheduler.add_request(request("urgent", 2, priority=0))  # more urgent than "big": it goes ahead
    ids, _ = step(scheduler, runner)
    assert ids == ["running", "urgent"] and scheduler.num_cache_waiting == 2  # 10 bytes left: "small" waits
    assert scheduler.cache_bytes_held == 90
    assert run(scheduler, runner, 1) == [["running", "urgent"]]  # both done
    # "big" takes the room, "small" fits beside it (80 + 10).
    assert run(scheduler, runner, 2) == [["big", "small"], ["big", "small"]]
    assert_no_trace(scheduler, runner)


def test_a_waiting_big_request_of_higher_priority_is_not_starved_by_small_ones_of_lower():
    sizes = {f"small{i}": 40 for i in range(6)} | {"big": 90}
    scheduler, runner = budgeted(100, sizes, PriorityPolicy()), FakeRunner()
    scheduler.add_request(request("small0", 2, priority=2))
    run(scheduler, runner, 1)
    scheduler.add_request(request("big", 1, priority=0))
    for i in range(1, 6):  # small ones keep coming; none takes the room "big" waits for, though one would fit now
        scheduler.add_request(request(f"small{i}", 2, priority=2))
    assert run(scheduler, runner, 3) == [["small0"], ["big"], ["small1", "small2"]]


def test_under_fifo_the_oldest_waiting_request_blocks_the_queue_behind_it():
    sizes = {"a": 50, "b": 80, "c": 10}
    scheduler, runner = budgeted(100, sizes, FifoPolicy()), FakeRunner()
    for request_id, steps in [("a", 2), ("b", 1), ("c", 1)]:
        scheduler.add_request(request(request_id, steps))
    assert run(scheduler, runner, 4) == [["a"], ["a"], ["b", "c"], []]


def test_tenants_take_turns_for_the_room_as_they_take_rows():
    sizes = {f"heavy{i}": 50 for i in range(4)} | {"light": 50}
    scheduler, runner = budgeted(100, sizes, PriorityPolicy()), FakeRunner()
    for i in range(4):
        scheduler.add_request(request(f"heavy{i}", 2, tenant="heavy"))
    assert run(scheduler, runner, 1) == [["heavy0", "heavy1"]]
    scheduler.add_request(request("light", 2, tenant="light"))  # arrived after heavy2 and heavy3
    # The room "heavy0" and "heavy1" leave goes first to the tenant that used the DiT least, then to "heavy2".
    assert run(scheduler, runner, 3) == [["heavy0", "heavy1"], ["heavy2", "light"], ["heavy2", "light"]]
    assert "heavy3" not in runner.steps


# --- what a Qwen-Image 2.1 request's cache takes -------------------------------------------------------------------


def embeds(tokens, slots=0):
    image_slots = torch.zeros(tokens, dtype=torch.bool)
    image_slots[1:1 + slots] = True
    return PromptEmbeds(torch.zeros(tokens, 4), image_slots if slots else None)


def test_a_requests_cache_counts_each_branch_with_its_image_slots_widened():
    assert condition_tokens(embeds(10)) == 10 and condition_tokens(embeds(10, slots=4)) == 10 + 3 * 4
    size = ConditionCacheSize(num_layers=2, inner_dim=64, dtype_bytes=2)
    plain = DenoiseRequest("p", DenoiseParams(64, 64, 2, 0), embeds(10, slots=4), embeds(5))
    assert size(plain) == qwen_image21.cache_bytes(22, 2, 64, 2) == 2 * 22 * 2 * 64 * 2  # no CFG: the prompt's alone
    cfg = DenoiseRequest("c", DenoiseParams(64, 64, 2, 0, 4.0, true_cfg=True), embeds(10, slots=4), embeds(5, 1))
    assert size(cfg) == qwen_image21.cache_bytes(22, 2, 64, 2) + qwen_image21.cache_bytes(8, 2, 64, 2)


def checkpoint21(root, with_config=True):
    root.mkdir()
    (root / "model_index.json").write_text(json.dumps({"_class_name": "QwenImage21Pipeline"}))
    if with_config:
        (root / "transformer").mkdir()
        (root / "transformer" / "config.json").write_text(
            json.dumps({"num_layers": 3, "num_attention_heads": 2, "attention_head_dim": 32, "patch_size": 1}))
    return root


def preset21(model, **dit):
    config = load_config("stage_configs/qwen_image_2_1_tiny.yaml", model=str(model))
    return config.model_copy(update={"dit": config.dit.model_copy(update={"runner": "simulated", **dit})})


def test_build_dit_core_bounds_qwen_image_21s_caches_from_its_transformer_config(tmp_path):
    config = preset21(checkpoint21(tmp_path / "ckpt"))
    scheduler = build_dit_core(config).scheduler
    assert scheduler.cache_memory_bytes == config.dit.cache_memory_bytes == 64 * 2**20
    assert scheduler.cache_bytes == ConditionCacheSize(num_layers=3, inner_dim=64, dtype_bytes=4)  # float32
    assert condition_cache_size(preset21(tmp_path / "ckpt", dtype="bfloat16")).dtype_bytes == 2
    qwen_image = load_config("stage_configs/qwen_image_tiny.yaml", model=str(tmp_path / "missing"))
    assert condition_cache_size(qwen_image) is None


def test_without_the_transformer_config_a_bound_refuses_to_start_and_no_bound_goes_uncounted(tmp_path, caplog):
    model = checkpoint21(tmp_path / "ckpt", with_config=False)
    with pytest.raises(ConfigError, match="dit.cache_memory_bytes.*transformer/config.json"):
        condition_cache_size(preset21(model))
    with caplog.at_level(logging.WARNING):
        assert condition_cache_size(preset21(model, cache_memory_bytes=None)) is None
    assert "uncounted" in caplog.text


def test_a_hub_checkpoints_config_comes_from_the_hugging_face_cache_or_hub_and_its_absence_is_none(tmp_path,
                                                                                                    monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    fetched = checkpoint21(tmp_path / "snapshot") / "transformer" / "config.json"
    asked = []

    def download(repo, filename):
        asked.append((repo, filename))
        return str(fetched)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert ConditionCacheSize.from_checkpoint("Qwen/Qwen-Image-2.1", 2, local=False) == ConditionCacheSize(3, 64, 2)
    assert asked == [("Qwen/Qwen-Image-2.1", "transformer/config.json")]

    def offline(repo, filename):
        raise LocalEntryNotFoundError("not in the cache, and offline")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    assert ConditionCacheSize.from_checkpoint("Qwen/Qwen-Image-2.1", 2, local=False) is None
    assert ConditionCacheSize.from_checkpoint(str(tmp_path / "nowhere"), 2) is None
