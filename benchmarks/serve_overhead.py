"""The served app against diffusers' QwenImagePipeline in this process, on the same checkpoint, in one run.

    .venv/bin/python -m benchmarks.serve_overhead [--size tiny|small] [--image 256x256] [--steps 8]

- latency: one request at a time, served (HTTP -> coordinator -> encoder -> DiT -> VAE -> PNG) against the
  in-process pipeline (to PIL); the median of several, as a ratio and as the served app's overhead in ms;
- throughput: 16 concurrent requests to the app against the same 16 run one after another in process, and
  against the same 16 sent to the app one after another (what concurrency gains the served app).

The app runs `serve run config.yaml` on a local cluster (testing.local_serve.LocalServe) with the checkpoint swapped
in. Writes benchmarks/results/serve_overhead.{json,png}.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import statistics
import time
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny", help="checkpoint")
    parser.add_argument("--image", default="256x256", help="WxH of every image")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="single requests timed for the latency median")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--out", default=str(RESULTS / "serve_overhead.json"))
    args = parser.parse_args()

    import torch
    from diffusers import QwenImagePipeline

    from benchmarks.engine_throughput import machine
    from omni_ray.checkpoints.tiny import write_checkpoint
    from testing.local_serve import LocalServe

    checkpoint = pathlib.Path.home() / ".cache" / "omni-ray" / f"bench-{args.size}"
    if not (checkpoint / "model_index.json").exists():
        write_checkpoint(checkpoint, seed=0, size=args.size)
    width, height = (int(side) for side in args.image.split("x"))
    negative = " "

    def body(i: int) -> dict:
        return {"prompt": f"a lighthouse on a cliff at sunset, variation {i}", "size": args.image, "seed": i,
                "num_inference_steps": args.steps, "negative_prompt": negative, "true_cfg_scale": 4.0}

    reference = QwenImagePipeline.from_pretrained(checkpoint)
    reference.set_progress_bar_config(disable=True)

    def in_process(i: int):
        b = body(i)
        return reference(b["prompt"], negative_prompt=negative, true_cfg_scale=4.0, height=height, width=width,
                         num_inference_steps=args.steps, generator=torch.Generator("cpu").manual_seed(i)).images[0]

    in_process(0)  # warm-up
    local_times = []
    for i in range(args.repeats):
        start = time.perf_counter()
        in_process(i)
        local_times.append(time.perf_counter() - start)
    start = time.perf_counter()
    for i in range(args.concurrency):
        in_process(100 + i)
    local_sequential = time.perf_counter() - start

    with LocalServe(REPO / "config.yaml", model=str(checkpoint)) as served:
        url = served.base_url + "/v1/images/generations"
        post(url, body(0))  # warm-up
        served_times = []
        for i in range(args.repeats):
            start = time.perf_counter()
            post(url, body(i))
            served_times.append(time.perf_counter() - start)
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            start = time.perf_counter()
            list(pool.map(lambda i: post(url, body(100 + i)), range(args.concurrency)))
            served_concurrent = time.perf_counter() - start
        start = time.perf_counter()
        for i in range(args.concurrency):
            post(url, body(100 + i))
        served_sequential = time.perf_counter() - start

    local_latency, served_latency = statistics.median(local_times), statistics.median(served_times)
    report = {
        "machine": machine(),
        "checkpoint": args.size,
        "image": args.image,
        "steps": args.steps,
        "true_cfg": True,
        "latency_in_process_s": local_latency,
        "latency_served_s": served_latency,
        "latency_ratio": served_latency / local_latency,
        "latency_overhead_ms": 1000 * (served_latency - local_latency),
        "concurrency": args.concurrency,
        "throughput_in_process_img_s": args.concurrency / local_sequential,
        "throughput_served_img_s": args.concurrency / served_concurrent,
        "throughput_ratio": local_sequential / served_concurrent,
        "throughput_served_sequential_img_s": args.concurrency / served_sequential,
        "concurrency_gain": served_sequential / served_concurrent,
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    print(json.dumps(report, indent=2))


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(["in process", "served"], [1000 * report["latency_in_process_s"], 1000 * report["latency_served_s"]])
    left.set_ylabel("ms per request, one at a time")
    left.set_title(f"latency: served x{report['latency_ratio']:.2f} (+{report['latency_overhead_ms']:.0f} ms)")
    right.bar(["in process,\nsequential", "served,\nsequential", f"served,\n{report['concurrency']} concurrent"],
              [report["throughput_in_process_img_s"], report["throughput_served_sequential_img_s"],
               report["throughput_served_img_s"]])
    right.set_ylabel("images / s")
    right.set_title(f"throughput: x{report['throughput_ratio']:.2f} in-process sequential, "
                    f"x{report['concurrency_gain']:.2f} served sequential", fontsize=9)
    fig.suptitle(f"{report['checkpoint']} checkpoint, {report['image']}, {report['steps']} steps, true CFG; "
                 f"{report['machine']['cores']} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
