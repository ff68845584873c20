"""What the GPU path does differently, checked on the CPU (issue 14): results leave the stages as normal CPU tensors
made outside inference mode, and the DiT's blocks compiled with torch.compile (``dit.compile``) give what eager
blocks give, with and without LoRA adapters in the batch."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from omni_ray.records import DenoiseParams, LoraRef, PromptEmbeds
from omni_ray.runners.decode import VaeRunner
from omni_ray.runners.denoise import DenoiseRunner
from omni_ray.runners.lora import read_lora
from testing.engines import TOLERANCE
from testing.lora_files import make_adapter


def denoise(runner: DenoiseRunner, loras: list, steps: int = 2) -> list[torch.Tensor]:
    """Rows that differ only by their adapter (same prompt, negative prompt and seed)."""
    generator = torch.Generator().manual_seed(0)
    dim = runner.transformer.config.joint_attention_dim
    prompt, negative = (PromptEmbeds(torch.randn(length, dim, generator=generator)) for length in (12, 9))
    states = [runner.prepare(DenoiseParams(64, 64, steps, 0, 4.0, lora=lora, true_cfg=True), prompt, negative)
              for lora in loras]
    for _ in range(steps):
        runner.step(states)
    return [runner.finish(state).latents for state in states]


def test_stage_results_are_plain_cpu_tensors_a_caller_may_change(tiny_dir):
    runner, vae = DenoiseRunner.load(str(tiny_dir)), VaeRunner.load(str(tiny_dir))
    (latents,) = denoise(runner, [None])
    image_latents = vae.encode([np.zeros((64, 64, 3), np.uint8)])[0].latents
    for tensor in (latents, image_latents):
        assert tensor.device.type == "cpu" and tensor.is_contiguous() and not tensor.is_inference()
        tensor.mul_(1.0)  # an inference tensor would refuse this outside inference mode


def test_compiled_blocks_match_eager_ones_with_and_without_adapters(tiny_dir, tmp_path):
    adapter = str(make_adapter(tiny_dir, tmp_path / "A", rank=4, seed=1))
    lora = LoraRef("A", adapter, 0.9)
    results = []
    for compile in (False, True):
        runner = DenoiseRunner.load(str(tiny_dir), compile=compile)
        runner.add_lora(lora.key, read_lora(adapter, runner.lora_shapes))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results.append(denoise(runner, [None, lora, None]))
    # The rotary embeddings are real arithmetic (runners/attention.py): Inductor generates code for the whole block
    # instead of falling back around diffusers' complex multiplication.
    assert not [w for w in caught if "complex" in str(w.message)]
    (eager, compiled) = results
    for row in range(3):
        assert (eager[row] - compiled[row]).abs().max().item() <= TOLERANCE, row
    assert (eager[1] - eager[0]).abs().max() > 0.05  # only the adapter tells row 1 from row 0: it is not ignored
