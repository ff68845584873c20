"""A DiT gang's split chosen per step against the two fixed ones, on the simulated preset under ``benchmarks.slo``'s
mixed load.

    python -m benchmarks.parallel_choice --out benchmarks/results/parallel_choice.json     # about 5 minutes

The DiT engine of ``stage_configs/qwen_image_sim.yaml`` as a gang of four sequence ranks (``dit.parallel.ulysses:
4``) runs in this process on a virtual clock: the simulated runner's steps take their H200 time
(``omni_ray/runners/gpu_costs.py``, all-to-alls included) without sleeping, so half an hour of load takes under a
minute and each run is exact. The same arrivals replay for each ``dit.parallel.split``: **sequence** (a fixed
Ulysses-4 gang), **rows** (a fixed data-parallel gang of four) and **per_step** (omni_ray/engine/dit_split.py). They
are slo's mix: interactive requests (512x512, 20 steps, true CFG, priority 0) and batch ones (1328x1328, 50 steps,
priority 1) from two tenants 3:1, Poisson at its seed, at ``--loads`` times its rates (1x keeps one GPU about 95%
busy).

Latency is the DiT's, from a request's arrival at the DiT to its last step: the encoder and the VAE add about 0.05 s
(interactive) and 0.15 s (batch) whatever the DiT's split. For each load and split: per class p50/p95/p99 and
throughput (requests over the time from the first arrival to the last finish, as slo counts it), steps by split, and
how far the step times the DiT learns (``StepTimes``, which its admission estimates read) are from its steps' times,
by split, fitted on the work tokens the scheduler reports and, for contrast, on the plain sum of its rows' tokens.
The checks: per_step's interactive p99 at or below sequence's, its throughput at or above rows'. JSON (``--out``) and a
plot beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
from collections import Counter
from dataclasses import dataclass

import torch
import yaml

from benchmarks.slo import MIX, Arrival, arrivals, percentile
from omni_ray.config import DiTConfig
from omni_ray.engine.builders import create_policy, create_split
from omni_ray.engine.core import DiTEngineCore
from omni_ray.engine.dit_load import StepTimes
from omni_ray.engine.dit_scheduler import DiTScheduler
from omni_ray.records import DenoiseBatch, DenoiseOutput, DenoiseParams, DenoiseRequest, PromptEmbeds
from omni_ray.runners.simulated import SimulatedDenoiser

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
SPLITS = ("sequence", "rows", "per_step")
RANKS = 4
PROMPT = PromptEmbeds(torch.zeros(12, 3584, dtype=torch.bfloat16))  # "a lighthouse at dusk, take 7", template dropped
NEGATIVE = PromptEmbeds(torch.zeros(3, 3584, dtype=torch.bfloat16))  # "blurry"


class VirtualClock:
    """Time that passes only when the simulated runner sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


@dataclass
class StepRecord:
    split: str
    tokens: int  # what the scheduler reports (StepPlan.tokens)
    plain_tokens: int  # the rows' work tokens summed
    seconds: float


class RecordingRunner:
    """The simulated denoiser, with each step's split, tokens and time written down."""

    def __init__(self, runner: SimulatedDenoiser, scheduler: DiTScheduler, clock: VirtualClock):
        self.runner, self.scheduler, self.clock = runner, scheduler, clock
        self.tokens: dict[str, int] = {}
        self.steps: list[StepRecord] = []

    def execute_model(self, batch: DenoiseBatch) -> DenoiseOutput:
        self.tokens.update((request.request_id, request.work_tokens) for request in batch.new_requests)
        started = self.clock.monotonic()
        output = self.runner.execute_model(batch)
        self.steps.append(StepRecord(batch.split, self.scheduler.last_step_tokens,
                                     sum(self.tokens[rid] for rid in batch.request_ids), self.clock.now - started))
        return output


def dit_stage(split: str) -> DiTConfig:
    """The simulated preset's DiT as a gang of ``RANKS`` sequence ranks, split as ``split`` says: a step holds
    ``RANKS`` times the preset's rows and tokens, so each rank's share is what the preset gives one GPU."""
    dit = yaml.safe_load((REPO / "stage_configs/qwen_image_sim.yaml").read_text())["dit"]
    return DiTConfig.model_validate({**dit, "max_batch_size": RANKS * dit["max_batch_size"],
                                     "max_batch_tokens": RANKS * dit["max_batch_tokens"],
                                     "parallel": {"ulysses": RANKS, "split": split}})


def denoise_request(index: int, arrival: Arrival) -> DenoiseRequest:
    body = arrival.body
    width, height = (int(side) for side in body["size"].split("x"))
    params = DenoiseParams(height, width, body["num_inference_steps"], seed=index, true_cfg_scale=4.0, true_cfg=True,
                           priority=body["priority"], tenant=body["user"])
    return DenoiseRequest(f"{arrival.kind}-{index}", params, PROMPT, NEGATIVE)


