"""Latency under mixed load: the DiT's scheduling (priorities, fair sharing, a budget of work per step, early
refusal) against the FIFO it replaced, and autoscaling on the replicas' own work, on the simulated preset.

    python -m benchmarks.slo --scale 0.3 --no-ramp     # three seeds, about an hour on a 2-core machine

Every run serves ``stage_configs/qwen_image_sim.yaml`` on a fresh local cluster (``testing.local_serve``): the stages
compute nothing and take as long as they would on an H200 (``omni_ray/runners/gpu_costs.py``), the coordinator
encodes real PNGs. Requests go over HTTP in an open loop, at seeded Poisson arrival times replayed the same way for
each scheduling. Two classes: **interactive** (512x512, 20 steps, true CFG, priority 0) and **batch** (1328x1328, 50
steps, true CFG, priority 1); the tenant is OpenAI's ``user`` field.

For each of ``dit.scheduling: fifo`` and ``priority`` (one cluster each, every seed of ``--seeds`` run on it in
turn; every part waits for all its answers before the next starts):

1. **solo** (once per cluster): each class alone, one request at a time: the latency every other figure is compared
   with.
2. **mix**: both classes, two tenants sending 3:1, at a rate that keeps the DiT busy (under priority scheduling its
   token budget leaves it about 95% busy); per class and tenant p50/p95/p99 latency, throughput (requests over the
   time from the first arrival to the last finish), refusals, paused request-steps, and for each batch request
   whether it starved: slower than 3x its solo latency times (1 + the batch requests ahead of it when it arrived).
3. **saturated**: batch requests at 1.6x what the DiT can do, an interactive one every 10 s: its latency against solo.
   Midway, five batch requests with ``timeout: 30``: each is either admitted and done within 30 s, or refused at
   once (a 503 with ``Retry-After``); how soon.
4. **tenants**: interactive requests only, a heavy tenant past what the DiT can do and ``LIGHT_TENANTS`` light ones,
   each at a tenth of its rate and one request at a time (its next at its seeded time or once its previous one is
   answered, whichever is later), from ``LIGHT_START_S`` into the heavy tenant's flood, for ``300 * scale`` seconds
   or until the light ones sent ``MIN_LIGHT_REQUESTS``: the light tenants' p95 against solo.

Each part reports its request counts per class and tenant (``requests``) and which percentiles they carry
(``PERCENTILE_SUPPORT``: a p95 of fewer than 20 requests is their maximum), and the per-stage times (``timings:
true``: each stage's milliseconds, and the part queued before its first step) of the slowest interactive requests and
the slowest light-tenant requests. ``checks`` holds each seed's acceptance figures and the worst of each over the
seeds.

Then **ramp**: the priority scheduling with the DiT autoscaling on its queued work (1 to 3 replicas), interactive
requests at a rate rising to twice what one replica can do and falling back; every second the running DiT replicas,
their queued work (the ``omni_dit_queued_work_seconds`` gauge) and the latency of requests finishing; after it, the
wait until the DiT is back to one replica. Errors by status (``errors: {}`` when none failed).

JSON (``--out``) and a plot beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import pathlib
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass

import yaml

from omni_ray.api.client import connect_ray
from testing.local_serve import LocalServe
from testing.serving import scrape, total

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"

CLASSES = {
    "interactive": {"size": "512x512", "num_inference_steps": 20, "negative_prompt": "blurry", "priority": 0},
    "batch": {"size": "1328x1328", "num_inference_steps": 50, "negative_prompt": "blurry", "priority": 1},
}
# What one simulated DiT replica does with the preset's budget (two 512x512 true-CFG rows a step, one 1328x1328):
# interactive requests at 0.68/s, or batch requests at 0.05/s.
MIX = [(0.225, "interactive", "A"), (0.075, "interactive", "B"), (0.015, "batch", "A"), (0.005, "batch", "B")]
SATURATED = [(0.08, "batch", "A")]
# Each light tenant sends at a tenth of the heavy one's rate; two of them together take about a fifth of the DiT (five
# took half, and then queued behind each other for its two rows a step: 2.2 to 5.6x solo, measured). A light tenant
# is a user waiting for its image: one request at a time. Sent open loop, its own bursts (four requests in 3 s at one
# seed) queue behind each other, whatever the scheduling: 1.87 to 2.19x solo at p95 over three seeds, the slowest
# waiting behind the same tenant's earlier requests, measured.
LIGHT_TENANTS = 2
LIGHT_NAMES = tuple(f"light{i}" for i in range(LIGHT_TENANTS))
TENANTS = [(0.7, "interactive", "heavy")] + [(0.07, "interactive", name) for name in LIGHT_NAMES]
# The heavy tenant floods alone first: the DiT shares by each tenant's use over its last steps (halved every 50, about
# 7 s here), and until the flood has run that long the heavy tenant has used no more than a light one, so they share
# alike (seed 0's four slowest light requests, 1.93x solo, all came in the flood's first 8 s, each paused a third of
# its steps). 20 s: three half-lives.
LIGHT_START_S = 20.0
MIN_LIGHT_REQUESTS = 30  # the light tenants' p95 is over at least this many of their requests
PERCENTILE_SUPPORT = {"p50": 2, "p95": 20, "p99": 100}  # requests a percentile needs to be more than their maximum
SLOWEST = 5  # requests whose per-stage times are reported, per group


@dataclass
class Arrival:
    at: float  # seconds after the run's start
    kind: str
    tenant: str
    body: dict


@dataclass
class Outcome:
    kind: str
    tenant: str
    arrived: float  # seconds after the run's start
    finished: float
    status: int
    retry_after: str | None = None
    probe: bool = False
    timings_ms: dict | None = None  # the first image's time per stage, and queued before each stage's first step

    @property
    def latency(self) -> float:
        return self.finished - self.arrived


def arrivals(seed: int, duration_s: float, streams: list[tuple[float, str, str]], **extra) -> list[Arrival]:
    """Poisson arrivals of each (rate, class, tenant) stream over ``duration_s``, in time order."""
    rng = random.Random(seed)
    out = []
    for rate, kind, tenant in streams:
        at = rng.expovariate(rate)
        while at < duration_s:
            out.append(Arrival(at, kind, tenant, {**CLASSES[kind], "user": tenant, **extra}))
            at += rng.expovariate(rate)
    return sorted(out, key=lambda a: a.at)


async def replay(base: str, plan: list[Arrival], probe_kinds: tuple[str, ...] = (),
                 one_at_a_time: tuple[str, ...] = ()) -> list[Outcome]:
    """Sends each arrival at its time (open loop) and waits for every answer; a tenant of ``one_at_a_time`` sends
    each of its requests at its time or once its previous one is answered, whichever is later."""
    import httpx

    start = time.monotonic()

    async def send(client, arrival: Arrival, index: int, previous: asyncio.Task | None) -> Outcome:
        await asyncio.sleep(max(0.0, start + arrival.at - time.monotonic()))
        if previous is not None:
            await previous
        sent = time.monotonic() - start
        body = {"prompt": f"a lighthouse at dusk, take {index}", "seed": index, "timings": True, **arrival.body}
        timings = None
        try:
            response = await client.post(base + "/v1/images/generations", json=body)
            status, retry_after = response.status_code, response.headers.get("retry-after")
            if status == 200:
                image = response.json()["data"][0]
                timings = {**image["timings_ms"], **{f"{k}_queued": v for k, v in image["queued_ms"].items()}}
        except httpx.HTTPError:
            status, retry_after = 598, None
        return Outcome(arrival.kind, arrival.tenant, sent, time.monotonic() - start, status, retry_after,
                       probe=arrival.kind in probe_kinds, timings_ms=timings)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        tasks, last = [], {}  # last: a one-at-a-time tenant's latest request
        for index, arrival in enumerate(plan):
            task = asyncio.ensure_future(send(client, arrival, index, last.get(arrival.tenant)))
            if arrival.tenant in one_at_a_time:
                last[arrival.tenant] = task
            tasks.append(task)
        return list(await asyncio.gather(*tasks))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)], 2)


def tenant_arrivals(seed: int, duration_s: float) -> list[Arrival]:
    """The tenants part's arrivals over ``duration_s``, or as much longer as it takes the light tenants to send
    ``MIN_LIGHT_REQUESTS``; the light tenants start ``LIGHT_START_S`` after the heavy one."""
    while True:
        plan = arrivals(seed, duration_s, TENANTS)
        if sum(a.tenant.startswith("light") for a in plan) >= MIN_LIGHT_REQUESTS:
            heavy = [a for a in arrivals(seed, duration_s + LIGHT_START_S, TENANTS) if a.tenant == "heavy"]
            light = [dataclasses.replace(a, at=a.at + LIGHT_START_S) for a in plan if a.tenant != "heavy"]
            return sorted(heavy + light, key=lambda a: a.at)
        duration_s += 5


def latency_figures(outcomes: list[Outcome]) -> dict:
    done = [o.latency for o in outcomes if o.status == 200]
    return {"requests": len(outcomes), "ok": len(done), "p50_s": percentile(done, 50), "p95_s": percentile(done, 95),
            "p99_s": percentile(done, 99), "max_s": round(max(done), 2) if done else None,
            "supported": [name for name, needs in PERCENTILE_SUPPORT.items() if len(done) >= needs]}


def slowest(outcomes: list[Outcome], count: int = SLOWEST) -> list[dict]:
    """The slowest answered requests, each with its stages' times (where it waited)."""
    done = sorted((o for o in outcomes if o.status == 200), key=lambda o: o.latency, reverse=True)
    return [_record(o) for o in done[:count]]


