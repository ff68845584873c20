"""Qwen-Image's text encoder written as a 4-bit GPTQ checkpoint (AutoGPTQ's and GPTQModel's ``gptq`` format,
symmetric, ``desc_act: false``), which the encoder stage loads through vLLM's GPTQ path as it loads AWQ
(``omni_ray.checkpoints.awq``: the same Linears quantized, the same tensors kept whole in float16).

    python -m omni_ray.checkpoints.gptq CHECKPOINT OUT_DIR [--group-size 128]

Each quantized Linear becomes ``qweight`` ``[in / 8, out]`` int32, eight 4-bit levels an int32 packed along the
input (nibble ``j`` of row ``r`` holds input ``8 r + j``), ``qzeros`` ``[in / group, out / 8]`` int32 packed along
the output, holding the zero point 8 as 7 (the format's stored offset of one), ``scales`` ``[in / group, out]``
float16 and ``g_idx`` ``[in]`` int32, each input's group. Round to nearest: per group, a scale of the largest
magnitude over 7.5 and levels ``round(w / scale) + 8`` within 0..15, as GPTQ's quantizer rounds, without its
Hessian-guided updates (those need calibration prompts and only choose the values).
"""

from __future__ import annotations

import argparse
import pathlib
from typing import TYPE_CHECKING

from omni_ray.checkpoints import awq
from omni_ray.checkpoints.awq import BITS, KEPT_DTYPE, MAX_LEVEL, PACK, QUANTIZED, link_parts, write_quantized

if TYPE_CHECKING:
    import torch

ZERO = (MAX_LEVEL + 1) // 2  # the symmetric zero point
SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def quantization_config(group_size: int) -> dict:
    """The ``quantization_config`` of ``config.json`` vLLM's GPTQ path reads."""
    return {"quant_method": "gptq", "bits": BITS, "group_size": group_size, "desc_act": False, "sym": True,
            "checkpoint_format": "gptq"}


def quantize(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, ...]:
    """A Linear's ``weight`` ``[out, in]`` as GPTQ's ``(qweight, qzeros, scales, g_idx)`` (the module's docstring);
    the scales rounded to float16 before the levels are."""
    import torch

    out_features, in_features = weight.shape
    if in_features % group_size or in_features % PACK or out_features % PACK:
        raise ValueError(f"a [{out_features}, {in_features}] weight does not split into groups of {group_size} inputs "
                         f"and packs of {PACK}")
    groups = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    scales = (groups.abs().amax(dim=2, keepdim=True).clamp(min=1e-5) / (ZERO - 0.5)).to(getattr(torch, KEPT_DTYPE))
    levels = (torch.round(groups / scales.float()) + ZERO).clamp(0, MAX_LEVEL).reshape(out_features, in_features)
    qweight = _pack(levels).t().contiguous()  # [in / 8, out], packed along the input
    qzeros = _pack(torch.full((in_features // group_size, out_features), ZERO - 1))
    g_idx = (torch.arange(in_features) // group_size).to(torch.int32)
    return qweight, qzeros, scales[..., 0].t().contiguous(), g_idx


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``[out, in]`` GPTQ's tensors stand for: ``(level - (stored zero + 1)) * scale`` of each
    input's group."""
    levels = _unpack(qweight.t()).t()  # [in, out]
    zeros = _unpack(qzeros) + 1  # [groups, out]
    groups = g_idx.long()
    return ((levels - zeros[groups]).float() * scales.float()[groups]).t().contiguous()


def _pack(levels: torch.Tensor) -> torch.Tensor:
    """``[rows, cols]`` levels as ``[rows, cols / 8]`` int32, column ``8 c + j`` in nibble ``j``."""
    import torch

    rows, cols = levels.shape
    grouped = levels.to(torch.int64).reshape(rows, cols // PACK, PACK)
    packed = (grouped << torch.arange(0, 32, BITS, dtype=torch.int64)).sum(dim=-1)
    return (packed - (packed >> 31 << 32)).to(torch.int32)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    import torch

    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> torch.arange(0, 32, BITS, dtype=torch.int32)) & MAX_LEVEL
    return nibbles.reshape(packed.shape[0], -1)


def quantize_state(state: dict[str, torch.Tensor], group_size: int) -> dict[str, torch.Tensor]:
    """A full-precision Qwen2.5-VL state dict in the GPTQ layout: the Linears ``awq.QUANTIZED`` names."""
    import torch

    out = {}
    for name, tensor in state.items():
        if QUANTIZED.match(name):
            module = name.removesuffix(".weight")
            out.update({f"{module}.{suffix}": t for suffix, t in zip(SUFFIXES, quantize(tensor, group_size))})
        else:
            out[name] = tensor.to(getattr(torch, KEPT_DTYPE)).contiguous()
    return out


def dequantized_state(folder: str | pathlib.Path) -> dict[str, torch.Tensor]:
    """A GPTQ text encoder folder's weights as a full-precision state dict in float32 (``awq.write_dequantized``
    writes it for a reference)."""
    return awq.dequantized_state(folder, dequantize, SUFFIXES)


def write(checkpoint: str | pathlib.Path, out: str | pathlib.Path, group_size: int = 128) -> pathlib.Path:
    """A copy of the diffusers-layout ``checkpoint`` at ``out`` whose ``text_encoder/`` is GPTQ-quantized; every
    other entry is a symbolic link to the original's."""
    checkpoint, out = pathlib.Path(checkpoint).resolve(), pathlib.Path(out)
    if not (checkpoint / "text_encoder" / "config.json").is_file():
        raise FileNotFoundError(f"{checkpoint} has no text_encoder/config.json")
    link_parts(checkpoint, out)
    write_quantized(checkpoint / "text_encoder", out / "text_encoder",
                    lambda state: quantize_state(state, group_size), quantization_config(group_size))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m omni_ray.checkpoints.gptq", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a diffusers-layout checkpoint whose text_encoder/ is full precision")
    parser.add_argument("out_dir", help="where to write the checkpoint with a GPTQ text_encoder/")
    parser.add_argument("--group-size", type=int, default=128, help="inputs sharing one scale (default 128)")
    args = parser.parse_args(argv)
    out = write(args.checkpoint, args.out_dir, args.group_size)
    print(f"wrote {args.checkpoint} with a 4-bit GPTQ text encoder (group size {args.group_size}) to {out}")


if __name__ == "__main__":
    main()
