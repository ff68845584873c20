"""encode -> denoise -> decode on the tiny checkpoint gives diffusers' QwenImagePipeline's pixels.

In one process the operations are the same on the same values, so the difference must be exactly 0. Across
processes, thread counts change float sums in the last bit (about 5e-7), so one uint8 level is allowed there.
"""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import REPO
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

from omni_ray.config import load_config
from omni_ray.records import DenoiseParams
from omni_ray.runners.denoise import DenoiseRunner
from testing.reference import ReferencePipeline

LONG = "an oil painting of a lighthouse on a cliff at sunset, waves crashing against the rocks below"


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return QwenImagePipeline.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def ours(tiny_dir):
    return ReferencePipeline(load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir)))


def diffusers_images(pipe, prompts, seeds, height, width, steps, negative=None, output_type="pil"):
    result = pipe(
        prompts,
        negative_prompt=negative,
        true_cfg_scale=4.0,
        height=height,
        width=width,
        num_inference_steps=steps,
        generator=[torch.Generator("cpu").manual_seed(seed) for seed in seeds],
        output_type=output_type,
    ).images
    return result if output_type == "latent" else np.stack([np.asarray(image) for image in result])


CASES = {
    "square, no CFG, 4 steps": (["a red cat"], [0], 64, 64, 4, None),
    "wide, no CFG, 4 steps": (["a red cat"], [7], 64, 96, 4, None),
    "tall, CFG with negative prompt, 4 steps": (["a red cat on a mat"], [3], 96, 64, 4, ["blurry, low quality"]),
    "two prompts of different lengths, no CFG": (["a red cat", LONG], [1, 2], 64, 64, 4, None),
    "two prompts of different lengths, CFG": (["a red cat", LONG], [1, 2], 64, 96, 2, ["blurry", "dark, noisy"]),
    "two steps, no CFG": (["a cup of coffee"], [11], 64, 64, 2, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pixels_equal_diffusers_in_process(reference, ours, case):
    prompts, seeds, height, width, steps, negative = CASES[case]
    expected = diffusers_images(reference, prompts, seeds, height, width, steps, negative)
    got = ours.generate(
        prompts, seeds=seeds, height=height, width=width, num_inference_steps=steps, negative_prompts=negative
    )
    assert got.dtype == np.uint8 and got.shape == (len(prompts), height, width, 3)
    assert expected.std() > 10  # a real image, not a flat one that any pipeline would match
    # Our VAE runs diffusers' arithmetic with 2-D kernels (runners/vae_frame.py), whose float sums round otherwise
    # (about 4e-6 in [-1, 1]): a pixel that lands on a rounding edge moves one level. The latents are diffusers'
    # bit for bit (the next test).
    difference = np.abs(got.astype(int) - expected.astype(int))
    assert difference.max() <= 1 and difference.mean() < 0.01


def test_stage_records_equal_diffusers(reference, ours):
    """The records between stages (prompt embeddings, final latents) are diffusers' tensors bit for bit."""
    prompts, negative = ["a red cat", LONG], ["blurry", "dark, noisy"]
    embeds = ours.encoder.encode(prompts)
    expected, mask = reference.encode_prompt(prompts, device="cpu")
    for row, record in enumerate(embeds):
        length = int(mask[row].sum())
        assert record.embeds.is_contiguous() and record.embeds.device.type == "cpu"
        assert torch.equal(record.embeds, expected[row, :length])

    negative_embeds = ours.encoder.encode(negative)
    states = [
        ours.denoiser.prepare(DenoiseParams(64, 64, 3, seed, 4.0, true_cfg=True), p, n)
        for p, n, seed in zip(embeds, negative_embeds, [5, 6])
    ]
    for _ in range(3):
        ours.denoiser.step(states)  # CFG's passes apart, as diffusers runs them
    latents = [ours.denoiser.finish(state) for state in states]
    expected_latents = diffusers_images(reference, prompts, [5, 6], 64, 64, 3, negative, output_type="latent")
    assert torch.equal(torch.stack([item.latents for item in latents]), expected_latents)


def test_fused_cfg_forward_stays_within_float_noise_of_diffusers(reference, ours):
    """The engine's CFG runs prompt and negative rows in one forward, the negative padded to the prompt's length.

    Padding with a mask changes the order of float sums in attention, so the latents differ from diffusers' two
    passes by rounding only: measured 1e-5 absolute on values of order 3 after 4 steps (about 3e-6 relative).
    """
    prompt, negative = ours.encoder.encode([LONG]), ours.encoder.encode(["blurry"])
    fused = DenoiseRunner(ours.denoiser.transformer, ours.denoiser.scheduler_config)  # the engine's runner
    state = fused.prepare(DenoiseParams(64, 64, 4, 9, 4.0, true_cfg=True), prompt[0], negative[0])
    for _ in range(4):
        fused.step([state])
    expected = diffusers_images(reference, [LONG], [9], 64, 64, 4, ["blurry"], output_type="latent")[0]
    got = fused.finish(state).latents
    assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def test_one_step(reference, ours, tiny_dir):
    """One step: diffusers' stock schedule is NaN (its terminal stretch divides 0 by 0); ours is its unstretched step."""
    with pytest.warns(RuntimeWarning):
        stock = diffusers_images(reference, ["a red cat"], [0], 64, 64, 1, output_type="latent")
    assert torch.isnan(stock).all()

    unstretched = QwenImagePipeline.from_pretrained(
        tiny_dir, scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_dir, subfolder="scheduler",
                                                                            shift_terminal=None)
    )
    expected = diffusers_images(unstretched, ["a red cat"], [0], 64, 64, 1)
    got = ours.generate(["a red cat"], seeds=[0], height=64, width=64, num_inference_steps=1)
    assert expected.std() > 10
    assert np.abs(got.astype(int) - expected.astype(int)).max() == 0


DIFFUSERS_IN_SUBPROCESS = textwrap.dedent(
    """
    import json, sys, numpy as np, torch
    from diffusers import QwenImagePipeline
    torch.set_num_threads(1)
    ckpt, case, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    prompts, seeds, height, width, steps, negative = case
    pipe = QwenImagePipeline.from_pretrained(ckpt)
    images = pipe(prompts, negative_prompt=negative, true_cfg_scale=4.0, height=height, width=width,
                  num_inference_steps=steps, generator=[torch.Generator("cpu").manual_seed(s) for s in seeds]).images
    np.save(out, np.stack([np.asarray(image) for image in images]))
    """
)


@pytest.mark.parametrize("case", ["tall, CFG with negative prompt, 4 steps", "two prompts of different lengths, CFG"])
def test_pixels_within_one_level_of_diffusers_across_processes(ours, tiny_dir, tmp_path, case):
    out = tmp_path / "reference.npy"
    result = subprocess.run(
        [sys.executable, "-c", DIFFUSERS_IN_SUBPROCESS, str(tiny_dir), json.dumps(CASES[case]), str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    prompts, seeds, height, width, steps, negative = CASES[case]
    got = ours.generate(
        prompts, seeds=seeds, height=height, width=width, num_inference_steps=steps, negative_prompts=negative
    )
    assert np.abs(got.astype(int) - np.load(out).astype(int)).max() <= 1