def refusal_seconds(outcomes: list[Outcome]) -> list[float]:
    """How soon each refusal (503) came."""
    return [round(o.latency, 3) for o in outcomes if o.status == 503]


def errors(outcomes: list[Outcome]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for outcome in outcomes:
        if outcome.status != 200:
            counts[str(outcome.status)] = counts.get(str(outcome.status), 0) + 1
    return counts


def by_group(outcomes: list[Outcome]) -> dict:
    groups: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        groups.setdefault(outcome.kind, []).append(outcome)
        groups.setdefault(f"{outcome.kind}/{outcome.tenant}", []).append(outcome)
    return {name: latency_figures(group) for name, group in sorted(groups.items())}


def starved(outcomes: list[Outcome], solo_batch_s: float) -> list[dict]:
    """Batch requests slower than 3x solo times (1 + the batch requests still unfinished when they arrived)."""
    batch = [o for o in outcomes if o.kind == "batch" and o.status == 200]
    late = []
    for outcome in batch:
        ahead = sum(1 for other in batch if other.arrived < outcome.arrived < other.finished)
        bound = 3 * solo_batch_s * (1 + ahead)
        if outcome.latency > bound:
            late.append({"arrived_s": round(outcome.arrived, 1), "latency_s": round(outcome.latency, 1),
                         "ahead": ahead, "bound_s": round(bound, 1)})
    return late


def preset(scheduling: str, autoscaling: dict | None = None) -> dict:
    config = yaml.safe_load((REPO / "stage_configs/qwen_image_sim.yaml").read_text())
    config["dit"]["scheduling"] = scheduling
    if autoscaling is not None:
        deployment = config["dit"]["deployment"]
        deployment.pop("num_replicas", None)
        deployment["autoscaling"] = autoscaling
    return config


def dit_stats(served: LocalServe) -> dict:
    import ray
    from ray import serve


    try:
        connect_ray(served.address)
        return serve.get_deployment_handle("DiT", "omni-ray").stats.remote().result()
    finally:
        ray.shutdown()


def solo(base: str, kind: str, repeats: int) -> float:
    """Median latency of the class sent alone, one after another (the first, warming up, not counted)."""
    outcomes = [asyncio.run(replay(base, [Arrival(0, kind, "solo", {**CLASSES[kind], "user": "solo"})]))[0]
                for _ in range(repeats + 1)]
    assert all(o.status == 200 for o in outcomes), outcomes
    return round(statistics.median(o.latency for o in outcomes[1:]), 2)


def scheduling_runs(scheduling: str, scale: float, seeds: list[int]) -> dict:
    """Solo latencies, then each seed's mix, saturated and tenants parts, on one cluster."""
    with LocalServe(REPO / "config.sim.yaml", preset=preset(scheduling), num_cpus=8) as served:
        base = served.base_url
        solo_s = {kind: solo(base, kind, 3 if kind == "interactive" else 2) for kind in CLASSES}
        return {"scheduling": scheduling, "solo_s": solo_s,
                "seeds": {str(seed): seed_runs(served, scale, seed, solo_s) for seed in seeds}}


def seed_runs(served: LocalServe, scale: float, seed: int, solo_s: dict) -> dict:
    base = served.base_url
    result = {}
    before = dit_stats(served)["paused_request_steps"]
    mix = asyncio.run(replay(base, arrivals(seed, 600 * scale, MIX)))
    finished = max(o.finished for o in mix)
    result["mix"] = {
        "duration_s": round(600 * scale), "latency": by_group(mix), "errors": errors(mix),
        "refusal_s": refusal_seconds(mix),
        "throughput_req_s": round(sum(o.status == 200 for o in mix) / finished, 4),
        "refused": sum(o.status == 503 for o in mix),
        "paused_request_steps": dit_stats(served)["paused_request_steps"] - before,
        "starved_batch_requests": starved(mix, solo_s["batch"]),
        "slowest_interactive": slowest([o for o in mix if o.kind == "interactive"]),
        "requests": [_record(o) for o in mix],
    }
    probes = [Arrival(at, "interactive", "probe", {**CLASSES["interactive"], "user": "probe"})
              for at in range(20, int(240 * scale), 10)]
    refusals = [Arrival(120 * scale + i, "batch", "late", {**CLASSES["batch"], "user": "late", "timeout": 30})
                for i in range(5)]
    saturated = asyncio.run(replay(base, sorted(arrivals(seed + 1, 240 * scale, SATURATED) + probes + refusals,
                                                key=lambda a: a.at), probe_kinds=("interactive",)))
    probed = [o for o in saturated if o.probe]
    late = [o for o in saturated if o.tenant == "late"]
    result["saturated"] = {
        "probe": latency_figures(probed),
        "probe_over_solo_p50": _ratio(latency_figures(probed)["p50_s"], solo_s["interactive"]),
        "probe_over_solo_max": _ratio(latency_figures(probed)["max_s"], solo_s["interactive"]),
        "deadline_requests": [{"status": o.status, "seconds": round(o.latency, 3), "retry_after": o.retry_after}
                              for o in late],
        "errors": errors(saturated),  # the deadline requests' included: a 504 there is a promise broken
        "refusal_s": refusal_seconds(saturated),
        "slowest_probes": slowest(probed),
    }
    tenants = asyncio.run(replay(base, tenant_arrivals(seed + 2, 300 * scale), one_at_a_time=LIGHT_NAMES))
    light_outcomes = [o for o in tenants if o.tenant.startswith("light")]
    light = latency_figures(light_outcomes)
    result["tenants"] = {"latency": by_group(tenants), "light": light, "errors": errors(tenants),
                         "refusal_s": refusal_seconds(tenants),
                         "light_requests": len(light_outcomes),
                         "light_p95_over_solo": _ratio(light["p95_s"], solo_s["interactive"]),
                         "slowest_light": slowest(light_outcomes)}
    return result


def _record(outcome: Outcome) -> dict:
    """The request, and with ``timings`` its first image's milliseconds per stage (``<stage>_queued``: before the
    stage's first step that ran it)."""
    return {"kind": outcome.kind, "tenant": outcome.tenant, "arrived_s": round(outcome.arrived, 2),
            "latency_s": round(outcome.latency, 2), "status": outcome.status,
            "timings_ms": {k: round(v) for k, v in (outcome.timings_ms or {}).items()}}


def _ratio(value: float | None, reference: float) -> float | None:
    return round(value / reference, 2) if value is not None else None


def ramp_run(scale: float, seed: int) -> dict:
    """Interactive load rising to 2x one replica's capacity and falling back, the DiT autoscaling on its work."""
    import ray
    from ray import serve


    autoscaling = {"min_replicas": 1, "max_replicas": 3, "target_queued_work_s": 15, "look_back_period_s": 12,
                   "upscale_delay_s": 3, "downscale_delay_s": 20}
    period = 360 * scale
    peak = 1.36  # twice one replica's interactive capacity

    def rate(at: float) -> float:  # up, hold, down: a trapezoid over the period
        x = at / period
        return 0.15 + (peak - 0.15) * max(0.0, min(1.0, 3 * x, 3 * (1 - x)))

    rng = random.Random(seed)
    plan, at = [], 0.0
    while at < period:  # thinning: Poisson arrivals at the time-varying rate
        at += rng.expovariate(peak)
        if rng.random() < rate(at) / peak:
            plan.append(Arrival(at, "interactive", "A", {**CLASSES["interactive"], "user": "A"}))
    samples = []
    with LocalServe(REPO / "config.sim.yaml", preset=preset("priority", autoscaling), num_cpus=8) as served:
        connect_ray(served.address)
        try:
            started = time.monotonic()

            def sample() -> dict:
                status = serve.status().applications["omni-ray"].deployments["DiT"]
                try:
                    work = total(scrape(served.metrics_url), "ray_omni_dit_queued_work_seconds")
                except OSError:
                    work = None
                return {"t": round(time.monotonic() - started, 1), "replicas": status.replica_states.get("RUNNING", 0),
                        "queued_work_s": round(work, 1) if work is not None else None}

            async def watch(stop: asyncio.Event) -> None:
                while not stop.is_set():
                    samples.append(await asyncio.to_thread(sample))
                    await asyncio.sleep(1.0)

            async def run() -> list[Outcome]:
                stop = asyncio.Event()
                watcher = asyncio.create_task(watch(stop))
                outcomes = await replay(served.base_url, plan)
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and (not samples or samples[-1]["replicas"] > 1):
                    await asyncio.sleep(1.0)  # the scale-down after the load
                stop.set()
                await watcher
                return outcomes

            outcomes = asyncio.run(run())
        finally:
            ray.shutdown()
    return {
        "autoscaling": autoscaling, "period_s": round(period), "peak_rate_req_s": peak, "requests": len(plan),
        "latency": latency_figures(outcomes), "errors": errors(outcomes),
        "max_replicas_seen": max(s["replicas"] for s in samples), "final_replicas": samples[-1]["replicas"],
        "samples": samples, "finishes": [[round(o.finished, 1), round(o.latency, 2)] for o in outcomes],
    }


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"fifo": "tab:gray", "priority": "tab:blue"}
    ramp = result.get("ramp")
    fig, grid = plt.subplots(2 if ramp else 1, 3, figsize=(17, 9.2 if ramp else 4.6), squeeze=False)
    axes = list(grid[0])
    runs = {run["scheduling"]: run for run in result["runs"]}
    seeds = list(result["checks"]["by_seed"])
    groups = [(seed, kind) for seed in seeds for kind in ("interactive", "batch")]
    for offset, (name, run) in enumerate(runs.items()):
        xs = [i + 0.38 * offset for i in range(len(groups))]
        axes[0].bar(xs, [run["seeds"][seed]["mix"]["latency"][kind]["p99_s"] or 0 for seed, kind in groups],
                    width=0.36, alpha=0.35, color=colours[name], label=f"{name} p99")
        axes[0].bar(xs, [run["seeds"][seed]["mix"]["latency"][kind]["p50_s"] or 0 for seed, kind in groups],
                    width=0.36, color=colours[name], label=f"{name} p50")
    axes[0].set_xticks([i + 0.19 for i in range(len(groups))], [f"{kind}\nseed {seed}" for seed, kind in groups],
                       fontsize=7)
    axes[0].set_ylabel("latency (s)")
    axes[0].set_title("mix: latency by class and seed")
    axes[0].legend(fontsize=8)
    figures = [("interactive p99\n/ FIFO's", "interactive_p99_vs_fifo", 0.5),
               ("priority 0 saturated\nmax / solo", "priority0_under_saturation_over_solo", 1.3),
               ("light tenants\np95 / solo", "light_tenant_p95_over_solo", 1.5)]
    for i, (label, name, bar) in enumerate(figures):
        for k, seed in enumerate(seeds):
            value = result["checks"]["by_seed"][seed][name] or 0
            x = i + 0.25 * k
            axes[1].bar(x, value, width=0.23, color=f"C{k}", label=f"seed {seed}" if i == 0 else None)
            axes[1].text(x, value, f"{value:.2f}", ha="center", va="bottom", fontsize=7)
        axes[1].hlines(bar, i - 0.15, i + 0.25 * len(seeds) - 0.1, colors="black", linestyles="dashed")
    axes[1].set_xticks([i + 0.25 for i in range(len(figures))], [label for label, _, _ in figures], fontsize=8)
    axes[1].set_title("priority scheduling: figures per seed (dashed: the bar)")
    axes[1].legend(fontsize=8)
    slow = [r for seed in seeds for r in runs["priority"]["seeds"][seed]["tenants"]["slowest_light"]]
    slow = sorted(slow, key=lambda r: r["latency_s"], reverse=True)[:8]
    stages = ("encoder", "dit", "vae")
    bottoms = [0.0] * len(slow)
    for j, stage in enumerate(stages):
        for part, alpha in (("_queued", 0.4), ("", 1.0)):
            values = [(r["timings_ms"].get(stage, 0) - r["timings_ms"].get(f"{stage}_queued", 0)
                       if not part else r["timings_ms"].get(f"{stage}_queued", 0)) / 1000 for r in slow]
            axes[2].bar(range(len(slow)), values, bottom=bottoms, color=f"C{j}", alpha=alpha,
                        label=f"{stage} {'queued' if part else 'running'}")
            bottoms = [b + v for b, v in zip(bottoms, values)]
    axes[2].scatter(range(len(slow)), [r["latency_s"] for r in slow], color="black", s=10, label="latency")
    axes[2].set_xticks(range(len(slow)), [f"{r['tenant']}\n{r['arrived_s']:.0f}s" for r in slow], fontsize=7)
    axes[2].set_ylabel("seconds")
    axes[2].set_title("priority: the light tenants' slowest requests, by stage")
    axes[2].legend(fontsize=7)
    if ramp:
        for axis in grid[1][1:]:
            axis.set_visible(False)
        axes.append(grid[1][0])
        t = [s["t"] for s in ramp["samples"]]
        axes[3].plot(t, [s["replicas"] for s in ramp["samples"]], label="DiT replicas", color="tab:red")
        twin = axes[3].twinx()
        twin.plot(t, [s["queued_work_s"] or 0 for s in ramp["samples"]], label="queued work (s)", color="tab:green")
        twin.scatter(*zip(*ramp["finishes"]), s=4, label="latency at finish (s)", color="tab:blue")
        twin.set_ylabel("seconds")
        axes[3].set_ylabel("replicas")
        axes[3].set_xlabel("time (s)")
        axes[3].set_title("ramp with autoscaling on queued work")
        axes[3].legend(loc="upper left", fontsize=8)
        twin.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def seed_checks(fifo: dict, new: dict) -> dict:
    """One seed's acceptance figures: the priority scheduling against FIFO's and its solo latencies; every admitted
    request that ran past its deadline (504) and the slowest refusal (503) in either scheduling, the deadline
    requests included."""
    parts = ("mix", "saturated", "tenants")
    refusals = [s for run in (fifo, new) for part in parts for s in run[part]["refusal_s"]]
    return {
        "interactive_p99_vs_fifo": _ratio(new["mix"]["latency"]["interactive"]["p99_s"],
                                          fifo["mix"]["latency"]["interactive"]["p99_s"]),
        "throughput_vs_fifo": _ratio(new["mix"]["throughput_req_s"], fifo["mix"]["throughput_req_s"]),
        "interactive_requests": new["mix"]["latency"]["interactive"]["requests"],
        "starved_batch_requests": len(new["mix"]["starved_batch_requests"]),
        "priority0_under_saturation_over_solo": new["saturated"]["probe_over_solo_max"],
        "light_tenant_p95_over_solo": new["tenants"]["light_p95_over_solo"],
        "light_requests": new["tenants"]["light_requests"],
        "deadline_requests": {name: [r["status"] for r in run["saturated"]["deadline_requests"]]
                              for name, run in (("fifo", fifo), ("priority", new))},
        "admitted_requests_timed_out": sum(run[part]["errors"].get("504", 0) for run in (fifo, new) for part in parts),
        "refusals": len(refusals),
        "slowest_refusal_s": max(refusals, default=None),
    }


