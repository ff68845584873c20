"""A DiT replica as a gang of two ranks (``dit.parallel``) and a VAE replica as a gang of two (``vae.parallel``), in
one app on a real local Ray cluster: the app answers with diffusers' pixels; a DiT rank killed under load fails its
step, the replica ends and Serve replaces it and its gang while every request is retried and none is lost (the VAE's
gang untouched); rank actors die with their replica; a gang no node can hold is refused when the app is built."""

import concurrent.futures
import time
import urllib.error
import urllib.request

import psutil
import pytest
import yaml
from conftest import REPO

from deployments.gang import RANK_ACTOR_PREFIX
from omni_ray.api.client import connect_ray
from testing.local_serve import LocalServe
from testing.serving import expected, png, post, within_one_level

pytestmark = pytest.mark.serve

GANG = {"rank_num_cpus": 0.25, "timeout_s": 30}
DEGREES = {"dit": {"ulysses": 2}, "vae": {"patches": 2}}  # two ranks


def gang_preset(tiny_dir, stages: tuple[str, ...] = ("dit",), **parallel) -> dict:
    preset = yaml.safe_load((REPO / "stage_configs" / "qwen_image_tiny.yaml").read_text())
    preset["model"] = str(tiny_dir)
    preset["encoder"]["runner"] = "transformers"  # starts in seconds; the encoder is not the subject here
    for stage in stages:
        preset[stage]["parallel"] = {**GANG, **DEGREES[stage], **parallel}
    return preset


@pytest.fixture(scope="module")
def served(tiny_dir):
    with LocalServe(REPO / "config.yaml", model=str(tiny_dir), preset=gang_preset(tiny_dir, ("dit", "vae"))) as local:
        connect_ray(local.address, namespace="serve")
        try:
            yield local
        finally:
            import ray

            ray.shutdown()


def rank_names(stage: str) -> list[str]:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(f"{RANK_ACTOR_PREFIX}{stage}:"))


def rank_pids() -> set[int]:
    """Every rank actor's process running on this machine (both stages')."""
    return {p.pid for p in psutil.process_iter(["cmdline"])
            if (p.info["cmdline"] or [""])[0].startswith("ray::RankWorker")}


def stage_rank_pids(stage: str) -> set[int]:
    """The processes of ``stage``'s live rank actors, from the GCS's actor table."""
    from ray._private.state import actors

    return {actor["Pid"] for actor in actors(actor_state_name="ALIVE").values()
            if actor["Name"].startswith(f"{RANK_ACTOR_PREFIX}{stage}:")}


