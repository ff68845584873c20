"""Load on a running app over HTTP: a mix of real-size requests, closed-loop at a concurrency or open-loop at a rate.

    serve run config.sim.yaml &    # or any app: the simulated preset runs Qwen-Image's real sizes on any machine
    python -m benchmarks.load --url http://127.0.0.1:8000 --concurrency 16 --duration 120 \\
        [--metrics-url http://127.0.0.1:8080/metrics]
    python -m benchmarks.load --url ... --rate 0.5 --duration 120      # open loop: Poisson arrivals, 0.5 req/s

The mix (seeded, so runs compare): sizes 512x512 to 1328x1328 with non-square ones, 8 to 50 steps, true CFG on half,
n=2 on a quarter, a quarter streamed (server-sent events), PNG, every request with ``timings: true``.

Reported: images per second over the measured window (after ``--warmup`` s; requests still running at its end are
not counted), latency p50/p95/p99 of the requests that finished in it, each stage's time queued before its first
step (mean and p95, from the responses' ``queued_ms``), errors by status; with ``--metrics-url`` (the cluster's
Prometheus endpoint) also the coordinator's CPU ms per image and its longest event-loop stall over the window (Ray
exports metrics every 10 s by default; a window of minutes makes the lag small), and apart from the stalls the
longest its loop's thread waited for a CPU held by other processes; beside them, the same watch in an idle process
of its own over the window (``idle_process_event_loop``): what the machine alone does to an event loop, and how much
CPU time a virtual machine's host took from it. JSON (``--out``) and a plot beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from testing.serving import scrape, total

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"

SIZES = ["512x512", "768x768", "1024x1024", "1328x1328", "1328x800", "800x1328", "1024x768", "768x1024"]
STEPS = [8, 20, 30, 50]
SUBJECTS = ["a lighthouse on a cliff at dusk", "a bowl of ramen, steam rising", "a red fox in fresh snow",
            "a street market in Marrakesh", "an astronaut reading in a library", "a glass teapot on a wooden table"]
STAGES = ("encoder", "dit", "vae")


def cpu_steal_s() -> list[float]:
    """Seconds each CPU of this (virtual) machine was kept from running by its hypervisor so far, to 10 ms (Linux's
    /proc/stat; empty elsewhere). A stolen CPU delays whatever thread it runs, the event loop's or a GIL holder's,
    and the thread's own schedstat does not see it."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu") and not line.startswith("cpu ")]
        return [int(fields[8]) / os.sysconf("SC_CLK_TCK") for fields in lines]
    except (OSError, IndexError, ValueError):
        return []


def request_mix(seed: int = 0):
    """An endless, seeded stream of (body, streamed) pairs."""
    rng = random.Random(seed)
    index = 0
    while True:
        body = {"prompt": f"{rng.choice(SUBJECTS)}, photo {index}", "size": rng.choice(SIZES),
                "num_inference_steps": rng.choice(STEPS), "seed": index, "n": 2 if rng.random() < 0.25 else 1,
                "output_format": "png", "timings": True}
        if rng.random() < 0.5:
            body["negative_prompt"] = "blurry, low quality"
        yield body, rng.random() < 0.25
        index += 1


@dataclass
class Outcome:
    started: float
    finished: float
    status: int
    images: int = 0
    queued_ms: list[dict] = field(default_factory=list)  # per image


async def send(client, url: str, body: dict, streamed: bool) -> Outcome:
    started = time.monotonic()
    endpoint = url.rstrip("/") + "/v1/images/generations"
    try:
        if streamed:
            outcome = Outcome(started, 0.0, 200)
            async with client.stream("POST", endpoint, json={**body, "stream": True}) as response:
                outcome.status = response.status_code
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[6:])
                    if event["type"].endswith(".completed"):
                        outcome.images += 1
                        outcome.queued_ms.append(event.get("queued_ms", {}))
                    elif event["type"] == "error":
                        outcome.status = 500 if outcome.status == 200 else outcome.status
            if outcome.images < body["n"] and outcome.status == 200:
                outcome.status = 599  # the stream ended early
        else:
            response = await client.post(endpoint, json=body)
            outcome = Outcome(started, 0.0, response.status_code)
            if response.status_code == 200:
                data = response.json()["data"]
                outcome.images = len(data)
                outcome.queued_ms = [item.get("queued_ms", {}) for item in data]
    except Exception:  # connection reset, timeout: counted as errors
        outcome = Outcome(started, 0.0, 598)
    outcome.finished = time.monotonic()
    return outcome