WORSE_IS_LOWER = {"throughput_vs_fifo", "interactive_requests", "light_requests"}


def worst(by_seed: dict[str, dict]) -> dict:
    """Each figure's worst over the seeds (the lowest throughput and counts, the highest of the rest)."""
    out = {}
    for name in next(iter(by_seed.values())):
        values = [figures[name] for figures in by_seed.values() if isinstance(figures[name], (int, float))]
        if values:
            out[name] = min(values) if name in WORSE_IS_LOWER else max(values)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "slo.json")
    parser.add_argument("--scale", type=float, default=1.0, help="durations times this (0.3 for a quick look)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="each seed's arrivals in turn")
    parser.add_argument("--no-ramp", action="store_true")
    args = parser.parse_args()
    started = time.monotonic()
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; the stages simulated "
                         "at H200 costs", "scale": args.scale, "seeds": args.seeds,
              "percentile_support": PERCENTILE_SUPPORT, "light_tenants": LIGHT_TENANTS,
              "runs": [scheduling_runs(policy, args.scale, args.seeds) for policy in ("fifo", "priority")]}
    if not args.no_ramp:
        result["ramp"] = ramp_run(args.scale, args.seeds[0])
    fifo, new = result["runs"]
    by_seed = {str(seed): seed_checks(fifo["seeds"][str(seed)], new["seeds"][str(seed)]) for seed in args.seeds}
    if "ramp" in result:
        by_seed[str(args.seeds[0])]["admitted_requests_timed_out"] += result["ramp"]["errors"].get("504", 0)
    result["checks"] = {"by_seed": by_seed, "worst": worst(by_seed)}
    result["wall_s"] = round(time.monotonic() - started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=asdict) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps(result["checks"], indent=1))


if __name__ == "__main__":
    main()
