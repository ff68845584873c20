"""The DiT's weights quantized to int8 at load (``dit.quantization: int8``, torchao's weight-only int8, issue 50): on
the tiny checkpoint, the quantized runner's latents are those of the unquantized runner holding the int8 weights'
own values (each row's int8 levels times its scale, in float32) within float32 reordering, and far from the
unquantized checkpoint's (the quantization took effect); a step batch mixing rows with an adapter and without, and
with a cache, gives each row as it runs alone; a gang of two Ulysses ranks as one rank; the placement check counts
the blocks' Linears at a byte a weight; and what int8 does not do yet is refused naming the field. int4 (CUDA only):
its placement bytes and its refusals."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO

from omni_ray.config import CacheSettings, ConfigError, ParallelSettings, load_config
from omni_ray.families.qwen_image.facts import BLOCK_LINEAR_PARAMS
from omni_ray.records import DenoiseParams, LoraRef
from omni_ray.runners.denoise import DenoiseRunner
from omni_ray.runners.lora import read_lora
from omni_ray.runners.quantization import int8_linears
from testing.gang import run_gang
from testing.lora_files import make_adapter
from testing.numerics import assert_reordered
from testing.parallel import denoise_mix
from testing.reference import PromptEncoder


def _denoise(runner: DenoiseRunner, rows, prompt, negative) -> list[torch.Tensor]:
    states = [runner.prepare(params, prompt, negative) for params in rows]
    while not states[0].is_finished:
        runner.step(states)
    return [runner.finish(state).latents for state in states]


def _params(seed: int, **more) -> DenoiseParams:
    return DenoiseParams(64, 64, 4, seed=seed, true_cfg_scale=4.0, true_cfg=True, **more)


@pytest.fixture(scope="module")
def prompts(tiny_dir):
    return PromptEncoder(str(tiny_dir)).encode(["a red cat", "blurry"])


def test_int8_latents_are_those_of_its_own_weights_and_not_the_checkpoint_s(tiny_dir, prompts):
    quantized = DenoiseRunner.load(str(tiny_dir), quantization="int8")
    names = int8_linears(quantized.transformer)
    assert len(names) == 2 * 14  # the tiny transformer's two blocks, 14 Linears each
    modules = dict(quantized.transformer.named_modules())
    assert all(type(modules[name].weight).__name__ == "Int8Tensor" for name in names)
    same_values = DenoiseRunner.load(str(tiny_dir))  # the int8 weights' own values, unquantized
    plain = dict(same_values.transformer.named_modules())
    with torch.no_grad():
        for name in names:
            plain[name].weight.copy_(modules[name].weight.dequantize())
    checkpoint = DenoiseRunner.load(str(tiny_dir))
    rows = [_params(1), _params(2)]
    got = _denoise(quantized, rows, *prompts)
    expected_all, original_all = _denoise(same_values, rows, *prompts), _denoise(checkpoint, rows, *prompts)
    for expected, mine, original in zip(expected_all, got, original_all, strict=True):
        assert_reordered(mine, expected)
        assert (mine - original).abs().max() > 1e3 * (mine - expected).abs().max()  # int8 rounding, not reordering


def test_a_step_of_int8_rows_with_and_without_an_adapter_and_a_cache_gives_each_row_alone(tiny_dir, prompts, tmp_path):
    runner = DenoiseRunner.load(str(tiny_dir), quantization="int8")
    adapter = str(make_adapter(tiny_dir, tmp_path / "A", rank=4, alpha=8, seed=1))
    runner.add_lora(("A", adapter), read_lora(adapter, runner.lora_shapes))
    rows = [_params(1), _params(2, loras=(LoraRef("A", adapter, 0.8),)),
            _params(3, cache=CacheSettings(kind="first_block", threshold=2.0))]
    together = _denoise(runner, rows, *prompts)
    for i, row in enumerate(rows):
        assert_reordered(together[i], _denoise(runner, [row], *prompts)[0], i)
    assert (together[0] - together[1]).abs().max() > 1e-2  # the adapter took effect beside the int8 weights


def test_a_gang_denoises_an_int8_dit_as_one_rank_does(tiny_dir, tiny_adapters):
    """Ulysses over two ranks, each quantizing its own copy, with the parallel tests' mix of adapters and caches."""
    one = denoise_mix(None, str(tiny_dir), tiny_adapters, 4, "sequence", False, None, None, "int8")[0]
    for latents, _ in run_gang(denoise_mix, ParallelSettings(ulysses=2), str(tiny_dir), tiny_adapters, 4, "sequence",
                               False, None, None, "int8"):
        assert latents.keys() == one.keys()
        for request_id, expected in one.items():
            assert_reordered(latents[request_id], expected, request_id)


