"""End to end on a real local Ray cluster: `serve run` on the repository's config.yaml, then HTTP, the openai
client and the Ray-handle client, with pixels checked against diffusers' QwenImagePipeline in this process."""

import base64
import concurrent.futures
import io
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import REPO
from deployments.local import LocalServe

pytestmark = pytest.mark.serve
def post(url: str, body, timeout: float = 300) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
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


@pytest.fixture(scope="module")
def served(tiny_dir):
    """`serve run` on the repository's config.yaml (a free port, the test checkpoint) on a fresh local cluster."""
    with LocalServe(REPO / "config.yaml", model=str(tiny_dir)) as local:
        yield {"base": local.base_url, "address": local.address}


@pytest.fixture(scope="module")
def reference(tiny_dir):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(tiny_dir)


def expected(reference, prompt, seed, height, width, steps, negative=None, cfg=4.0):
    image = reference(
        prompt, negative_prompt=negative, true_cfg_scale=cfg, height=height, width=width,
        num_inference_steps=steps, generator=torch.Generator("cpu").manual_seed(seed),
    ).images[0]
    return np.asarray(image)


def within_one_level(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.abs(a.astype(int) - b.astype(int)).max() <= 1


def test_models_and_health(served):
    with urllib.request.urlopen(served["base"] + "/v1/models") as response:
        assert json.loads(response.read())["data"][0]["id"] == "qwen-image-tiny"
    with urllib.request.urlopen(served["base"] + "/health") as response:
        assert response.status == 200


def test_http_images_match_diffusers_with_seed_per_image(served, reference):
    body = {"prompt": "a lighthouse at sunset", "n": 2, "size": "96x64", "seed": 7, "num_inference_steps": 3,
            "negative_prompt": "blurry", "true_cfg_scale": 4.0, "response_format": "b64_json"}
    status, response = post(served["base"] + "/v1/images/generations", body)
    assert status == 200, response
    assert response["size"] == "96x64" and len(response["data"]) == 2
    for i, item in enumerate(response["data"]):
        pixels = png(item["b64_json"])
        assert pixels.shape == (64, 96, 3)
        assert within_one_level(pixels, expected(reference, body["prompt"], 7 + i, 64, 96, 3, "blurry"))


def test_openai_client(served, reference):
    import openai

    client = openai.OpenAI(base_url=served["base"] + "/v1", api_key="unused")
    result = client.images.generate(
        model="qwen-image-tiny", prompt="a red cat", size="64x64", response_format="b64_json",
        extra_body={"seed": 3, "num_inference_steps": 2},
    )
    pixels = png(result.data[0].b64_json)
    assert within_one_level(pixels, expected(reference, "a red cat", 3, 64, 64, 2))
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(prompt="a red cat", size="65x64")
    assert info.value.param == "size"


def test_python_client_through_ray_and_http(served, reference):
    from omni_ray.client import Client
    from omni_ray.errors import RequestError

    import ray

    try:
        via_ray = Client.ray(address=served["address"]).generate("a red cat", size="64x64", seed=11,
                                                                 num_inference_steps=2)
        with pytest.raises(RequestError, match="n"):
            Client.ray(address=served["address"]).generate("a red cat", n=11)
    finally:
        ray.shutdown()
    via_http = Client.http(served["base"]).generate("a red cat", size="64x64", seed=11, num_inference_steps=2)
    reference_pixels = expected(reference, "a red cat", 11, 64, 64, 2)
    for images in (via_ray, via_http):
        assert images[0].size == (64, 64)
        assert within_one_level(np.asarray(images[0]), reference_pixels)


def test_sixteen_concurrent_requests_complete_and_batch_in_the_dit(served):
    import ray
    from ray import serve

    def one(i):
        body = {"prompt": f"a watercolor of a mountain lake, variation {i}", "size": "64x64", "seed": i,
                "num_inference_steps": 8}
        return post(served["base"] + "/v1/images/generations", body)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert [status for status, _ in results] == [200] * 16
    assert all(png(r["data"][0]["b64_json"]).shape == (64, 64, 3) for _, r in results)
    try:
        ray.init(address=served["address"], log_to_driver=False)
        sizes = serve.get_deployment_handle("DiT", "omni-ray").batch_sizes.remote().result()
    finally:
        ray.shutdown()
    assert max(sizes) > 1, sizes  # steps that advanced several requests at once


def test_invalid_request_is_a_400_naming_the_field(served):
    status, response = post(served["base"] + "/v1/images/generations", {"prompt": "a cat", "size": "64x60"})
    assert status == 400
    assert response["error"]["param"] == "size" and response["error"]["type"] == "invalid_request_error"
    status, response = post(served["base"] + "/v1/images/generations", b"not json")
    assert status == 400 and "JSON" in response["error"]["message"]
