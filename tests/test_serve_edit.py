"""Image editing end to end: `serve run config.edit.yaml` on a local Ray cluster, then the openai client's
images.edit, multipart HTTP and the Python client, with pixels checked against diffusers' QwenImageEditPipeline."""

import io
import json

import numpy as np
import pytest
import requests
from conftest import REPO

from omni_ray.config import load_config
from testing.local_serve import LocalServe
from testing.openai_api import conforms
from testing.reference import load_reference, openai_mask, reference_edit, reference_masked, source_image
from testing.serving import assert_stops_within_10_s_leaving_no_vllm_file, png, stage_stats, within_one_level

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def served(edit_dir):
    with LocalServe(REPO / "config.edit.yaml", model=str(edit_dir)) as local:
        yield {"base": local.base_url, "address": local.address, "local": local}


@pytest.fixture(scope="module")
def reference(edit_dir):
    return load_reference(edit_dir)


@pytest.fixture(scope="module")
def image_area(edit_dir):
    return load_config(REPO / "stage_configs/qwen_image_edit_tiny.yaml", model=str(edit_dir)).edit.image_area


def file_bytes(image, format="PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format)
    return buffer.getvalue()


def post_edit(served, fields: dict, files: list | None, **kwargs) -> requests.Response:
    return requests.post(served["base"] + "/v1/images/edits", data=fields, files=files, timeout=300, **kwargs)


def test_the_page_edits_an_uploaded_image(served, tmp_path):
    """Issue 17, in a real headless Chromium on the edit preset: upload a file (its preview shows), type a prompt,
    press Generate, and get the edited image at the upload's working size."""
    from testing.browser import WATCH, browser_page, result_size

    (tmp_path / "photo.png").write_bytes(file_bytes(source_image(180, 100, seed=4)))
    with browser_page() as page:
        page.goto(served["base"] + "/")
        assert page.is_visible("#image")
        page.fill("#prompt", "make the disc blue")
        page.click("#generate")  # no image yet: the error is beside the upload
        page.wait_for_selector('[data-error-for="image"]:not(:empty)')
        page.set_input_files("#image", str(tmp_path / "photo.png"))
        page.wait_for_selector("#image-preview", state="visible")  # once the browser has decoded the file
        page.fill("#num_inference_steps", "4")
        page.evaluate(WATCH)
        page.click("#generate")
        assert result_size(page) == (160, 96)  # 128x128 pixels at 9:5, as the API answers
        assert page.text_content('[data-error-for="image"]') == ""
        assert page.evaluate("window.seen")["previews"] >= 1
        page.screenshot(path=tmp_path / "page-edit.png", full_page=True)


def test_openai_client_edits_an_image(served, reference, image_area):
    import openai

    client = openai.OpenAI(base_url=served["base"] + "/v1", api_key="unused")
    source = source_image(180, 100, seed=4)
    result = client.images.edit(
        model="qwen-image-edit-tiny", image=("photo.png", file_bytes(source), "image/png"),
        prompt="make the disc blue", n=2, response_format="b64_json",
        extra_body={"seed": 21, "num_inference_steps": 3, "negative_prompt": "blurry"},
    )
    assert len(result.data) == 2 and result.size is None  # 160x96 is not among the sizes OpenAI's schema allows
    assert png(result.data[0].b64_json).shape == (96, 160, 3)  # the input's working size: 128x128 pixels at 9:5
    conforms("ImagesResponse", result.to_dict())
    for i, item in enumerate(result.data):
        expected = reference_edit(reference, image_area, source, seed=21 + i, prompt="make the disc blue",
                                  negative_prompt="blurry", true_cfg_scale=4.0, num_inference_steps=3)
        assert within_one_level(png(item.b64_json), expected)
    sized = client.images.edit(image=("photo.jpg", file_bytes(source, "JPEG"), "image/jpeg"), prompt="make it red",
                               size="64x128", extra_body={"num_inference_steps": 2})
    assert png(sized.data[0].b64_json).shape == (128, 64, 3)
    with pytest.raises(openai.BadRequestError) as info:
        client.images.edit(image=("photo.gif", file_bytes(source, "GIF"), "image/gif"), prompt="make it red")
    assert info.value.param == "image" and "GIF" in info.value.message


def test_edit_streams_progress_then_the_image_and_the_python_client_edits(served, reference, image_area):
    import ray

    from omni_ray.api.client import Client

    source = source_image(120, 240, seed=5)
    fields = {"prompt": "make it red", "seed": "3", "num_inference_steps": "3", "stream": "true", "progress": "true"}
    with post_edit(served, fields, [("image", ("in.png", file_bytes(source), "image/png"))], stream=True) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len(b"data: "):]) for line in response.iter_lines() if line.startswith(b"data: ")]
    assert [event["type"] for event in events] == ["image_edit.progress"] * 3 + ["image_edit.completed"]
    assert [event["step"] for event in events[:3]] == [1, 2, 3]
    conforms("ImageEditStreamEvent", events[-1])
    expected = reference_edit(reference, image_area, source, seed=3, prompt="make it red", num_inference_steps=3)
    streamed = png(events[-1]["b64_json"])
    assert within_one_level(streamed, expected)

    via_http = Client.http(served["base"]).edit(source, "make it red", seed=3, num_inference_steps=3)
    try:
        client = Client.ray(address=served["address"])
        via_ray = client.edit(file_bytes(source), "make it red", seed=3, num_inference_steps=3, progress=True)
    finally:
        ray.shutdown()
    for images in (via_http, via_ray):
        assert np.asarray(images[0]).tolist() == streamed.tolist()  # same request, same pixels, however asked

    # Cache acceleration on an edit, as a form field (the client sends it as JSON text).
    cached = Client.http(served["base"]).edit(source, "make it red", seed=3, num_inference_steps=8,
                                              cache={"kind": "teacache", "threshold": 1.5})
    fields = {"prompt": "make it red", "seed": "3", "num_inference_steps": "8", "timings": "true",
              "cache": json.dumps({"kind": "teacache", "threshold": 1.5})}
    with post_edit(served, fields, [("image", ("in.png", file_bytes(source), "image/png"))]) as response:
        item = response.json()["data"][0]
    assert item["dit_passes"]["reused"] > 0 and sum(item["dit_passes"].values()) == 8
    assert np.asarray(cached[0]).tolist() == png(item["b64_json"]).tolist()


