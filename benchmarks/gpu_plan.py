"""The GPU plan: five self-contained commands for a lent H100 or H200, each under 9 minutes, each writing its JSON as
each phase ends, so that a command cut short still returns what it measured.

On the GPU machine, through the device tool, from the repository root, with the wheels of ``make gpu-wheels``
carried (``.whl/profile`` for the first command, ``.whl/serve`` for the others; the README says each one's size):

    bash benchmarks/gpu_plan.sh profile      # (a) the machine, then benchmarks.gpu: diffusers' loop against ours
                                             #     eager, compiled and FP8, batch 1-8, 512/1024/1328, kernel classes,
                                             #     the VAE   -> gpu_profile.json have.txt gpu.json gpu.png
    bash benchmarks/gpu_plan.sh serve        # (b) the one-GPU dummy preset served: 1024/50 steps one at a time,
                                             #     512/20 eight at a time, each stage's GPU memory, the coordinator's
                                             #     CPU per image; the same requests in process and through diffusers'
                                             #     pipeline  -> gpu_serve.json app.log
    bash benchmarks/gpu_plan.sh reliability  # (c) 200 mixed requests, the DiT replica killed once: lost requests,
                                             #     GPU memory against its baseline  -> gpu_reliability.json app.log
    bash benchmarks/gpu_plan.sh small_card   # (e) the one-card presets' DiT from a random Q4_0 GGUF file at full size
                                             #     and their banded VAE, on the GPU capped to 24 and 16 GiB: s per
                                             #     image-step at batch 1 and 4 against every block on the card, peak
                                             #     memory; torchao int4 on the bf16 DiT  -> gpu_small_card.json
    bash benchmarks/gpu_plan.sh qwen21       # (d) Qwen-Image 2.1's dummy preset: served latency at 1024x1024 (a
                                             #     generation and an edit), then in process its DiT's first step
                                             #     (which fills the condition cache) against the later ones (which
                                             #     read it), and the cache's bytes  -> gpu_qwen21.json app.log

Each command's JSON starts with the machine (``environment``: the GPU, driver, Python and package versions).
(``gpu_plan.sh`` installs the carried wheels into /tmp/site, then runs ``python3 -m benchmarks.gpu_plan COMMAND --out
$OUT``, its output teed to ``$OUT/COMMAND.log``.) Each JSON lists ``phases_done``, ``phases_skipped`` (a phase that
would have started with less than it needs of ``--budget-s`` left, 480 s by default), ``failed`` (each failed phase
and its error; a failed phase ends the command only when the later ones need it) and ``cut`` (the phase the watchdog
ended at ``--limit-s``, 540 s, stopping the served app first, before the device tool's 600 s would end the command
and leave the cluster holding the GPU). It is replaced atomically, so a command killed mid-write leaves the last
whole one.

``--dry-run`` runs the same phases on the CPU on the tiny checkpoints at toy sizes (the profile on Qwen-Image's
full-size configs at one block): the rehearsal in the suite (tests/test_gpu_plan.py), which proves each command writes
every file it promises, and that a command cut by its limit (``--limit-s``) still leaves the phases it finished.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.metadata
import json
import os
import pathlib
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import yaml

REPO = pathlib.Path(__file__).resolve().parent.parent
PRESETS = REPO / "stage_configs"
SERVE_CONFIG = REPO / "config.yaml"
PACKAGES = ("torch", "transformers", "diffusers", "ray", "pydantic", "fastapi", "torchao", "numpy", "safetensors")
# What each command imports of the carried wheels (tools/gpu_wheels/): checked first, so a missing one is named.
PROFILE_MODULES = ("diffusers", "pydantic", "matplotlib")
SMALL_CARD_MODULES = ("diffusers", "pydantic", "gguf")
SERVED_MODULES = ("ray.serve", "fastapi", "starlette", "uvicorn", "pydantic", "python_multipart", "diffusers",
                  "opentelemetry.sdk", "psutil", "yaml")
VARIANTS = ("diffusers", "eager", "compiled", "fp8")  # benchmarks.gpu.VARIANTS, without importing torch here
PROMPT = "a lighthouse on a cliff at dusk, photo"
NEGATIVE = "blurry, low quality"


class PhaseFailed(Exception):
    """A required phase failed (its error is in the JSON already): the command ends."""


class Record:
    """One command's JSON, rewritten whole after each phase (atomically: a process killed mid-write leaves the last
    whole file). Times count from ``started_at`` (epoch seconds: when gpu_plan.sh began, its wheels' install
    included). A watchdog ends the command at ``limit_s``, before the device tool's own limit would: it writes the
    JSON naming the phase it cut, runs ``cleanup`` (the served app's cluster, which would outlive a killed command and
    hold the GPU) and exits 124. Without ``limit_s`` there is no watchdog (a Record inside a test's process)."""

    def __init__(self, path: pathlib.Path, command: str, dry_run: bool, budget_s: float, limit_s: float | None = None,
                 started_at: float | None = None):
        self.path = path
        self.started = time.monotonic() - (time.time() - started_at if started_at else 0.0)
        self.budget_s = budget_s
        self.cleanup = None  # set while something outlives this process if it is killed
        self.current: str | None = None
        self.lock = threading.Lock()
        self.data = {"command": command, "dry_run": dry_run, "budget_s": budget_s, "limit_s": limit_s,
                     "phases_done": [], "phases_skipped": [], "failed": [], "cut": None}
        self.save()
        if limit_s is not None:  # the command's process alone: the watchdog ends the process it runs in
            threading.Thread(target=self._watch, args=(limit_s,), daemon=True).start()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def save(self) -> None:
        with self.lock:
            self.data["elapsed_s"] = round(self.elapsed(), 1)
            partial = self.path.with_name(self.path.name + ".partial")
            partial.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
            os.replace(partial, self.path)

    def phase(self, name: str, measure, needs_s: float = 0.0, required: bool = False):
        """Runs ``measure()`` and records what it returns under ``name``, unless less than ``needs_s`` of the budget
        is left (then the phase is skipped). A failure is recorded with its traceback, and raised if the phase is
        ``required`` (the later ones need it); otherwise the command goes on. Returns the figures, or None."""
        if self.data["cut"]:  # the watchdog is ending the command: nothing after its cut is recorded
            return None
        left = self.budget_s - self.elapsed()
        if left < needs_s:
            print(f"[{name}] skipped: {left:.0f} s of the budget left, it needs {needs_s:.0f}", flush=True)
            self.data["phases_skipped"].append(name)
            self.save()
            return None
        print(f"[{name}] at {self.elapsed():.0f} s", flush=True)
        self.current = name
        try:
            result = measure()
            if self.data["cut"]:  # it ended as the watchdog stopped the app: not a figure
                return None
        except Exception as error:
            if self.data["cut"]:
                return None
            self.data["failed"].append({"phase": name, "error": traceback.format_exc(limit=8)[-3000:]})
            self.save()
            print(f"[{name}] failed: {error!r}", flush=True)
            if required:
                raise PhaseFailed(name) from error
            return None
        finally:
            self.current = None
        self.data[name] = result
        self.data["phases_done"].append(name)
        self.save()
        print(f"[{name}] done: {json.dumps(result, default=str)[:600]}", flush=True)
        return result

    def _watch(self, limit_s: float) -> None:
        time.sleep(max(0.0, limit_s - self.elapsed()))
        self.data["cut"] = {"phase": self.current, "at_s": round(self.elapsed(), 1)}
        self.save()
        print(f"[{self.current}] cut at {self.elapsed():.0f} s: the command's limit", flush=True)
        if self.cleanup is not None:
            with contextlib.suppress(Exception):
                self.cleanup()
        os._exit(124)


# ---------------------------------------------------------------------------------------------------------------------
# The machine


def environment(modules: tuple[str, ...] = ()) -> dict:
    """The GPU, its driver, the Python and package versions that ran the command; raises, naming them, if any of
    ``modules`` (what the command needs of the carried wheels) cannot be imported. The GPU is read through
    nvidia-smi: this process takes no CUDA context (its memory) while the served app shares the GPU."""
    import importlib

    import torch

    missing = {}
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 - each missing one is named
            missing[module] = repr(error)
    if missing:
        raise RuntimeError(f"cannot import what the command needs (were the wheels carried?): {missing}")
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap,clocks.max.sm",
                "--format=csv,noheader"])
    return {
        "python": platform.python_version(), "cpus": os.cpu_count(), "cuda_available": torch.cuda.is_available(),
        "torch_cuda": torch.version.cuda, "packages": {name: _version(name) for name in PACKAGES},
        "device": smi.splitlines()[0].split(",")[0].strip() if smi else "cpu", "nvidia_smi": smi,
    }


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(command: list[str]) -> str | None:
    """A command's output, or None where it is missing or fails (nvidia-smi on a CPU machine)."""
    if shutil.which(command[0]) is None:
        return None
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    return result.stdout.strip() if result.returncode == 0 else None


