"""The DiT's executors without Ray: a gang of two spawned ranks over gloo runs every call on every rank in the same
order, a lost or hung rank is a GangError within the timeout and the gang stays unhealthy, shutdown leaves no
process; the engine core drives the tiny runner through a gang and gets the latents it gets alone."""

import os
import signal
import time

import psutil
import pytest
import torch
import yaml
from conftest import REPO

from omni_ray.config import ParallelSettings, parse_config
from omni_ray.engine.builders import build_dit_core
from omni_ray.engine.executor import GangRunner, MultiprocExecutor, UniProcExecutor
from omni_ray.errors import GangError
from omni_ray.records import DenoiseParams, DenoiseRequest, PromptEmbeds
from testing.engines import run_to_completion
from testing.numerics import assert_reordered
from testing.ranks import broken_runner, history, make_recorder

SETTINGS = ParallelSettings(cfg=2, timeout_s=20)


@pytest.fixture
def gang():
    executor = MultiprocExecutor(make_recorder, SETTINGS, start_timeout_s=120)
    yield executor
    executor.shutdown()


def test_every_call_runs_on_every_rank_in_order(gang):
    assert gang.world_size == 2
    assert [gang.collective_rpc("record", (i,)) for i in range(4)] == [[(0, i), (1, i)] for i in range(4)]
    assert gang.collective_rpc("record", kwargs={"value": "x"}, unique_reply_rank=1) == [(1, "x")]
    assert gang.collective_rpc(history) == [[0, 1, 2, 3, "x"]] * 2  # rank 0 ran the call it did not answer too
    assert gang.collective_rpc("total", (3,)) == [6.0, 6.0]
    runner = GangRunner(gang)
    assert (runner.lora_shapes, runner.warmup_s) == ({"block.0": (4, 4)}, 0.5)  # rank 0's
    with pytest.raises(ValueError, match="rank 0"):  # raised alike on every rank: the runner's own error
        gang.collective_rpc("fail")
    gang.check_health()
    assert gang.collective_rpc("record", (5,)) == [(0, 5), (1, 5)]


def test_a_rank_raising_alone_breaks_the_gang(gang):
    with pytest.raises(GangError, match="rank 1 of 2 raised in fail"):
        gang.collective_rpc("fail", (1,))
    with pytest.raises(GangError):
        gang.check_health()
    with pytest.raises(GangError):
        gang.collective_rpc("record", (1,))


def test_a_killed_rank_is_a_gang_error_at_once_and_for_good(gang):
    pids = gang.collective_rpc("pid")
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(GangError, match=r"rank 1 \(pid \d+\) exited with code -9 during sleep"):
        gang.collective_rpc("sleep", (0.2,))  # rank 0 answers; rank 1 is gone
    assert time.monotonic() - start < SETTINGS.timeout_s / 2
    with pytest.raises(GangError, match="exited"):
        gang.check_health()
    with pytest.raises(GangError):
        gang.collective_rpc("record", (1,))
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)


def test_a_rank_past_the_timeout_is_a_gang_error():
    executor = MultiprocExecutor(make_recorder, ParallelSettings(cfg=2, timeout_s=1.5), start_timeout_s=120)
    try:
        pids = executor.collective_rpc("pid")
        start = time.monotonic()
        with pytest.raises(GangError, match=r"did not finish sleep within 2 s"):
            executor.collective_rpc("sleep", (30,), timeout_s=2)
        assert 2 <= time.monotonic() - start < 10
        with pytest.raises(GangError):
            executor.check_health()
        assert not any(psutil.pid_exists(pid) for pid in pids)  # the hung ranks were stopped
    finally:
        executor.shutdown()


def test_shutdown_leaves_no_process():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    executor = MultiprocExecutor(make_recorder, SETTINGS, start_timeout_s=120)
    pids = executor.collective_rpc("pid")
    assert len(set(pids)) == 2 and os.getpid() not in pids
    executor.shutdown()
    executor.shutdown()  # idempotent
    assert not any(psutil.pid_exists(pid) for pid in pids)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_a_rank_that_fails_to_start_fails_the_executor():
    with pytest.raises(GangError, match="failed to start: ZeroDivisionError"):
        MultiprocExecutor(broken_runner, SETTINGS, start_timeout_s=120)


def test_uniproc_executor_calls_in_process():
    class Runner:
        def twice(self, x):
            return 2 * x

    assert UniProcExecutor(Runner()).collective_rpc("twice", (4,)) == [8]


def _preset(tiny_dir, **dit) -> dict:
    preset = yaml.safe_load((REPO / "stage_configs" / "qwen_image_tiny.yaml").read_text())
    preset["model"] = str(tiny_dir)
    preset["dit"].update(dit)
    return preset


def _requests(dim: int) -> list[DenoiseRequest]:
    generator = torch.Generator().manual_seed(0)
    embeds = [PromptEmbeds(torch.randn(n, dim, generator=generator)) for n in (7, 5, 9)]
    return [DenoiseRequest("cfg", DenoiseParams(64, 64, 3, seed=1, true_cfg_scale=4.0, true_cfg=True),
                           embeds[0], embeds[1]),
            DenoiseRequest("plain", DenoiseParams(64, 64, 2, seed=2), embeds[2])]


def test_the_engine_core_runs_the_tiny_dit_on_a_gang_as_alone(tiny_dir):
    """World size 2 (cfg 2) on spawned gloo ranks: the same latents as the in-process runner."""
    results = {}
    for parallel in ({}, {"cfg": 2, "timeout_s": 60}):
        config = parse_config(_preset(tiny_dir, parallel=parallel))
        core = build_dit_core(config)
        assert isinstance(core.runner, GangRunner) == bool(parallel)
        try:
            for request in _requests(64):
                core.add_request(request)
            results[bool(parallel)], _ = run_to_completion(core)
            assert core.stats().warmup_s is None
        finally:
            core.shutdown()
    alone, gang = results[False], results[True]
    assert sorted(gang) == ["cfg", "plain"]
    for request_id, latents in alone.items():
        assert latents.latents.shape == (16, 64)
        assert_reordered(gang[request_id].latents, latents.latents)
        assert gang[request_id].dit_passes == latents.dit_passes
