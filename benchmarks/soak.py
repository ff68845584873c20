"""Soak: thousands of mixed requests on the served app, 16 at a time; nothing lost, no memory growth, no leftovers.

    .venv/bin/python -m benchmarks.soak [--requests 2000] [--edits 500] [--plus-edits 500] [--concurrency 16]
        [--minutes M]   # each phase for M minutes instead of its count (0 skips a phase still)

Three phases, each on a fresh local cluster (``testing.local_serve.LocalServe``):

- ``config.yaml`` (tiny text-to-image preset): text to image with n 1-3, a quarter streamed, a tenth invalid (each
  must be a 400 naming its field) and a twentieth cancelled by the client mid-flight;
- ``config.edit.yaml`` (tiny edit preset): multipart edits of generated photos, a quarter streamed, a tenth invalid,
  a fifth masked (OpenAI's mask, strength 0.4 to 1);
- ``config.edit.yaml`` on the tiny Edit-Plus preset: edits of 1 to 3 photos of three sizes, as the edit phase.

A valid request is lost unless it comes back 200 with all its images (a stream: all its ``completed`` events and no
``error`` event) within its deadline. Every 2 s it samples the resident memory (RSS) of each process of the cluster
that serves (every Serve replica, Serve's proxy and controller, the GCS and the raylet), the part of it in shared
memory (object store pages the process touched: the store's, bounded by it) and the object store. It passes when
nothing was lost, no such process's RSS grew by 50 MB or more after warm-up (the first fifth of the requests, or of
the minutes), and the object store came back to its baseline; the report gives each process's growth over the second
half of the warm samples too (the rise of their least-squares line: a leak keeps growing; a cache filling or the heap
settling does not) and without shared memory. Writes benchmarks/results/soak.json and soak.png.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import pathlib
import threading
import time

import numpy as np

from benchmarks import write_report
from benchmarks.engine_throughput import REPO, RESULTS, machine, save_figure
from omni_ray.api.client import connect_ray

MAX_GROWTH_MB = 50.0
INVALID = [  # (body, the param the 400 must name)
    ({"prompt": ""}, "prompt"),
    ({"prompt": "a cat", "size": "65x64"}, "size"),
    ({"prompt": "a cat", "n": 0}, "n"),
    ({"prompt": "a cat", "num_inference_steps": 500}, "num_inference_steps"),
    ({"prompt": "a cat", "true_cfg_scale": "high"}, "true_cfg_scale"),
    ({"prompt": "a cat", "style": "vivid"}, "style"),
]


class Client:
    """One HTTP request at a time on loopback: JSON, a stream, or a request abandoned after ``hang_up_s``."""

    def __init__(self, base_url: str):
        host, port = base_url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)

    def send(self, path: str, body: bytes, content_type: str, timeout: float, hang_up_s: float | None = None):
        connection = http.client.HTTPConnection(self.host, self.port, timeout=hang_up_s or timeout)
        try:
            connection.request("POST", path, body, {"Content-Type": content_type})
            response = connection.getresponse()
            return response.status, response.read()
        except TimeoutError:
            if hang_up_s is not None:
                return None, b""  # hung up, as a client that went away
            raise
        finally:
            connection.close()


def multipart(fields: dict, images: list[bytes], mask: bytes | None = None) -> tuple[bytes, str]:
    boundary = "soakboundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    files = [("image[]" if len(images) > 1 else "image", image) for image in images] + ([("mask", mask)] if mask
                                                                                          else [])
    for name, data in files:
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="in.png"\r\n'
                     "Content-Type: image/png\r\n\r\n".encode() + data + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def mask(seed: int, width: int = 160, height: int = 112) -> bytes:
    """OpenAI's mask for ``photo``'s size: a PNG, fully transparent in a rectangle."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = np.full((height, width, 4), 255, np.uint8)
    top, left = rng.integers(0, height // 2), rng.integers(0, width // 2)
    pixels[top : top + height // 3, left : left + width // 3, 3] = 0
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="RGBA").save(buffer, format="PNG")
    return buffer.getvalue()


PLUS_SIZES = [(160, 112), (96, 160), (128, 128)]  # an Edit-Plus request's photos: wide, tall, square


def photo(seed: int, width: int = 160, height: int = 112) -> bytes:
    """A small photo-like PNG: gradients and noise."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    pixels = np.stack([x, y, 1 - x * y], axis=-1) * rng.uniform(120, 255, 3) + rng.normal(0, 8, (height, width, 3))
    buffer = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def check(status, data: bytes, n: int, streamed: bool) -> str | None:
    """None when the answer holds all ``n`` images; else what was wrong."""
    if status != 200:
        return f"{status}: {data[:300]!r}"
    if streamed:
        events = [json.loads(line[6:]) for line in data.split(b"\n") if line.startswith(b"data: ")]
        errors = [e for e in events if e["type"] == "error"]
        images = [e["b64_json"] for e in events if e["type"].endswith(".completed")]
        if errors:
            return f"error event: {errors[0]['error']['message'][:300]}"
    else:
        images = [item["b64_json"] for item in json.loads(data)["data"]]
    if len(images) != n or any(not base64.b64decode(b).startswith(b"\x89PNG") for b in images):
        return f"{len(images)} of {n} images"
    return None


TOY_SIZES = ("64x64", "96x64", "64x96")


def one_request(client: Client, i: int, edit: str, timeout: float, sizes: tuple[str, ...] = TOY_SIZES
                ) -> tuple[str, str | None, float]:
    """Request ``i`` of the mix (``edit``: "" for text to image, "edit" or "plus"; a generation's size one of
    ``sizes``): (kind, problem or None, seconds)."""
    start = time.monotonic()
    path = "/v1/images/edits" if edit else "/v1/images/generations"
    if i % 10 == 0:
        body, param = INVALID[i // 10 % len(INVALID)]
        if edit:
            data, content_type = multipart({k: v for k, v in body.items()}, [photo(i)])
        else:
            data, content_type = json.dumps(body).encode(), "application/json"
        status, answer = client.send(path, data, content_type, timeout)
        got = json.loads(answer).get("error", {}).get("param") if answer else None
        return "invalid", None if (status, got) == (400, param) else f"{status} naming {got}", time.monotonic() - start
    n, streamed = 1 + i % 3, i % 4 == 1
    body = {"prompt": f"a quiet harbour, take {i % 11}", "seed": i, "n": n, "num_inference_steps": 2 + i % 5,
            **({"negative_prompt": "blurry"} if i % 2 else {}), **({"stream": True} if streamed else {})}
    if not edit:
        body["size"] = sizes[i % len(sizes)]
    masked = edit == "edit" and i % 5 == 3
    if masked:
        body["strength"] = 0.4 + 0.2 * (i % 4)
    if edit:
        fields = {k: str(v).lower() if isinstance(v, bool) else v for k, v in body.items()}
        images = [photo(i + k, *PLUS_SIZES[(i + k) % 3]) for k in range(1 + i % 3)] if edit == "plus" else [photo(i)]
        data, content_type = multipart(fields, images, mask(i) if masked else None)
    else:
        data, content_type = json.dumps(body).encode(), "application/json"
    if i % 20 == 7:
        status, _ = client.send(path, data, content_type, timeout, hang_up_s=0.2)
        return "cancelled", None, time.monotonic() - start
    status, answer = client.send(path, data, content_type, timeout)
    kind = ("masked " if masked else "") + ("streamed" if streamed else "json")
    return kind, check(status, answer, n, streamed), time.monotonic() - start


def process_label(process) -> str | None:
    """What a cluster process is, by its title: a Serve replica by its deployment ("Coordinator"), Serve's proxy and
    controller, the GCS and the raylet; None for the rest (idle workers, agents, monitors)."""
    cmdline = process.info["cmdline"] or [""]
    if cmdline[0].startswith("ray::ServeReplica:"):  # then "<app>:<deployment>", and ".<method>" while one runs
        return cmdline[0].removeprefix("ray::ServeReplica:").split(":")[1].split(".")[0].split()[0]
    if cmdline[0].startswith(("ray::ProxyActor", "ray::ServeController")):
        return cmdline[0].removeprefix("ray::").split()[0].split(".")[0]
    name = cmdline[0].rsplit("/", 1)[-1]
    return name if name in ("gcs_server", "raylet") else None


class Sampler(threading.Thread):
    """Every ``period_s``: each cluster process's RSS (MB; Serve's replicas, proxy and controller, the GCS and the
    raylet, labelled ``<what> <pid>``), its part in shared memory (the object store's pages it has touched, which
    count in its RSS and are the store's, not the process's) and the object store's bytes, until stopped."""

    def __init__(self, served, period_s: float = 2.0):
        super().__init__(daemon=True)
        self.served, self.period_s = served, period_s
        self.samples: list[dict] = []
        self.done = threading.Event()

    def sample(self) -> dict:
        import psutil

        rss, shmem = {}, {}
        for process in self.served._cluster_processes():
            try:
                process.info = {"cmdline": process.cmdline()}
                if (label := process_label(process)) is not None:
                    memory = process.memory_info()
                    rss[f"{label} {process.pid}"] = memory.rss / 2**20
                    shmem[f"{label} {process.pid}"] = shared_mb(process.pid)
            except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
                pass
        return {"t": time.monotonic(), "rss_mb": rss, "shmem_mb": shmem, "store_bytes": self.served.store_bytes()}

    def run(self) -> None:
        while not self.done.wait(self.period_s):
            self.samples.append(self.sample())