def gpu_memory(pids: dict[str, int]) -> dict:
    """The GPU's memory in use (MiB) and each named process's share, from nvidia-smi; None where it has no figure
    (no nvidia-smi; ``[N/A]`` under some virtualisation; process ids from another namespace). nvidia-smi's own lines
    are kept, so a figure it did not give can still be read."""
    used = _run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"])
    apps = _run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"])
    by_pid = {}
    for line in (apps or "").splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
            by_pid[int(fields[0])] = int(fields[1])
    totals = [_mib(field) for field in used.splitlines()[0].split(",")] if used else [None, None]
    return {"used_mib": totals[0], "total_mib": totals[-1], "apps": apps,
            "by_process_mib": {name: by_pid.get(pid) for name, pid in pids.items()}}


def _mib(text: str) -> int | None:
    return int(text) if text.strip().isdigit() else None


# ---------------------------------------------------------------------------------------------------------------------
# (a) profile


def profile(record: Record, args) -> None:
    from benchmarks import gpu

    def save(report: dict) -> None:  # gpu.json as each variant ends, as gpu_profile.json is after each phase
        partial = args.out / "gpu.json.partial"
        partial.write_text(json.dumps(report, indent=1) + "\n")
        os.replace(partial, args.out / "gpu.json")

    record.phase("environment", lambda: environment(PROFILE_MODULES), required=True)
    record.phase("packages", lambda: _packages(args.out / "have.txt"))
    if args.dry_run:  # one full-width block on the CPU; the compiled variant compiles for the CPU
        settings = {"sizes": [64], "batches": [1, 2], "steps": 2, "text_tokens": 8, "repeats": 1, "num_layers": 1,
                    "profile_sizes": [64]}
    else:
        settings = {"sizes": [512, 1024, 1328], "batches": [1, 2, 4, 8], "steps": 20, "text_tokens": 64,
                    "repeats": 3, "num_layers": 60, "profile_sizes": [1024, 1328]}
    deadline = record.started + record.budget_s - 60  # a phase started later may not end in time

    def dit_and_vae() -> dict:
        report = gpu.run(variants=args.variants, save=save, deadline=deadline, **settings)
        gpu.plot(report, args.out / "gpu.png")
        return {"file": "gpu.json", "skipped": report["skipped"], "fp8_skipped": report["fp8_skipped"]}

    record.phase("dit_and_vae", dit_and_vae)


