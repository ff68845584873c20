"""Qwen-Image's transformer written as a GGUF file in the layout of the published ones, for tests and for people who
quantize their own checkpoint (``dit.weights_file`` reads it: ``omni_ray.runners.gguf_weights``).

    python -m omni_ray.checkpoints.gguf CHECKPOINT OUT.gguf [--type Q8_0]   # CHECKPOINT's transformer/

The published files' layout: ``general.architecture`` ``qwen_image``, each tensor under the transformer's own name
(diffusers' and ComfyUI's are the same for Qwen-Image), vectors (biases, norms) in F32, and the matrices ComfyUI-GGUF's
converter keeps at full precision (the image and text input projections, the timestep embedder, the output
projection and its modulation) in F32 too; every other matrix in ``--type``. The ``gguf`` package writes Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1, BF16 and F16; it reads the K-quants too (Q2_K to Q6_K, what most published files use), and
diffusers dequantizes them, but it cannot write them: a K-quant file from elsewhere loads, this writer makes none.
"""

from __future__ import annotations

import argparse
import pathlib

from omni_ray.runners.gguf_weights import ARCHITECTURE

FULL_PRECISION = ("img_in.", "txt_in.", "time_text_embed.", "proj_out.", "norm_out.")


def write(checkpoint: str | pathlib.Path, out: str | pathlib.Path, quant_type: str = "Q8_0") -> pathlib.Path:
    """``checkpoint``'s ``transformer/`` weights as a GGUF file at ``out`` (``quant_type`` for the matrices that
    the published files quantize)."""
    import gguf
    from safetensors.torch import load_file

    qtype = gguf.GGMLQuantizationType[quant_type]
    folder = pathlib.Path(checkpoint) / "transformer"
    state = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(load_file(path))
    writer = _writer(qtype)
    for name, tensor in state.items():
        data = tensor.float().numpy()
        kept = data.ndim < 2 or name.startswith(FULL_PRECISION)
        kind = gguf.GGMLQuantizationType.F32 if kept else qtype
        writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    return _close(writer, out)


def write_random(checkpoint: str | pathlib.Path, out: str | pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A Q4_0 GGUF file of ``checkpoint``'s transformer config with random weights, written as fast as the disk
    takes it (no quantizing: each block's bytes drawn at random under one small scale), in the published files'
    layout: for timing and memory at full size (the GPU plan's ``small_card``), where no file can be downloaded. The
    images are noise."""
    import gguf
    import numpy as np
    import torch
    from diffusers import QwenImageTransformer2DModel

    config = QwenImageTransformer2DModel.load_config(checkpoint, subfolder="transformer")
    with torch.device("meta"):
        state = QwenImageTransformer2DModel.from_config(config).state_dict()
        shapes = {name: tuple(t.shape) for name, t in state.items()}
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_0]  # 32 weights in 18 bytes
    scale = np.frombuffer(np.float16(0.02 / 8).tobytes(), np.uint8)  # |w| up to 0.02
    writer = _writer(gguf.GGMLQuantizationType.Q4_0)
    for name, shape in shapes.items():
        if len(shape) < 2 or name.startswith(FULL_PRECISION) or shape[-1] % block:
            writer.add_tensor(name, (0.02 * rng.standard_normal(shape)).astype(np.float32))
            continue
        rows = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
        rows[:, :, :2] = scale
        writer.add_tensor(name, rows.reshape(shape[0], -1), raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    return _close(writer, out)


def _writer(file_type):
    """A writer of the published files' header: the architecture, the quantization version, the file's type."""
    import gguf

    writer = gguf.GGUFWriter(path=None, arch=ARCHITECTURE)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(file_type)
    return writer


def _close(writer, out: str | pathlib.Path) -> pathlib.Path:
    out = pathlib.Path(out)
    writer.write_header_to_file(path=out)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint in diffusers' layout (its transformer/)")
    parser.add_argument("out", help="the GGUF file to write")
    parser.add_argument("--type", default="Q8_0", help="Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, BF16 or F16")
    args = parser.parse_args(argv)
    out = write(args.checkpoint, args.out, args.type)
    print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()