def shared_mb(pid: int) -> float:
    """The part of a process's RSS in shared memory (``RssShmem`` in ``/proc/<pid>/status``, MB)."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssShmem:")) / 1024


def phase(config: str, count: int, concurrency: int, edit: str, timeout: float = 300.0, preset: str | None = None,
          minutes: float = 0.0) -> dict:
    import ray
    import yaml

    from testing.local_serve import LocalServe

    name = f"{config} ({preset})" if preset else config
    print(f"{name}: {f'{minutes:g} minutes of requests' if minutes else f'{count} requests'}, {concurrency} at a time",
          flush=True)
    stage_config = yaml.safe_load((REPO / "stage_configs" / preset).read_text()) if preset else None
    with LocalServe(REPO / config, preset=stage_config) as served:
        connect_ray(served.address)
        try:  # disconnect before LocalServe stops the cluster (`ray stop --force` ends connected drivers too)
            outcomes, elapsed, sampler, warm_at, baseline, end = drive(served, count, concurrency, edit, timeout,
                                                                          minutes)
        finally:
            ray.shutdown()
    return summarize(name, outcomes, elapsed, sampler.samples, warm_at, baseline, end)


def drive(served, count: int, concurrency: int, edit: str, timeout: float, minutes: float = 0.0):
    """Sends the mix while the sampler runs (``count`` requests, or as many as ``minutes`` allow when given), warm
    after the first fifth of them (of the time); waits up to 30 s for the object store to drain."""
    sampler = Sampler(served)
    baseline = sampler.sample()
    sampler.start()
    client = Client(served.base_url)
    start = time.monotonic()
    stop_at = start + 60 * minutes if minutes else None
    warm_at = [start + 12 * minutes if minutes else None]
    lock, next_index, outcomes = threading.Lock(), [0], {}

    def worker():
        while True:
            with lock:
                i = next_index[0]
                if (stop_at is None and i >= count) or (stop_at is not None and time.monotonic() >= stop_at):
                    return
                next_index[0] += 1
            outcome = one_request(client, i, edit, timeout)
            with lock:
                outcomes[i] = outcome
                if stop_at is None and len(outcomes) == max(1, count // 5):
                    warm_at[0] = time.monotonic()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - start
    deadline = time.monotonic() + 30
    while (end := sampler.sample())["store_bytes"] > baseline["store_bytes"] and time.monotonic() < deadline:
        time.sleep(1)
    sampler.done.set()
    sampler.join()
    sampler.samples.append(end)
    return [outcomes[i] for i in sorted(outcomes)], elapsed, sampler, warm_at[0] or start, baseline, end


def trend_mb(points: list[tuple[float, float]]) -> float | None:
    """How much the least-squares line through ``points`` ((seconds, MB)) rises over their span. Endpoints mislead
    where RSS swings: the VAE's allocator takes and gives back 15 MB as its batch sizes change, so two samples can
    differ by 15 MB with no trend; a leak's line keeps rising."""
    if len(points) < 2:
        return None
    t, mb = np.array(points).T
    return round(float(np.polyfit(t, mb, 1)[0] * (t[-1] - t[0])), 1)