async def drive(url: str, *, concurrency: int | None, rate: float | None, duration_s: float, warmup_s: float,
                seed: int = 0, metrics_url: str | None = None, timeout_s: float = 1800, api_key: str | None = None):
    """Runs the load; returns every outcome, the measured window (monotonic start, end) and, with ``metrics_url``,
    scrapes taken at the window's start and end (so warm-up, the first calls' set-up, is left out). ``api_key`` for
    a server that takes keys."""
    import httpx

    mix = request_mix(seed)
    start = time.monotonic()
    window = (start + warmup_s, start + warmup_s + duration_s)

    async def scrape_at(at: float) -> dict:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        return await asyncio.to_thread(scrape, metrics_url)

    marks = [asyncio.create_task(scrape_at(at)) for at in window] if metrics_url else []
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, headers=headers) as client:
        if concurrency is not None:
            async def worker() -> None:
                while time.monotonic() < window[1]:
                    outcomes.append(await send(client, url, *next(mix)))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            rng = random.Random(seed + 1)
            tasks = []
            at = start
            while at < window[1]:
                at += rng.expovariate(rate)
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                tasks.append(asyncio.create_task(send(client, url, *next(mix))))
            outcomes = list(await asyncio.gather(*tasks))
    return outcomes, window, [await mark for mark in marks]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _histogram(before: dict, after: dict, name: str) -> dict[float, float]:
    """The coordinator's samples of one histogram between two scrapes, as {bucket bound: count at or below it}."""
    def buckets(samples: dict) -> dict[float, float]:
        counts: dict[float, float] = {}
        for (metric, labels), value in samples.items():
            if metric == f"{name}_bucket" and 'stage="coordinator"' in labels:
                bound = float(labels.split('le="')[1].split('"')[0])  # "+Inf" parses
                counts[bound] = counts.get(bound, 0.0) + value
        return counts

    now, then = buckets(after), buckets(before)
    return {bound: count - then.get(bound, 0.0) for bound, count in now.items()}


def _longest(counts: dict[float, float]) -> tuple[int, float | None, int | None]:
    """Samples, the bucket bound that holds them all in ms (None past the top bound), and how many passed 20 ms."""
    samples = counts.get(float("inf"), 0.0)
    if not samples:
        return 0, None, None
    longest = min(bound for bound, count in counts.items() if count >= samples)
    return int(samples), None if longest == float("inf") else 1000 * longest, int(samples - counts.get(0.02, 0.0))


def coordinator_figures(before: dict, after: dict, images: int) -> dict:
    """The coordinator's CPU ms per image, its longest event-loop stall, and apart from it the longest its loop's
    thread waited for a CPU (both as the histogram's bucket bound that holds every sample), from two scrapes."""
    samples, stall_ms, stalls = _longest(_histogram(before, after, "ray_omni_event_loop_stall_seconds"))
    _, wait_ms, waits = _longest(_histogram(before, after, "ray_omni_event_loop_cpu_wait_seconds"))
    cpu = total(after, "ray_omni_process_cpu_seconds_total", stage="coordinator") - total(
        before, "ray_omni_process_cpu_seconds_total", stage="coordinator")
    return {
        "coordinator_cpu_ms_per_image": round(1000 * cpu / images, 1) if images else None,
        "event_loop_samples": samples,
        # None when a stall passed the histogram's top bound (or nothing was sampled)
        "event_loop_stall_max_ms_at_most": stall_ms,
        "event_loop_stalls_over_20ms": stalls,
        "event_loop_cpu_wait_max_ms_at_most": wait_ms,
        "event_loop_cpu_waits_over_20ms": waits,
    }


