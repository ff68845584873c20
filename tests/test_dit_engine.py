"""The DiT engine on the tiny checkpoint: step-level batching keeps each request's result, aborts leave cleanly."""

import asyncio
import dataclasses

import pytest
import torch

from omni_ray.engine.async_engine import AsyncEngine
from omni_ray.engine.core import EngineCore
from omni_ray.engine.dit_policy import PriorityPolicy
from omni_ray.engine.dit_scheduler import DiTScheduler
from omni_ray.errors import EngineError
from omni_ray.records import DenoiseParams, DenoiseRequest, PromptEmbeds
from testing.engines import run_to_completion
from testing.numerics import assert_reordered
from testing.reference import PromptEncoder

# Batched rows pad their text to the batch's longest (prompt or negative) with a mask. That moves the image tokens'
# keys to other positions in the joint attention, which changes the order of float sums: rounding only, measured
# at most 9e-6 on one machine and 1.24e-5 on another (AMD EPYC, same torch) on latents of magnitude 8 after 4 CFG
# steps: about 1.5e-6 relative, a dozen float32 ulps, within testing.numerics' bound.

PROMPTS = [
    "a red cat",
    "an oil painting of a lighthouse on a cliff at sunset, waves crashing",
    "a cup",
    "two children flying a kite on a beach under a bright summer sky",
]
NEGATIVES = ["blurry", "low quality", "dark, noisy, ugly, bad anatomy, watermark", " "]
STEPS = [2, 3, 4, 4]
SCALES = [4.0, 2.5, 6.0, 4.0]


@pytest.fixture(scope="module")
def requests(tiny_dir):
    encoder = PromptEncoder(str(tiny_dir))
    prompts, negatives = encoder.encode(PROMPTS), encoder.encode(NEGATIVES)
    return [
        DenoiseRequest(f"r{i}", DenoiseParams(64, 64, STEPS[i], 100 + i, SCALES[i], true_cfg=True), p, n)
        for i, (p, n) in enumerate(zip(prompts, negatives))
    ]


@pytest.fixture(scope="module")
def solo(runner, requests):
    results = {}
    for request in requests:
        core = EngineCore(DiTScheduler(max_batch_size=8, max_wait_steps=4), runner)
        core.add_request(request)
        results.update(run_to_completion(core)[0])
    return results


def test_batching_keeps_each_requests_latents(runner, requests, solo):
    core = EngineCore(DiTScheduler(max_batch_size=8, max_wait_steps=4), runner)
    for request in requests:
        core.add_request(request)
    together, batches = run_to_completion(core)
    assert batches == [["r0", "r1", "r2", "r3"], ["r0", "r1", "r2", "r3"], ["r1", "r2", "r3"], ["r2", "r3"]]
    for request_id, latents in together.items():
        assert latents.latents.shape == (16, 64)
        assert_reordered(latents.latents, solo[request_id].latents)
    # The results differ from each other: the test would notice requests swapping rows.
    assert (together["r2"].latents - together["r3"].latents).abs().max() > 0.1


def test_cfg_and_plain_requests_never_share_a_forward(runner, requests):
    scheduler = DiTScheduler(max_batch_size=8, max_wait_steps=4)
    core = EngineCore(scheduler, runner)
    plain = DenoiseRequest("plain", DenoiseParams(64, 64, 2, seed=1), requests[0].prompt)
    core.add_request(requests[0])
    core.add_request(plain)
    _, batches = run_to_completion(core)
    assert batches == [["r0"], ["r0"], ["plain"], ["plain"]]


def test_abort_leaves_at_next_step_and_others_are_unchanged(runner, requests, solo):
    core = EngineCore(DiTScheduler(max_batch_size=8, max_wait_steps=4), runner)
    for request in requests[1:]:
        core.add_request(request)
    first = core.step()
    assert sorted(o.request_id for o in first) == ["r1", "r2", "r3"]
    core.abort_requests(["r2"])
    assert "r2" in runner.states  # the runner still holds it until the step boundary
    second = core.step()
    assert sorted(o.request_id for o in second) == ["r1", "r3"]
    assert "r2" not in runner.states
    results, _ = run_to_completion(core)
    assert set(results) == {"r1", "r3"}
    for request_id in ("r1", "r3"):
        assert_reordered(results[request_id].latents, solo[request_id].latents)
    scheduler = core.scheduler
    assert not (scheduler.entries or scheduler.last_served or scheduler.freed_ids)
    assert runner.states == {}


def test_a_request_that_fails_inside_the_step_fails_alone(runner, requests, solo):
    core = EngineCore(DiTScheduler(max_batch_size=8, max_wait_steps=4), runner)
    # Same batch key as r0, but embeddings of the wrong width: the batched forward raises.
    bad = DenoiseRequest("bad", requests[0].params, PromptEmbeds(torch.ones(5, 32)), requests[0].negative)
    unprepared = DenoiseRequest("unprepared", DenoiseParams(64, 64, 0, seed=1, true_cfg_scale=4.0, true_cfg=True),
                                requests[0].prompt, requests[0].negative)
    for request in (requests[0], bad, unprepared):
        core.add_request(request)
    outputs = core.step()
    errors = {o.request_id: o.error for o in outputs if o.finish_reason == "error"}
    assert sorted(errors) == ["bad", "unprepared"]
    assert "RuntimeError" in str(errors["bad"]) and "ZeroDivisionError" in str(errors["unprepared"])
    assert [o.progress for o in outputs if o.request_id == "r0"] == [(1, 2)]
    results, _ = run_to_completion(core)
    assert_reordered(results["r0"].latents, solo["r0"].latents)
    assert runner.states == {} and not core.scheduler.has_requests()


