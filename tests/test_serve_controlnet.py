"""ControlNet served (issue 39): `serve run` on the tiny Qwen-Image preset holding a tiny ControlNet-Union, the
official client sending `control` with base64 images and a multipart form with the images as files, each image
within one level of diffusers' QwenImageControlNetPipeline; bad controls a 400 naming the field."""

import json

import pytest
import yaml
from conftest import REPO

from testing.local_serve import LocalServe
from testing.serving import png, post, within_one_level

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    from omni_ray.checkpoints.tiny import write_controlnet

    preset = yaml.safe_load((REPO / "stage_configs" / "qwen_image_tiny.yaml").read_text())
    preset["controlnets"] = {"union": str(write_controlnet(tmp_path_factory.mktemp("controlnet") / "union", tiny_dir,
                                                           seed=1))}
    with LocalServe(REPO / "config.yaml", model=str(tiny_dir), preset=preset) as local:
        yield {"base": local.base_url, "local": local}


def test_controlled_generations_as_json_and_multipart_equal_diffusers(served, tiny_dir):
    """ControlNet served (issue 39): the official client sending `control` with a base64 image (extra_body), and a
    multipart form with the image as a file, each within one level of diffusers' QwenImageControlNetPipeline; an
    unknown controlnet a 400 naming it."""
    import base64

    import openai
    import requests
    from diffusers import QwenImageControlNetModel, QwenImageControlNetPipeline, QwenImagePipeline

    from testing.reference import reference_controlnet, source_image
    from testing.serving import file_bytes

    client = openai.OpenAI(base_url=served["base"] + "/v1", api_key="unused")
    local = served["local"]
    net = QwenImageControlNetModel.from_pretrained(local.preset["controlnets"]["union"])
    reference = QwenImageControlNetPipeline(controlnet=net, **QwenImagePipeline.from_pretrained(tiny_dir).components)
    control_image = source_image(96, 64, seed=9)
    png_file = file_bytes(control_image)
    expected = reference_controlnet(reference, [control_image], 12, prompt="a harbour", num_inference_steps=4,
                                    controlnet_conditioning_scale=0.9)
    control = {"name": "union", "scale": 0.9}
    result = client.images.generate(prompt="a harbour", size="96x64", extra_body={
        "seed": 12, "num_inference_steps": 4, "control": [{**control, "image": base64.b64encode(png_file).decode()}]})
    assert within_one_level(png(result.data[0].b64_json), expected)
    response = requests.post(served["base"] + "/v1/images/generations", timeout=120, data={
        "prompt": "a harbour", "size": "96x64", "seed": "12", "num_inference_steps": "4",
        "control": json.dumps([control])}, files=[("control_image", ("c.png", png_file, "image/png"))])
    assert response.status_code == 200, response.text
    assert within_one_level(png(response.json()["data"][0]["b64_json"]), expected)
    unknown = [{"name": "canny", "image": base64.b64encode(png_file).decode()}]
    status, body = post(served["base"] + "/v1/images/generations", {"prompt": "a harbour", "size": "96x64",
                                                                     "control": unknown})
    assert status == 400 and body["error"]["param"] == "control[0].name", body
