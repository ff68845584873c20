"""Qwen-Image 2.1 served: `serve run config.qwen21.yaml` on the tiny 2.1 checkpoint, the official openai client
generating and editing (one and two condition images of different aspect ratios), JSON and streamed, CFG on and
off, n=2, each RGBA image within one level of diffusers' QwenImage21Pipeline; a Qwen-Image field refused with a 400
naming it."""

import time

import openai
import pytest
from conftest import REPO

from omni_ray.api.images import working_size
from omni_ray.config import load_config
from testing.local_serve import LocalServe
from testing.openai_api import conforms
from testing.reference import reference21, source_image
from testing.serving import file_bytes, png, post, stage_stats, within_one_level

pytestmark = pytest.mark.serve

PRESET = REPO / "stage_configs/qwen_image_2_1_tiny.yaml"
SOURCES = [source_image(90, 40, seed=1), source_image(48, 100, seed=2)]


@pytest.fixture(scope="module")
def served(tiny21_dir):
    with LocalServe(REPO / "config.qwen21.yaml", model=str(tiny21_dir)) as local:
        yield {"base": local.base_url, "address": local.address, "metrics": local.metrics_url}


def client_of(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served["base"] + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def client(served):
    return client_of(served)


@pytest.fixture(scope="module")
def config(tiny21_dir):
    return load_config(PRESET, model=str(tiny21_dir))


@pytest.fixture(scope="module")
def reference(tiny21_dir):
    from diffusers import QwenImage21Pipeline

    pipe = QwenImage21Pipeline.from_pretrained(tiny21_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def uploads(count: int) -> list:
    return [(f"in{i}.png", file_bytes(image), "image/png") for i, image in enumerate(SOURCES[:count])]


@pytest.mark.parametrize("negative", [None, "blurry"], ids=["CFG off", "CFG on"])
def test_the_official_client_generates_rgba_images_as_diffusers_does(client, reference, negative):
    extra = {"seed": 4, **({"negative_prompt": negative, "true_cfg_scale": 3.0} if negative else {})}
    result = client.images.generate(model="qwen-image-2.1-tiny", prompt="a lighthouse", n=2, size="64x96",
                                    response_format="b64_json", extra_body=extra)
    conforms("ImagesResponse", result.to_dict())
    assert result.background == "transparent"
    for i, item in enumerate(result.data):
        expected = reference21(reference, 4 + i, prompt="a lighthouse", negative_prompt=negative, height=96, width=64,
                               true_cfg_scale=3.0 if negative else 1.0)
        assert within_one_level(png(item.b64_json), expected), i


@pytest.mark.parametrize("count, negative", [(1, None), (2, "dark")], ids=["1 image, CFG off", "2 images, CFG on"])
def test_the_official_client_edits_with_condition_images_as_diffusers_does(client, reference, config, count,
                                                                            negative):
    extra = {"seed": 6, **({"negative_prompt": negative, "true_cfg_scale": 3.0} if negative else {})}
    result = client.images.edit(image=uploads(count), prompt="paint it at night", n=2, response_format="b64_json",
                                extra_body=extra)
    conforms("ImagesResponse", result.to_dict())
    for i, item in enumerate(result.data):
        pixels = png(item.b64_json)
        assert pixels.shape == (*working_size(SOURCES[count - 1].width, SOURCES[count - 1].height,
                                              config.edit.image_area), 4)
        expected = reference21(reference, 6 + i, images=SOURCES[:count], prompt="paint it at night",
                               negative_prompt=negative, true_cfg_scale=3.0 if negative else 1.0,
                               image_area=config.edit.image_area)
        assert within_one_level(pixels, expected), i


def test_the_official_client_streams_an_edit_with_a_preview(client, reference, config):
    events = list(client.images.edit(image=uploads(2), prompt="snow", stream=True, partial_images=1,
                                      extra_body={"seed": 8}))
    assert [type(event).__name__ for event in events] == ["ImageEditPartialImageEvent", "ImageEditCompletedEvent"]
    expected = reference21(reference, 8, images=SOURCES[:2], prompt="snow", image_area=config.edit.image_area)
    assert within_one_level(png(events[-1].b64_json), expected)


def test_a_qwen_image_field_is_a_400_naming_it(served):
    status, body = post(served["base"] + "/v1/images/generations",
                        {"prompt": "a cat", "cache": {"kind": "teacache", "threshold": 0.3}})
    assert status == 400 and body["error"]["param"] == "cache", body
    status, body = post(served["base"] + "/v1/images/generations", {"prompt": "a cat", "size": "48x64"})
    assert status == 400 and body["error"]["param"] == "size", body


def test_16_concurrent_requests_and_a_client_that_leaves_hold_no_condition_cache_after(served, client):
    """Under load (generations and edits of one and two images, CFG on and off, sent at once) every request is
    answered, the DiT batches them, and once they are done, and a client that hung up mid-run is aborted, no
    condition cache is left held."""
    import concurrent.futures
    import http.client
    import json

    def generate(i):
        extra = {"seed": i, **({"negative_prompt": "dark", "true_cfg_scale": 2.0} if i % 2 else {})}
        return client.images.generate(prompt=f"a harbour at dawn, take {i}", extra_body=extra).data

    def edit(i):
        return client.images.edit(image=uploads(1 + i % 2), prompt=f"add snow, take {i}", extra_body={"seed": i}).data

    def leave():
        host, port = served["base"].removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=1.5)
        body = {"prompt": "a very long request", "size": "256x256", "num_inference_steps": 200}
        try:
            connection.request("POST", "/v1/images/generations", json.dumps(body),
                               {"Content-Type": "application/json"})
            return connection.getresponse().status
        except TimeoutError:
            return None
        finally:
            connection.close()

    before = stage_stats(served)["DiT"]
    with concurrent.futures.ThreadPoolExecutor(17) as pool:
        left = pool.submit(leave)
        answers = list(pool.map(lambda i: generate(i) if i < 8 else edit(i), range(16)))
        assert left.result() is None
    assert all(len(data) == 1 and data[0].b64_json for data in answers)
    deadline = time.monotonic() + 30
    while (dit := stage_stats(served)["DiT"])["running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert dit["running"] == 0 and dit["aborted"] == before["aborted"] + 1
    assert dit["condition_cache"]["bytes"] == 0 and dit["condition_cache"]["budget"] > 0
    batched = {size: count - before["batch_sizes"].get(size, 0) for size, count in dit["batch_sizes"].items()}
    assert any(int(size) > 1 and count > 0 for size, count in batched.items()), dit["batch_sizes"]


def test_the_dashboards_condition_cache_panel_reads_exported_series(served):
    """k8s/grafana-omni-ray.json's Qwen-Image 2.1 panel queries series this app exports (test_serve.py checks the
    others on a Qwen-Image app)."""
    import json
    import re

    from testing.serving import scrape

    dashboard = json.loads((REPO / "k8s" / "grafana-omni-ray.json").read_text())
    queried = {name for panel in dashboard["panels"] if panel["title"].startswith("Qwen-Image 2.1")
               for target in panel["targets"] for name in re.findall(r"ray_omni_\w+", target["expr"])}
    assert queried == {"ray_omni_dit_condition_cache_bytes", "ray_omni_dit_condition_cache_budget_bytes"}
    client_of(served).images.generate(prompt="keep the gauges fresh", extra_body={"seed": 1})
    deadline = time.monotonic() + 30
    while missing := queried - {name for name, _ in scrape(served["metrics"])}:
        assert time.monotonic() < deadline, missing
        time.sleep(1)

