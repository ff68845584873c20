"""Edit throughput of omni-ray's three engines against diffusers' QwenImageEditPipeline, one edit at a time.

    .venv/bin/python -m benchmarks.edit_throughput [--batches 1 2 4 8] [--steps 8] [--area 65536]

On the small edit checkpoint (``python -m omni_ray.checkpoints.tiny --edit --size small``), b edits of b different
photos of
one size (so their working sizes match), each with its own prompt and seed, true CFG on with a negative prompt:

- omni-ray: the three engines in one process (vLLM's vision path, the batched VAE encode and decode, the DiT with
  step-level batching), b concurrent requests.
- diffusers: QwenImageEditPipeline on the same inputs, one after another, its working area set to the same.

The input images are resized to ``--area`` pixels (256x256 by default: on a CPU, Qwen-Image-Edit's 1024x1024 would
make one diffusers edit take minutes). Runs in a fresh process with OMP_NUM_THREADS set to all cores, so that vLLM
leaves torch's threads alone. Writes benchmarks/results/edit_throughput.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import pathlib
import subprocess
import sys

from benchmarks.engine_throughput import PROMPTS, REPO, RESULTS, best_time, machine, save_figure

INPUT = (384, 256)  # input photo width, height
NEGATIVE = "blurry, low quality"


def worker(batches: list[int], steps: int, repeats: int, area: int) -> dict:
    from diffusers.utils import logging as diffusers_logging

    from omni_ray.api.images import load_input_images
    from omni_ray.checkpoints.tiny import write_checkpoint
    from omni_ray.config import load_config
    from omni_ray.pipeline import Pipeline
    from testing.reference import load_reference, reference_edit, source_image

    checkpoint = pathlib.Path.home() / ".cache" / "omni-ray" / "bench-small-edit"
    if not (checkpoint / "model_index.json").exists():
        write_checkpoint(checkpoint, seed=0, size="small", edit=True)
    config = load_config(REPO / "stage_configs" / "qwen_image_edit_tiny.yaml", model=str(checkpoint))
    config = config.model_copy(update={
        "edit": config.edit.model_copy(update={"image_area": area}),
        "dit": config.dit.model_copy(update={"max_batch_size": 16}),
        "vae": config.vae.model_copy(update={"max_batch_size": 8}),
    })
    photos = [source_image(*INPUT, seed) for seed in range(max(batches))]
    files = []
    for photo in photos:
        buffer = io.BytesIO()
        photo.save(buffer, format="PNG")
        files.append(buffer.getvalue())
    images = [load_input_images([data], config).vae[0] for data in files]
    height, width = images[0].shape[:2]

    diffusers_logging.set_verbosity_error()
    reference = load_reference(checkpoint)
    reference.set_progress_bar_config(disable=True)

    def diffusers_batch(b: int) -> None:
        for i in range(b):
            reference_edit(reference, area, photos[i], seed=i, prompt=PROMPTS[i % len(PROMPTS)],
                           negative_prompt=NEGATIVE, true_cfg_scale=4.0, num_inference_steps=steps)

    results = {"input": f"{INPUT[0]}x{INPUT[1]}", "height": height, "width": width, "steps": steps, "area": area,
               "batches": []}
    diffusers_batch(1)  # warm-up
    for b in batches:
        seconds = best_time(lambda: diffusers_batch(b), repeats)
        results["batches"].append({"batch": b, "diffusers_s": seconds})
        print(f"b={b}: diffusers {b / seconds:.2f} edits/s", flush=True)

    # The engines last: starting vLLM binds this process's threads.
    pipeline = Pipeline(config)

    async def edit(b: int):
        return await asyncio.gather(*(
            pipeline.generate({"prompt": PROMPTS[i % len(PROMPTS)], "negative_prompt": NEGATIVE, "seed": i,
                               "num_inference_steps": steps, "true_cfg_scale": 4.0}, images[i])
            for i in range(b)
        ))

    asyncio.run(edit(2))  # warm-up
    for entry in results["batches"]:
        entry["ours_s"] = best_time(lambda: asyncio.run(edit(entry["batch"])), repeats)
        print(f"b={entry['batch']}: omni-ray {entry['batch'] / entry['ours_s']:.2f} edits/s", flush=True)
    results["dit_batch_sizes"] = dict(sorted(pipeline.stages.dit.stats.core.batch_sizes.items()))
    pipeline.shutdown()
    for entry in results["batches"]:
        b = entry["batch"]
        entry.update(ours_edits_s=b / entry["ours_s"], diffusers_edits_s=b / entry["diffusers_s"],
                     ratio=entry["diffusers_s"] / entry["ours_s"])
    return {"machine": machine(), **results}


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    batches = [e["batch"] for e in report["batches"]]
    ax.plot(batches, [e["ours_edits_s"] for e in report["batches"]], "o-", label="omni-ray engines")
    ax.plot(batches, [e["diffusers_edits_s"] for e in report["batches"]], "o--", label="diffusers one at a time")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("concurrent edits")
    ax.set_ylabel("edits / s")
    ax.set_title(f"small edit checkpoint, {report['input']} input -> {report['width']}x{report['height']}, "
                 f"{report['steps']} steps, true CFG", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, report["machine"], path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="runs per measurement; the fastest counts")
    parser.add_argument("--area", type=int, default=256 * 256, help="working area of the input images, in pixels")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS / "edit_throughput.json"))
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    if args.worker:
        out.write_text(json.dumps(worker(args.batches, args.steps, args.repeats, args.area), indent=2) + "\n")
        return

    RESULTS.mkdir(exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count()), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    command = [sys.executable, "-m", "benchmarks.edit_throughput", "--worker", "--steps", str(args.steps),
               "--repeats", str(args.repeats), "--area", str(args.area), "--out", str(out),
               "--batches", *map(str, args.batches)]
    subprocess.run(command, env=env, check=True, cwd=REPO)
    report = json.loads(out.read_text())
    plot(report, out.with_suffix(".png"))
    for e in report["batches"]:
        print(f"b={e['batch']:>2}: {e['ours_edits_s']:.2f} vs {e['diffusers_edits_s']:.2f} edits/s (x{e['ratio']:.2f})")
    print(f"DiT steps by batch size: {report['dit_batch_sizes']}")
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
