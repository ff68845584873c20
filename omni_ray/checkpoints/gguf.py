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
    writer = gguf.GGUFWriter(path=None, arch=ARCHITECTURE)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(qtype)
    for name, tensor in state.items():
        data = tensor.float().numpy()
        kept = data.ndim < 2 or name.startswith(FULL_PRECISION)
        kind = gguf.GGMLQuantizationType.F32 if kept else qtype
        writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
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

