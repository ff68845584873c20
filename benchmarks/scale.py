"""Scale-out on one machine: the simulated preset with 1, 2, 4, 8 DiT replicas under the load benchmark.

    python -m benchmarks.scale --dit-replicas 1,2,4,8 --out benchmarks/results/scale.json

For each DiT replica count k, a fresh local cluster serves ``stage_configs/qwen_image_sim.yaml`` (all three stages
simulated at Qwen-Image's real sizes, PNG output encoded for real by the coordinator) with k DiT replicas, one
encoder and one VAE replica (each far from saturating: the encoder takes ~35 ms per request in batches of 16, the
VAE ~17-115 ms per image) and ``--coordinators`` coordinators; ``benchmarks.load`` then runs closed-loop with
``--per-replica`` requests in flight per DiT replica. Each run records throughput, p50/p99 latency, the time queued
per stage, the coordinator's CPU per image and longest event-loop stall, and the bottleneck: the coordinator when its
CPU is past 80% of a core per replica, else the stage where requests queued longest. JSON and a plot of the curve.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile

import yaml

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"


def bottleneck(run: dict, coordinators: int) -> str:
    """Where the load waits: the coordinator if its CPU is nearly spent, else the stage queued longest."""
    cpu_ms = run.get("coordinator_cpu_ms_per_image")
    if cpu_ms is not None and cpu_ms * run["throughput_img_s"] / 1000 > 0.8 * coordinators:
        return "coordinator CPU"
    queued = {stage: q["mean"] or 0 for stage, q in run["queued_ms"].items()}
    stage = max(queued, key=queued.get)
    return f"{stage} (queued {queued[stage]:.0f} ms on average)" + (" : the simulated GPUs" if stage == "dit" else "")


def serve_config(dit_replicas: int, coordinators: int, workdir: pathlib.Path) -> pathlib.Path:
    preset = yaml.safe_load((REPO / "stage_configs/qwen_image_sim.yaml").read_text())
    preset["dit"]["deployment"]["num_replicas"] = dit_replicas
    preset["coordinator"]["num_replicas"] = coordinators
    preset_path = workdir / f"sim_{dit_replicas}.yaml"
    preset_path.write_text(yaml.safe_dump(preset))
    config = yaml.safe_load((REPO / "config.sim.yaml").read_text())
    config["applications"][0]["args"]["stage_config"] = str(preset_path)
    config_path = workdir / f"serve_{dit_replicas}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    return config_path


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    replicas = [r["dit_replicas"] for r in runs]
    throughput = [r["throughput_img_s"] for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(replicas, throughput, "o-", label="measured")
    left.plot(replicas, [throughput[0] * k / replicas[0] for k in replicas], "--", color="grey", label="linear")
    left.set(xlabel="DiT replicas", ylabel="images / s", title="simulated Qwen-Image, PNG, 2-core CPU machine")
    left.legend()
    right.plot(replicas, [r["p50_s"] for r in runs], "o-", label="p50")
    right.plot(replicas, [r["p99_s"] for r in runs], "o-", label="p99")
    right.set(xlabel="DiT replicas", ylabel="latency (s)", title="latency at a fixed load per replica")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dit-replicas", default="1,2,4,8", help="comma-separated DiT replica counts")
    parser.add_argument("--per-replica", type=int, default=4, help="requests in flight per DiT replica")
    parser.add_argument("--coordinators", type=int, default=1)
    parser.add_argument("--duration", type=float, default=90, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=30, help="seconds before the measured window")
    parser.add_argument("--out", default=str(RESULTS / "scale.json"))
    args = parser.parse_args()

    from benchmarks import load
    from benchmarks.engine_throughput import machine
    from testing.local_serve import LocalServe

    workdir = pathlib.Path(tempfile.mkdtemp(prefix="omni-ray-scale-"))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine(), "preset": "stage_configs/qwen_image_sim.yaml",
              "settings": {"per_replica_concurrency": args.per_replica, "coordinators": args.coordinators,
                           "duration_s": args.duration, "warmup_s": args.warmup, "mix": load.SIZES},
              "runs": []}
    for replicas in (int(k) for k in args.dit_replicas.split(",")):
        with LocalServe(serve_config(replicas, args.coordinators, workdir)) as served:
            run = load.run(served.base_url, concurrency=args.per_replica * replicas, duration_s=args.duration,
                           warmup_s=args.warmup, metrics_url=served.metrics_url)
        run.pop("latencies_s")
        run = {"dit_replicas": replicas, "bottleneck": bottleneck(run, args.coordinators), **run}
        result["runs"].append(run)
        print(json.dumps(run), flush=True)
        out.write_text(json.dumps(result, indent=1) + "\n")  # each run as it comes
    base = result["runs"][0]["throughput_img_s"]
    for run in result["runs"]:
        run["speedup"] = round(run["throughput_img_s"] / base, 2) if base else None
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(json.dumps([{k: r[k] for k in ("dit_replicas", "throughput_img_s", "speedup", "p50_s", "p99_s",
                                         "bottleneck")} for r in result["runs"]], indent=1))


if __name__ == "__main__":
    main()
