"""Qwen-Image-Layered's API over fake stages: its fields and their 400s, the empty prompt captioned before the prompt
is encoded (and a lost caption issued again), one RGBA PNG per layer in ``data`` and one completed event per layer,
each held against OpenAI's published definition and read by the official client. The engines are not the subject
here: test_pipeline_layered.py and test_serve_layered.py run the same requests on the tiny checkpoint."""

import asyncio
import base64
import io
import json

import numpy as np
import openai
import pytest
from conftest import REPO
from PIL import Image

from omni_ray.api.planning import plan_request
from omni_ray.config import load_config
from omni_ray.errors import RequestError
from omni_ray.request_path import collect, run_request
from testing.coordinator import client
from testing.fake_stages import FakeStages
from testing.openai_api import conforms, event_kind


@pytest.fixture(scope="module")
def config(layered_dir):
    return load_config(REPO / "stage_configs/qwen_image_layered_tiny.yaml", model=str(layered_dir))


def png_file(height=96, width=64, mode="RGBA") -> bytes:
    buffer = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, len(mode)), dtype=np.uint8)
    Image.fromarray(pixels, mode=mode).save(buffer, format="PNG")
    return buffer.getvalue()


def events_of(response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: ")]


def post(app, data, image=None):
    files = {"image": ("cat.png", image or png_file(), "image/png")}
    return app.post("/v1/images/edits", data=data, files=files)


def test_a_layered_edit_answers_each_images_layers_bottom_to_top_as_rgba_pngs(config):
    stages = FakeStages()
    app = client(config, stages)
    response = post(app, {"prompt": "a cat", "n": "2", "layers": "3", "seed": "7"})
    assert response.status_code == 200, response.text
    body = response.json()
    conforms("ImagesResponse", body)
    assert body["background"] == "transparent" and len(body["data"]) == 6
    layers = [np.asarray(Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))))
              for item in body["data"]]
    assert all(layer.shape[-1] == 4 for layer in layers)
    assert [int(layer[0, 0, 0]) for layer in layers] == [7, 8, 9, 8, 9, 10]  # image i's layer k: seed + i + k
    assert "revised_prompt" not in body["data"][0]
    height, width = layers[0].shape[:2]
    assert body["usage"]["output_tokens"] == 6 * (height // 16) * (width // 16)
    (encode,) = stages.calls_to("encode_prompt")
    assert encode.args[0].prompt == "a cat" and encode.args[1] == ()  # the prompt alone: no image for the encoder
    assert not stages.calls_to("caption")
    assert {call.args[1].layers for call in stages.calls_to("denoise")} == {3}


def test_an_empty_prompt_is_captioned_once_and_the_caption_is_encoded_and_revised_prompt(config):
    stages = FakeStages()
    app = client(config, stages)
    body = post(app, {"prompt": "", "n": "2", "layers": "2", "caption_language": "zh"}).json()
    (caption,) = stages.calls_to("caption")
    (put,) = stages.calls_to("put_image")
    assert caption.args[0].language == "zh" and caption.args[1] is put
    assert put.args[0].shape[-1] == 4  # the RGBA image at its working size, as the pipeline captions it
    (encode,) = stages.calls_to("encode_prompt")
    assert encode.args[0].prompt == f"a caption of {put!r}"
    assert [item["revised_prompt"] for item in body["data"]] == [encode.args[0].prompt] * 4
    conforms("ImagesResponse", body)


def test_a_lost_caption_is_issued_again_and_a_failed_one_fails_the_request(config):
    stages = FakeStages(lose={"caption": 1})
    assert post(client(config, stages), {"prompt": " ", "layers": "2"}).status_code == 200
    assert [call.args[0].request_id.endswith("caption1") for call in stages.calls_to("caption")] == [False, True]
    failing = FakeStages(fail={"caption": RequestError("image: unreadable", param="image")})
    response = post(client(config, failing), {"prompt": "", "layers": "2"})
    assert response.status_code == 400 and not failing.calls_to("denoise")


def test_streamed_one_completed_event_per_layer_each_openais_and_the_official_client_reads_them(config):
    app = client(config, FakeStages())
    events = events_of(post(app, {"prompt": "", "layers": "4", "n": "2", "stream": "true", "partial_images": "1"}))
    completed = [event for event in events if event["type"] == "image_edit.completed"]
    assert sorted((event["index"], event["layer"]) for event in completed) == \
        [(i * 4 + k, k) for i in range(2) for k in range(4)]
    assert all(event["background"] == "transparent" and event["revised_prompt"] for event in completed)
    for event in events:
        conforms(event_kind(event, edit=True), event)
    partial = [event for event in events if event["type"] == "image_edit.partial_image"]
    assert len(partial) == 2  # a preview per image: its layers composited
    openai_client = openai.OpenAI(api_key="x", base_url="http://testserver/v1", http_client=app)
    result = openai_client.images.edit(image=("cat.png", png_file(), "image/png"), prompt="a cat",
                                       extra_body={"layers": 2})
    assert len(result.data) == 2 and result.background == "transparent"


@pytest.mark.parametrize(("data", "param"), [
    ({"layers": "1"}, "layers"),
    ({"layers": "9"}, "layers"),
    ({"layers": "four"}, "layers"),
    ({"resolution": "512"}, "resolution"),
    ({"size": "64x64"}, "size"),
    ({"mask": True}, "mask"),
])
def test_bad_layered_input_is_a_400_naming_the_field_before_any_stage_runs(config, data, param):
    stages = FakeStages()
    app = client(config, stages)
    files = {"image": ("cat.png", png_file(), "image/png")}
    if data.pop("mask", False):
        files["mask"] = ("mask.png", png_file(), "image/png")
    response = app.post("/v1/images/edits", data={"prompt": "a cat", **data}, files=files)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert not stages.calls


@pytest.mark.parametrize(("image", "param"), [(b"not an image", "image"), (None, "image")])
def test_an_unreadable_or_missing_image_is_a_400_naming_image(config, image, param):
    stages = FakeStages()
    app = client(config, stages)
    files = {"image": ("cat.png", image, "image/png")} if image is not None else {}
    response = app.post("/v1/images/edits", data={"prompt": "a cat"}, files=files)
    assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert not stages.calls


def test_an_oversized_image_is_refused_before_any_stage_runs(config):
    stages = FakeStages()
    small = config.model_copy(update={"edit": config.edit.model_copy(update={"max_image_bytes": 1000})})
    response = post(client(small, stages), {"prompt": "a cat"}, png_file(200, 200))
    assert response.status_code == 413 and response.json()["error"]["param"] == "image"
    assert not stages.calls


@pytest.mark.parametrize("field", ["layers", "resolution", "cfg_normalize", "caption_language"])
def test_layered_fields_on_another_preset_are_400s_naming_them(tiny_dir, field):
    other = load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir))
    value = {"layers": 3, "resolution": 640, "cfg_normalize": True, "caption_language": "en"}[field]
    with pytest.raises(RequestError) as err:
        plan_request({"prompt": "a cat", field: value}, other)
    assert err.value.param == field


