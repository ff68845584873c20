"""Qwen-Image's transformer from a GGUF file, the form people download it in (QuantStack's and city96's Qwen-Image,
Qwen-Image-2512 and Edit GGUFs, written with ComfyUI-GGUF's converter): ``dit.weights_file``.

``check`` reads a file's header and tensor table (memory-mapped, nothing dequantized) against the checkpoint's
transformer config: ``ValueError`` naming ``dit.weights_file`` for a file that is not a GGUF, is cut short, is
another model's or another variant's, or holds a quant type diffusers cannot dequantize. ``load_transformer`` then
builds the transformer through diffusers' single-file path with ``GGUFQuantizationConfig``: each quantized Linear
keeps its weight quantized and dequantizes it in the compute dtype per forward (diffusers' CUDA kernels where
installed). Tensor names may carry a full-model file's prefix (``model.diffusion_model.``), which is dropped.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

ARCHITECTURE = "qwen_image"  # the published files' general.architecture
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.")  # full-model files' names
SETTING = "dit.weights_file"


@dataclass(frozen=True)
class GgufSummary:
    architecture: str | None
    quant_types: dict[str, int]  # type name -> tensors of it
    bytes: int  # of the tensors' data


def check(path: str | pathlib.Path, transformer_config: dict, setting: str = SETTING) -> GgufSummary:
    """What the GGUF file at ``path`` holds, checked to be ``transformer_config``'s model in types diffusers reads;
    ValueError naming ``setting`` otherwise."""
    import gguf
    import torch
    from diffusers import QwenImageTransformer2DModel
    from diffusers.quantizers.gguf.utils import KQUANT_TYPES, STANDARD_QUANT_TYPES, UNQUANTIZED_TYPES

    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"{setting}: {path} is not a file")
    with path.open("rb") as file:
        if file.read(4) != b"GGUF":
            raise ValueError(f"{setting}: {path} is not a GGUF file (it does not start with 'GGUF')")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as err:  # noqa: BLE001 - gguf raises ValueError, struct.error, IndexError... on a broken file
        raise ValueError(f"{setting}: {path} is not a whole GGUF file ({type(err).__name__}: {err}); "
                         "download it again") from None
    field = reader.fields.get("general.architecture")
    architecture = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in
                    QwenImageTransformer2DModel.from_config(transformer_config).state_dict().items()}
    readable = UNQUANTIZED_TYPES | STANDARD_QUANT_TYPES | KQUANT_TYPES
    types: dict[str, int] = {}
    found: dict[str, tuple[int, ...]] = {}
    for tensor in reader.tensors:
        name = strip_prefix(tensor.name)
        if tensor.tensor_type not in readable:
            raise ValueError(f"{setting}: {path} holds {tensor.name} as {tensor.tensor_type.name}, a type diffusers "
                             f"cannot dequantize (it reads {', '.join(sorted(t.name for t in readable))})")
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
        found[name] = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    if architecture not in (None, ARCHITECTURE) or not set(found) & set(expected):
        raise ValueError(f"{setting}: {path} is not a Qwen-Image transformer (its architecture is {architecture!r}, "
                         f"and {len(set(found) & set(expected))} of its {len(found)} tensors are Qwen-Image's)")
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = sorted(name for name in set(found) & set(expected) if found[name] != expected[name])
    if missing or unexpected or wrong:
        raise ValueError(f"{setting}: {path} is another variant of the model than the checkpoint's transformer config "
                         f"({len(missing)} tensors missing, e.g. {missing[:2]}; {len(unexpected)} unexpected, e.g. "
                         f"{unexpected[:2]}; {len(wrong)} of other shapes, e.g. {wrong[:2]})")
    return GgufSummary(architecture, types, int(sum(int(t.n_bytes) for t in reader.tensors)))


def strip_prefix(name: str) -> str:
    for prefix in PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def load_transformer(path: str | pathlib.Path, model: str, dtype):
    """The transformer of ``model``'s config with the GGUF file's weights, each quantized Linear dequantizing its
    weight in ``dtype`` per forward (diffusers' ``GGUFQuantizationConfig``; its CUDA kernels where installed)."""
    from diffusers import GGUFQuantizationConfig, QwenImageTransformer2DModel
    from diffusers.models.model_loading_utils import load_gguf_checkpoint

    state = {strip_prefix(name): tensor for name, tensor in load_gguf_checkpoint(str(path)).items()}
    return QwenImageTransformer2DModel.from_single_file(
        state, config=model, subfolder="transformer", torch_dtype=dtype,
        quantization_config=GGUFQuantizationConfig(compute_dtype=dtype))