def test_served_and_in_process_stages_report_the_same_timings(served, edit_dir):
    """The two implementations of the stage protocol (the deployments' handles, the engines in one process) time a
    request in one place: the same stages, each with the part it queued, for the same edit."""
    import asyncio

    from omni_ray.api.images import load_input_images
    from omni_ray.api.responses import image_stats
    from omni_ray.pipeline import Pipeline

    source = file_bytes(source_image(180, 100, seed=2))
    fields = {"prompt": "make it red", "seed": "3", "num_inference_steps": "2", "timings": "true"}
    with post_edit(served, fields, [("image", ("in.png", source, "image/png"))]) as response:
        item = response.json()["data"][0]
    config = load_config(REPO / "stage_configs/qwen_image_edit_tiny.yaml", model=str(edit_dir))
    config = config.model_copy(update={"encoder": config.encoder.model_copy(update={"runner": "transformers"})})
    pipeline = Pipeline(config)  # transformers' encoder: vLLM would bind this process's threads
    try:
        (image,) = asyncio.run(pipeline.generate({"prompt": "make it red", "seed": 3, "num_inference_steps": 2},
                                                 load_input_images([source], config)))
    finally:
        pipeline.shutdown()
    in_process = image_stats(image.timings, image.dit_passes)
    stages = {"encoder", "vae_encode", "dit", "vae"}
    assert set(item["timings_ms"]) == set(item["queued_ms"]) == stages
    assert set(in_process["timings_ms"]) == set(in_process["queued_ms"]) == stages
    assert all(0 <= in_process["queued_ms"][stage] < in_process["timings_ms"][stage] for stage in stages)


