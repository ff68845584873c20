"""LoRA adapters on a served app with two DiT replicas (issue 16): adapters from the preset, and requests routed to
the replica that holds their adapter (Ray Serve's model multiplexing), so each is loaded once."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
import yaml
from conftest import REPO

from testing.local_serve import LocalServe
from testing.lora_files import make_adapter
from testing.serving import scrape, total

pytestmark = pytest.mark.serve  # it starts a local cluster


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def test_requests_go_to_the_dit_replica_that_holds_their_adapter(tiny_dir, tmp_path):
    """Two DiT replicas holding one adapter each (max_loras 1): were requests routed without regard to adapters,
    A and B would evict each other and load again and again; routed by adapter, each is loaded once."""
    preset = yaml.safe_load((REPO / "stage_configs" / "qwen_image_tiny.yaml").read_text())
    preset["dit"]["deployment"]["num_replicas"] = 2
    preset["dit"]["max_loras"] = 1
    preset["loras"] = {name: str(make_adapter(tiny_dir, tmp_path / name, rank=4, seed=seed))
                       for name, seed in (("A", 1), ("B", 2))}
    (tmp_path / "preset.yaml").write_text(yaml.safe_dump(preset))
    serve_config = yaml.safe_load((REPO / "config.yaml").read_text())
    serve_config["applications"][0]["args"]["stage_config"] = str(tmp_path / "preset.yaml")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(serve_config))

    with LocalServe(tmp_path / "config.yaml", model=str(tiny_dir)) as served:
        models = json.loads(urllib.request.urlopen(served.base_url + "/v1/models").read())["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [("qwen-image-tiny", None), ("A", "qwen-image-tiny"),
                                                                  ("B", "qwen-image-tiny")]
        url = served.base_url + "/v1/images/generations"
        body = {"prompt": "a red cat", "size": "64x64", "num_inference_steps": 2}
        for i, model in enumerate(["A", "B"] + ["A", "B", "B", "A"] * 3):
            assert post(url, {**body, "model": model, "seed": i})["data"]
            if i < 2:
                time.sleep(2)  # the replica tells the routers what it holds within a second or so
        deadline = time.monotonic() + 30
        while True:  # the replicas' counters reach the exporter every second
            samples = scrape(served.metrics_url)
            loads = {name: total(samples, "ray_omni_lora_loads_total", adapter=name) for name in "AB"}
            if sum(loads.values()) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert loads == {"A": 1, "B": 1}
        # Ray 2.60 labels a sample with its process (WorkerId), not with Serve's replica tag.
        holders = {labels.split('adapter="')[1][0]: labels.split('WorkerId="')[1].split('"')[0]
                   for (name, labels), value in samples.items() if name == "ray_omni_lora_loads_total" and value}
        assert len(holders) == 2 and holders["A"] != holders["B"]  # one replica holds A, the other B
