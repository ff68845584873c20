"""The DiT's blocks streamed through the device (``dit.offload``, issue 50): with none, one or every block kept
resident, the parallel tests' mix of step batches (adapters, first-block and TeaCache rows, true CFG, an edit)
denoises to the latents of the unstreamed runner, bit for bit (the same values, copied in and out); the blocks'
weights on the device never pass the kept ones plus two (the one computing and the one arriving); a gang of two
streams on each rank; a GGUF transformer streams too. On the CPU the "device" copies are real allocations, so the
count is of real tensors; the copy stream and pinned memory are CUDA's and wait for a GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO

from omni_ray.checkpoints import gguf as gguf_file
from omni_ray.config import ParallelSettings, load_config
from omni_ray.records import DenoiseParams, PromptEmbeds
from omni_ray.runners.denoise import DenoiseRunner
from testing.gang import run_gang
from testing.numerics import assert_reordered
from testing.parallel import denoise_mix

BLOCKS = 2  # the tiny transformer's
SMALL_BLOCKS = 4  # the small one's


@pytest.fixture(scope="module")
def unstreamed(tiny_dir, tiny_adapters) -> dict[str, torch.Tensor]:
    return denoise_mix(None, str(tiny_dir), tiny_adapters)[0]


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    from omni_ray.checkpoints.tiny import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("small") / "small", size="small")


@pytest.fixture(scope="module")
def tiny_adapters_small(small_dir, tmp_path_factory) -> dict[str, str]:
    from testing.lora_files import two_adapters

    return two_adapters(small_dir, tmp_path_factory.mktemp("small-adapters"))


@pytest.fixture(scope="module")
def unstreamed_small(small_dir, tiny_adapters_small) -> dict[str, torch.Tensor]:
    return denoise_mix(None, str(small_dir), tiny_adapters_small)[0]


@pytest.mark.parametrize("resident", [0, 1, BLOCKS])
def test_streamed_blocks_denoise_the_unstreamed_latents_and_stay_within_their_count(
        resident, small_dir, tiny_adapters_small, unstreamed_small):
    """The small checkpoint's four blocks: the first always kept (0 and 1 keep one), the rest streamed."""
    latents, sent = denoise_mix(None, str(small_dir), tiny_adapters_small, 4, "sequence", False, None, resident)
    assert latents.keys() == unstreamed_small.keys()
    for request_id, expected in unstreamed_small.items():
        assert torch.equal(latents[request_id], expected), request_id
    kept = min(max(resident, 1), SMALL_BLOCKS)
    assert sent[-1]["peak"] == min(kept + 2, SMALL_BLOCKS)
    # 4 steps of 3 batch keys (CFG's passes in one forward): a forward fetches each streamed block it reaches once
    # (a block that cache acceleration's reused rows skip, not at all; one its sub-batch runs again, twice at most)
    assert 12 <= sent[-1]["fetches"] <= 2 * 12 * (SMALL_BLOCKS - kept), sent[-1]


def test_a_streamed_block_s_weights_leave_the_device_after_it_ran(tiny_dir):
    runner = DenoiseRunner.load(str(tiny_dir), offload_resident=0)
    streamer, blocks = runner.streamer, runner.transformer.transformer_blocks
    assert all(p.numel() == 0 for p in blocks[1].parameters())  # streamed, not fetched yet
    assert streamer.bytes_per_pass == sum(p.numel() * p.element_size() for _, _, p in streamer.host[1])
    img_in = runner.transformer.img_in.weight.data_ptr()  # outside the blocks: on the device throughout
    state = runner.prepare(DenoiseParams(48, 80, 2, seed=1), PromptEmbeds(torch.randn(7, 64)))
    while not state.is_finished:
        runner.step([state])
    assert (streamer.peak, streamer.fetches) == (2, 2)  # the first block kept, the second fetched once a step
    # After a forward the kept block holds its weights, the streamed one none (with several streamed, the first of
    # them would stay, fetched ahead for the next forward while the last one computed).
    assert all(p.numel() > 0 for p in blocks[0].parameters()) and all(p.numel() == 0 for p in blocks[1].parameters())
    assert runner.transformer.img_in.weight.data_ptr() == img_in


def test_a_gang_of_two_streams_on_each_rank(tiny_dir, tiny_adapters, unstreamed):
    for latents, sent in run_gang(denoise_mix, ParallelSettings(ulysses=2), str(tiny_dir), tiny_adapters, 4,
                                  "sequence", False, None, 0):
        assert sent[-1]["peak"] == 2 and sent[-1]["fetches"] > 0  # the first block kept, the second streamed
        for request_id, expected in unstreamed.items():
            assert_reordered(latents[request_id], expected, request_id)


def test_a_gguf_transformer_streams_as_it_runs_whole(tiny_dir, tiny_adapters, tmp_path):
    path = str(gguf_file.write(tiny_dir, tmp_path / "tiny-Q4_0.gguf", "Q4_0"))
    whole = denoise_mix(None, str(tiny_dir), tiny_adapters, 3, "sequence", False, path)[0]
    streamed, sent = denoise_mix(None, str(tiny_dir), tiny_adapters, 3, "sequence", False, path, 0)
    assert sent[-1]["peak"] == 2
    for request_id, expected in whole.items():
        assert torch.equal(streamed[request_id], expected), request_id


def test_the_dit_s_load_counts_the_transfer_as_its_steps_fixed_cost_from_the_start(tiny_dir):
    """Before steps of two sizes have drawn the line, a streamed DiT's fit keeps the transfer as its overhead: a
    step of eight images is estimated at far less than eight of one, as the transfer is paid once."""
    from omni_ray.engine.builders import build_dit_core

    config = load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir),
                         overrides={"dit": {"offload": {"blocks_on_gpu": 1, "host_to_device_gbps": 0.001}}})
    core = build_dit_core(config)
    transfer_s = core.runner.streamer.bytes_per_pass / 1e6  # the tiny block's bytes at 1 MB/s: a CPU copy's
    assert transfer_s > 0.05  # stand-in for a PCIe transfer, so that it shows beside the compute
    assert core.step_times.overhead_s == pytest.approx(transfer_s)
    for _ in range(3):  # steps of one size: a line cannot be drawn yet
        core.step_times.observe(100, transfer_s + 0.01)
    fit = core.step_times.snapshot()
    assert fit.overhead_s == pytest.approx(transfer_s) and fit.per_token_s == pytest.approx(0.01 / 100)
    eight, one = fit.overhead_s + fit.per_token_s * 800, fit.overhead_s + fit.per_token_s * 100
    assert eight < 1.2 * one  # against 8x without the known transfer


def test_offload_is_refused_with_what_it_cannot_run_beside(tiny_dir):
    preset = REPO / "stage_configs/qwen_image_tiny.yaml"
    with pytest.raises(ValueError, match="offload: streamed blocks swap their weights in hooks"):
        load_config(preset, model=str(tiny_dir), overrides={"dit": {"offload": {"blocks_on_gpu": 1}, "compile": True}})
    with pytest.raises(ValueError, match="offload: not with tensor parallelism"):
        load_config(preset, model=str(tiny_dir), overrides={"dit": {"offload": {"blocks_on_gpu": 1},
                                                                     "parallel": {"tensor": 2}}})
    config = load_config(preset, model=str(tiny_dir), overrides={"dit": {"offload": {"blocks_on_gpu": 1}}})
    assert config.dit.offload.blocks_on_gpu == 1