def test_the_official_client_sends_a_mask_and_the_edit_equals_diffusers_edit_inpainting(served, edit_dir, image_area):
    import openai
    from diffusers import QwenImageEditInpaintPipeline
    from PIL import Image

    client = openai.OpenAI(base_url=served["base"] + "/v1", api_key="unused")
    source = source_image(180, 100, seed=6)
    repaint = np.zeros((100, 180), bool)
    repaint[20:70, 90:160] = True
    result = client.images.edit(image=("photo.png", file_bytes(source), "image/png"),
                                mask=("mask.png", openai_mask(repaint), "image/png"), prompt="a blue box", n=2,
                                extra_body={"seed": 4, "num_inference_steps": 4, "strength": 0.75,
                                            "negative_prompt": "blurry"})
    conforms("ImagesResponse", result.to_dict())
    reference = load_reference(edit_dir, pipeline=QwenImageEditInpaintPipeline)
    for i, item in enumerate(result.data):
        expected = reference_masked(reference, source, Image.fromarray(repaint.astype(np.uint8) * 255), seed=4 + i,
                                    image_area=image_area, prompt="a blue box", negative_prompt="blurry",
                                    true_cfg_scale=4.0, num_inference_steps=4, strength=0.75)
        assert within_one_level(png(item.b64_json), expected), i


def multipart_without_image() -> bytes:
    return b"--b\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nmake it red\r\n--b--\r\n"


