"""DiT cache acceleration on the small checkpoint: what each kind and threshold reuses, saves and changes, and a
step batch where half the requests are cached.

    .venv/bin/python -m benchmarks.dit_cache [--steps 30] [--requests 4]

For each setting (no cache, then first_block and teacache at a few thresholds) the same requests (256x256, true CFG)
run one at a time:

- DiT: the DiT engine alone, from precomputed prompt embeddings; the share of transformer passes reused.
- end to end: the three engines in one process (vLLM encoder, DiT, VAE); the pixels' max and mean difference from
  the uncached image of the same request.

Then 8 concurrent requests in one DiT engine: none cached, half cached (first_block), all cached.

The small checkpoint has random weights. Its residuals change fast and unlike a trained model's, so the thresholds
here are far above those used on Qwen-Image's weights, and the reuse rates and pixel differences say nothing about
quality there: the benchmark shows what a reused pass saves and that caching composes with step batching. With 4
transformer blocks, a first_block pass that reuses still runs 1 block of 4 (on Qwen-Image, 1 of 60).
Writes benchmarks/results/dit_cache.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import subprocess
import sys
import time
import uuid

from benchmarks import write_report
from benchmarks.engine_throughput import PROMPTS, REPO, RESULTS, machine, save_figure

SETTINGS = [None, ("first_block", 0.8), ("first_block", 1.0), ("first_block", 1.2),
            ("teacache", 0.6), ("teacache", 1.0), ("teacache", 1.6)]
MIXED = ("first_block", 1.0)  # the cached half of the mixed batch
HEIGHT = WIDTH = 256
NEGATIVE = "blurry, low quality"


def cache_field(setting) -> dict | None:
    return None if setting is None else {"kind": setting[0], "threshold": setting[1]}


def worker(steps: int, num_requests: int, repeats: int) -> dict:
    """Runs in its own process (vLLM binds threads for a whole process): every measurement."""
    import numpy as np

    from omni_ray.checkpoints.tiny import write_checkpoint
    from omni_ray.config import CacheSettings, load_config
    from omni_ray.engine.builders import build_dit_core
    from omni_ray.pipeline import Pipeline
    from omni_ray.records import DenoiseParams, DenoiseRequest
    from testing.reference import PromptEncoder

    checkpoint = pathlib.Path.home() / ".cache" / "omni-ray" / "bench-small"
    if not (checkpoint / "model_index.json").exists():
        write_checkpoint(checkpoint, seed=0, size="small")
    config = load_config(REPO / "stage_configs" / "qwen_image_tiny.yaml", model=str(checkpoint))
    encoder = PromptEncoder(str(checkpoint))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    embeds, (negative,) = encoder.encode(prompts), encoder.encode([NEGATIVE])
    dit = build_dit_core(config)

    def run_dit(indices: list[int], settings: list) -> tuple[float, dict]:
        """Seconds for these requests in one DiT engine, all added at once; their finished latents by index."""
        ids = {}
        start = time.perf_counter()
        for i, setting in zip(indices, settings):
            cache = CacheSettings(**cache_field(setting)) if setting is not None else None
            ids[i] = uuid.uuid4().hex
            params = DenoiseParams(HEIGHT, WIDTH, steps, 1000 + i, 4.0, cache, true_cfg=True)
            dit.add_request(DenoiseRequest(ids[i], params,
                                           embeds[i], negative))
        done = {}
        while dit.has_unfinished_requests():
            done.update({o.request_id: o.result for o in dit.step() if o.finish_reason == "stop"})
        return time.perf_counter() - start, {i: done[ids[i]] for i in indices}

    def one_at_a_time(setting) -> tuple[float, list]:
        total, results = 0.0, []
        for i in range(num_requests):
            seconds, out = run_dit([i], [setting])
            total += seconds
            results.append(out[i])
        return total, results

    run_dit([0], [None])  # warm-up
    rows = []
    for setting in SETTINGS:
        seconds = min(one_at_a_time(setting)[0] for _ in range(repeats))
        _, latents = one_at_a_time(setting)
        passes = [item.dit_passes for item in latents]
        reused = sum(p["reused"] for p in passes) / sum(p["computed"] + p["reused"] for p in passes)
        rows.append({"cache": cache_field(setting), "dit_s": seconds, "reused_share": reused})
        print(f"DiT {setting}: {seconds:.2f} s for {num_requests}, {100 * reused:.0f}% of passes reused", flush=True)

    batch = list(range(8))
    mixed = []
    for label, settings in [("none cached", [None] * 8), ("half cached", [MIXED if i % 2 else None for i in batch]),
                            ("all cached", [MIXED] * 8)]:
        seconds = min(run_dit(batch, settings)[0] for _ in range(repeats))
        mixed.append({"label": label, "img_s": len(batch) / seconds, "seconds": seconds})
        print(f"8 concurrent, {label}: {len(batch) / seconds:.2f} img/s", flush=True)

    # End to end last: starting vLLM binds this process's threads.
    pipeline = Pipeline(config)

    def generate(setting) -> tuple[float, list]:
        start, images = time.perf_counter(), []
        for i in range(num_requests):
            body = {"prompt": prompts[i], "negative_prompt": NEGATIVE, "size": f"{WIDTH}x{HEIGHT}", "seed": 1000 + i,
                    "num_inference_steps": steps, "true_cfg_scale": 4.0, "cache": cache_field(setting)}
            (image,) = asyncio.run(pipeline.generate(body))
            images.append(image.pixels.astype(np.int16))
        return time.perf_counter() - start, images

    generate(None)  # warm-up
    uncached = None
    for row, setting in zip(rows, SETTINGS):
        seconds = min(generate(setting)[0] for _ in range(repeats))
        _, images = generate(setting)
        uncached = uncached if uncached is not None else images
        diffs = [np.abs(a - b) for a, b in zip(images, uncached)]
        row.update(e2e_s=seconds, max_pixel_diff=int(max(d.max() for d in diffs)),
                   mean_pixel_diff=float(np.mean([d.mean() for d in diffs])))
        print(f"end to end {setting}: {seconds:.2f} s, pixels max {row['max_pixel_diff']} mean "
              f"{row['mean_pixel_diff']:.1f} from uncached", flush=True)
    pipeline.shutdown()
    for row in rows:
        row.update(dit_speedup=rows[0]["dit_s"] / row["dit_s"], e2e_speedup=rows[0]["e2e_s"] / row["e2e_s"])
    return {"checkpoint": "small", "height": HEIGHT, "width": WIDTH, "steps": steps, "requests": num_requests,
            "settings": rows, "mixed_batch": {"cached": cache_field(MIXED), "runs": mixed}}


def label(cache: dict | None) -> str:
    return "none" if cache is None else f"{cache['kind']}\n{cache['threshold']:g}"


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["settings"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [2.2, 1]})
    xs = range(len(rows))
    left.bar([x - 0.2 for x in xs], [r["dit_speedup"] for r in rows], 0.4, label="DiT speedup")
    left.bar([x + 0.2 for x in xs], [r["e2e_speedup"] for r in rows], 0.4, label="end-to-end speedup")
    for x, r in zip(xs, rows):
        left.annotate(f"{100 * r['reused_share']:.0f}% reused\nmax diff {r['max_pixel_diff']}", (x, 0.05),
                      ha="center", fontsize=7, color="white")
    left.set_xticks(list(xs), [label(r["cache"]) for r in rows], fontsize=8)
    left.set_ylabel("x uncached")
    left.set_title(f"one at a time: small checkpoint (random weights), {report['width']}x{report['height']}, "
                   f"{report['steps']} steps, true CFG", fontsize=9)
    left.legend(fontsize=8)
    mixed = report["mixed_batch"]["runs"]
    right.bar([m["label"] for m in mixed], [m["img_s"] for m in mixed], color="tab:green")
    right.set_ylabel("images / s")
    cached = report["mixed_batch"]["cached"]
    right.set_title(f"8 concurrent in one DiT step batch\n(cached: {cached['kind']} {cached['threshold']:g})",
                    fontsize=9)
    save_figure(fig, report["machine"], path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--requests", type=int, default=4, help="requests per setting, run one at a time")
    parser.add_argument("--repeats", type=int, default=2, help="runs per measurement; the fastest counts")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS / "dit_cache.json"))
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    if args.worker:
        out.write_text(json.dumps(worker(args.steps, args.requests, args.repeats)))
        return

    RESULTS.mkdir(exist_ok=True)
    part = out.with_suffix(".tmp")
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count()), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    subprocess.run([sys.executable, "-m", "benchmarks.dit_cache", "--worker", "--steps", str(args.steps),
                    "--requests", str(args.requests), "--repeats", str(args.repeats), "--out", str(part)],
                   env=env, check=True, cwd=REPO)
    report = {"machine": machine(), **json.loads(part.read_text())}
    part.unlink()
    write_report(report, out, plot)
    print(f"{'cache':<20} {'reused':>7} {'DiT':>6} {'e2e':>6} {'max diff':>9} {'mean diff':>10}")
    for r in report["settings"]:
        name = label(r["cache"]).replace("\n", " ")
        print(f"{name:<20} {100 * r['reused_share']:>6.0f}% {r['dit_speedup']:>5.2f}x {r['e2e_speedup']:>5.2f}x "
              f"{r['max_pixel_diff']:>9} {r['mean_pixel_diff']:>10.1f}")
    for m in report["mixed_batch"]["runs"]:
        print(f"8 concurrent, {m['label']}: {m['img_s']:.2f} img/s")
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
