"""The GPU cost model and the simulated stage runners (``runner: simulated``), without Ray."""

from __future__ import annotations

import asyncio
import io
import pathlib
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from omni_ray.config import DiTConfig, load_config
from omni_ray.engine.builders import build_dit_core, build_dit_runner, create_split
from omni_ray.engine.core import EngineCore
from omni_ray.engine.dit_policy import FifoPolicy, PriorityPolicy
from omni_ray.engine.dit_scheduler import DiTScheduler
from omni_ray.engine.dit_split import FixedSplit, PerStepSplit, StepShape
from omni_ray.engine.vae_scheduler import VaeScheduler
from omni_ray.families.qwen_image.facts import image_tokens
from omni_ray.pipeline import Pipeline
from omni_ray.records import (
    DecodeRequest,
    DenoiseBatch,
    DenoiseParams,
    DenoiseRequest,
    ImageEncodeRequest,
    Latents,
    PromptEmbeds,
)
from omni_ray.runners.gpu_costs import GpuCosts, dit_pass_flops
from omni_ray.runners.parallel.split import assign_passes
from omni_ray.runners.simulated import SimulatedDenoiser, SimulatedVae, photo_like

REPO = pathlib.Path(__file__).resolve().parent.parent
COSTS = GpuCosts.h200()


def test_the_model_reproduces_the_published_timings_it_is_calibrated_to():
    assert COSTS.dit_step(1, 1024, 1024, 50, true_cfg=True) == pytest.approx(0.243)  # s per step
    assert 20 * COSTS.dit_step(1, 512, 512, 50, true_cfg=True) == pytest.approx(2.17)  # DiT of one 512x512 image
    assert COSTS.encoder_step(2 * (40 + 34)) == pytest.approx(0.035)
    assert COSTS.vae_step(512 * 512) == pytest.approx(0.017)
    assert 700e12 < COSTS.dit_flops_per_s < 900e12 and 0.05 < COSTS.dit_step_overhead_s < 0.09
    # 1328x1328 (83 x 83 = 6889 image tokens) is dominated by the linear layers, with attention a quarter of it.
    tokens = image_tokens(1328, 1328) + 50
    assert image_tokens(1328, 1328) == 6889
    assert 0.2 < 4 * 60 * 3072 * tokens**2 / dit_pass_flops(tokens) < 0.35


def test_batching_gains_shrink_as_images_grow():
    def gain(side: int) -> float:  # images per second at batch 8 over batch 1
        return 8 * COSTS.dit_step(1, side, side, 50, True) / COSTS.dit_step(8, side, side, 50, True)

    gains = [gain(side) for side in (256, 512, 1024, 1328, 2048)]
    assert all(a > b for a, b in zip(gains, gains[1:])), gains
    assert gains[0] > 3 and gains[-1] < 1.15


@pytest.mark.parametrize("side, batch", [(512, 1), (1328, 1), (1024, 4)])
def test_true_cfg_doubles_the_dit_work(side, batch):
    overhead = COSTS.dit_step_overhead_s
    with_cfg = COSTS.dit_step(batch, side, side, 60, true_cfg=True) - overhead
    without = COSTS.dit_step(batch, side, side, 60, true_cfg=False) - overhead
    assert with_cfg == pytest.approx(2 * without)


def test_a_non_square_image_costs_by_its_tokens():
    steps = [COSTS.dit_step(1, h, w, 60, False) for h, w in ((800, 800), (1328, 800), (800, 1328), (1328, 1328))]
    assert steps[0] < steps[1] == steps[2] < steps[3]


def run_until_done(core, ids: set[str]) -> tuple[dict, list]:
    results, progress = {}, []
    while ids - results.keys():
        for output in core.step():
            assert output.error is None, output.error
            if output.progress is not None:
                progress.append((output.request_id, output.progress))
            if output.finished:
                results[output.request_id] = output.result
    return results, progress


def embeds(tokens: int) -> PromptEmbeds:
    return PromptEmbeds(torch.zeros(tokens, 3584, dtype=torch.bfloat16))