def test_placement_counts_int8_block_weights_and_refuses_what_int8_does_not_do(tiny_dir):
    """The published transformer's block Linears (counted here from its config) at a byte a weight: 20.5 GB in all
    against bf16's 40.9; int8 with streamed blocks or tensor ranks is refused, naming the field."""
    from diffusers import QwenImageTransformer2DModel

    from omni_ray.checkpoints.full_size import CONFIG_DIR
    from omni_ray.placement import GIB, stage_memory

    config = QwenImageTransformer2DModel.load_config(CONFIG_DIR, subfolder="transformer")
    with torch.device("meta"):
        model = QwenImageTransformer2DModel.from_config(config)
    modules = dict(model.named_modules())
    assert sum(modules[name].weight.numel() for name in int8_linears(model)) == BLOCK_LINEAR_PARAMS
    preset = REPO / "stage_configs/qwen_image_one_gpu_dummy.yaml"
    bf16, int8 = (next(e for e in stage_memory(load_config(preset, overrides={"dit": {"quantization": q}}), 80)
                       if e.stage == "dit") for q in ("none", "int8"))
    assert "int8 and bfloat16" in int8.detail
    assert bf16.need_gib - int8.need_gib == pytest.approx(BLOCK_LINEAR_PARAMS / GIB, abs=0.1)
    tiny = REPO / "stage_configs/qwen_image_tiny.yaml"
    for more in ({"offload": {"blocks_on_gpu": 1}}, {"parallel": {"tensor": 2}}):
        with pytest.raises(ConfigError, match="dit: quantization: int8 weights are not streamed"):
            load_config(tiny, model=str(tiny_dir), overrides={"dit": {"quantization": "int8", **more}})


def test_int4_is_placed_at_a_little_over_half_a_byte_a_block_weight_and_refused_where_torchao_cannot_run_it(tiny_dir):
    """``dit.quantization: int4`` (torchao's tinygemm int4, CUDA only): the placement check counts the block Linears
    at half a byte and a group's scale and zero point; a CPU preset, a float32 one, streamed blocks and tensor ranks
    are refused naming the field; the quantizer itself refuses a CPU model. Its images wait for a GPU (the GPU plan's
    ``small_card`` command)."""
    from omni_ray.placement import GIB, stage_memory
    from omni_ray.runners.quantization import INT4_GROUP, quantize_int4

    preset = REPO / "stage_configs/qwen_image_one_gpu_dummy.yaml"
    bf16, int4 = (next(e for e in stage_memory(load_config(preset, overrides={"dit": {"quantization": q}}), 80)
                       if e.stage == "dit") for q in ("none", "int4"))
    assert "int4 and bfloat16" in int4.detail
    saved = BLOCK_LINEAR_PARAMS * (2 - 0.5 - 4 / INT4_GROUP) / GIB
    assert bf16.need_gib - int4.need_gib == pytest.approx(saved, abs=0.1) and saved > 27
    with pytest.raises(ConfigError, match="dit.quantization: int4 runs on CUDA GPUs in bfloat16.*not dit.device cuda "
                                          "in float32"):
        load_config(preset, overrides={"dit": {"quantization": "int4", "dtype": "float32"}})
    tiny = REPO / "stage_configs/qwen_image_tiny.yaml"
    with pytest.raises(ConfigError, match="dit.quantization: int4 runs on CUDA GPUs .* not dit.device cpu"):
        load_config(tiny, model=str(tiny_dir), overrides={"dit": {"quantization": "int4"}})
    for more in ({"offload": {"blocks_on_gpu": 1}}, {"parallel": {"tensor": 2}}):
        with pytest.raises(ConfigError, match="dit: quantization: int4 weights are not streamed"):
            load_config(preset, overrides={"dit": {"quantization": "int4", "compile": False, **more}})
    runner = DenoiseRunner.load(str(tiny_dir))
    with pytest.raises(RuntimeError, match="dit.quantization: int4 runs on CUDA GPUs in bfloat16 .* not cpu"):
        quantize_int4(runner.transformer)