def summarize(outcomes: list[Outcome], window: tuple[float, float]) -> dict:
    start, end = window
    measured = [o for o in outcomes if start <= o.finished <= end]
    ok = [o for o in measured if o.status == 200]
    latencies = [o.finished - o.started for o in ok]
    images = sum(o.images for o in ok)
    queued = {stage: [q[stage] for o in ok for q in o.queued_ms if stage in q] for stage in STAGES}
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.status != 200:
            errors[str(o.status)] = errors.get(str(o.status), 0) + 1
    return {
        "window_s": round(end - start, 1),
        "requests": len(ok),
        "images": images,
        "throughput_img_s": round(images / (end - start), 3),
        "p50_s": _round(percentile(latencies, 50)),
        "p95_s": _round(percentile(latencies, 95)),
        "p99_s": _round(percentile(latencies, 99)),
        "queued_ms": {stage: {"mean": _round(statistics.fmean(v)) if v else None, "p95": _round(percentile(v, 95))}
                      for stage, v in queued.items()},
        "errors": errors,
        "latencies_s": [round(x, 3) for x in latencies],
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def idle_process_lateness(duration_s: float) -> dict:
    """What the machine does to an event loop that runs nothing: this process's loop, watched as the coordinator's
    is, for ``duration_s``; how often it woke over 20 ms late, and over 20 ms less its wait for a CPU; and how much
    of the machine's CPU time its hypervisor took (``host_steal_share``; 0 on bare metal), with the samples in
    which it surely held one CPU over 20 ms (Linux counts it in ticks of 10 ms: three ticks or more)."""
    from deployments.process import watch_event_loop

    samples: list[tuple[float, float]] = []
    stolen = [cpu_steal_s()]
    start = time.perf_counter()

    def observe(stall: float, wait: float) -> None:
        samples.append((stall, wait))
        stolen.append(cpu_steal_s())

    async def watch() -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(watch_event_loop(observe), duration_s)

    asyncio.run(watch())
    cpu_seconds = (time.perf_counter() - start) * len(stolen[0])
    tick = 1 / os.sysconf("SC_CLK_TCK")
    late = [stall + wait for stall, wait in samples]
    most_stolen = [max((b - a for a, b in zip(before, after)), default=0.0)
                   for before, after in itertools.pairwise(stolen)]
    return {"samples": len(samples), "late_over_20ms": sum(x > 0.02 for x in late),
            "late_max_ms": round(1000 * max(late, default=0.0), 1),
            "stalls_over_20ms": sum(stall > 0.02 for stall, _ in samples),
            "host_steal_share": round((sum(stolen[-1]) - sum(stolen[0])) / cpu_seconds, 3) if cpu_seconds else 0.0,
            "samples_with_over_20ms_stolen": sum(seconds >= 0.02 + tick - 1e-9 for seconds in most_stolen)}


def _idle_process(delay_s: float, duration_s: float) -> subprocess.Popen:
    """Starts ``idle_process_lateness`` over the window in a process of its own; its JSON comes on stdout."""
    code = (f"import json, time; from benchmarks.load import idle_process_lateness; time.sleep({delay_s}); "
            f"print(json.dumps(idle_process_lateness({duration_s})))")
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def run(url: str, *, concurrency: int | None = None, rate: float | None = None, duration_s: float = 120,
        warmup_s: float = 20, metrics_url: str | None = None, seed: int = 0, api_key: str | None = None) -> dict:
    """One load run; the summary (with the coordinator's figures over the window when ``metrics_url`` is given, and
    beside them an idle process's: what the machine alone does to an event loop)."""
    assert (concurrency is None) != (rate is None), "give a concurrency or a rate"
    idle = _idle_process(warmup_s, duration_s) if metrics_url else None
    outcomes, window, scrapes = asyncio.run(drive(url, concurrency=concurrency, rate=rate, duration_s=duration_s,
                                                  warmup_s=warmup_s, seed=seed, metrics_url=metrics_url,
                                                  api_key=api_key))
    result = {"concurrency": concurrency, "rate_req_s": rate, **summarize(outcomes, window)}
    if scrapes:
        result.update(coordinator_figures(*scrapes, result["images"]))
    if idle is not None:
        result["idle_process_event_loop"] = json.loads(idle.communicate(timeout=60)[0])
    return result


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    latencies = sorted(result["latencies_s"])
    left.plot(latencies, [(i + 1) / len(latencies) for i in range(len(latencies))])
    left.set(xlabel="latency (s)", ylabel="share of requests", title=f"{result['throughput_img_s']} img/s")
    stages = list(result["queued_ms"])
    right.bar(stages, [result["queued_ms"][s]["mean"] or 0 for s in stages], label="mean")
    right.bar(stages, [result["queued_ms"][s]["p95"] or 0 for s in stages], alpha=0.4, label="p95")
    right.set(ylabel="queued before first step (ms)", title="time queued per stage")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True, help="the app, e.g. http://127.0.0.1:8000")
    parser.add_argument("--metrics-url", default=None, help="the cluster's Prometheus endpoint (coordinator figures)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--concurrency", type=int, default=None, help="closed loop: requests in flight (default 16)")
    group.add_argument("--rate", type=float, default=None, help="open loop: requests per second (Poisson)")
    parser.add_argument("--duration", type=float, default=120, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=20, help="seconds before the measured window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "load.json"))
    parser.add_argument("--api-key", default=os.environ.get("OMNI_RAY_API_KEY", "").split(",")[0].strip() or None,
                        help="for a server that takes keys (default: OMNI_RAY_API_KEY's first)")
    args = parser.parse_args()
    concurrency = args.concurrency if args.concurrency is not None or args.rate is not None else 16

    from benchmarks.engine_throughput import machine

    result = run(args.url, concurrency=concurrency, rate=args.rate, duration_s=args.duration,
                 warmup_s=args.warmup, metrics_url=args.metrics_url, seed=args.seed, api_key=args.api_key)
    result = {"machine": machine(), "url": args.url, **result}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    shown = {k: v for k, v in result.items() if k != "latencies_s"}
    print(json.dumps(shown, indent=1))


if __name__ == "__main__":
    main()
