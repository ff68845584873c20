"""ControlNet served (issue 39): `serve run` on the tiny Qwen-Image preset holding a tiny ControlNet-Union, the
official client sending `control` with base64 images and a multipart form with the images as files, each image
within one level of diffusers' QwenImageControlNetPipeline; an inpainting ControlNet's control with OpenAI's mask,
as JSON and as a `control_mask` file, within one level of QwenImageControlNetInpaintPipeline; bad controls a 400
naming the field."""

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
    root = tmp_path_factory.mktemp("controlnet")
    preset["controlnets"] = {"union": str(write_controlnet(root / "union", tiny_dir, seed=1)),
                             "inpaint": str(write_controlnet(root / "inpaint", tiny_dir, seed=2, inpaint=True))}
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


def test_inpainting_control_as_json_and_multipart_equals_diffusers(served, tiny_dir):
    import base64

    import numpy as np
    import requests
    from diffusers import QwenImageControlNetInpaintPipeline, QwenImageControlNetModel

    from testing.reference import openai_mask, reference_controlnet_inpaint, source_image
    from testing.serving import file_bytes

    net = QwenImageControlNetModel.from_pretrained(served["local"].preset["controlnets"]["inpaint"])
    reference = QwenImageControlNetInpaintPipeline.from_pretrained(tiny_dir, controlnet=net)
    control_image = source_image(96, 64, seed=3)
    repaint = np.zeros((64, 96), bool)
    repaint[8:40, 30:90] = True
    image_file, mask_file = file_bytes(control_image), openai_mask(repaint)
    expected = reference_controlnet_inpaint(reference, control_image, repaint, 14, prompt="a taxi",
                                            num_inference_steps=4, controlnet_conditioning_scale=1.1)
    fields = {"prompt": "a taxi", "size": "96x64", "seed": 14, "num_inference_steps": 4}
    encoded = {"image": base64.b64encode(image_file).decode(), "mask": base64.b64encode(mask_file).decode()}
    status, body = post(served["base"] + "/v1/images/generations",
                        {**fields, "control": [{"name": "inpaint", "scale": 1.1, **encoded}]})
    assert status == 200, body
    assert within_one_level(png(body["data"][0]["b64_json"]), expected)
    response = requests.post(served["base"] + "/v1/images/generations", timeout=120, data={
        **{k: str(v) for k, v in fields.items()}, "control": json.dumps([{"name": "inpaint", "scale": 1.1}])},
        files=[("control_image", ("c.png", image_file, "image/png")),
               ("control_mask", ("m.png", mask_file, "image/png"))])
    assert response.status_code == 200, response.text
    assert within_one_level(png(response.json()["data"][0]["b64_json"]), expected)
    status, body = post(served["base"] + "/v1/images/generations",
                        {**fields, "control": [{"name": "inpaint", "image": encoded["image"]}]})
    assert status == 400 and body["error"]["param"] == "control[0].mask", body
