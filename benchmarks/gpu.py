"""The DiT and VAE stages at Qwen-Image's full size on one GPU, against diffusers' QwenImagePipeline on the same
weights: a first look at the GPU path.

    python -m benchmarks.gpu --out gpu.json     # on a machine with a CUDA GPU

No checkpoint can be downloaded here, so both models are built from Qwen-Image's published architecture (the
configs below) with random bf16 weights, directly on the GPU. For each size (512, 1024, 1328 square), true CFG on:

- ours: ``DenoiseRunner.step`` on b requests at once (b = 1, 2, 4, 8), CFG's two passes in one forward; the time of
  one denoising step, the best of a few after a warm-up;
- diffusers: ``QwenImagePipeline`` from the same transformer and VAE, given prompt embeddings (no text encoder),
  ``--steps`` steps one request at a time, end to end from embeddings to pixels;
- the VAE decode of one image; the DiT's achieved TFLOP/s against ``2*6.79e9*N + 4*60*3072*N^2`` FLOPs per pass (N
  image plus text tokens) and the device's peak; peak GPU memory.

Prompt embeddings are random ``[L, 3584]`` (L = ``--text-tokens``): the encoder stage (Qwen2.5-VL under vLLM) is not
measured, since vLLM's CUDA build cannot be installed on the machine this ran on. Writes JSON (and a plot beside it).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

from omni_ray.checkpoints.full_size import CONFIG_DIR, parameter_counts
from omni_ray.qwen_image import LATENT_CHANNELS, PUBLISHED_PARAMS, TEXT_HIDDEN, image_tokens
from omni_ray.runners.gpu_costs import dit_pass_flops

_SCHEDULER_FILE = CONFIG_DIR / "scheduler" / "scheduler_config.json"
SCHEDULER_CONFIG = {k: v for k, v in json.loads(_SCHEDULER_FILE.read_text()).items() if not k.startswith("_")}
FULL_LAYERS = 60
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense, per the vendor's data sheets


def dit_flops(height: int, width: int, text_tokens: int, passes: int) -> float:
    """The DiT forward's FLOPs (DESIGN.md's formula) for ``passes`` rows of one image."""
    return passes * dit_pass_flops(image_tokens(height, width) + text_tokens)


def build(device: str, num_layers: int):
    import torch
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    transformer_config = QwenImageTransformer2DModel.load_config(CONFIG_DIR / "transformer")
    transformer_config["num_layers"] = num_layers
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):  # random weights made on the GPU, in bf16: never 80 GB of fp32 on the host
        transformer = QwenImageTransformer2DModel.from_config(transformer_config)
        vae = AutoencoderKLQwenImage.from_config(AutoencoderKLQwenImage.load_config(CONFIG_DIR / "vae"))
    torch.set_default_dtype(torch.float32)
    return transformer.eval(), vae.eval()


def timed(fn, repeats: int) -> float:
    """The best of ``repeats`` runs of ``fn`` after one warm-up, in seconds, with the GPU synchronised."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        _synchronize()
        start = time.perf_counter()
        fn()
        _synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_gib() -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None


