"""What the GPU path does differently, checked on the CPU (issue 14): results leave the stages as normal CPU tensors
made outside inference mode, and the DiT's blocks compiled with torch.compile (``dit.compile``) give what eager
blocks give, with and without LoRA adapters in the batch."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from omni_ray.records import DenoiseParams, LoraRef, PromptEmbeds
from omni_ray.runners.denoise import DenoiseRunner
from omni_ray.runners.lora import read_lora
from omni_ray.runners.vae import VaeRunner
from testing.lora_files import make_adapter
from testing.numerics import assert_reordered


def denoise(runner: DenoiseRunner, loras: list, steps: int = 2) -> list[torch.Tensor]:
    """Rows that differ only by their adapter (same prompt, negative prompt and seed)."""
    generator = torch.Generator().manual_seed(0)
    dim = runner.transformer.config.joint_attention_dim
    prompt, negative = (PromptEmbeds(torch.randn(length, dim, generator=generator)) for length in (12, 9))
    states = [runner.prepare(DenoiseParams(64, 64, steps, 0, 4.0, loras=(lora,) if lora else (), true_cfg=True),
                             prompt, negative)
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
        assert_reordered(eager[row], compiled[row], row)
    assert (eager[1] - eager[0]).abs().max() > 0.05  # only the adapter tells row 1 from row 0: it is not ignored


def test_fp8_quantizes_the_blocks_linears_but_the_sensitive_ones_and_refuses_the_cpu(runner):
    """FP8 (dit.quantization) needs float8 tensor cores; what it would quantize is decided on any machine."""
    from omni_ray.runners.quantization import KEPT_IN_BF16, fp8_linears, quantize_fp8

    names = fp8_linears(runner.transformer)
    blocks = runner.transformer.config.num_layers
    assert len(names) == 11 * blocks  # 14 Linears a block, 3 kept
    assert {"transformer_blocks.0.attn.to_q", "transformer_blocks.0.img_mlp.net.0.proj",
            "transformer_blocks.0.txt_mlp.net.2"} <= set(names)
    assert not [name for name in names if name.endswith(KEPT_IN_BF16)]
    with pytest.raises(RuntimeError, match="dit.quantization: fp8 needs a CUDA GPU"):
        quantize_fp8(runner.transformer)


def test_compiled_blocks_compile_at_warm_up_and_not_again_for_other_sizes_batches_or_texts(tiny_dir):
    """``dit.compile`` warms up at start (``DenoiseRunner.warm_up``): after it, other image sizes, batch sizes and
    text lengths run the compiled code; no user's request waits for a compilation."""
    from torch._dynamo.utils import counters

    runner = DenoiseRunner.load(str(tiny_dir), compile=True)
    assert runner.warm_up(64, 64) > 0 and runner.warmup_s > 0
    graphs = counters["stats"]["unique_graphs"]
    generator = torch.Generator().manual_seed(0)
    dim = runner.transformer.config.joint_attention_dim
    for height, width, batch, cfg, length in [(64, 64, 3, True, 12), (64, 96, 1, False, 20), (96, 96, 5, True, 7),
                                              (128, 64, 2, False, 33)]:
        prompt = PromptEmbeds(torch.randn(length, dim, generator=generator))
        negative = PromptEmbeds(torch.randn(length + 3, dim, generator=generator))
        states = [runner.prepare(DenoiseParams(height, width, 2, seed, 4.0, true_cfg=cfg), prompt,
                                 negative if cfg else None) for seed in range(batch)]
        runner.step(states)
        assert counters["stats"]["unique_graphs"] == graphs, (height, width, batch, cfg, length)