def _packages(path: pathlib.Path) -> dict:
    """The machine's own ``pip list --format=freeze`` (not the carried wheels on PYTHONPATH), written to ``path``:
    what tools/gpu_machine_have.txt stands in for."""
    own = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    listing = subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True,
                             text=True, timeout=120, env=own).stdout
    path.write_text(listing)
    return {"count": len(listing.splitlines()), "file": path.name}


# ---------------------------------------------------------------------------------------------------------------------
# The served commands


def preset(name: str, dry_run: bool, **changes) -> dict:
    """A shipped preset with the encoder on the transformers runner (vLLM's CUDA wheel cannot travel), each stage's
    section updated by ``changes`` (``dit={"compile": False}``). A rehearsal's tiny preset takes random weights too,
    as the GPU's dummy presets do, so that it runs the same code."""
    data = yaml.safe_load((PRESETS / name).read_text())
    data["encoder"]["runner"] = "transformers"
    if dry_run:
        data["weights"] = "dummy"
    for section, values in changes.items():
        data[section] = {**data.get(section, {}), **values}
    return data


@contextlib.contextmanager
def served_app(record: Record, stage_config: dict, args):
    """The app served on a cluster of this machine (testing.local_serve: `ray start`, `serve run`), started as the
    ``start`` phase; its log kept in ``app.log`` and its cluster stopped however the command ends, the watchdog's cut
    included. On the GPU machine a cluster a cut command left behind is stopped first: it would hold the GPU."""
    import torch

    from testing.local_serve import LocalServe, tool

    if not args.dry_run:  # never on a shared CPU machine: `ray stop --force` ends every cluster there
        subprocess.run([tool("ray"), "stop", "--force"], capture_output=True, timeout=120)
    head_args = [f"--num-gpus={torch.cuda.device_count()}"] if torch.cuda.is_available() else []
    served = LocalServe(SERVE_CONFIG, preset=stage_config, num_cpus=4 if args.dry_run else os.cpu_count(),
                        ready_timeout_s=300 if args.dry_run else 420, head_args=head_args)

    def stop() -> None:
        _keep_log(served, args.out / "app.log")
        served.__exit__(None, None, None)

    record.cleanup = stop
    try:
        before = gpu_memory({})
        record.phase("start", lambda: {**started(served.__enter__()), "gpu_memory_before": before}, required=True)
        yield served
    finally:
        record.cleanup = None
        stop()


def started(served) -> dict:
    ready_s = round(time.time() - served.started_at, 1)
    pids = served.replica_pids()
    return {"ready_s": ready_s, "replicas": pids, "gpu_memory": gpu_memory(pids)}


def _post(base_url: str, path: str, body: bytes, content_type: str, timeout: float = 600) -> tuple[int, dict]:
    from benchmarks.soak import Client

    status, data = Client(base_url).send(path, body, content_type, timeout)
    try:
        return status, json.loads(data)
    except ValueError:
        return status, {"raw": data[:300].decode(errors="replace")}


def closed_loop(served, body: dict, *, concurrency: int, count: int, warmup: int,
                path: str = "/v1/images/generations", files: list[bytes] = ()) -> dict:
    """``warmup`` requests (not counted), then ``count`` requests ``concurrency`` at a time: throughput, latency,
    each stage's time (``timings``), the coordinator's and the HTTP proxy's CPU per image, the GPU's memory."""
    from benchmarks.soak import multipart

    body = {**body, "timings": True}
    if files:
        fields = {k: str(v).lower() if isinstance(v, bool) else v for k, v in body.items()}
        data, content_type = multipart(fields, list(files))
    else:
        data, content_type = json.dumps(body).encode(), "application/json"

    def one(_) -> tuple[float, int, dict]:
        start = time.monotonic()
        try:
            status, answer = _post(served.base_url, path, data, content_type)
        except OSError as error:  # a reset connection or a timeout: the request's answer, counted
            status, answer = 598, {"raw": repr(error)}
        return time.monotonic() - start, status, answer

    run_at_most(one, warmup, concurrency)
    processes = cpu_processes(served)
    cpu_before = {name: _cpu_s(pid) for name, pid in processes.items()}
    start = time.monotonic()
    outcomes = run_at_most(one, count, concurrency)
    wall = time.monotonic() - start
    cpu = {name: _cpu_s(pid) - cpu_before[name] for name, pid in processes.items()}
    ok = [(seconds, answer) for seconds, status, answer in outcomes if status == 200]
    images = sum(len(answer["data"]) for _, answer in ok)
    stages = [item["timings_ms"] for _, answer in ok for item in answer["data"]]
    latencies = sorted(seconds for seconds, _ in ok)
    errors, first_error = {}, None
    for _, status, answer in outcomes:
        if status != 200:
            errors[str(status)] = errors.get(str(status), 0) + 1
            first_error = first_error or json.dumps(answer)[:500]
    return {
        "size": body.get("size"), "steps": body.get("num_inference_steps"), "true_cfg": "negative_prompt" in body,
        "concurrency": concurrency, "requests": count, "ok": len(ok), "errors": errors, "first_error": first_error,
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(ok) / wall, 3), "images_per_s": round(images / wall, 3),
        "latency_s": {"mean": _round(statistics.fmean(latencies)) if latencies else None,
                      "p50": _round(statistics.median(latencies)) if latencies else None,
                      "max": _round(latencies[-1]) if latencies else None, "all": [_round(s) for s in latencies]},
        "stage_ms_mean": {stage: round(statistics.fmean(s[stage] for s in stages), 1)
                          for stage in (stages[0] if stages else {})},
        "cpu_ms_per_image": {name: round(1000 * seconds / images, 1) if images else None
                             for name, seconds in cpu.items()},
        "gpu_memory": gpu_memory(served.replica_pids()),
    }


