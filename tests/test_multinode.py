"""Three Ray nodes on this machine (a head and two worker raylets, each started with `ray start` and a custom
resource), each stage pinned to its own node by the preset: the app serves diffusers' image with the embeddings and
latents passed by reference from node to node."""

import pathlib
import subprocess
import sys

import psutil
import pytest
import yaml
from conftest import REPO

from omni_ray.api.client import connect_ray
from testing.local_serve import LocalServe
from testing.serving import expected, png, post, stage_stats, within_one_level

pytestmark = pytest.mark.serve

PINS = {"encoder": "omni_encoder_node", "dit": "omni_dit_node", "vae": "omni_vae_node"}


@pytest.fixture(scope="module")
def three_nodes(tiny_dir, tmp_path_factory):
    workdir: pathlib.Path = tmp_path_factory.mktemp("multinode")
    preset = yaml.safe_load((REPO / "stage_configs/qwen_image_tiny.yaml").read_text())
    for stage, resource in PINS.items():
        preset[stage]["deployment"]["resources"] = {resource: 1}
    (workdir / "preset.yaml").write_text(yaml.safe_dump(preset))
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["applications"][0]["args"]["stage_config"] = str(workdir / "preset.yaml")
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    # The head holds the encoder (and the coordinator, which needs no resource); a worker each the DiT and the VAE.
    # A process that looks like another cluster's raylet: stopping this cluster must leave it running (`ray stop`
    # would not).
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "--gcs-address=127.0.0.1:1",
                              "--session_dir=/tmp/ray/session_another_cluster"])
    try:
        with LocalServe(workdir / "config.yaml", model=str(tiny_dir), num_cpus=2,
                        head_resources={PINS["encoder"]: 1},
                        workers=[{PINS["dit"]: 1}, {PINS["vae"]: 1}]) as local:
            yield {"base": local.base_url, "address": local.address, "local": local}
            own = local._cluster_processes()
            current = pathlib.Path("/tmp/ray/ray_current_cluster")
            assert current.read_text().strip().endswith(f":{local.gcs_port}")  # `ray start --head` wrote it
        assert not [p for p in own if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], "left running"
        assert not current.exists(), "a stopped cluster's address left for `serve run` to join"
        assert other.poll() is None, "another cluster's process was stopped"
    finally:
        other.kill()


@pytest.fixture(scope="module")
def reference(tiny_dir):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(tiny_dir)


def test_each_stage_runs_on_its_own_node_and_the_image_equals_diffusers(three_nodes, reference):
    import ray

    body = {"prompt": "a lighthouse on a cliff", "negative_prompt": "blurry", "size": "96x64", "seed": 11,
            "num_inference_steps": 3, "n": 2}
    status, response = post(three_nodes["base"] + "/v1/images/generations", body)
    assert status == 200, response
    for index, item in enumerate(response["data"]):
        pixels = png(item["b64_json"])
        assert within_one_level(pixels, expected(reference, body["prompt"], 11 + index, 64, 96, 3, "blurry"))

    stats = stage_stats(three_nodes)
    nodes = {name: s["node_id"] for name, s in stats.items()}
    assert len(set(nodes.values())) == 3, nodes
    assert all(s["requests"] >= 1 for s in stats.values())
    try:
        connect_ray(three_nodes["address"])
        by_resource = {resource: node["NodeID"] for node in ray.nodes() if node["Alive"]
                       for resource in PINS.values() if resource in node["Resources"]}
    finally:
        ray.shutdown()
    assert nodes == {"Encoder": by_resource[PINS["encoder"]], "DiT": by_resource[PINS["dit"]],
                     "VAE": by_resource[PINS["vae"]]}


def test_the_cluster_knows_its_own_processes(three_nodes):
    """What LocalServe stops at exit (the fixture checks that they are gone, and another cluster's process is not)."""
    local = three_nodes["local"]
    own = local._cluster_processes()
    commands = [" ".join(p.cmdline()) for p in own]
    assert sum("/raylet " in command.split("--")[0] + " " for command in commands) == 3  # the head's and 2 workers'
    assert set(local.replica_pids().values()) <= {p.pid for p in own}
    assert not any("session_another_cluster" in command for command in commands)
