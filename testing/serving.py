"""Helpers for tests of a served app: HTTP calls, decoded images and their comparison with diffusers', the stage
replicas' counters, Prometheus samples, and how an app stops."""

from __future__ import annotations

import base64
import io
import json
import time
import urllib.error
import urllib.request

import numpy as np
import torch
from PIL import Image

from omni_ray.api.client import connect_ray


def post(url: str, body, timeout: float = 300) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()  # json writes NaN as NaN, as some do
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def png(b64: str) -> np.ndarray:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG"
    return np.asarray(image)


def expected(reference, prompt, seed, height, width, steps, negative=None, cfg=4.0):
    image = reference(
        prompt, negative_prompt=negative, true_cfg_scale=cfg, height=height, width=width,
        num_inference_steps=steps, generator=torch.Generator("cpu").manual_seed(seed),
    ).images[0]
    return np.asarray(image)


def within_one_level(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.abs(a.astype(int) - b.astype(int)).max() <= 1


def stage_stats(served) -> dict:
    import ray
    from ray import serve

    try:
        connect_ray(served["address"])
        return {name: serve.get_deployment_handle(name, "omni-ray").stats.remote().result()
                for name in ("Encoder", "DiT", "VAE")}
    finally:
        ray.shutdown()


def replica_stats(address: str, names=("Coordinator", "Encoder", "DiT", "VAE")) -> dict[str, list[dict]]:
    """Every replica's ``stats()`` of each deployment (Serve's broadcast), by deployment name."""
    import ray
    from ray import serve

    try:
        connect_ray(address)
        return {name: serve.get_deployment_handle(name, "omni-ray").broadcast("stats").results(timeout_s=60)
                for name in names}
    finally:
        ray.shutdown()


def assert_stops_within_10_s_leaving_no_vllm_file(served, signum) -> None:
    """vLLM's encoder rendezvouses over loopback TCP, so no /tmp/vllm_dist_* file exists to be left behind,
    however a replica ends; ``signum`` (SIGINT or SIGTERM) stops serve run within 10 s, with status 0 and no stack
    dump."""
    import glob
    import os

    assert not [f for f in glob.glob("/tmp/vllm_dist_*") if os.path.getmtime(f) >= served["local"].started_at]
    process = served["local"].process
    start = time.monotonic()
    process.send_signal(signum)
    process.wait(timeout=30)
    assert time.monotonic() - start < 10
    log = served["local"].log()
    assert process.returncode == 0 and "*** SIGTERM received" not in log, log[-3000:]


def scrape(url: str) -> dict[tuple[str, str], float]:
    """Prometheus text as {(metric name, labels text): value}."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, value = line.rsplit(" ", 1)
        name, _, labels = name_labels.partition("{")
        samples[(name, labels)] = samples.get((name, labels), 0.0) + float(value)
    return samples


def total(samples: dict, name: str, **labels) -> float:
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    return sum(v for (n, found), v in samples.items() if n == name and all(w in found for w in wanted))


def file_bytes(image: Image.Image, format: str = "PNG") -> bytes:
    """A PIL image as the bytes of an image file (an upload)."""
    buffer = io.BytesIO()
    image.save(buffer, format=format)
    return buffer.getvalue()
