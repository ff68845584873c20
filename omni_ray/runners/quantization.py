"""The DiT's bf16 weights quantized at load with torchao: ``dit.quantization: fp8``, ``int8`` or ``int4``.

**int8** (anywhere: GPUs and CPUs): torchao's weight-only int8 on every Linear of the transformer blocks, one
symmetric scale per output row; activations stay in ``dit.dtype`` and each call dequantizes as it multiplies. It
halves the transformer's weight bytes against bf16 (40.9 GB -> 20.5 GB: the block Linears hold all but 46 M of its
20.4 B parameters), for users who keep the published bf16 weights rather than download a GGUF file; the modulation
and MLP Linears alike (weight-only rounding is per row and mild; nothing is quantized on the activations' side).

**int4** (CUDA GPUs): torchao's weight-only int4 on the same Linears, in groups of ``INT4_GROUP`` weights of a row
with a bf16 scale and zero point each, packed for tinygemm's CUDA kernel (``tile_packed_to_4d``, bf16 activations):
a little over a quarter of bf16's bytes (the transformer in 10.9 GB against 40.9). torchao has no int4 layout for
the CPU in the version pinned here (its plain layout needs the mslk package; its packed one CUDA), so a CPU preset
is refused (``config.pipeline``) and only a GPU runs it: the GPU plan's ``small_card`` command measures its step and
its distance to bf16.

**fp8**: torchao's dynamic float8 on the transformer blocks' Linears.

Weights are stored in float8_e4m3 with one scale per output row; each call quantizes its activations per row
(token) and multiplies with ``torch._scaled_mm`` (float32 accumulation), so a Linear's work and weight bytes halve
against bf16 on GPUs with float8 tensor cores (compute capability 8.9+). What stays in bf16 is what the peers found
sensitive in Qwen-Image: the image MLP's output projection (``img_mlp.net.2``, whose activations after the GELU carry
outliers) and the modulation Linears (``img_mod.1``, ``txt_mod.1``: six shift/scale/gate vectors per block computed
from the timestep embedding, a few rows each, where quantization saves nothing and errors reach every token), along
with everything outside the blocks (embedders, final norm and projection). LoRA adapters add their update beside the
quantized base (``LoraLinear``), in bf16.
"""

from __future__ import annotations

import torch
from torch import nn

KEPT_IN_BF16 = ("img_mlp.net.2", "img_mod.1", "txt_mod.1")  # module names within a block
INT4_GROUP = 128  # int4's weights per scale and zero point (every block Linear's input width is a multiple)


def fp8_linears(transformer: nn.Module) -> list[str]:
    """The Linears that FP8 quantizes: those of the transformer blocks, less ``KEPT_IN_BF16``."""
    return [name for name, module in transformer.named_modules()
            if isinstance(module, nn.Linear) and name.startswith("transformer_blocks.")
            and not name.endswith(KEPT_IN_BF16)]


def int8_linears(transformer: nn.Module) -> list[str]:
    """The Linears that int8 quantizes: every Linear of the transformer blocks."""
    return [name for name, module in transformer.named_modules()
            if isinstance(module, nn.Linear) and name.startswith("transformer_blocks.")]


def quantize_int8(transformer: nn.Module) -> int:
    """Quantizes ``int8_linears`` in place (weight-only, per-row scales); returns how many."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    names = set(int8_linears(transformer))
    quantize_(transformer, Int8WeightOnlyConfig(), filter_fn=lambda module, name: name in names)
    return len(names)


def quantize_int4(transformer: nn.Module) -> int:
    """Quantizes ``int8_linears`` to int4 in place (weight-only, groups of ``INT4_GROUP``, tinygemm's packing);
    returns how many. Raises with the setting's name where it cannot run."""
    parameter = next(transformer.parameters())
    if parameter.device.type != "cuda" or parameter.dtype != torch.bfloat16:
        raise RuntimeError(f"dit.quantization: int4 runs on CUDA GPUs in bfloat16 (torchao's tinygemm kernel), not "
                           f"{parameter.device.type} in {parameter.dtype}")
    from torchao.quantization import Int4WeightOnlyConfig, quantize_

    names = set(int8_linears(transformer))
    quantize_(transformer, Int4WeightOnlyConfig(group_size=INT4_GROUP, int4_packing_format="tile_packed_to_4d"),
              filter_fn=lambda module, name: name in names)
    return len(names)


def quantize_fp8(transformer: nn.Module) -> int:
    """Quantizes ``fp8_linears`` in place; returns how many. Raises with the setting's name where it cannot run."""
    device = next(transformer.parameters()).device
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise RuntimeError(f"dit.quantization: fp8 needs a CUDA GPU of compute capability 8.9 or more, not {device}")
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
    except ImportError as err:
        raise RuntimeError("dit.quantization: fp8 needs torchao (a dependency of omni-ray's)") from err
    names = set(fp8_linears(transformer))
    quantize_(transformer, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
              filter_fn=lambda module, name: name in names)
    return len(names)