def _reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def run(sizes: list[int], batches: list[int], steps: int, text_tokens: int, repeats: int, num_layers: int) -> dict:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    from omni_ray.records import DenoiseParams, Latents, PromptEmbeds
    from omni_ray.runners.decode import VaeRunner
    from omni_ray.runners.denoise import DenoiseRunner

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only to try the script at a few layers
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = next((tflops for key, tflops in PEAK_BF16_TFLOPS.items() if key in name), None)
    start = time.perf_counter()
    transformer, vae = build(device, num_layers)
    report = {
        "device": name, "torch": torch.__version__, "peak_bf16_tflops": peak, "steps": steps,
        "text_tokens": text_tokens, "build_s": round(time.perf_counter() - start, 1),
        "params": {"transformer": sum(p.numel() for p in transformer.parameters()),
                   "vae": sum(p.numel() for p in vae.parameters())},
        "num_layers": num_layers, "sizes": [],
        "weights_gib": round(torch.cuda.memory_allocated() / 2**30, 2) if device == "cuda" else None,
    }
    print(f"{name}: built in {report['build_s']} s, {report['weights_gib']} GiB of weights", flush=True)
    runner, decoder = DenoiseRunner(transformer, SCHEDULER_CONFIG), VaeRunner(vae)
    generator = torch.Generator().manual_seed(0)
    embeds = [PromptEmbeds(torch.randn(text_tokens, TEXT_HIDDEN, generator=generator)) for _ in range(2 * max(batches))]
    pipe = QwenImagePipeline(FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), vae, None, None, transformer)
    pipe.set_progress_bar_config(disable=True)
    for side in sizes:
        entry = {"size": side, "dit": []}
        for b in batches:
            _reset_peak()
            params = [DenoiseParams(side, side, 1000, seed=i, true_cfg_scale=4.0, true_cfg=True) for i in range(b)]
            states = [runner.prepare(p, embeds[2 * i], embeds[2 * i + 1]) for i, p in enumerate(params)]
            seconds = timed(lambda: runner.step(states), repeats)
            flops = b * dit_flops(side, side, text_tokens, passes=2) * num_layers / FULL_LAYERS
            entry["dit"].append({
                "batch": b, "step_s": round(seconds, 4), "step_s_per_image": round(seconds / b, 4),
                "tflops": round(flops / seconds / 1e12, 1),
                "share_of_peak": round(flops / seconds / 1e12 / peak, 3) if peak else None,
                "peak_memory_gib": _peak_gib(),
            })
            print(f"{side}: DiT step at b={b}: {1000 * seconds:.0f} ms ({entry['dit'][-1]['tflops']} TFLOP/s)",
                  flush=True)
        one = entry["dit"][0]["step_s"]
        for row in entry["dit"]:
            row["gain_per_image"] = round(one / row["step_s_per_image"], 2)
        latents = Latents(torch.randn(image_tokens(side, side), LATENT_CHANNELS, generator=generator), side, side)
        _reset_peak()
        entry["vae_decode_s"] = round(timed(lambda: decoder.decode([latents]), repeats), 4)
        entry["vae_peak_memory_gib"] = _peak_gib()
        entry["ours_estimate_s"] = round(steps * one + entry["vae_decode_s"], 3)  # one image: steps x step + decode

        def diffusers_request():
            pipe(prompt_embeds=embeds[0].embeds[None].to(device, torch.bfloat16),
                 prompt_embeds_mask=torch.ones(1, text_tokens, dtype=torch.long, device=device),
                 negative_prompt_embeds=embeds[1].embeds[None].to(device, torch.bfloat16),
                 negative_prompt_embeds_mask=torch.ones(1, text_tokens, dtype=torch.long, device=device),
                 true_cfg_scale=4.0, height=side, width=side, num_inference_steps=steps,
                 generator=torch.Generator("cpu").manual_seed(0), output_type="np")

        entry["diffusers_s"] = round(timed(diffusers_request, 1), 3)
        print(f"{side}: VAE decode {1000 * entry['vae_decode_s']:.0f} ms; {steps} steps: ours (b=1, from the "
              f"step time) {entry['ours_estimate_s']} s, diffusers {entry['diffusers_s']} s", flush=True)
        report["sizes"].append(entry)
    return report


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for entry in report["sizes"]:
        rows = entry["dit"]
        left.plot([r["batch"] for r in rows], [r["step_s_per_image"] * 1000 for r in rows], "o-",
                  label=f"{entry['size']}x{entry['size']}")
        right.plot([r["batch"] for r in rows], [r["tflops"] for r in rows], "o-", label=f"{entry['size']}")
    left.set(xlabel="requests per DiT step", ylabel="ms per image per step (true CFG)", xscale="log")
    right.set(xlabel="requests per DiT step", ylabel="achieved TFLOP/s", xscale="log")
    if report["peak_bf16_tflops"]:
        right.axhline(report["peak_bf16_tflops"], ls="--", c="grey", label="bf16 peak")
    batches = [row["batch"] for row in report["sizes"][0]["dit"]]
    for ax in (left, right):
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Qwen-Image DiT at full size, random bf16 weights: {report['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


SHARED_PRESET = "stage_configs/qwen_image_shared.yaml"


def dry_run() -> dict:
    """The full-size models built on the meta device from the shipped configs: parameter counts against the
    published ones; and the shared-GPU preset's placement check, stage by stage (any machine, a few seconds)."""
    from dataclasses import asdict

    from omni_ray.config import load_config
    from omni_ray.placement import stage_memory

    params = parameter_counts()
    shared = load_config(pathlib.Path(__file__).resolve().parent.parent / SHARED_PRESET)  # raises if it cannot fit
    return {"params": params, "published_params": PUBLISHED_PARAMS,
            "params_off_published": {name: round(params[name] / PUBLISHED_PARAMS[name] - 1, 5) for name in params},
            "placement": {"preset": SHARED_PRESET, "gpu_memory_gib": shared.gpu_memory_gib,
                          "stages": [{**asdict(estimate), "fits": estimate.fits}
                                     for estimate in stage_memory(shared, shared.gpu_memory_gib)]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[512, 1024, 1328])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=20, help="steps of the end-to-end requests")
    parser.add_argument("--text-tokens", type=int, default=64, help="prompt length after the template")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=60, help="transformer blocks (60 is Qwen-Image; fewer to try)")
    parser.add_argument("--out", default="benchmarks/results/gpu.json")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: build the full-size models on the meta device and write their sizes")
    args = parser.parse_args()
    if args.dry_run:
        report = dry_run()
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report, indent=1))
        return
    report = run(args.sizes, args.batches, args.steps, args.text_tokens, args.repeats, args.layers)
    out = pathlib.Path(args.out)
    out.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