def test_simulated_denoiser_steps_a_batch_for_its_simulated_time_and_returns_packed_latents():
    core = EngineCore(DiTScheduler(8, 8), SimulatedDenoiser(torch.bfloat16))
    for index in range(3):  # one batch: same size and CFG mode, different step counts and seeds
        params = DenoiseParams(height=1328, width=800, num_inference_steps=2 + index, seed=index, true_cfg_scale=4.0,
                               true_cfg=True)
        core.add_request(DenoiseRequest(f"r{index}", params, embeds(40 + index), embeds(30)))
    started = time.monotonic()
    results, progress = run_until_done(core, {"r0", "r1", "r2"})
    elapsed = time.monotonic() - started
    # steps 1-2 run three requests, 3 two, 4 one: at least the model's time for those batches
    expected = sum(COSTS.dit_step(b, 1328, 800, 42, True) for b in (3, 3, 2, 1))
    assert elapsed >= 0.98 * expected
    for index in range(3):
        latents = results[f"r{index}"]
        assert isinstance(latents, Latents) and (latents.height, latents.width) == (1328, 800)
        assert latents.latents.shape == (83 * 50, 64) and latents.latents.dtype == torch.bfloat16
        assert latents.dit_passes == {"computed": 2 * (2 + index), "reused": 0}
        assert [p for rid, p in progress if rid == f"r{index}"] == [(s, 2 + index) for s in range(1, 3 + index)]
    assert not torch.equal(results["r0"].latents, results["r1"].latents)  # drawn from each request's seed


def test_simulated_vae_decodes_to_photo_like_pixels_and_encodes_edit_images():
    core = EngineCore(VaeScheduler(4), SimulatedVae(torch.bfloat16))
    latents = Latents(torch.randn(16 * 24, 64).to(torch.bfloat16), 256, 384)
    core.add_request(DecodeRequest("d", latents, "both"))
    core.add_request(ImageEncodeRequest("e", np.zeros((320, 192, 3), np.uint8)))
    results, _ = run_until_done(core, {"d", "e"})
    pixels = results["d"].pixels
    assert pixels.shape == (256, 384, 3) and pixels.dtype == np.uint8 and pixels.flags.writeable
    assert results["d"].latents is latents
    assert results["e"].latents.shape == (20 * 12, 64) and (results["e"].height, results["e"].width) == (320, 192)
    # Compresses like a photograph: neither flat (a PNG of well under a byte per pixel) nor noise (3 bytes).
    png = io.BytesIO()
    Image.fromarray(photo_like(1024, 1024)).save(png, "PNG")
    assert 0.8 < len(png.getvalue()) / (1024 * 1024) < 2.5
    assert photo_like(1024, 1024).std() > 20


def test_the_simulated_preset_serves_real_shapes_through_the_request_path():
    config = load_config(REPO / "stage_configs/qwen_image_sim.yaml")
    assert (config.requests.default_width, config.requests.default_height, config.requests.default_steps) == (
        1328, 1328, 50)
    assert {config.encoder.runner, config.dit.runner, config.vae.runner} == {"simulated"}
    pipeline = Pipeline(config)
    try:
        body = {"prompt": "a lighthouse at dusk", "negative_prompt": "blurry", "size": "800x1328", "n": 2,
                "num_inference_steps": 2}
        images = asyncio.run(pipeline.generate(body, output="both"))
    finally:
        pipeline.shutdown()
    assert [image.pixels.shape for image in images] == [(1328, 800, 3)] * 2
    assert images[0].latents.latents.shape == (83 * 50, 64)
    assert images[0].dit_passes == {"computed": 4, "reused": 0}


def test_the_presets_dit_scheduling_becomes_the_policy_its_scheduler_is_given():
    config = load_config(REPO / "stage_configs/qwen_image_sim.yaml")
    dit = config.dit
    assert build_dit_core(config).scheduler.policy == PriorityPolicy(4608, dit.max_paused, dit.priority_aging_s)
    fifo = config.model_copy(update={"dit": dit.model_copy(update={"scheduling": "fifo"})})
    assert build_dit_core(fifo).scheduler.policy == FifoPolicy()
    assert build_dit_core(config).scheduler.split == FixedSplit()
    gang = DiTConfig.model_validate({**dit.model_dump(), "parallel": {"ulysses": 4, "split": "per_step"}})
    assert create_split(gang) == PerStepSplit(4)
    assert build_dit_runner(config.model_copy(update={"dit": gang})).ranks == 4  # each rank sleeps the gang's step


