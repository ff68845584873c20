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


def test_the_page_generates_with_a_control_image(served, tmp_path):
    """In a headless Chromium: the page's Control section takes a control image (its thumbnail shows, the empty size
    takes its size), names one of another size than the output before sending, shows the server's 400 beside the
    part it names, and generates the image the same request sends over HTTP (within one level); at most
    requests.max_controls (2) ControlNets; it fits a phone's width."""
    import base64

    from testing.browser import browser_page, fits_a_phone, result_size
    from testing.reference import source_image
    from testing.serving import file_bytes

    png_file = file_bytes(source_image(96, 64, seed=9))
    (tmp_path / "edges.png").write_bytes(png_file)
    with browser_page() as page:
        sent = []
        page.on("request", lambda request: sent.append(request.url) if "/v1/" in request.url else None)
        page.goto(served["base"] + "/")
        page.click("#add-control")
        assert page.eval_on_selector("#control-0-name", "select => [...select.options].map(o => o.value)") == ["union"]
        page.click("#add-control")
        assert page.is_disabled("#add-control")  # requests.max_controls: 2
        page.click('[data-field="control[1]"] .remove')
        page.set_input_files("#control-0-image", str(tmp_path / "edges.png"))
        page.wait_for_selector(".control-preview", state="visible")
        page.wait_for_function("document.getElementById('size').value !== ''")
        assert page.input_value("#size") == "96x64"  # the output takes the control image's size

        page.fill("#size", "64x64")
        page.fill("#prompt", "a harbour")
        page.click("#generate")
        page.wait_for_selector('[data-field="control[0].image"] .error:not(:empty)')
        assert "96x64, but the output is 64x64" in page.text_content('[data-field="control[0].image"] .error')
        assert sent == []  # said on the page, not sent
        page.fill("#size", "96x64")
        page.fill("#control-0-scale", "20")
        page.click("#generate")
        page.wait_for_selector('[data-field="control[0].scale"] .error:not(:empty)')  # the server's 400
        assert "control[0].scale" in page.text_content('[data-field="control[0].scale"] .error')
        assert page.text_content('[data-field="control[0].image"] .error') == ""

        page.fill("#control-0-scale", "0.9")
        page.fill("#num_inference_steps", "4")
        page.fill("#seed", "12")
        page.click("#generate")
        assert result_size(page) == (96, 64)
        shown = page.get_attribute(".card img.result", "src").removeprefix("data:image/png;base64,")
        page.screenshot(path=tmp_path / "page-control.png", full_page=True)
        page.set_viewport_size({"width": 390, "height": 844})
        assert fits_a_phone(page)
    control = [{"name": "union", "image": base64.b64encode(png_file).decode(), "scale": 0.9}]
    status, body = post(served["base"] + "/v1/images/generations", {
        "prompt": "a harbour", "size": "96x64", "seed": 12, "num_inference_steps": 4, "true_cfg_scale": 4,
        "control": control})
    assert status == 200, body
    assert within_one_level(png(shown), png(body["data"][0]["b64_json"]))