def run_at_most(call, count: int, concurrency: int) -> list:
    """``call(i)`` for i in 0..count-1 with at most ``concurrency`` running; their results in the order they ended,
    a call that raised as its exception (a connection reset or a timeout is a result too: counted, not lost)."""
    results, lock, issued = [], threading.Lock(), [0]

    def worker():
        while True:
            with lock:
                if issued[0] >= count:
                    return
                i = issued[0]
                issued[0] += 1
            try:
                result = call(i)
            except Exception as error:  # noqa: BLE001 - the caller counts it
                result = error
            with lock:
                results.append(result)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, count))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def cpu_processes(served) -> dict[str, int]:
    """The coordinator replica's process and Serve's HTTP proxy's, by name."""
    import psutil

    pids = {"coordinator": served.replica_pids().get("Coordinator")}
    for process in psutil.process_iter(["cmdline"]):
        if (process.info["cmdline"] or [""])[0].startswith("ray::ProxyActor"):
            pids["http_proxy"] = process.pid
    return {name: pid for name, pid in pids.items() if pid is not None}


def _cpu_s(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def _round(seconds: float) -> float:
    return round(seconds, 3)


def in_process(stage_config: dict, body: dict, count: int) -> dict:
    """The same request ``count`` times (after one warm-up) through the three engines in this process (omni_ray's
    Pipeline, no Ray), one at a time."""
    from omni_ray.config import parse_config
    from omni_ray.pipeline import Pipeline

    free_gib = _gpu_free_gib()
    pipeline = Pipeline(parse_config(stage_config))
    try:
        asyncio.run(pipeline.generate(body))
        latencies = []
        for _ in range(count):
            start = time.monotonic()
            asyncio.run(pipeline.generate(body))
            latencies.append(time.monotonic() - start)
    finally:
        pipeline.shutdown()
        del pipeline
        _free_gpu()
    return {"requests": count, "gpu_free_gib_before": free_gib,
            "latency_s": {"mean": _round(statistics.fmean(latencies)), "all": [_round(s) for s in latencies]}}


def through_diffusers(stage_config: dict, body: dict, count: int) -> dict:
    """The same request through diffusers' ``QwenImagePipeline`` on the preset's checkpoint (its components with
    random weights where the preset's are dummy), ``count`` times after one warm-up."""
    import torch

    from omni_ray import checkpoints
    from omni_ray.config import parse_config

    config = checkpoints.ensure(parse_config(stage_config))
    dtype = getattr(torch, config.dit.dtype)
    device = config.dit.device
    free_gib = _gpu_free_gib()
    pipe = diffusers_pipeline(config.model, config.weights == "dummy", dtype, device)
    width, height = (int(side) for side in body["size"].split("x"))

    def generate(pipe):
        pipe(prompt=body["prompt"], negative_prompt=body.get("negative_prompt"), true_cfg_scale=4.0, width=width,
             height=height, num_inference_steps=body["num_inference_steps"],
             generator=torch.Generator("cpu").manual_seed(0), output_type="np")
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    try:
        generate(pipe)
        latencies = []
        for _ in range(count):
            start = time.monotonic()
            generate(pipe)
            latencies.append(time.monotonic() - start)
    finally:
        del pipe
        _free_gpu()
    return {"requests": count, "gpu_free_gib_before": free_gib,
            "latency_s": {"mean": _round(statistics.fmean(latencies)), "all": [_round(s) for s in latencies]}}


def diffusers_pipeline(model: str, dummy: bool, dtype, device: str):
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from omni_ray.runners.random_weights import random_model

    root = pathlib.Path(model)
    pipe = QwenImagePipeline.from_pretrained(model, dtype=dtype).to(device) if not dummy else QwenImagePipeline(
        FlowMatchEulerDiscreteScheduler.from_pretrained(root / "scheduler"),
        random_model(AutoencoderKLQwenImage, AutoencoderKLQwenImage.load_config(root / "vae"), dtype, device),
        random_model(Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig.from_pretrained(root / "text_encoder"),
                     dtype, device),
        AutoTokenizer.from_pretrained(root / "tokenizer"),
        random_model(QwenImageTransformer2DModel, QwenImageTransformer2DModel.load_config(root / "transformer"),
                     dtype, device),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _free_gpu() -> None:
    """What the last phase in this process held, back to the GPU: compiled code's caches hold their modules."""
    import torch

    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _gpu_free_gib() -> float | None:
    import torch

    return round(torch.cuda.mem_get_info()[0] / 2**30, 1) if torch.cuda.is_available() else None


def serve(record: Record, args) -> None:
    """(b): issue 26's served figures, then the same request in process and through diffusers (the served app gone:
    each of the three holds most of the GPU)."""
    record.phase("environment", lambda: environment(SERVED_MODULES), required=True)
    if args.dry_run:
        stage_config = preset("qwen_image_tiny.yaml", True)
        latency = {"size": "64x64", "num_inference_steps": 2}
        throughput = {"size": "64x64", "num_inference_steps": 2}
    else:
        stage_config = preset("qwen_image_one_gpu_dummy.yaml", False)
        latency = {"size": "1024x1024", "num_inference_steps": 50}
        throughput = {"size": "512x512", "num_inference_steps": 20}
    counts = {"latency": 2, "throughput": 16, "in_process": 2}  # after 1, 8 and 1 not counted
    latency = {"prompt": PROMPT, "negative_prompt": NEGATIVE, "seed": 0, **latency}
    throughput = {"prompt": PROMPT, "negative_prompt": NEGATIVE, "seed": 0, **throughput}
    with served_app(record, stage_config, args) as served:
        record.phase("latency", lambda: closed_loop(served, latency, concurrency=1, count=counts["latency"],
                                                    warmup=1))
        record.phase("throughput", lambda: closed_loop(served, throughput, concurrency=8,
                                                       count=counts["throughput"], warmup=8), needs_s=60)
    record.phase("in_process", lambda: in_process(stage_config, latency, counts["in_process"]), needs_s=180)
    record.phase("diffusers", lambda: through_diffusers(stage_config, latency, counts["in_process"]), needs_s=90)
    served_s = (record.data.get("latency") or {}).get("latency_s", {}).get("mean")
    local_s = (record.data.get("in_process") or {}).get("latency_s", {}).get("mean")
    record.data["served_over_in_process"] = round(served_s / local_s, 3) if served_s and local_s else None
    record.save()


def _keep_log(served, path: pathlib.Path) -> None:
    path.write_text(served.log()[-200_000:])


def reliability(record: Record, args) -> None:
    """(c): 200 mixed requests, 16 at a time, the DiT replica killed with SIGKILL once a third have ended; every
    request must still be answered (invalid ones with their 400), and once the replacement has served, the GPU's
    memory must be back to what it held just before the kill (the dead replica's freed, nothing held twice)."""
    from benchmarks.soak import Client, one_request

    record.phase("environment", lambda: environment(SERVED_MODULES), required=True)
    if args.dry_run:
        stage_config, sizes, count = preset("qwen_image_tiny.yaml", True), ("64x64", "96x64", "64x96"), 40
    else:  # not compiled: the replacement replica is serving sooner
        stage_config = preset("qwen_image_one_gpu_dummy.yaml", False, dit={"compile": False})
        sizes, count = ("512x512", "768x512", "512x768"), 200
    with served_app(record, stage_config, args) as served:
        client = Client(served.base_url)

        def each_stage_runs() -> list[str]:  # four of the mix, none invalid or abandoned: the problems, if any
            answers = [one_request(client, i, "", 600, sizes=sizes) for i in (1, 2, 3, 5)]
            return [problem for _, problem, _ in answers if problem is not None]

        record.phase("baseline", lambda: {"problems": each_stage_runs(), **gpu_memory(served.replica_pids())},
                     required=True)
        requests = record.phase("requests", lambda: kill_once(served, client, count, sizes), required=True)

        def after() -> dict:  # the replacement DiT serving as its predecessor did, then the GPU's memory again
            problems = each_stage_runs()
            time.sleep(0 if args.dry_run else 10)  # the driver frees a killed process's memory
            memory = gpu_memory(served.replica_pids())
            before = requests["gpu_memory_before_kill"]["used_mib"]
            change = memory["used_mib"] - before if memory["used_mib"] is not None and before is not None else None
            return {**memory, "problems": problems, "change_mib": change,
                    "back_to_baseline": abs(change) <= 1024 if change is not None else None}

        record.phase("after", after)


def kill_once(served, client, count: int, sizes: tuple[str, ...]) -> dict:
    """``count`` requests of the soak's mix, 16 at a time; the DiT replica killed once a third have ended."""
    from benchmarks.soak import one_request

    lock, ended, killed = threading.Lock(), [0], {}
    start = time.monotonic()

    def one(i: int):
        outcome = one_request(client, i, "", 900, sizes=sizes)
        with lock:
            ended[0] += 1
            if ended[0] == count // 3:
                killed["gpu_memory_before_kill"] = gpu_memory(served.replica_pids())
                killed["pid"] = served.replica_pids()["DiT"]
                killed["at_s"] = round(time.monotonic() - start, 1)
                os.kill(killed["pid"], signal.SIGKILL)
        return outcome

    outcomes = run_at_most(one, count, 16)
    wall = time.monotonic() - start
    problems = [repr(o) if isinstance(o, Exception) else o[1] for o in outcomes
                if isinstance(o, Exception) or o[1] is not None]
    kinds = {}
    for outcome in outcomes:
        kind = "raised" if isinstance(outcome, Exception) else outcome[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    memory = killed.pop("gpu_memory_before_kill", None)
    return {"requests": count, "answered": len(outcomes) - kinds.get("raised", 0), "lost": len(problems),
            "problems": problems[:20], "kinds": kinds, "wall_s": round(wall, 1), "gpu_memory_before_kill": memory,
            "killed": {**killed, "replaced_by": served.replica_pids().get("DiT")}}


def qwen21(record: Record, args) -> None:
    """(d): Qwen-Image 2.1's dummy preset served at 1024x1024, then its DiT in process: a first step (it fills the
    condition cache) against later ones (they read it), and the cache's bytes."""
    from benchmarks.soak import photo

    record.phase("environment", lambda: environment(SERVED_MODULES), required=True)
    if args.dry_run:
        stage_config, side, steps, count = preset("qwen_image_2_1_tiny.yaml", True), 64, 2, 1
    else:
        stage_config, side, steps, count = preset("qwen_image_2_1_dummy.yaml", False), 1024, 40, 2
    body = {"prompt": PROMPT, "negative_prompt": NEGATIVE, "seed": 0, "size": f"{side}x{side}",
            "num_inference_steps": steps}
    condition = photo(0, side, side)
    with served_app(record, stage_config, args) as served:
        record.phase("generation", lambda: closed_loop(served, body, concurrency=1, count=count, warmup=1))
        record.phase("edit", lambda: closed_loop(served, body, concurrency=1, count=count, warmup=1,
                                                 path="/v1/images/edits", files=[condition]), needs_s=60)
    record.phase("condition_cache", lambda: condition_cache(stage_config, side, steps=4), needs_s=90)


def condition_cache(stage_config: dict, side: int, steps: int) -> dict:
    """Qwen-Image 2.1's DiT in process on one true-CFG request, a generation (a 100-token prompt) and an edit (one
    condition image of ``side``): each step's time, the first (it computes the whole sequence and keeps the
    condition's keys and values) against the later ones (the target's tokens alone), and the cache's bytes."""
    import torch

    from omni_ray import checkpoints
    from omni_ray.config import parse_config
    from omni_ray.families.qwen_image_2_1.denoise import Denoise21Runner
    from omni_ray.families.qwen_image_2_1.facts import vision_slots
    from omni_ray.records import DenoiseParams, Latents, PromptEmbeds

    config = checkpoints.ensure(parse_config(stage_config))
    dtype, device = getattr(torch, config.dit.dtype), config.dit.device
    runner = Denoise21Runner.load(config.model, dtype, device, dummy=config.weights == "dummy")
    context = runner.transformer.config.context_in_dim
    channels = runner.transformer.config.in_channels
    generator = torch.Generator().manual_seed(0)
    image = Latents(torch.randn((side // 16) ** 2, channels, generator=generator), side, side)
    slots = vision_slots(side, side)

    def embeds(images: tuple) -> PromptEmbeds:  # 100 text tokens, then the image's vision tokens
        marked = torch.zeros(100 + slots * len(images), dtype=torch.bool)
        marked[100:] = True
        return PromptEmbeds(torch.randn(len(marked), context, generator=generator), marked if images else None)

    report = {"side": side, "prompt_tokens": 100}
    try:
        for kind, images in (("generation", ()), ("edit", (image,))):
            params = DenoiseParams(side, side, steps, seed=0, true_cfg_scale=4.0, true_cfg=True)
            warm_up = runner.prepare(params, embeds(images), embeds(images), images=images)
            for _ in range(2):  # a first and a later step of the same shapes, so the timed ones find kernels ready
                runner.step([warm_up])
            del warm_up
            state = runner.prepare(params, embeds(images), embeds(images), images=images)
            times = []
            for _ in range(steps):
                _synchronize()
                start = time.perf_counter()
                runner.step([state])
                _synchronize()
                times.append(time.perf_counter() - start)
            first, later = times[0], statistics.fmean(times[1:])
            report[kind] = {"first_step_s": round(first, 4), "later_step_s": round(later, 4),
                            "saving_per_step_s": round(first - later, 4), "cache_bytes": state.cache_bytes,
                            "step_times_s": [round(t, 4) for t in times]}
    finally:
        del runner
        _free_gpu()
    return report


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def small_card(record: Record, args) -> None:
    """(e): the one-card layout's DiT and VAE in this process on a GPU capped, as a 24 and a 16 GB card
    (``torch.cuda.set_per_process_memory_fraction``), at Qwen-Image's full size with random Q4_0 weights in the GGUF
    layout (``checkpoints.gguf.write_random``): each card's preset's blocks kept (all on 24 GiB, 36 on 16), seconds
    per step at 1024x1024 with true CFG for one image and four, the same steps with every block on an uncapped card
    (its compute alone, against which the streamed step's overlap reads), peak memory; torchao's int4 on the bf16
    model (``_dit_int4``: its bytes, steps and distance to bf16); the VAE's banded decode at
    1664x1664 under the card's VAE share; the encoder's weights leaving the card and coming back, as between its turns
    on a shared card (``card``)."""
    from omni_ray.checkpoints import gguf as gguf_file

    record.phase("environment", lambda: environment(SMALL_CARD_MODULES), required=True)
    folder = pathlib.Path(tempfile.mkdtemp(prefix="omni-ray-small-card-"))  # 11 GB at full size: not under $OUT
    if args.dry_run:
        checkpoint, side, vae_side, batches = _tiny_checkpoint(), 64, 128, (1, 2)
        cards = {"24gib": (None, 2), "16gib": (None, 1)}  # the tiny model's two blocks: all kept, or one
    else:
        from omni_ray.checkpoints.dummy import write_dummy_checkpoint

        checkpoint = str(write_dummy_checkpoint(folder / "qwen-image-dummy"))
        side, vae_side, batches = 1024, 1664, (1, 4)
        cards = {"24gib": (24, 60), "16gib": (16, 36)}  # qwen_image_24gb_card.yaml's and qwen_image_16gb_card.yaml's
    try:
        _small_card_phases(record, gguf_file, checkpoint, folder, side, vae_side, batches, cards, args.dry_run)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _small_card_phases(record, gguf_file, checkpoint, folder, side, vae_side, batches, cards, dry_run) -> None:
    weights = record.phase("weights", lambda: _random_gguf(gguf_file, checkpoint, folder), required=True)
    record.phase("dit_uncapped", lambda: _dit_steps(checkpoint, weights["file"], None, None, side, batches),
                 needs_s=90)
    for name, (cap_gib, kept) in cards.items():
        record.phase(f"dit_{name}", lambda c=cap_gib, k=kept: _dit_steps(checkpoint, weights["file"], c, k, side,
                                                                          batches), needs_s=90)
    record.phase("dit_int4", lambda: _dit_int4(checkpoint, side, batches), needs_s=120)
    record.phase("vae_banded", lambda: _vae_banded(checkpoint, None if dry_run else 7.2, vae_side), needs_s=30)
    record.phase("encoder_turns", lambda: _encoder_turns(checkpoint), needs_s=60)


def _tiny_checkpoint() -> str:
    from omni_ray import checkpoints
    from omni_ray.config import load_config

    return checkpoints.ensure(load_config(PRESETS / "qwen_image_tiny.yaml")).model


def _random_gguf(gguf_file, checkpoint, folder: pathlib.Path) -> dict:
    start = time.monotonic()
    path = gguf_file.write_random(checkpoint, folder / "qwen-image-random-Q4_0.gguf")
    return {"file": str(path), "bytes": path.stat().st_size, "write_s": round(time.monotonic() - start, 1)}


def _capped(cap_gib: float | None) -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(1.0 if cap_gib is None else cap_gib * 2**30 / total)
        torch.cuda.reset_peak_memory_stats()


def _dit_steps(checkpoint: str, weights_file: str, cap_gib: float | None, kept: int | None, side: int,
               batches: tuple[int, ...], repeats: int = 2) -> dict:
    """Seconds per step of ``batches`` true-CFG images of ``side``, the DiT from the GGUF file with ``kept`` blocks
    on the card (None: all) under a cap of ``cap_gib``; peak memory; the streamer's copies."""
    import torch

    from benchmarks.gpu import timed
    from omni_ray.families.qwen_image.facts import NUM_BLOCKS
    from omni_ray.records import DenoiseParams, PromptEmbeds
    from omni_ray.runners.denoise import DenoiseRunner

    _capped(cap_gib)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    start = time.monotonic()
    runner = DenoiseRunner.load(checkpoint, dtype, device, weights_file=weights_file,
                                offload_resident=kept if kept is not None and kept < NUM_BLOCKS else None)
    loaded_s = time.monotonic() - start
    dim = runner.transformer.config.joint_attention_dim
    generator = torch.Generator().manual_seed(0)
    rows = {}
    try:
        for batch in batches:
            states = [runner.prepare(DenoiseParams(side, side, 1000, seed=i, true_cfg_scale=4.0, true_cfg=True),
                                     PromptEmbeds(torch.randn(64, dim, generator=generator)),
                                     PromptEmbeds(torch.randn(64, dim, generator=generator))) for i in range(batch)]
            seconds = timed(lambda states=states: runner.step(states), repeats)
            rows[batch] = {"step_s": round(seconds, 3), "s_per_image_step": round(seconds / batch, 3)}
        streamer = runner.streamer
        return {"cap_gib": cap_gib, "kept": kept, "side": side, "load_s": round(loaded_s, 1), "batches": rows,
                "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None,
                "streamed_bytes_per_step": streamer.bytes_per_pass if streamer else 0,
                "fetches": streamer.fetches if streamer else 0}
    finally:
        runner = None  # its weights go back to the GPU before the next phase
        _free_gpu()


def _dit_int4(checkpoint: str, side: int, batches: tuple[int, ...], repeats: int = 2) -> dict:
    """``dit.quantization: int4`` (torchao's tinygemm int4, CUDA only) on the full-size DiT with random bf16 weights
    (``weights: dummy``), uncapped: the quantizing's seconds, the weights' GiB before and after, seconds per step at
    ``side`` with true CFG for ``batches`` images, peak memory, and one step's latents against the bf16 model's from
    the same state (the quantization's error on these weights). Where int4 cannot run (the CPU of a rehearsal) the
    refusal, naming the setting, is the figure."""
    import torch

    from benchmarks.gpu import timed
    from omni_ray.records import DenoiseParams, PromptEmbeds
    from omni_ray.runners.denoise import DenoiseRunner
    from omni_ray.runners.quantization import quantize_int4

    _capped(None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    runner = DenoiseRunner.load(checkpoint, dtype, device, dummy=True)
    dim = runner.transformer.config.joint_attention_dim
    generator = torch.Generator().manual_seed(0)
    embeds = [PromptEmbeds(torch.randn(64, dim, generator=generator)) for _ in range(2 * max(batches))]

    def states(batch: int):
        return [runner.prepare(DenoiseParams(side, side, 1000, seed=i, true_cfg_scale=4.0, true_cfg=True),
                               embeds[2 * i], embeds[2 * i + 1]) for i in range(batch)]

    def one_step():
        (state,) = states(1)
        runner.step([state])
        return state.latents.float()

    try:
        bf16 = one_step()
        before = torch.cuda.memory_allocated() if device == "cuda" else None
        start = time.monotonic()
        try:
            quantized = quantize_int4(runner.transformer)
        except RuntimeError as refusal:
            return {"skipped": str(refusal)}
        _synchronize()
        report = {"linears": quantized, "quantize_s": round(time.monotonic() - start, 1),
                  "weights_gib_before": round(before / 2**30, 2),
                  "weights_gib": round(torch.cuda.memory_allocated() / 2**30, 2)}
        torch.cuda.reset_peak_memory_stats()
        got = one_step()
        report["latents_rel_l2"] = float((got - bf16).norm() / bf16.norm())
        report["batches"] = {}
        for batch in batches:
            batch_states = states(batch)
            seconds = timed(lambda: runner.step(batch_states), repeats)
            report["batches"][batch] = {"step_s": round(seconds, 3), "s_per_image_step": round(seconds / batch, 3)}
        report["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        return report
    finally:
        runner = None
        _free_gpu()


def _vae_banded(checkpoint: str, cap_gib: float | None, side: int) -> dict:
    """The VAE's banded decode of one ``side`` x ``side`` image under ``cap_gib``: seconds and peak memory."""
    import torch

    from benchmarks.gpu import timed
    from omni_ray.records import Latents
    from omni_ray.runners.vae import VaeRunner

    _capped(cap_gib)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    vae = VaeRunner.load(checkpoint, dtype, device, dummy=True, tiling=True)
    latents = Latents(torch.randn((side // 16) ** 2, 64, generator=torch.Generator().manual_seed(0)), side, side)
    try:
        seconds = timed(lambda: vae.decode([latents]), 1)
        return {"cap_gib": cap_gib, "side": side, "decode_s": round(seconds, 3),
                "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None}
    finally:
        vae = None
        _free_gpu()


def _encoder_turns(checkpoint: str, moves: int = 3) -> dict:
    """The encoder's weights (Qwen2.5-VL with random weights, transformers, bf16) leaving the card and coming back
    as between two turns on a shared card (``offload.ParkedWeights``): seconds each way, the GB/s, the memory this
    process keeps on the card while they are away, and one forward after the last return equal to one before."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from omni_ray.runners.offload import ParkedWeights, device_bytes
    from omni_ray.runners.random_weights import random_model

    _capped(None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = Qwen2_5_VLConfig.from_pretrained(pathlib.Path(checkpoint) / "text_encoder")
    model = random_model(Qwen2_5_VLForConditionalGeneration, config, dtype, device).eval()
    ids = torch.arange(16, device=device)[None] % config.text_config.vocab_size
    try:
        with torch.no_grad():
            before = model(input_ids=ids, output_hidden_states=True).hidden_states[-1].float().cpu()
        weights, parked = device_bytes([model]), ParkedWeights([model], device)
        away_s, back_s, reserved_away = [], [], []
        for _ in range(moves):
            _synchronize()
            start = time.monotonic()
            parked.send_away()
            if device == "cuda":
                torch.cuda.empty_cache()
            away_s.append(time.monotonic() - start)
            reserved_away.append(torch.cuda.memory_reserved() if device == "cuda" else device_bytes([model]))
            start = time.monotonic()
            parked.bring()
            _synchronize()
            back_s.append(time.monotonic() - start)
        with torch.no_grad():
            after = model(input_ids=ids, output_hidden_states=True).hidden_states[-1].float().cpu()
        back = min(back_s)
        return {"weights_bytes": weights, "weights_gib": round(weights / 2**30, 2),
                "away_s": [round(t, 3) for t in away_s], "back_s": [round(t, 3) for t in back_s],
                "back_gb_s": round(weights / back / 1e9, 1),
                "kept_while_away_gib": round(max(reserved_away) / 2**30, 3),
                "same_after": bool(torch.equal(before, after))}
    finally:
        model = None
        _free_gpu()


COMMANDS = {"profile": (profile, "gpu_profile.json"), "serve": (serve, "gpu_serve.json"),
            "reliability": (reliability, "gpu_reliability.json"), "qwen21": (qwen21, "gpu_qwen21.json"),
            "small_card": (small_card, "gpu_small_card.json")}
# Every file a command promises under --out (beside its log, which gpu_plan.sh writes): the rehearsal checks them.
PROMISES = {"profile": ("gpu_profile.json", "have.txt", "gpu.json", "gpu.png"),
            "serve": ("gpu_serve.json", "app.log"),
            "reliability": ("gpu_reliability.json", "app.log"),
            "qwen21": ("gpu_qwen21.json", "app.log"),
            "small_card": ("gpu_small_card.json",)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=COMMANDS)
    parser.add_argument("--out", type=pathlib.Path, required=True, help="the folder for the JSON ($OUT there)")
    parser.add_argument("--dry-run", action="store_true", help="the CPU, the tiny checkpoints, toy sizes")
    parser.add_argument("--started-at", type=float, default=None,
                        help="epoch seconds the command began (gpu_plan.sh's start, the wheels' install included)")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="no phase starts that would need more than what is left of this")
    parser.add_argument("--limit-s", type=float, default=540.0,
                        help="the watchdog's cut: the phase running then is named, the app stopped, exit 124")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                        help="profile: which of benchmarks.gpu's variants, in its order (a short lease takes fewer)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    run, name = COMMANDS[args.command]
    record = Record(args.out / name, args.command, args.dry_run, args.budget_s, args.limit_s, args.started_at)
    data = record.data
    try:
        run(record, args)
    except PhaseFailed:
        pass
    except Exception:  # outside any phase: recorded all the same
        data["failed"].append({"phase": None, "error": traceback.format_exc(limit=8)[-3000:]})
        record.save()
        traceback.print_exc()
    print(f"{args.command}: {data['phases_done']} done, {data['phases_skipped']} skipped, "
          f"{[f['phase'] for f in data['failed']]} failed, in {record.elapsed():.0f} s", flush=True)
    return 124 if data["cut"] else 1 if data["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
