"""DiT and end-to-end throughput of omni-ray's engines against diffusers' QwenImagePipeline, one request at a time.

    .venv/bin/python -m benchmarks.engine_throughput [--sizes tiny small] [--batches 1 2 4 8 16] [--steps 8]

For each checkpoint size and batch size b, the same b requests (different prompts and seeds, true CFG on with a
negative prompt, as Qwen-Image is served) run:

- DiT, ours: the DiT engine (step-level batching) denoises all b together, from precomputed prompt embeddings.
- DiT, diffusers: QwenImagePipeline denoises them one after another, from the same embeddings (output "latent").
- end to end, ours: the three engines in one process (vLLM encoder, DiT, VAE), b concurrent requests.
- end to end, diffusers: QwenImagePipeline from prompt to pixels, one request after another.

Each checkpoint runs in its own process (vLLM binds threads for a whole process), with OMP_NUM_THREADS set to all
cores so that vLLM leaves torch's threads alone. Writes benchmarks/results/engine_throughput.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
import uuid

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
REPO = HERE.parent
SIZES = {"tiny": (64, 64), "small": (256, 256)}  # (height, width) per checkpoint
PROMPTS = [
    "a red cat sitting on a wooden table",
    "an oil painting of a lighthouse at sunset",
    "a watercolor of mountains and a lake in the morning mist",
    "a neon sign in a rainy city street at night",
    "close-up of a yellow flower with water drops",
    "a small robot reading a book in a quiet library",
    "two children flying a kite on a beach",
    "a bowl of fruit on a white plate",
]


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def requests_for(batch: int) -> list[tuple[str, int]]:
    return [(PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f", variation {i}"), 1000 + i) for i in range(batch)]


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def worker(size: str, batches: list[int], steps: int, repeats: int) -> dict:
    """Runs in its own process: one checkpoint, every batch size, all four measurements."""
    import torch
    from diffusers import QwenImagePipeline
    from diffusers.utils import logging as diffusers_logging

    from omni_ray.checkpoints.tiny import write_checkpoint
    from omni_ray.config import load_config
    from omni_ray.engine.builders import build_dit_core
    from omni_ray.pipeline import Pipeline
    from omni_ray.records import DenoiseParams, DenoiseRequest
    from testing.reference import PromptEncoder

    checkpoint = pathlib.Path.home() / ".cache" / "omni-ray" / f"bench-{size}"
    if not (checkpoint / "model_index.json").exists():
        write_checkpoint(checkpoint, seed=0, size=size)
    config = load_config(REPO / "stage_configs" / "qwen_image_tiny.yaml", model=str(checkpoint))
    config = config.model_copy(update={"dit": dit_config_for_bench(config)})
    height, width = SIZES[size]
    negative = " "
    diffusers_logging.set_verbosity_error()  # it warns on every call that passes embeddings without a mask
    reference = QwenImagePipeline.from_pretrained(checkpoint)
    reference.set_progress_bar_config(disable=True)
    encoder = PromptEncoder(str(checkpoint))
    negative_embeds = encoder.encode([negative])[0]
    dit = build_dit_core(config)

    def params(seed: int) -> DenoiseParams:
        return DenoiseParams(height, width, steps, seed, true_cfg_scale=4.0, true_cfg=True)

    def diffusers_call(prompt, seed, **kwargs):
        if "negative_prompt_embeds" not in kwargs:
            kwargs["negative_prompt"] = negative
        return reference(
            prompt, true_cfg_scale=4.0, height=height, width=width,
            num_inference_steps=steps, generator=torch.Generator("cpu").manual_seed(seed), **kwargs,
        )

    results = {"size": size, "height": height, "width": width, "steps": steps, "batches": []}
    diffusers_call(PROMPTS[0], 0)  # warm-up
    for batch_size in batches:
        batch = requests_for(batch_size)

        def timed_ours_dit():
            embeds = encoder.encode([prompt for prompt, _ in batch])
            start = time.perf_counter()
            for (_, seed), prompt in zip(batch, embeds):
                dit.add_request(DenoiseRequest(uuid.uuid4().hex, params(seed), prompt, negative_embeds))
            while dit.has_unfinished_requests():
                dit.step()
            return time.perf_counter() - start

        def timed_diffusers_dit():
            prepared = []
            for prompt, seed in batch:
                embeds, _ = reference.encode_prompt(prompt, device="cpu")
                negative_prompt_embeds, _ = reference.encode_prompt(negative, device="cpu")
                prepared.append((seed, embeds, negative_prompt_embeds))
            start = time.perf_counter()
            for seed, embeds, negative_prompt_embeds in prepared:
                diffusers_call(None, seed, prompt_embeds=embeds, negative_prompt_embeds=negative_prompt_embeds,
                               output_type="latent")
            return time.perf_counter() - start

        ours = min(timed_ours_dit() for _ in range(repeats))
        theirs = min(timed_diffusers_dit() for _ in range(repeats))
        diffusers_e2e = best_time(lambda: [diffusers_call(p, s, output_type="np") for p, s in batch], repeats)
        results["batches"].append(
            {"batch": batch_size, "dit_ours_s": ours, "dit_diffusers_s": theirs, "e2e_diffusers_s": diffusers_e2e}
        )
        print(f"[{size}] b={batch_size}: DiT ours {batch_size / ours:.2f} img/s, diffusers {batch_size / theirs:.2f}",
              flush=True)

    # The end-to-end engines last: starting vLLM binds this process's threads.
    pipeline = Pipeline(config)

    async def serve(batch):
        return await asyncio.gather(*(
            pipeline.generate({"prompt": prompt, "negative_prompt": negative, "size": f"{width}x{height}", "seed": seed,
                               "num_inference_steps": steps, "true_cfg_scale": 4.0})
            for prompt, seed in batch
        ))

    asyncio.run(serve(requests_for(2)))  # warm-up
    for entry in results["batches"]:
        batch = requests_for(entry["batch"])
        entry["e2e_ours_s"] = best_time(lambda: asyncio.run(serve(batch)), repeats)
        print(f"[{size}] b={entry['batch']}: end to end ours {entry['batch'] / entry['e2e_ours_s']:.2f} img/s, "
              f"diffusers {entry['batch'] / entry['e2e_diffusers_s']:.2f}", flush=True)
    pipeline.shutdown()
    return results


def dit_config_for_bench(config):
    return config.dit.model_copy(
        update={
            "max_batch_size": 16,
            "deployment": config.dit.deployment.model_copy(update={"max_ongoing_requests": 16}),
        }
    )


def summarise(runs: list[dict]) -> dict:
    for run in runs:
        for entry in run["batches"]:
            b = entry["batch"]
            entry.update(
                dit_ours_img_s=b / entry["dit_ours_s"],
                dit_diffusers_img_s=b / entry["dit_diffusers_s"],
                e2e_ours_img_s=b / entry["e2e_ours_s"],
                e2e_diffusers_img_s=b / entry["e2e_diffusers_s"],
                dit_ratio=entry["dit_diffusers_s"] / entry["dit_ours_s"],
                e2e_ratio=entry["e2e_diffusers_s"] / entry["e2e_ours_s"],
            )
    return {"machine": machine(), "runs": runs}


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.5), squeeze=False)
    for ax, run in zip(axes[0], runs):
        batches = [e["batch"] for e in run["batches"]]
        for key, label, style in [
            ("dit_ours_img_s", "DiT, omni-ray engine", "o-"),
            ("dit_diffusers_img_s", "DiT, diffusers one at a time", "o--"),
            ("e2e_ours_img_s", "end to end, omni-ray engines", "s-"),
            ("e2e_diffusers_img_s", "end to end, diffusers one at a time", "s--"),
        ]:
            ax.plot(batches, [e[key] for e in run["batches"]], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("images / s")
        ax.set_title(f"{run['size']} checkpoint, {run['width']}x{run['height']}, {run['steps']} steps, true CFG")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, report["machine"], path)


def save_figure(fig, machine_info: dict, path: pathlib.Path) -> None:
    """Titles the figure with the machine it was measured on and writes it."""
    fig.suptitle(f"{machine_info['cores']} cores: {machine_info['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="runs per measurement; the fastest counts")
    parser.add_argument("--worker", choices=list(SIZES), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS / "engine_throughput.json"))
    args = parser.parse_args()

    if args.worker:
        print(json.dumps(worker(args.worker, args.batches, args.steps, args.repeats)), file=open(args.out, "w"))
        return

    RESULTS.mkdir(exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count()), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    runs = []
    for size in args.sizes:
        part = RESULTS / f"engine_throughput.{size}.tmp"
        command = [sys.executable, "-m", "benchmarks.engine_throughput", "--worker", size, "--steps", str(args.steps), "--repeats",
                   str(args.repeats), "--out", str(part), "--batches", *map(str, args.batches)]
        subprocess.run(command, env=env, check=True, cwd=REPO)
        runs.append(json.loads(part.read_text()))
        part.unlink()
    report = summarise(runs)
    out = pathlib.Path(args.out)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    for run in report["runs"]:
        for e in run["batches"]:
            print(f"{run['size']:>5} b={e['batch']:>2}: DiT {e['dit_ours_img_s']:.2f} vs {e['dit_diffusers_img_s']:.2f} "
                  f"img/s (x{e['dit_ratio']:.2f}); end to end {e['e2e_ours_img_s']:.2f} vs "
                  f"{e['e2e_diffusers_img_s']:.2f} img/s (x{e['e2e_ratio']:.2f})")
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