def test_the_async_engine_times_each_request_and_how_long_it_queued():
    from omni_ray.engine.async_engine import AsyncEngine

    engine = AsyncEngine(lambda: EngineCore(DiTScheduler(1, 8), SimulatedDenoiser(torch.bfloat16)), "dit").start()

    async def run() -> list[dict[str, float]]:
        requests = [DenoiseRequest(rid, DenoiseParams(512, 512, 3, 0), embeds(20)) for rid in ("first", "second")]
        results = await asyncio.gather(*(engine.generate(r, upstream={"encoder": 0.25}) for r in requests))
        return [result.timings for result in results]

    try:
        first, second = asyncio.run(run())
    finally:
        engine.shutdown()
    first_runs = 3 * COSTS.dit_step(1, 512, 512, 20, False)  # batches of one: the second waits for all of it
    assert first["dit_queued"] < 0.5 * first_runs <= first_runs * 0.98 <= second["dit_queued"]
    assert first["dit"] >= first_runs * 0.98 and second["dit"] >= second["dit_queued"] + first_runs * 0.98
    assert set(first) == set(second) == {"encoder", "dit", "dit_queued"} and first["encoder"] == 0.25


class VirtualClock:
    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_the_simulated_gang_takes_a_sequence_step_over_its_ranks_and_a_rows_step_as_its_busiest_rank():
    costs, clock = GpuCosts.h200(), VirtualClock()
    runner = SimulatedDenoiser(torch.bfloat16, costs, ranks=4, clock=clock)
    embeds = PromptEmbeds(torch.zeros(12, 8))
    requests = [DenoiseRequest(f"r{i}", DenoiseParams(1328, 1328, 4, seed=i, true_cfg_scale=4.0, true_cfg=True),
                               embeds, embeds) for i in range(5)]
    seconds = []
    for split, count in (("sequence", 1), ("rows", 4), ("rows", 5)):
        new = [r for r in requests[:count] if r.request_id not in runner.states]
        started = clock.now
        runner.execute_model(DenoiseBatch(new, [r.request_id for r in requests[:count]], [], split))
        seconds.append(clock.now - started)
    one = costs.dit_step(1, 1328, 1328, 12, True)
    assert seconds[0] == pytest.approx(costs.dit_step(1, 1328, 1328, 12, True, ranks=4))
    assert seconds[0] < one / 2 and seconds[1] == pytest.approx(one)  # eight passes, two a rank: one row's time
    assert seconds[2] == pytest.approx(costs.dit_forward(3, image_tokens(1328, 1328) + 12))  # ten: the busiest 3


def test_the_ulysses_model_is_kind_to_sequence_parallelism_against_vllm_omnis_published_scaling():
    costs = GpuCosts.h200()
    one = costs.dit_step(1, 2048, 2048, 50, True)
    published = {2: 112.5 / (2 * 65.2), 4: 112.5 / (4 * 39.6), 8: 112.5 / (8 * 30.8)}  # H800, 2048x2048, end to end
    for ranks, efficiency in published.items():
        modelled = one / (ranks * costs.dit_step(1, 2048, 2048, 50, True, ranks=ranks))
        assert efficiency < modelled < 1
    step = costs.dit_step(1, 1024, 1024, 50, True, ranks=4)
    assert 0.03 < costs.all_to_alls(2 * (4096 + 50), 4) / step < 0.1
    assert costs.dit_step(3, 512, 512, 50, True, ranks=1) == costs.dit_step(3, 512, 512, 50, True)


@pytest.mark.parametrize("passes", [1, 2])
def test_a_rows_plan_deals_the_passes_over_the_ranks_as_the_runner_does(passes):
    rows = [SimpleNamespace(tokens=passes * tokens, passes=passes, priority=0) for tokens in (30, 50, 40, 20, 60)]
    dealt = rows + (rows if passes == 2 else [])
    ranks = assign_passes([None] * len(dealt), [0] * len(rows) + [1] * (len(dealt) - len(rows)), False, 4)
    loads = [0.0] * 4
    for row, rank in zip(dealt, ranks):
        loads[rank] += row.tokens / row.passes
    assert StepShape("rows", 4, 32, None).loads(rows) == loads