PHOTO = file_bytes(source_image(180, 100, seed=0))
BAD_EDITS = {
    # name: (fields, files, status, param)
    "no image": ({"prompt": "make it red"}, None, 400, "image"),
    "empty file": ({"prompt": "make it red"}, [("image", ("a.png", b"", "image/png"))], 400, "image"),
    "not an image": ({"prompt": "make it red"}, [("image", ("a.png", b"hello" * 100, "image/png"))], 400, "image"),
    "truncated": ({"prompt": "make it red"}, [("image", ("a.png", PHOTO[: len(PHOTO) // 2], "image/png"))], 400,
                  "image"),
    "GIF": ({"prompt": "make it red"}, [("image", ("a.gif", file_bytes(source_image(64, 64, 0), "GIF"), "image/gif"))],
            400, "image"),
    "too long and thin": ({"prompt": "make it red"}, [("image", ("a.png", file_bytes(source_image(2000, 20, 0)),
                                                                 "image/png"))], 400, "image"),
    "two images": ({"prompt": "make it red"}, [("image[]", ("a.png", PHOTO, "image/png")),
                                               ("image[]", ("b.png", PHOTO, "image/png"))], 400, "image"),
    "image as text": ({"prompt": "make it red", "image": "photo.png"}, [("x", ("x", b"x"))], 400, "image"),
    "mask without alpha": ({"prompt": "make it red"}, [("image", ("a.png", PHOTO, "image/png")),
                                                       ("mask", ("m.png", PHOTO, "image/png"))], 400, "mask"),
    "opaque mask": ({"prompt": "make it red"}, [("image", ("a.png", PHOTO, "image/png")),
                                                ("mask", ("m.png", openai_mask(np.zeros((100, 180), bool)),
                                                          "image/png"))], 400, "mask"),
    "mask of another size": ({"prompt": "make it red"}, [("image", ("a.png", PHOTO, "image/png")),
                                                         ("mask", ("m.png", openai_mask(np.ones((50, 90), bool)),
                                                                   "image/png"))], 400, "mask"),
    "two masks": ({"prompt": "make it red"}, [("image", ("a.png", PHOTO, "image/png")),
                                              ("mask", ("m.png", openai_mask(np.ones((100, 180), bool)), "image/png")),
                                              ("mask", ("n.png", openai_mask(np.ones((100, 180), bool)), "image/png"))],
                  400, "mask"),
    "mask as text": ({"prompt": "make it red", "mask": "m.png"}, [("image", ("a.png", PHOTO, "image/png"))], 400,
                     "mask"),
    "strength without a mask": ({"prompt": "make it red", "strength": "0.5"}, [("image", ("a.png", PHOTO,
                                                                                           "image/png"))], 400,
                                "strength"),
    "strength above 1": ({"prompt": "make it red", "strength": "1.5"}, [("image", ("a.png", PHOTO, "image/png")),
                                                                         ("mask", ("m.png", openai_mask(
                                                                             np.ones((100, 180), bool)),
                                                                             "image/png"))], 400, "strength"),
    "no prompt": ({}, [("image", ("a.png", PHOTO, "image/png"))], 400, "prompt"),
    "blank prompt": ({"prompt": " "}, [("image", ("a.png", PHOTO, "image/png"))], 400, "prompt"),
    "bad n": ({"prompt": "make it red", "n": "two"}, [("image", ("a.png", PHOTO, "image/png"))], 400, "n"),
    "n too large": ({"prompt": "make it red", "n": "11"}, [("image", ("a.png", PHOTO, "image/png"))], 400, "n"),
    "bad size": ({"prompt": "make it red", "size": "65x64"}, [("image", ("a.png", PHOTO, "image/png"))], 400, "size"),
    "bad steps": ({"prompt": "make it red", "num_inference_steps": "0"}, [("image", ("a.png", PHOTO, "image/png"))],
                  400, "num_inference_steps"),
    "unknown field": ({"prompt": "make it red", "colour": "red"}, [("image", ("a.png", PHOTO, "image/png"))], 400,
                      "colour"),
    "repeated field": ({"prompt": ["make it red", "make it blue"]}, [("image", ("a.png", PHOTO, "image/png"))], 400,
                       "prompt"),
    "cache not JSON": ({"prompt": "make it red", "cache": "first_block:0.2"}, [("image", ("a.png", PHOTO, "image/png"))],
                       400, "cache"),
    "bad cache kind": ({"prompt": "make it red", "cache": '{"kind": "fast", "threshold": 0.2}'},
                       [("image", ("a.png", PHOTO, "image/png"))], 400, "cache.kind"),
    "long prompt": ({"prompt": "word " * 1100}, [("image", ("a.png", PHOTO, "image/png"))], 400, "prompt"),
    "oversized": ({"prompt": "make it red"}, [("image", ("a.png", b"\x89PNG" + bytes(21 << 20), "image/png"))], 413,
                  "image"),
}


def test_bad_edits_get_a_4xx_naming_the_field_and_never_reach_a_stage(served):
    before = stage_stats(served)
    for name, (fields, files, status, param) in BAD_EDITS.items():
        response = post_edit(served, fields, files)
        error = response.json()["error"]
        assert (response.status_code, error["param"]) == (status, param), (name, error)
        assert error["message"], name
    not_multipart = requests.post(served["base"] + "/v1/images/edits", json={"prompt": "make it red"}, timeout=60)
    assert not_multipart.status_code == 400 and "multipart/form-data" in not_multipart.json()["error"]["message"]
    headers = {"Content-Type": "multipart/form-data; boundary=b"}
    no_image = requests.post(served["base"] + "/v1/images/edits", data=multipart_without_image(), headers=headers)
    assert no_image.status_code == 400 and no_image.json()["error"]["param"] == "image"
    broken = requests.post(served["base"] + "/v1/images/edits", data=b"--b\r\ngarbage", headers=headers, timeout=60)
    assert broken.status_code == 400, broken.text
    generation = requests.post(served["base"] + "/v1/images/generations", json={"prompt": "a cat"}, timeout=60)
    assert generation.status_code == 400 and "/v1/images/edits" in generation.json()["error"]["message"]
    after = stage_stats(served)
    assert {name: stats["requests"] for name, stats in after.items()} == \
        {name: stats["requests"] for name, stats in before.items()}


def test_ctrl_c_stops_serve_run_within_10_s_and_leaves_no_vllm_file(served):
    """Last in this module: it stops the app, as a person at the terminal does."""
    import signal

    assert_stops_within_10_s_leaving_no_vllm_file(served, signal.SIGINT)
