"""Qwen-Image's text encoder written as a 4-bit AWQ checkpoint in the layout of the published one
(``Qwen/Qwen2.5-VL-7B-Instruct-AWQ``), for tests and for people who quantize their own; the encoder stage loads it
through vLLM's AWQ path (``encoder.dtype`` bfloat16 or float16: docs/one-card.md).

    python -m omni_ray.checkpoints.awq CHECKPOINT OUT_DIR [--group-size 128]
    python -m omni_ray.checkpoints.awq CHECKPOINT OUT_DIR --text-encoder AWQ_DIR   # e.g. the published one

``OUT_DIR`` is a whole checkpoint: its ``text_encoder/`` quantized (or, with ``--text-encoder``, a link to an AWQ
Qwen2.5-VL folder such as a download of the published one), every other entry of ``CHECKPOINT`` a symbolic link to
the original. The published layout (AutoAWQ's ``WQLinear_GEMM``, ``version: gemm``): each Linear of the language
model's decoder layers becomes ``qweight`` ``[in, out / 8]`` int32 and ``qzeros`` ``[in / group, out / 8]`` int32,
eight 4-bit values an int32 packed along the output dimension in AWQ's order (column ``k`` of eight in the nibble
``AWQ_NIBBLE_OF_COLUMN[k]``), ``scales`` ``[in / group, out]`` float16, and its ``bias`` in float16; the vision tower,
the embeddings, the norms and ``lm_head`` stay whole, in float16; ``config.json`` carries the ``quantization_config``
that vLLM and transformers detect AWQ by (``modules_to_not_convert: ["visual"]``, as AutoAWQ writes it for
Qwen2.5-VL; ``lm_head`` is outside the decoder layers, so never quantized).

The values are round-to-nearest with a zero point per group of ``group_size`` inputs (AutoAWQ's
``pseudo_quantize_tensor``), without AWQ's activation-aware scaling search: that search needs calibration prompts
and only chooses the values; the layout, and so the loading code and the kernels, are the same. ``dequantized_state``
and ``write_dequantized`` give a checkpoint's weights back in float32, the reference a quantized encoder is compared
with; ``check_layout`` refuses a folder whose tensors disagree with its ``quantization_config``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import shutil
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BITS = 4
PACK = 32 // BITS  # values an int32 holds
MAX_LEVEL = (1 << BITS) - 1
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i (bits 4i..4i+3) holds column AWQ_PACK_ORDER[i] of eight
AWQ_NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)  # its inverse: column k sits in nibble AWQ_NIBBLE_OF_COLUMN[k]
KEPT_DTYPE = "float16"  # what AutoAWQ writes the scales and the unquantized tensors in
# The language model's Linears (the decoder layers' projections); the vision tower is kept (``visual.``).
QUANTIZED = re.compile(r"^(model\.|model\.language_model\.)layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")
NOT_CONVERTED = ["visual"]
QUANTIZED_SUFFIXES = ("qweight", "qzeros", "scales")


def read_quantization(folder: str | pathlib.Path) -> dict | None:
    """The ``quantization_config`` a model folder's ``config.json`` declares, with AutoAWQ's older key names
    (``w_bit``, ``q_group_size``) read as ``bits`` and ``group_size``; None for a full-precision model."""
    config = json.loads((pathlib.Path(folder) / "config.json").read_text())
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    quantization = dict(quantization)
    for old, new in (("w_bit", "bits"), ("q_group_size", "group_size")):
        if old in quantization:
            quantization.setdefault(new, quantization[old])
    return quantization


def bytes_per_weight(quantization: dict) -> float:
    """Bytes a quantized Linear's weight takes per parameter: its ``bits``, and per group of ``group_size`` inputs
    a float16 scale and a packed zero point (AWQ's 4-bit, group 128: 0.52)."""
    bits, group_size = quantization["bits"], quantization["group_size"]
    return bits / 8 + ((2 + bits / 8) / group_size if group_size > 0 else 0)  # -1: one group a whole row


def quantization_config(group_size: int) -> dict:
    """The ``quantization_config`` of ``config.json``, as the published checkpoint has it."""
    return {"quant_method": "awq", "bits": BITS, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": list(NOT_CONVERTED)}


def quantize(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Linear's ``weight`` ``[out, in]`` as AWQ's ``(qweight [in, out/8], qzeros [in/g, out/8], scales [in/g, out])``:
    per group of ``group_size`` inputs, round to nearest between the group's least and greatest value.

    The scales are rounded to float16 before the values are, so that ``dequantize`` gives exactly what a kernel
    reading these float16 scales computes from."""
    import torch

    kept = getattr(torch, KEPT_DTYPE)
    out_features, in_features = weight.shape
    if in_features % group_size or out_features % PACK:
        raise ValueError(f"a [{out_features}, {in_features}] weight does not split into groups of {group_size} inputs "
                         f"and packs of {PACK} outputs")
    groups = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=2, keepdim=True), groups.amax(dim=2, keepdim=True)
    scales = ((high - low).clamp(min=1e-5) / MAX_LEVEL).to(kept).float()
    zeros = (-torch.round(low / scales)).clamp(0, MAX_LEVEL)
    levels = (torch.round(groups / scales) + zeros).clamp(0, MAX_LEVEL)
    levels = levels.reshape(out_features, in_features).t().to(torch.int32)  # [in, out]
    return pack(levels), pack(zeros[..., 0].t().to(torch.int32)), scales[..., 0].t().to(kept).contiguous()


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``[out, in]`` that AWQ's tensors stand for: ``(level - zero) * scale``, per group."""
    levels, zeros = unpack(qweight), unpack(qzeros)  # [in, out], [groups, out]
    in_features, num_groups = levels.shape[0], zeros.shape[0]
    if scales.shape != zeros.shape or in_features % num_groups:
        raise ValueError(f"AWQ tensors disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                         f"scales {tuple(scales.shape)}")
    group_size = in_features // num_groups
    zeros = zeros.repeat_interleave(group_size, dim=0)
    scales = scales.float().repeat_interleave(group_size, dim=0)
    return ((levels - zeros).float() * scales).t().contiguous()


def pack(levels: torch.Tensor) -> torch.Tensor:
    """``[rows, cols]`` 4-bit levels as ``[rows, cols/8]`` int32, eight columns an int32 in AWQ's order."""
    import torch

    rows, cols = levels.shape
    grouped = levels.to(torch.int64).reshape(rows, cols // PACK, PACK)[..., list(AWQ_PACK_ORDER)]
    shifts = torch.arange(0, 32, BITS, dtype=torch.int64)
    packed = (grouped << shifts).sum(dim=-1)  # below 2**32
    return (packed - (packed >> 31 << 32)).to(torch.int32)  # the same 32 bits, as a signed int32


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """``pack``'s inverse: ``[rows, cols/8]`` int32 to ``[rows, cols]`` levels (int32)."""
    import torch

    shifts = torch.arange(0, 32, BITS, dtype=torch.int32)
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & MAX_LEVEL  # [rows, cols/8, nibble]
    return nibbles[..., list(AWQ_NIBBLE_OF_COLUMN)].reshape(packed.shape[0], -1)


def quantize_state(state: dict[str, torch.Tensor], group_size: int) -> dict[str, torch.Tensor]:
    """A full-precision Qwen2.5-VL state dict in the AWQ layout (the module's docstring)."""
    import torch

    out = {}
    for name, tensor in state.items():
        if QUANTIZED.match(name):
            module = name.removesuffix(".weight")
            quantized = quantize(tensor, group_size)
            out.update({f"{module}.{suffix}": t for suffix, t in zip(QUANTIZED_SUFFIXES, quantized)})
        else:
            out[name] = tensor.to(getattr(torch, KEPT_DTYPE)).contiguous()
    return out


def dequantized_state(folder: str | pathlib.Path, dequantize=dequantize,
                      suffixes: tuple[str, ...] = QUANTIZED_SUFFIXES) -> dict[str, torch.Tensor]:
    """An AWQ text encoder folder's weights as a full-precision Qwen2.5-VL state dict in float32: each quantized
    Linear's ``weight`` dequantized, every other tensor as stored. What the checkpoint computes, for a reference.
    (``dequantize`` of a Linear's ``suffixes`` tensors, in that order: another layout's, GPTQ's.)"""
    from safetensors.torch import load_file

    stored = {}
    for path in sorted(pathlib.Path(folder).glob("*.safetensors")):
        stored.update(load_file(path))
    state = {}
    for name, tensor in stored.items():
        module, _, suffix = name.rpartition(".")
        if suffix == "qweight":
            state[f"{module}.weight"] = dequantize(*(stored[f"{module}.{s}"] for s in suffixes))
        elif suffix not in suffixes:
            state[name] = tensor.float()
    return state


def write_dequantized(folder: str | pathlib.Path, out: str | pathlib.Path, dequantized=None) -> pathlib.Path:
    """An AWQ text encoder folder (or with ``dequantized``, a function such as ``gptq.dequantized_state``, another
    format's) written back as a full-precision one (float32, no ``quantization_config``) at ``out``, which
    transformers' own class loads without a quantized kernel: the checkpoint's definition, as a reference."""
    from safetensors.torch import save_file

    folder, out = pathlib.Path(folder), pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file((dequantized or dequantized_state)(folder), out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config", None)
    _set_dtype(config, "float32")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def _set_dtype(config: dict, dtype: str) -> None:
    """The dtype a model config (and its text and vision sections) declares its weights in."""
    for section in (config, config.get("text_config") or {}, config.get("vision_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if key in section:
                section[key] = dtype


def write_text_encoder(source: str | pathlib.Path, out: str | pathlib.Path, group_size: int = 128) -> pathlib.Path:
    """``source`` (a full-precision Qwen2.5-VL folder: config.json and safetensors, sharded or not) written to
    ``out`` in the AWQ layout."""
    return write_quantized(source, out, lambda state: quantize_state(state, group_size),
                           quantization_config(group_size))


def write_quantized(source: str | pathlib.Path, out: str | pathlib.Path, quantize, quantization: dict) -> pathlib.Path:
    """``source``'s safetensors through ``quantize`` (a state dict to the quantized one) to ``out``, shard by shard
    under the same names, with ``quantization`` as its config.json's ``quantization_config``; other files copied."""
    from safetensors.torch import load_file, save_file

    source, out = pathlib.Path(source), pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for path in sorted(source.glob("*.safetensors")):
        quantized = quantize(load_file(path))
        save_file(quantized, out / path.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(quantized, path.name))
    for path in source.iterdir():
        if path.suffix == ".safetensors" or path.name == "config.json":
            continue
        if path.name.endswith(".safetensors.index.json"):
            index = json.loads(path.read_text())
            index["weight_map"] = dict(sorted(weight_map.items()))
            index.get("metadata", {}).pop("total_size", None)
            (out / path.name).write_text(json.dumps(index, indent=2) + "\n")
        elif path.is_file():
            shutil.copy2(path, out / path.name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization
    _set_dtype(config, KEPT_DTYPE)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def write(checkpoint: str | pathlib.Path, out: str | pathlib.Path, group_size: int = 128,
          text_encoder: str | pathlib.Path | None = None) -> pathlib.Path:
    """A copy of the diffusers-layout ``checkpoint`` at ``out`` whose ``text_encoder/`` is AWQ: ``checkpoint``'s own
    quantized, or with ``text_encoder`` a link to that AWQ folder (checked with ``check_layout``); every other entry
    is a symbolic link to the original's."""
    checkpoint, out = pathlib.Path(checkpoint).resolve(), pathlib.Path(out)
    if not (checkpoint / "text_encoder" / "config.json").is_file():
        raise FileNotFoundError(f"{checkpoint} has no text_encoder/config.json")
    if text_encoder is not None:
        text_encoder = pathlib.Path(text_encoder).resolve()
        quantization = read_quantization(text_encoder)
        if quantization is None or quantization.get("quant_method") != "awq":
            raise ValueError(f"{text_encoder}: its config.json declares no AWQ quantization_config")
        check_layout(text_encoder, quantization)
    link_parts(checkpoint, out)
    if text_encoder is not None:
        (out / "text_encoder").symlink_to(text_encoder)
    else:
        write_text_encoder(checkpoint / "text_encoder", out / "text_encoder", group_size)
    return out


def link_parts(checkpoint: pathlib.Path, out: pathlib.Path) -> None:
    """Symbolic links at ``out`` to every entry of ``checkpoint`` but its ``text_encoder/``."""
    out.mkdir(parents=True, exist_ok=True)
    for entry in checkpoint.iterdir():
        if entry.name != "text_encoder" and not (out / entry.name).exists():
            (out / entry.name).symlink_to(entry)


def check_layout(folder: str | pathlib.Path, quantization: dict) -> None:
    """Raises ValueError naming the file or tensor where an AWQ folder's tensors disagree with its
    ``quantization_config`` (``read_quantization``): a file cut short, a ``qweight`` without its ``qzeros`` or
    ``scales``, shapes that another group size or bit width made. vLLM's loader meets these as a bare assertion or
    a safetensors header error; this reads only the files' headers."""
    from safetensors import SafetensorError, safe_open

    bits, group_size = quantization["bits"], quantization["group_size"]
    pack_factor = 32 // bits
    tensors = {}  # name -> (shape, dtype)
    for path in sorted(pathlib.Path(folder).glob("*.safetensors")):
        try:
            with safe_open(path, "pt") as f:
                names = f.keys()  # the header's; the data is not read
                for name in names:
                    part = f.get_slice(name)
                    tensors[name] = (tuple(part.get_shape()), part.get_dtype())
        except SafetensorError as err:
            raise ValueError(f"{path}: not a whole safetensors file ({err}); write or download it again") from err
    for name, (shape, _) in sorted(tensors.items()):
        if not name.endswith(".qweight"):
            continue
        module = name.removesuffix(".qweight")
        in_features, out_features = shape[0], shape[1] * pack_factor
        group = in_features if group_size == -1 else group_size
        if in_features % group:
            raise ValueError(f"{name}: {in_features} inputs do not split into groups of {group} "
                             f"(quantization_config.group_size in config.json)")
        expected = {"qzeros": ((in_features // group, shape[1]), "I32"),
                    "scales": ((in_features // group, out_features), ("F16", "BF16"))}
        for suffix, (want_shape, want_dtype) in expected.items():
            got = tensors.get(f"{module}.{suffix}")
            if got is None:
                raise ValueError(f"{module}: a qweight without its {suffix}")
            if got[0] != want_shape or got[1] not in want_dtype:
                raise ValueError(
                    f"{module}.{suffix}: {got[1]} {list(got[0])}, but a qweight of {in_features} inputs and "
                    f"{out_features} outputs at {bits} bits in groups of {group} (quantization_config in config.json) "
                    f"needs {want_dtype if isinstance(want_dtype, str) else ' or '.join(want_dtype)} "
                    f"{list(want_shape)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m omni_ray.checkpoints.awq", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a diffusers-layout checkpoint whose text_encoder/ is full precision")
    parser.add_argument("out_dir", help="where to write the checkpoint with an AWQ text_encoder/")
    parser.add_argument("--group-size", type=int, default=128,
                        help="inputs sharing one scale and zero point (default 128, the published one's)")
    parser.add_argument("--text-encoder", metavar="AWQ_DIR",
                        help="link this AWQ Qwen2.5-VL folder (e.g. a download of Qwen/Qwen2.5-VL-7B-Instruct-AWQ) as "
                        "text_encoder/ instead of quantizing the checkpoint's own")
    args = parser.parse_args(argv)
    out = write(args.checkpoint, args.out_dir, args.group_size, args.text_encoder)
    what = args.text_encoder or f"a 4-bit AWQ text encoder (group size {args.group_size})"
    print(f"wrote {args.checkpoint} with {what} to {out}")


if __name__ == "__main__":
    main()