def summarize(config, outcomes, elapsed, samples, warm_at, baseline, end) -> dict:
    kinds: dict[str, int] = {}
    for kind, _, _ in outcomes:
        kinds[kind] = kinds.get(kind, 0) + 1
    problems = [(kind, problem) for kind, problem, _ in outcomes if problem is not None]
    latencies = np.array([seconds for kind, problem, seconds in outcomes if kind not in ("invalid", "cancelled")])
    warm = [s for s in samples if s["t"] >= warm_at]
    late = warm[len(warm) // 2:]
    growth, late_growth, private_growth, rss = {}, {}, {}, {}
    for name in sorted({n for s in samples for n in s["rss_mb"]}):
        series = [s["rss_mb"][name] for s in warm if name in s["rss_mb"]]
        growth[name] = round(series[-1] - series[0], 1) if series else None
        late_growth[name] = trend_mb([(s["t"], s["rss_mb"][name]) for s in late if name in s["rss_mb"]])
        private = [s["rss_mb"][name] - s["shmem_mb"].get(name, 0.0) for s in warm if name in s["rss_mb"]]
        private_growth[name] = round(private[-1] - private[0], 1) if private else None
        every = [s["rss_mb"][name] for s in samples if name in s["rss_mb"]]
        rss[name] = {"start": round(every[0], 1), "warm": round(series[0], 1) if series else None,
                     "end": round(every[-1], 1), "max": round(max(every), 1)}
    t0 = samples[0]["t"] if samples else 0.0
    return {
        "config": config,
        "requests": len(outcomes),
        "by_kind": kinds,
        "lost": len(problems),
        "problems": [f"{kind}: {problem}" for kind, problem in problems[:10]],
        "seconds": round(elapsed, 1),
        "requests_per_s": round(len(outcomes) / elapsed, 2),
        "latency_s": {f"p{q}": round(float(np.percentile(latencies, q)), 3) for q in (50, 95, 99)},
        "rss_growth_after_warmup_mb": growth,
        "rss_growth_second_half_mb": late_growth,  # the trend over the second half of the warm samples (a leak's rises)
        "private_growth_after_warmup_mb": private_growth,  # RSS less shared memory (the object store's pages)
        "rss_mb": rss,
        "store_bytes": {"baseline": baseline["store_bytes"], "end": end["store_bytes"]},
        "samples": [{"t": round(s["t"] - t0, 1), "rss_mb": {k: round(v, 1) for k, v in s["rss_mb"].items()},
                     "shmem_mb": {k: round(v, 1) for k, v in s["shmem_mb"].items()},
                     "store_bytes": s["store_bytes"]} for s in samples],
    }


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(report["phases"]), figsize=(6 * len(report["phases"]), 4.5), squeeze=False)
    for ax, phase_report in zip(axes[0], report["phases"]):
        samples = phase_report["samples"]
        for name in sorted({n for s in samples for n in s["rss_mb"]}):
            points = [(s["t"], s["rss_mb"][name]) for s in samples if name in s["rss_mb"]]
            ax.plot(*zip(*points), label=name)
        ax.set_xlabel("seconds")
        ax.set_ylabel("process RSS (MB)")
        ax.set_title(f"{phase_report['config']}: {phase_report['requests']} requests, {phase_report['lost']} lost",
                     fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, report["machine"], path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="mixed requests on config.yaml (0 skips it)")
    parser.add_argument("--edits", type=int, default=500, help="edits on config.edit.yaml (0 skips the phase)")
    parser.add_argument("--plus-edits", type=int, default=500,
                        help="edits of 1 to 3 images on the tiny Edit-Plus preset (0 skips the phase)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--minutes", type=float, default=0.0,
                        help="each phase sends requests for this long instead of its count (its count then only says "
                             "whether it runs); warm-up is its first fifth")
    parser.add_argument("--out", default=str(RESULTS / "soak.json"))
    args = parser.parse_args()
    phases = []
    if args.requests:
        phases.append(phase("config.yaml", args.requests, args.concurrency, edit="", minutes=args.minutes))
    if args.edits:
        phases.append(phase("config.edit.yaml", args.edits, args.concurrency, edit="edit",
                            minutes=args.minutes))
    if args.plus_edits:
        phases.append(phase("config.edit.yaml", args.plus_edits, args.concurrency, edit="plus",
                            preset="qwen_image_edit_plus_tiny.yaml", minutes=args.minutes))
    report = {"machine": machine(), "concurrency": args.concurrency, "minutes": args.minutes,
              "max_growth_mb": MAX_GROWTH_MB, "phases": phases}
    write_report(report, args.out, plot)
    failed = False
    for p in phases:
        grown = {k: v for k, v in p["rss_growth_after_warmup_mb"].items() if v is not None and v >= MAX_GROWTH_MB}
        leftover = p["store_bytes"]["end"] > p["store_bytes"]["baseline"]
        print(f"{p['config']}: {p['requests']} requests {p['by_kind']} in {p['seconds']} s, lost {p['lost']}, "
              f"p50 {p['latency_s']['p50']} s p99 {p['latency_s']['p99']} s; RSS growth after warm-up (MB) "
              f"{p['rss_growth_after_warmup_mb']}, over its second half {p['rss_growth_second_half_mb']}, less shared "
              f"memory {p['private_growth_after_warmup_mb']}; object store {p['store_bytes']}")
        for problem in p["problems"]:
            print("  ", problem)
        failed |= bool(p["lost"] or grown or leftover)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