def test_an_empty_prompt_is_still_refused_where_nothing_captions(tiny_dir):
    other = load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir))
    with pytest.raises(RequestError) as err:
        plan_request({"prompt": " "}, other)
    assert err.value.param == "prompt"


def test_the_image_takes_its_buckets_area_and_the_plan_the_layered_settings(config):
    from omni_ray.api.images import load_inputs
    from omni_ray.families.qwen_image_layered.facts import working_size

    buckets = config.edit.resolutions
    for bucket in buckets:
        inputs = load_inputs([png_file(96, 64, "RGB")], None, config, resolution=bucket)
        assert inputs.sizes == (working_size(96, 64, bucket),) and inputs.vae[0].shape[-1] == 4
        assert inputs.encoder == ()
        assert (inputs.vae[0][..., 3] == 255).all()  # an RGB upload is opaque
        plan = plan_request({"prompt": "", "resolution": bucket, "true_cfg_scale": 4.0, "negative_prompt": " ",
                             "cfg_normalize": True}, config, image=inputs)
        params = plan.denoise_params(0)
        assert (plan.height, plan.width) == inputs.sizes[0] and plan.caption == "en"
        assert params.layers == 4 and params.cfg_normalize and params.true_cfg


def test_a_caption_counts_at_its_bound_so_the_estimate_is_never_short(config):
    from omni_ray.api.images import load_inputs
    from omni_ray.tokenizer import tokenizer_for

    inputs = load_inputs([png_file()], None, config)
    count = tokenizer_for(config).num_tokens
    captioned = plan_request({"prompt": ""}, config, count, image=inputs)
    prompted = plan_request({"prompt": "a cat"}, config, count, image=inputs)
    assert captioned.input_tokens.total >= config.encoder.max_sequence_length > prompted.input_tokens.total
    assert captioned.work_tokens > prompted.work_tokens


def test_the_request_path_decodes_each_image_once_with_all_its_layers(config):
    from omni_ray.api.images import load_inputs

    stages = FakeStages()
    plan = plan_request({"prompt": "", "layers": 5, "n": 2, "seed": 3}, config,
                        image=load_inputs([png_file()], None, config))

    async def main():
        return await collect(run_request(stages, plan, "r", config.requests))

    results = asyncio.run(main())
    assert [result.pixels.shape[0] for result in results] == [5, 5] and len(stages.calls_to("decode")) == 2
    assert all(result.revised_prompt for result in results)