def test_a_step_that_raises_fails_its_requests_only_and_other_keys_run_on(runner, requests, solo):
    """A failure that escapes the runner's per-request isolation fails the requests of that step; requests of
    another batch key, waiting meanwhile, and the engine loop carry on."""

    class FailsOnce:
        def __init__(self):
            self.failed = False

        def execute_model(self, batch):
            if not self.failed and "doomed" in batch.request_ids:
                self.failed = True
                raise RuntimeError("device lost its mind")
            return runner.execute_model(batch)

    engine = AsyncEngine(lambda: EngineCore(DiTScheduler(max_batch_size=8, max_wait_steps=4), FailsOnce()), "dit")
    engine.start()
    doomed = DenoiseRequest("doomed", DenoiseParams(64, 64, 2, seed=1), requests[0].prompt)
    other_key = DenoiseRequest("other", DenoiseParams(64, 96, 2, seed=2), requests[2].prompt)

    async def main():
        return await asyncio.gather(engine.generate(doomed), engine.generate(other_key), engine.generate(requests[1]),
                                    return_exceptions=True)

    try:
        failed, other, with_cfg = asyncio.run(main())
    finally:
        engine.shutdown()
    assert isinstance(failed, EngineError) and "dit: RuntimeError: device lost its mind" in str(failed)
    assert other.latents.shape == (24, 64)
    assert_reordered(with_cfg.latents, solo["r1"].latents)  # r1: true CFG, another key
    assert runner.states == {}


def test_async_driver_batches_concurrent_callers_and_reports_progress(runner, requests, solo):
    engine = AsyncEngine(lambda: EngineCore(DiTScheduler(max_batch_size=8, max_wait_steps=4), runner), "dit").start()
    progress = {request.request_id: [] for request in requests}

    async def main():
        return await asyncio.gather(
            *(engine.generate(r, lambda done, total, preview, rid=r.request_id: progress[rid].append((done, total)))
              for r in requests)
        )

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    for request, latents in zip(requests, results):
        assert_reordered(latents.latents, solo[request.request_id].latents)
        total = request.params.num_inference_steps
        assert progress[request.request_id] == [(step, total) for step in range(1, total + 1)]
    assert engine.num_steps < sum(STEPS)  # fewer engine steps than requests' steps: they shared batches


def test_cancelling_the_caller_aborts_the_request(runner, requests):
    scheduler = DiTScheduler(max_batch_size=8, max_wait_steps=4)
    engine = AsyncEngine(lambda: EngineCore(scheduler, runner), "dit").start()
    long = DenoiseRequest("long", DenoiseParams(64, 64, 200, seed=3), requests[0].prompt)

    async def main():
        steps = []
        task = asyncio.create_task(engine.generate(long, lambda done, total, preview: steps.append(done)))
        while len(steps) < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):  # the abort lands at the next step boundary
            if not scheduler.has_requests() and "long" not in runner.states:
                break
            await asyncio.sleep(0.01)
        return steps

    try:
        steps = asyncio.run(main())
    finally:
        engine.shutdown()
    assert len(steps) < 200
    assert not scheduler.has_requests() and runner.states == {}


def test_duplicate_ids_and_dead_loops_are_engine_errors(runner, requests):
    engine = AsyncEngine(lambda: EngineCore(DiTScheduler(max_batch_size=8, max_wait_steps=4), runner), "dit").start()

    async def twice():
        first = asyncio.create_task(engine.generate(requests[3]))
        await asyncio.sleep(0)  # let the first call queue its add
        with pytest.raises(EngineError, match="duplicate request id"):
            await engine.generate(requests[3])
        return await first

    asyncio.run(twice())
    engine.check_health()
    engine.shutdown()
    with pytest.raises(EngineError, match="dead"):
        engine.check_health()


def test_a_stuck_step_fails_the_health_check():
    import threading

    release = threading.Event()

    class StuckCore:
        def __init__(self):
            self.pending = []

        def add_request(self, request):
            self.pending.append(request)

        def abort_requests(self, request_ids):
            self.pending = []

        def has_unfinished_requests(self):
            return bool(self.pending)

        def step(self):
            release.wait(10)
            return []

        def stats(self):
            return None

        def shutdown(self):
            pass

    engine = AsyncEngine(StuckCore, "dit", stall_timeout_s=0.2).start()

    async def main():
        task = asyncio.create_task(engine.generate(DenoiseRequest("stuck", DenoiseParams(64, 64, 1, 0), None)))
        await asyncio.sleep(0.5)
        with pytest.raises(EngineError, match="one step has run for over"):
            engine.check_health()
        release.set()
        task.cancel()

    asyncio.run(main())
    engine.shutdown()


def test_a_request_paused_for_a_more_urgent_one_resumes_where_it_was_and_ends_as_it_would_alone(
        runner, requests, solo):
    """Preemption at a step boundary keeps the paused request's state in the runner: its latents are those of the
    same request never paused (each step of it ran alone both times, so equal exactly)."""
    one_row_a_step = PriorityPolicy(max_batch_tokens=1)
    scheduler = DiTScheduler(max_batch_size=8, max_wait_steps=4, policy=one_row_a_step)
    core = EngineCore(scheduler, runner)
    low = DenoiseRequest("low", dataclasses.replace(requests[3].params, priority=1), requests[3].prompt,
                         requests[3].negative)
    core.add_request(low)
    core.step()
    core.add_request(requests[0])  # priority 0, two steps
    results, batches = run_to_completion(core)
    assert batches == [["r0"], ["r0"], ["low"], ["low"], ["low"]]
    assert scheduler.num_paused_steps == 2
    assert torch.equal(results["low"].latents, solo["r3"].latents)
    assert torch.equal(results["r0"].latents, solo["r0"].latents)
    assert runner.states == {}
