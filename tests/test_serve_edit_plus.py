"""Multi-image edits served: `serve run` on the tiny Edit-Plus preset, the official openai client sending
``image=[...]`` (as ``image[]``), JSON and streamed, each image within one level of diffusers'
QwenImageEditPlusPipeline; bad uploads a 400 naming ``image`` before any stage sees them."""

import openai
import pytest
import requests
import yaml
from conftest import REPO

from omni_ray.config import load_config
from testing.local_serve import LocalServe
from testing.openai_api import conforms
from testing.reference import load_reference, reference_edit_plus, source_image
from testing.serving import file_bytes, png, stage_stats, within_one_level

pytestmark = pytest.mark.serve

PRESET = REPO / "stage_configs/qwen_image_edit_plus_tiny.yaml"


@pytest.fixture(scope="module")
def served(edit_plus_dir):
    preset = yaml.safe_load(PRESET.read_text())
    with LocalServe(REPO / "config.edit.yaml", model=str(edit_plus_dir), preset=preset) as local:
        yield {"base": local.base_url, "address": local.address}


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served["base"] + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def reference(edit_plus_dir):
    from diffusers import QwenImageEditPlusPipeline

    return load_reference(edit_plus_dir, pipeline=QwenImageEditPlusPipeline)


@pytest.fixture(scope="module")
def edit(edit_plus_dir):
    return load_config(PRESET, model=str(edit_plus_dir)).edit


SOURCES = [source_image(180, 100, seed=1), source_image(120, 240, seed=2), source_image(150, 150, seed=3)]


def uploads(count: int) -> list:
    return [(f"in{i}.png", file_bytes(image), "image/png") for i, image in enumerate(SOURCES[:count])]


@pytest.mark.parametrize("count, negative", [(2, "blurry"), (3, None)], ids=["2 images, CFG on", "3 images, CFG off"])
def test_the_official_client_edits_several_images_as_diffusers_does(client, reference, edit, count, negative):
    extra = {"seed": 5, "num_inference_steps": 3, **({"negative_prompt": negative} if negative else {})}
    result = client.images.edit(model="qwen-image-edit-plus-tiny", image=uploads(count), prompt="put them together",
                                n=2, response_format="b64_json", extra_body=extra)
    conforms("ImagesResponse", result.to_dict())
    assert len(result.data) == 2 and result.usage.input_tokens_details.image_tokens > 0
    for i, item in enumerate(result.data):
        expected = reference_edit_plus(reference, edit, SOURCES[:count], seed=5 + i, prompt="put them together",
                                       negative_prompt=negative, true_cfg_scale=4.0, num_inference_steps=3)
        assert within_one_level(png(item.b64_json), expected), i


def test_the_official_client_streams_a_multi_image_edit(client, reference, edit):
    events = list(client.images.edit(image=uploads(2), prompt="swap the colours", stream=True, partial_images=1,
                                      extra_body={"seed": 8, "num_inference_steps": 3, "negative_prompt": "dark"}))
    assert [type(event).__name__ for event in events] == ["ImageEditPartialImageEvent", "ImageEditCompletedEvent"]
    expected = reference_edit_plus(reference, edit, SOURCES[:2], seed=8, prompt="swap the colours",
                                   negative_prompt="dark", true_cfg_scale=4.0, num_inference_steps=3)
    assert within_one_level(png(events[-1].b64_json), expected)


def test_bad_uploads_are_a_400_naming_image_and_reach_no_stage(served, client):
    before = stage_stats(served)
    photo = uploads(1)[0]
    for files, message in [
        ([("image[]", photo)] * 4, "at most 3"),
        ([("image[]", photo), ("image[]", ("b.png", b"hello" * 100, "image/png"))], "image 2 of 2"),
        ([("image[]", photo), ("image[]", ("b.png", file_bytes(source_image(2000, 20, 0)), "image/png"))],
         "image 2 of 2"),
    ]:
        response = requests.post(served["base"] + "/v1/images/edits", data={"prompt": "make it red"}, files=files,
                                 timeout=60)
        error = response.json()["error"]
        assert (response.status_code, error["param"]) == (400, "image") and message in error["message"], error
    with pytest.raises(openai.BadRequestError) as info:
        client.images.edit(image=[photo] * 4, prompt="make it red")
    assert info.value.param == "image"
    after = stage_stats(served)
    assert {name: stats["requests"] for name, stats in after.items()} == \
        {name: stats["requests"] for name, stats in before.items()}


def test_the_page_uploads_several_images_in_order(served, tmp_path):
    """In a headless Chromium: the Edit-Plus page takes several files and the result takes the last one's working
    size (a tall second image: 96x192 on the tiny preset), as the API answers."""
    from testing.browser import browser_page, result_size

    paths = []
    for i, image in enumerate(SOURCES[:2]):
        paths.append(str(tmp_path / f"in{i}.png"))
        image.save(paths[-1])
    with browser_page() as page:
        page.goto(served["base"] + "/")
        assert page.get_attribute("#image", "multiple") is not None
        assert "up to 3" in page.text_content('label[for="image"]')
        page.set_input_files("#image", paths)
        page.fill("#prompt", "put them together")
        page.fill("#num_inference_steps", "2")
        page.click("#generate")
        assert result_size(page) == (96, 192)