def run(split: str, plan: list[Arrival]) -> dict:
    """Replays ``plan`` on the DiT engine split as ``split``, on a virtual clock."""
    stage, clock = dit_stage(split), VirtualClock()
    scheduler = DiTScheduler(stage.max_batch_size, stage.max_wait_steps, create_policy(stage), clock.monotonic,
                             create_split(stage))
    runner = RecordingRunner(SimulatedDenoiser(torch.bfloat16, ranks=stage.parallel.sequence, clock=clock),
                             scheduler, clock)
    core = DiTEngineCore(scheduler, runner, clock.monotonic)
    pending = list(enumerate(plan))[::-1]
    arrived: dict[str, tuple[str, float]] = {}  # request id -> (class, arrival time)
    latencies: dict[str, list[float]] = {"interactive": [], "batch": []}
    last_finish = 0.0
    while pending or core.has_unfinished_requests():
        if not core.has_unfinished_requests():
            clock.now = max(clock.now, pending[-1][1].at)
        while pending and pending[-1][1].at <= clock.now:  # requests join at step boundaries
            index, arrival = pending.pop()
            request = denoise_request(index, arrival)
            arrived[request.request_id] = (arrival.kind, arrival.at)
            core.add_request(request)
        for output in core.step():
            assert output.error is None, output.error
            if output.finished:
                kind, at = arrived[output.request_id]
                latencies[kind].append(clock.now - at)
                last_finish = clock.now
    done = sum(len(values) for values in latencies.values())
    return {
        "split": split,
        "latency_s": {kind: {"requests": len(values), "p50": percentile(values, 50), "p95": percentile(values, 95),
                             "p99": percentile(values, 99), "max": round(max(values), 2)}
                      for kind, values in latencies.items() if values},
        "throughput_req_s": round(done / (last_finish - plan[0].at), 4),
        "busy": round(sum(step.seconds for step in runner.steps) / last_finish, 3),
        "steps": dict(Counter(step.split for step in runner.steps)),
        "step_fit_error": step_fit_error(runner.steps),
    }


def step_fit_error(steps: list[StepRecord]) -> dict:
    """Mean relative error of a StepTimes fit over the run's steps, per split: on the tokens the scheduler reports,
    and on the rows' plain sum."""
    errors = {}
    for name, tokens in (("reported_tokens", lambda s: s.tokens), ("plain_sum", lambda s: s.plain_tokens)):
        fit = StepTimes(halflife_steps=1e9)
        for step in steps:
            fit.observe(tokens(step), step.seconds)
        by_split: dict[str, list[float]] = {}
        for step in steps:
            by_split.setdefault(step.split, []).append(abs(fit.seconds(tokens(step)) - step.seconds) / step.seconds)
        errors[name] = {split: round(sum(values) / len(values), 3) for split, values in by_split.items()}
    return errors


def checks(runs: dict) -> dict:
    """Per step against the fixed splits: its interactive p99 over sequence's, its throughput over rows'."""
    p99 = runs["per_step"]["latency_s"]["interactive"]["p99"] / runs["sequence"]["latency_s"]["interactive"]["p99"]
    throughput = runs["per_step"]["throughput_req_s"] / runs["rows"]["throughput_req_s"]
    return {"interactive_p99_vs_sequence": round(p99, 4), "throughput_vs_rows": round(throughput, 4),
            "passed": p99 <= 1 and throughput >= 1}


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"sequence": "tab:orange", "rows": "tab:green", "per_step": "tab:blue"}
    loads = [entry["load"] for entry in result["loads"]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for split in SPLITS:
        runs = [entry["runs"][split] for entry in result["loads"]]
        axes[0].plot(loads, [r["latency_s"]["interactive"]["p99"] for r in runs], "o-", color=colours[split],
                     label=f"{split} p99")
        axes[0].plot(loads, [r["latency_s"]["interactive"]["p50"] for r in runs], "o--", color=colours[split],
                     alpha=0.6, label=f"{split} p50")
        axes[1].plot(loads, [r["latency_s"]["batch"]["p50"] for r in runs], "o-", color=colours[split], label=split)
        axes[2].plot(loads, [r["throughput_req_s"] for r in runs], "o-", color=colours[split], label=split)
    titles = ["interactive latency (DiT)", "batch p50 latency (DiT)", "throughput (requests / s)"]
    for axis, title in zip(axes, titles):
        axis.set_title(title)
        axis.set_xlabel("load (x benchmarks.slo's mix)")
        axis.legend(fontsize=8)
    axes[0].set_ylabel("seconds")
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    fig.suptitle(f"DiT gang of {RANKS} sequence ranks, simulated H200 costs: sequence vs rows vs per-step split")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "parallel_choice.json")
    parser.add_argument("--loads", type=float, nargs="+", default=[1.0, 2.0, 2.5, 3.0, 3.5, 4.0, 6.0],
                        help="benchmarks.slo's mix rates times these")
    parser.add_argument("--duration", type=float, default=3600.0, help="seconds of arrivals (virtual)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; the DiT simulated at "
                         f"H200 costs on a virtual clock, a gang of {RANKS} sequence ranks",
              "duration_s": args.duration, "seed": args.seed, "loads": []}
    for load in args.loads:
        streams = [(rate * load, kind, tenant) for rate, kind, tenant in MIX]
        plan = arrivals(args.seed, args.duration, streams)
        runs = {split: run(split, plan) for split in SPLITS}
        result["loads"].append({"load": load, "requests": len(plan), "runs": runs, "checks": checks(runs)})
        print(f"load {load}: {len(plan)} requests", json.dumps(result["loads"][-1]["checks"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
