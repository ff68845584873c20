"""What one trace per request costs: the served tiny preset with tracing off and on, in one run.

    .venv/bin/python -m benchmarks.tracing [--image 128x128] [--steps 4] [--n 2] [--requests 20] [--rounds 1]

- served: the app (`serve run config.yaml` on a local cluster, testing.local_serve.LocalServe) started once without
  tracing and once with Ray Serve's tracing on (``tracing_config``, every request sampled, omni-ray's JSON-lines
  exporter: a synchronous file write per span, the dearer of our two exporters); the same requests, one at a time,
  timed end to end over HTTP; medians, quartiles and the difference. ``--rounds`` alternates off and on clusters more
  times (the machine drifts between clusters);
- in process: the coordinator over fake stages (no Ray, no models), the same requests with tracing off and on (the
  same exporter), which isolates the spans' own cost per request from the served run's noise;
- the spans one request makes, and one request's trace printed as a tree (what docs/observability.md shows).

Writes benchmarks/results/tracing.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import tempfile
import time
import urllib.request

import yaml

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
TRACING = {"enabled": True, "exporter_import_path": "omni_ray.tracing.export:jsonl", "sampling_ratio": 1.0}


def post(url: str, body: dict, request_id: str) -> None:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                      "x-request-id": request_id})
    with urllib.request.urlopen(request, timeout=600) as response:
        response.read()


def summary(times: list[float]) -> dict:
    quartiles = statistics.quantiles(times, n=4)
    return {"median_ms": 1000 * statistics.median(times), "p25_ms": 1000 * quartiles[0],
            "p75_ms": 1000 * quartiles[2], "mean_ms": 1000 * statistics.mean(times), "count": len(times)}


def served_run(checkpoint: pathlib.Path, traced: bool, body, requests: int, tag: str) -> tuple[list[float], dict]:
    """Times ``requests`` requests one at a time on a fresh cluster; with tracing, also one request's spans."""
    from testing.local_serve import LocalServe
    from testing.traces import format_tree, ours, read_spans, request_traces

    config = yaml.safe_load((REPO / "config.yaml").read_text())
    spans_dir = pathlib.Path(tempfile.mkdtemp(prefix="omni-ray-spans-"))
    if traced:
        config["tracing_config"] = TRACING
    config_path = spans_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    times, example = [], {}
    with LocalServe(config_path, model=str(checkpoint), env={"OMNI_RAY_TRACE_DIR": str(spans_dir)}) as served:
        url = served.base_url + "/v1/images/generations"
        for i in range(3):  # warm-up
            post(url, body(1000 + i), f"{tag}-warm{i}")
        for i in range(requests):
            start = time.perf_counter()
            post(url, body(i), f"{tag}-{i}")
            times.append(time.perf_counter() - start)
        if traced:
            time.sleep(2)  # Ray's own spans end after the response
            traces = request_traces(read_spans(spans_dir))
            trace = traces[f"{tag}-0"]
            example = {"spans_per_request": len(trace), "omni_ray_spans_per_request": len(ours(trace)),
                       "tree": format_tree(trace), "tree_ours": format_tree(ours(trace))}
    return times, example


def in_process(checkpoint: pathlib.Path, body, requests: int) -> dict:
    """The coordinator over fake stages: the same requests with tracing off and on (JSON lines to a file)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from omni_ray import tracing
    from omni_ray.config import load_config
    from omni_ray.tracing.export import JsonLinesExporter
    from testing.coordinator import coordinator
    from testing.fake_stages import FakeStages

    config = load_config(REPO / "stage_configs" / "qwen_image_tiny.yaml", model=str(checkpoint))

    async def run(plain) -> list[float]:
        times = []
        for i in range(requests):
            plan = await plain.plan(body(i))
            start = time.perf_counter()
            await plain.json_response(plan, f"r{i}")
            times.append(time.perf_counter() - start)
        return times

    off = asyncio.run(run(coordinator(config, FakeStages())))
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(tempfile.mkdtemp(prefix="omni-ray-spans-"))))
    tracing.enable(provider)
    try:
        on = asyncio.run(run(coordinator(config, FakeStages())))
    finally:
        tracing.disable()
    return {"off": summary(off[requests // 5:]), "on": summary(on[requests // 5:])}  # the first fifth warms up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--image", default="128x128", help="WxH of every image")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--n", type=int, default=2, help="images per request (a DiT call each)")
    parser.add_argument("--requests", type=int, default=20, help="timed requests per cluster")
    parser.add_argument("--rounds", type=int, default=1, help="off-then-on cluster pairs")
    parser.add_argument("--out", default=str(RESULTS / "tracing.json"))
    args = parser.parse_args()

    from benchmarks.engine_throughput import machine
    from omni_ray.checkpoints.tiny import write_checkpoint

    checkpoint = pathlib.Path.home() / ".cache" / "omni-ray" / "bench-tiny"
    if not (checkpoint / "model_index.json").exists():
        write_checkpoint(checkpoint, seed=0, size="tiny")

    def body(i: int) -> dict:  # a prompt of its own each: the encoder's prompt cache serves no request
        return {"prompt": f"a lighthouse on a cliff at sunset, variation {i}", "size": args.image, "seed": i,
                "n": args.n, "num_inference_steps": args.steps}

    local = in_process(checkpoint, body, 500)
    served = {"off": [], "on": []}
    example = {}
    for round_ in range(args.rounds):
        for mode in ("off", "on"):
            times, seen = served_run(checkpoint, mode == "on", body, args.requests, f"{mode}{round_}")
            served[mode] += times
            example = example or seen
    off, on = summary(served["off"]), summary(served["on"])
    report = {
        "machine": machine(), "checkpoint": "tiny", "image": args.image, "steps": args.steps, "n": args.n,
        "exporter": TRACING["exporter_import_path"], "sampling_ratio": TRACING["sampling_ratio"],
        "rounds": args.rounds, "served_off": off, "served_on": on,
        "served_overhead_ms": on["median_ms"] - off["median_ms"],
        "served_overhead_ratio": on["median_ms"] / off["median_ms"],
        "in_process_off": local["off"], "in_process_on": local["on"],
        "in_process_overhead_us": 1000 * (local["on"]["median_ms"] - local["off"]["median_ms"]),
        **example,
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    print(json.dumps({key: value for key, value in report.items() if not key.startswith("tree")}, indent=2))
    print(report.get("tree", ""))


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for axis, prefix, unit, scale in ((left, "served", "ms per request, one at a time", 1),
                                      (right, "in_process", "µs per request at the coordinator (fake stages)", 1000)):
        rows = [report[f"{prefix}_off"], report[f"{prefix}_on"]]
        medians = [scale * row["median_ms"] for row in rows]
        errors = [[scale * (row["median_ms"] - row["p25_ms"]) for row in rows],
                  [scale * (row["p75_ms"] - row["median_ms"]) for row in rows]]
        axis.bar(["tracing off", "tracing on"], medians, yerr=errors, capsize=6, color=["#8da0cb", "#fc8d62"])
        axis.set_ylabel(unit)
    left.set_title(f"served: {report['served_overhead_ms']:+.1f} ms median (x{report['served_overhead_ratio']:.3f})",
                   fontsize=10)
    right.set_title(f"in process: {report['in_process_overhead_us']:+.0f} µs per request", fontsize=10)
    fig.suptitle(f"tiny checkpoint, {report['image']}, {report['steps']} steps, n={report['n']}; "
                 f"{report.get('spans_per_request', '?')} spans per request; bars: median, whiskers: quartiles; "
                 f"{report['machine']['cores']} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
