"""The VAE stage's decode and encode against diffusers' ``AutoencoderKLQwenImage`` on the same weights and inputs.

    .venv/bin/python -m benchmarks.vae [--size small|tiny|full] [--image 256x256] [--batches 1 2 4]

Ours is ``VaeRunner`` (the video VAE's first frame as 2-D convolutions, channels-last; ``runners/vae_frame.py``) from
packed latents to uint8 pixels; diffusers' is ``AutoencoderKLQwenImage.decode`` on the same latents unpacked (to
[-1, 1] floats: ours does a little more). Encode: ``VaeRunner.encode`` from uint8 images against diffusers' ``encode``
of the same images preprocessed. Each figure is the median of ``--repeats`` calls after a warm-up. ``--size full``
builds Qwen-Image's VAE at full size with random weights (bf16 on a GPU). Writes benchmarks/results/vae.{json,png}.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time

from benchmarks import write_report

HERE = pathlib.Path(__file__).resolve().parent


def median_time(fn, repeats: int) -> float:
    import torch

    def synchronize():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    fn()
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def load_vae(size: str, device: str):
    import torch
    from diffusers import AutoencoderKLQwenImage

    if size == "full":
        from omni_ray.checkpoints.full_size import CONFIG_DIR

        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        with torch.device(device):
            vae = AutoencoderKLQwenImage.from_config(AutoencoderKLQwenImage.load_config(CONFIG_DIR / "vae"))
        return vae.to(dtype).eval()
    from omni_ray.checkpoints.tiny import write_checkpoint

    checkpoint = pathlib.Path.home() / ".cache" / "omni-ray" / f"bench-{size}"
    if not (checkpoint / "model_index.json").exists():
        write_checkpoint(checkpoint, seed=0, size=size)
    return AutoencoderKLQwenImage.from_pretrained(checkpoint, subfolder="vae").to(device).eval()


def run(size: str, width: int, height: int, batches: list[int], repeats: int) -> dict:
    import torch
    from PIL import Image

    from benchmarks.engine_throughput import machine
    from omni_ray.families.qwen_image.facts import LATENT_CHANNELS, image_tokens
    from omni_ray.records import Latents
    from omni_ray.runners.packing import unpack_latents
    from omni_ray.runners.vae import VaeRunner

    device = "cuda" if torch.cuda.is_available() else "cpu"
    vae = load_vae(size, device)
    runner = VaeRunner(vae)
    z_dim = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean, device=device).view(1, z_dim, 1, 1, 1).to(vae.dtype)
    std = torch.tensor(vae.config.latents_std, device=device).view(1, z_dim, 1, 1, 1).to(vae.dtype)
    generator = torch.Generator().manual_seed(0)
    report = {"machine": machine(), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "torch": torch.__version__, "threads": torch.get_num_threads(), "checkpoint": size,
              "dtype": str(vae.dtype), "image": f"{width}x{height}", "rows": []}
    for batch in batches:
        items = [Latents(torch.randn(image_tokens(height, width), LATENT_CHANNELS, generator=generator), height, width)
                 for _ in range(batch)]
        unpacked = (unpack_latents(torch.stack([i.latents for i in items]), height, width).to(device, vae.dtype)
                    * std + mean)
        pixels = runner.decode(items)
        processed = torch.cat([runner.image_processor.preprocess(Image.fromarray(p)) for p in pixels])
        processed = processed.unsqueeze(2).to(device, vae.dtype)
        with torch.inference_mode():
            row = {
                "batch": batch,
                "decode_ours_s": median_time(lambda: runner.decode(items), repeats),
                "decode_diffusers_s": median_time(lambda: vae.decode(unpacked), repeats),
                "encode_ours_s": median_time(lambda: runner.encode(list(pixels)), repeats),
                "encode_diffusers_s": median_time(lambda: vae.encode(processed).latent_dist.mode(), repeats),
            }
        row["decode_speedup"] = row["decode_diffusers_s"] / row["decode_ours_s"]
        row["encode_speedup"] = row["encode_diffusers_s"] / row["encode_ours_s"]
        report["rows"].append({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
        print(f"b={batch}: decode ours {1000 * row['decode_ours_s']:.0f} ms, diffusers "
              f"{1000 * row['decode_diffusers_s']:.0f} ms (x{row['decode_speedup']:.2f}); encode ours "
              f"{1000 * row['encode_ours_s']:.0f} ms, diffusers {1000 * row['encode_diffusers_s']:.0f} ms "
              f"(x{row['encode_speedup']:.2f})", flush=True)
    return report


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    batches = [row["batch"] for row in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    lines = (("decode_ours_s", "decode, ours", "o-"), ("decode_diffusers_s", "decode, diffusers", "o--"),
             ("encode_ours_s", "encode, ours", "s-"), ("encode_diffusers_s", "encode, diffusers", "s--"))
    for key, label, style in lines:
        ax.plot(batches, [1000 * row[key] / row["batch"] for row in rows], style, label=label)
    ax.set(xlabel="images per VAE call", ylabel="ms per image", xscale="log", yscale="log")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"Qwen-Image VAE ({report['checkpoint']}, {report['image']}, {report['dtype']}): {report['device']}, "
                 f"{report['machine']['cpu'][:28]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=["tiny", "small", "full"], default="small", help="checkpoint")
    parser.add_argument("--image", default="256x256", help="WxH")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "results" / "vae.json"))
    args = parser.parse_args()
    width, height = (int(side) for side in args.image.split("x"))
    write_report(run(args.size, width, height, args.batches, args.repeats), args.out, plot)


if __name__ == "__main__":
    main()