def health(served) -> int:
    try:
        with urllib.request.urlopen(served.base_url + "/health", timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def wait_for(condition, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not (result := condition()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return result


def generate(served, seed: int, steps: int = 4) -> tuple[int, dict]:
    body = {"prompt": f"a lighthouse, variation {seed % 5}", "size": "64x64", "seed": seed,
            "num_inference_steps": steps, **({"negative_prompt": "blurry"} if seed % 2 else {})}
    return post(served.base_url + "/v1/images/generations", body, timeout=300)


def test_a_vae_gang_serves_the_pixels_of_one_rank(served, tiny_dir):
    """``vae.parallel.patches: 2``: the official client's image is within one level of diffusers', as world size
    1's is (tests/test_serve.py; the patches decode itself is bit for bit world size 1's on the CPU,
    tests/test_vae_parallel.py); the VAE replica's two ranks run as rank actors beside the DiT's two."""
    import openai
    from diffusers import QwenImagePipeline

    client = openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused")
    result = client.images.generate(model="qwen-image-tiny", prompt="a lighthouse", size="64x96",
                                    response_format="b64_json",
                                    extra_body={"seed": 5, "num_inference_steps": 2, "negative_prompt": "blurry"})
    assert [name.rsplit(":", 1)[1] for name in rank_names("vae")] == ["rank0", "rank1"]
    assert len(stage_rank_pids("vae")) == 2 and len(rank_pids()) == 4
    assert "vae gang of 2 ranks started" in served.log()
    reference = QwenImagePipeline.from_pretrained(tiny_dir)
    assert within_one_level(png(result.data[0].b64_json), expected(reference, "a lighthouse", 5, 96, 64, 2, "blurry"))


def test_the_gang_serves_diffusers_pixels(served, tiny_dir):
    """The official client's images from the Ulysses gang, with and without true CFG, within one level of
    diffusers' (as world size 1's are, tests/test_serve.py)."""
    import openai
    import ray
    from diffusers import QwenImagePipeline

    client = openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused")
    reference = QwenImagePipeline.from_pretrained(tiny_dir)
    for negative in ("blurry", None):
        result = client.images.generate(model="qwen-image-tiny", prompt="a lighthouse", size="64x64",
                                        response_format="b64_json", extra_body={
                                            "seed": 3, "num_inference_steps": 3,
                                            **({"negative_prompt": negative} if negative else {})})
        assert within_one_level(png(result.data[0].b64_json),
                                expected(reference, "a lighthouse", 3, 64, 64, 3, negative)), negative
    names = rank_names("dit")
    assert [name.rsplit(":", 1)[1] for name in names] == ["rank0", "rank1"] and len(stage_rank_pids("dit")) == 2
    for pid in stage_rank_pids("dit"):  # the replica's runtime environment reaches its ranks: the preset's threads
        assert psutil.Process(pid).environ().get("OMP_NUM_THREADS") == "2"
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    gangs = [g for g in groups if len(g["bundles"]) == 3]  # the DiT's and the VAE's: each replica and its 2 ranks
    assert len(gangs) == 2 and {g["strategy"] for g in gangs} == {"STRICT_PACK"}
    assert all(list(g["bundles"].values()) == [{"CPU": 0.25}] * 3 for g in gangs)


def test_a_killed_rank_loses_no_request_and_serve_replaces_the_gang(served):
    """32 concurrent requests; rank 1 is killed after the first few finish. The step it ran fails, the replica ends
    (``StageDeployment._end_replica``), the request path issues every lost call again, Serve starts a new replica
    and gang."""
    import ray

    old_names, old_pids, vae_pids = rank_names("dit"), stage_rank_pids("dit"), stage_rank_pids("vae")
    finished, killed_after = [], []

    def one(seed):
        outcome = generate(served, seed)
        finished.append(seed)
        return outcome

    def killer():
        wait_for(lambda: len(finished) >= 4, 120)
        victim = next(name for name in old_names if name.endswith(":rank1"))
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        killed_after.append(len(finished))

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(33) as pool:
        kill = pool.submit(killer)
        outcomes = list(pool.map(one, range(32)))
        kill.result(timeout=120)
    elapsed = time.monotonic() - start
    assert killed_after and killed_after[0] < 32  # the rank died with requests in flight
    for status, response in outcomes:
        assert status == 200 and len(response["data"]) == 1, response
    assert wait_for(lambda: health(served) == 200, 60)
    new_names = wait_for(lambda: (names := rank_names("dit")) and set(names).isdisjoint(old_names) and names, 30)
    assert len(new_names) == 2
    assert wait_for(lambda: not (rank_pids() & old_pids) and len(stage_rank_pids("dit")) == 2, 30), (
        old_pids, rank_pids())
    assert stage_rank_pids("vae") == vae_pids  # the VAE's gang is not the DiT's
    log = served.log()
    assert "dit gang broken" in log and "ending this replica" in log and "issuing it again" in log
    retries = [line for line in log.splitlines() if "issuing it again" in line]
    print(f"\n32 requests with a rank killed after {killed_after[0]}: {elapsed:.1f} s, {len(retries)} calls issued "
          f"again, {sum('retry 2' in line for line in retries)} of them twice")


def test_rank_actors_end_with_their_replica(served):
    """The ranks are the replica's children: killing the DiT replica itself takes its gang down, and the new replica
    brings a new one."""
    import ray

    old_pids = stage_rank_pids("dit")
    replica = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].startswith("SERVE_REPLICA::omni-ray#DiT#"))
    ray.kill(ray.get_actor(replica, namespace="serve"), no_restart=True)
    assert wait_for(lambda: not (rank_pids() & old_pids), 30), "the killed replica's ranks outlived it"
    assert wait_for(lambda: health(served) == 200 and len(stage_rank_pids("dit")) == 2, 60)
    assert generate(served, seed=7, steps=2)[0] == 200


def test_a_gang_no_node_can_hold_is_refused_when_the_app_is_built(served, tiny_dir, tmp_path):
    """The cluster's nodes have 4 CPUs: 2 ranks of 3 CPUs beside the replica's quarter would wait for ever."""
    from deployments.app import build_app

    path = tmp_path / "preset.yaml"
    path.write_text(yaml.safe_dump(gang_preset(tiny_dir, rank_num_cpus=3)))
    with pytest.raises(ValueError, match=r"dit\.parallel: a gang of 2 ranks needs 6.25 CPU on one node .*"
                                         r"the largest: 4 CPU"):
        build_app({"stage_config": str(path)})
    path.write_text(yaml.safe_dump(gang_preset(tiny_dir, rank_num_cpus=1.5)))
    assert build_app({"stage_config": str(path)}) is not None  # 3.25 CPUs fit

