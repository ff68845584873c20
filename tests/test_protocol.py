"""The response encoding that runs on the coordinator's threads: PNG files that keep every pixel at the size
Pillow's default gives, chunked base64 and JSON with the images spliced in that give exactly what base64 and
json.dumps give."""

from __future__ import annotations

import base64
import io
import json
import os

import numpy as np
import pytest
from PIL import Image

from omni_ray.api.images import write_image_file
from omni_ray.api.responses import B64_CHUNK, b64encode, json_bytes
from omni_ray.runners.simulated import photo_like


def test_png_keeps_every_pixel_at_about_the_default_size():
    pixels = photo_like(256, 384, variant=1)
    png = write_image_file(pixels, "png")
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(png))), pixels)
    default = io.BytesIO()
    Image.fromarray(pixels).save(default, format="PNG")
    assert len(png) < 1.1 * len(default.getvalue())


@pytest.mark.parametrize("size", [0, 1, 2, 3, B64_CHUNK - 1, B64_CHUNK, B64_CHUNK + 1, 5 * B64_CHUNK + 2])
def test_chunked_base64_equals_base64(size):
    data = os.urandom(size)
    assert b64encode(data) == base64.b64encode(data).decode()


def test_json_with_spliced_images_equals_json_dumps():
    images = [b64encode(os.urandom(n)) for n in (10, 3 * B64_CHUNK + 5)]
    response = {"created": 1, "data": [{"b64_json": images[0], "timings_ms": {"dit": 1.5}},
                                       {"b64_json": images[1], "note": 'quotes " and \\ and \u00e9'}],
                "output_format": "png", "size": "64x64"}
    event = {"type": "image_generation.completed", "index": 1, "b64_json": images[1], "size": "64x64"}
    for body in (response, event, {"type": "image_generation.progress", "step": 3}, {"data": []}):
        assert json_bytes(body) == json.dumps(body).encode()


@pytest.fixture(scope="module")
def tiny_config(tiny_dir):
    from conftest import REPO

    from omni_ray.config import load_config

    return load_config(REPO / "stage_configs" / "qwen_image_tiny.yaml", model=str(tiny_dir))


def test_openai_image_parameters_map_or_are_refused_naming_the_field(tiny_config):
    from omni_ray.api.planning import plan_request
    from omni_ray.api.responses import images_response
    from omni_ray.errors import NotFoundError, RequestError

    def plan(**fields):
        return plan_request({"prompt": "a cat", **fields}, tiny_config)

    levels = tiny_config.requests.quality_steps
    assert [plan(quality=q).num_inference_steps for q in ("low", "medium", "high")] == \
        [levels.low, levels.medium, levels.high]
    assert plan(quality="auto").num_inference_steps == plan().num_inference_steps == tiny_config.requests.default_steps
    assert plan(quality="low", num_inference_steps=3).num_inference_steps == 3  # steps win
    auto = plan(size="auto")
    assert (auto.height, auto.width) == (tiny_config.requests.default_height, tiny_config.requests.default_width)
    for fields in ({"background": "auto"}, {"background": "opaque"}, {"moderation": "low"}, {"moderation": "auto"},
                   {"user": "someone"}, {"model": "qwen-image-tiny"}):
        plan(**fields)
    for fields, param in (({"background": "transparent"}, "background"), ({"style": "vivid"}, "style"),
                          ({"quality": "hd"}, "quality"), ({"moderation": "strict"}, "moderation")):
        with pytest.raises(RequestError) as info:
            plan(**fields)
        assert info.value.param == param and info.value.status_code == 400
    with pytest.raises(NotFoundError) as info:
        plan(model="dall-e-3")
    assert (info.value.param, info.value.code, info.value.status_code) == ("model", "model_not_found", 404)
    response = images_response([b"png"], plan(quality="low", size="64x32", output_format="webp"))
    assert {k: response.get(k) for k in ("size", "quality", "background", "output_format")} == \
        {"size": None, "quality": "low", "background": "opaque", "output_format": "webp"}  # not an OpenAI size
