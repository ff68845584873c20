"""One request on several ranks: the bytes each parallel mode sends per DiT step, measured against its formula, and
(on a machine with several GPUs) each mode's step time and end to end against one GPU.

    .venv/bin/python -m benchmarks.parallel                      # CPU: gloo gangs of the tiny model's ranks
    .venv/bin/python -m benchmarks.parallel --gpus 4             # GPUs: the dummy full-size preset's DiT, per mode

On the CPU each mode's gang (spawned processes over gloo, ``testing.gang``) steps two true-CFG requests of the tiny
checkpoint at 48x80 (15 image tokens: a sequence split pads) and 64x64, and rank 0's bytes per step
(``Mesh.sent``) are set beside ``parallel.traffic.step_bytes`` of the same shapes; then the same formula at Qwen-Image's
full size (60 blocks, 24 heads of 128, bfloat16, a 128-token prompt) for one true-CFG request at 1024, 1328 and 1536.
With ``--gpus N`` every mode that fits N GPUs runs the DiT engine core of ``qwen_image_dummy.yaml`` (random weights,
bf16) on a gang (``MultiprocExecutor``, NCCL) for one true-CFG request per size, ``--steps`` steps, against world
size 1. Writes benchmarks/results/parallel.{json,png} (``--gpus``: parallel_gpu.{json,png}).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time

from benchmarks import write_report

HERE = pathlib.Path(__file__).resolve().parent

# name -> the gang's degrees (and "split": "rows" for a step that spreads rows whole over the sequence ranks)
MODES = {
    "cfg 2": {"cfg": 2},
    "ulysses 2": {"ulysses": 2},
    "ring 2": {"ring": 2},
    "tensor 2": {"tensor": 2},
    "ulysses 2 x cfg 2": {"ulysses": 2, "cfg": 2},
    "tensor 2 x cfg 2": {"tensor": 2, "cfg": 2},
    "ulysses 2 x ring 2": {"ulysses": 2, "ring": 2},
    "ulysses 2, rows split": {"ulysses": 2, "split": "rows"},
}
CPU_SIZES = ((48, 80), (64, 64))
FULL_SIZES = (1024, 1328, 1536)
PROMPT_TOKENS = 12  # the CPU runs' prompts and negatives (the same length: no text mask)


def traffic_steps(mesh, model: str, sizes, steps: int = 2, split: str = "sequence") -> list[dict]:
    """On every rank of a gang: two true-CFG requests per size, stepped ``steps`` times; rank 0's bytes per step
    by collective, and its seconds per step."""
    import torch

    from omni_ray.records import DenoiseBatch, DenoiseParams, DenoiseRequest, PromptEmbeds
    from omni_ray.runners.denoise import DenoiseRunner

    runner = DenoiseRunner.load(model, mesh=mesh)
    dim = runner.transformer.config.joint_attention_dim
    generator = torch.Generator().manual_seed(0)
    out = []
    for height, width in sizes:
        requests = [DenoiseRequest(f"{height}x{width}-{i}", DenoiseParams(height, width, steps, seed=i, true_cfg=True,
                                                                        true_cfg_scale=4.0),
                                   PromptEmbeds(torch.randn(PROMPT_TOKENS, dim, generator=generator)),
                                   PromptEmbeds(torch.randn(PROMPT_TOKENS, dim, generator=generator)))
                    for i in range(2)]
        ids, new = [r.request_id for r in requests], requests
        for _ in range(steps):
            before = dict(mesh.sent)
            start = time.perf_counter()
            runner.execute_model(DenoiseBatch(new, ids, [], split))
            seconds = time.perf_counter() - start
            new = []
            out.append({"height": height, "width": width, "seconds": seconds,
                        "sent": {op: n - before.get(op, 0) for op, n in mesh.sent.items() if n - before.get(op, 0)}})
    return out


def cpu_report(model: str, steps: int, modes: dict[str, dict] = MODES) -> dict:
    """Each mode's measured bytes per step (rank 0) beside the formula's, per size; the full-size formula."""
    from omni_ray.runners.parallel.traffic import step_bytes
    from testing.gang import run_gang

    rows = []
    for name, degrees in modes.items():
        settings, split = _settings(degrees)
        started = time.perf_counter()
        measured = run_gang(traffic_steps, settings, model, CPU_SIZES, steps, split)[0]
        for (height, width) in CPU_SIZES:
            per_step = [m["sent"] for m in measured if (m["height"], m["width"]) == (height, width)]
            formula = dict(step_bytes(settings, tiny_shapes(model, height, width), 2, True, split))
            rows.append({"mode": name, "world_size": settings.world_size, "height": height, "width": width,
                         "measured": per_step, "formula": formula,
                         "equal": all(step == formula for step in per_step),
                         "cpu_step_s": statistics.median(m["seconds"] for m in measured
                                                         if (m["height"], m["width"]) == (height, width))})
        print(f"{name}: {time.perf_counter() - started:.1f} s, " + ", ".join(
            f"{r['height']}x{r['width']} {'=' if r['equal'] else '!='} formula" for r in rows if r["mode"] == name))
    full = [{"mode": name, "side": side,
             "bytes": sum(step_bytes(*_settings(degrees)[:1], full_size_shapes(side), 1, True,
                                     _settings(degrees)[1]).values())}
            for name, degrees in MODES.items() for side in FULL_SIZES]
    return {"machine": "CPU, gloo (spawned processes), tiny checkpoint, float32", "rows_per_step": 2,
            "true_cfg": True, "steps": steps, "cpu": rows, "full_size_formula": full,
            "full_size": "Qwen-Image (60 blocks, 24 heads of 128), bfloat16, one true-CFG request, 128 text tokens"}


def tiny_shapes(model: str, height: int, width: int):
    """``traffic.Shapes`` of the checkpoint's transformer at a size, float32, the CPU runs' prompt length."""
    import json

    from omni_ray.families.qwen_image.facts import latent_grid
    from omni_ray.runners.parallel.traffic import Shapes

    config = json.loads((pathlib.Path(model) / "transformer" / "config.json").read_text())
    rows, cols = latent_grid(height, width)
    return Shapes(config["num_layers"], config["num_attention_heads"], config["attention_head_dim"],
                  config["out_channels"] * config["patch_size"] ** 2, (rows // 2) * (cols // 2), PROMPT_TOKENS, 4)


def full_size_shapes(side: int, text_tokens: int = 128):
    from omni_ray.runners.parallel.traffic import Shapes

    return Shapes(60, 24, 128, 64, (side // 16) ** 2, text_tokens, 2)


def gpu_report(gpus: int, sides: tuple[int, ...], steps: int, out: pathlib.Path) -> dict:
    """Each mode that fits ``gpus`` GPUs, and world size 1: the dummy full-size DiT core stepping one true-CFG
    request per side alone, median seconds per step after the first and end to end; the JSON rewritten after each
    mode, so a run cut short keeps what it measured."""
    import yaml

    from omni_ray.checkpoints import ensure
    from omni_ray.config import parse_config

    preset = yaml.safe_load((HERE.parent / "stage_configs" / "qwen_image_dummy.yaml").read_text())
    modes = {"one GPU": {}, **{name: degrees for name, degrees in MODES.items()
                               if _world(degrees) <= gpus and "split" not in degrees}}
    report = {"machine": f"{gpus} GPUs (see nvidia-smi in the run's log)", "steps": steps, "rows": []}
    for name, degrees in modes.items():
        preset["dit"]["parallel"] = degrees
        preset["dit"]["compile"] = False
        config = ensure(parse_config(preset))
        for side in sides:
            seconds = time_request(config, side, steps)
            report["rows"].append({"mode": name, "side": side, "step_s": statistics.median(seconds[1:]),
                                   "end_to_end_s": sum(seconds)})
            print(name, side, report["rows"][-1])
            write_report(report, out, plot_gpu)
    return report


def time_request(config, side: int, steps: int) -> list[float]:
    """Seconds of each step of one true-CFG request of ``side`` x ``side`` alone on ``config``'s DiT core."""
    import torch

    from omni_ray.engine.builders import build_dit_core
    from omni_ray.records import DenoiseParams, DenoiseRequest, PromptEmbeds

    core = build_dit_core(config)
    try:
        prompt, negative = (PromptEmbeds(torch.randn(128, 3584)) for _ in range(2))
        core.add_request(DenoiseRequest(f"{side}", DenoiseParams(side, side, steps, seed=0, true_cfg=True,
                                                                 true_cfg_scale=4.0), prompt, negative))
        seconds = []
        while core.has_unfinished_requests():
            start = time.perf_counter()
            core.step()
            seconds.append(time.perf_counter() - start)
        return seconds
    finally:
        core.shutdown()


def _settings(degrees: dict):
    """A mode's ``ParallelSettings`` and step split."""
    from omni_ray.config import ParallelSettings

    degrees = dict(degrees)
    split = degrees.pop("split", "sequence")
    return ParallelSettings(**degrees), split


def _world(degrees: dict) -> int:
    return _settings(degrees)[0].world_size


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (measured, full) = plt.subplots(1, 2, figsize=(13, 4.5))
    rows = [r for r in report["cpu"] if (r["height"], r["width"]) == CPU_SIZES[0]]
    names = [r["mode"] for r in rows]
    x = range(len(rows))
    measured.bar([i - 0.2 for i in x], [sum(r["measured"][0].values()) for r in rows], 0.4, label="measured")
    measured.bar([i + 0.2 for i in x], [sum(r["formula"].values()) for r in rows], 0.4, label="formula")
    measured.set_xticks(list(x), names, rotation=30, ha="right")
    measured.set_ylabel("bytes rank 0 sends per step")
    measured.set_title(f"tiny model, 2 true-CFG rows at {CPU_SIZES[0][0]}x{CPU_SIZES[0][1]} (CPU, gloo)")
    measured.legend()
    for side in FULL_SIZES:
        points = [r for r in report["full_size_formula"] if r["side"] == side]
        full.plot([p["mode"] for p in points], [p["bytes"] / 2**20 for p in points], marker="o", label=f"{side}")
    full.set_ylabel("MiB per step (formula)")
    full.set_title("Qwen-Image full size, bf16, one true-CFG request")
    full.tick_params(axis="x", rotation=30)
    full.legend(title="side")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_gpu(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode in dict.fromkeys(r["mode"] for r in report["rows"]):
        points = [r for r in report["rows"] if r["mode"] == mode]
        ax.plot([p["side"] for p in points], [p["step_s"] for p in points], marker="o", label=mode)
    ax.set_xlabel("side (px)")
    ax.set_ylabel("seconds per step (one true-CFG request)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=0, help="run the GPU modes on this many GPUs")
    parser.add_argument("--sides", type=int, nargs="+", default=list(FULL_SIZES))
    parser.add_argument("--steps", type=int, default=None, help="steps per request (CPU 2, GPU 10)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.gpus:
        out = pathlib.Path(args.out or HERE / "results" / "parallel_gpu.json")
        gpu_report(args.gpus, tuple(args.sides), args.steps or 10, out)
        return
    from omni_ray.checkpoints.tiny import write_checkpoint

    model = pathlib.Path.home() / ".cache" / "omni-ray" / "bench-tiny"
    if not (model / "model_index.json").exists():
        write_checkpoint(model, seed=0)
    report = cpu_report(str(model), args.steps or 2)
    write_report(report, args.out or HERE / "results" / "parallel.json", plot)
    if not all(r["equal"] for r in report["cpu"]):
        raise SystemExit("measured bytes differ from the formula: see the JSON")


if __name__ == "__main__":
    main()
