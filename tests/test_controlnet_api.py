"""ControlNets on the images API (issue 39), without a Ray cluster: `control` on POST /v1/images/generations as JSON
(base64 control images or data URLs) and as a multipart form (`control` JSON text, `control_image` files in order),
every refusal a 400 naming its field before any stage is called, both forms planned alike, and the request path's
seeded control encodes: one per (image, control), image i's with seed + i, control k's after k draws."""

import base64
import io
import json

import numpy as np
import pytest
from conftest import REPO
from PIL import Image

from omni_ray.api.images import decode_base64_file, load_control_images
from omni_ray.api.planning import plan_request
from omni_ray.api.schema import parse_request
from omni_ray.config import EditConfig, load_config
from omni_ray.errors import PayloadTooLargeError, RequestError
from omni_ray.records import Control, DenoiseParams, DenoiseRequest, Latents, PromptEmbeds
from testing import coordinator
from testing.fake_stages import FakeStages

CONTROLNETS = {"canny": "/controlnets/canny", "depth": "/controlnets/depth"}
SIZE = (64, 96)  # height, width of the output and of the control images


@pytest.fixture(scope="module")
def config(tiny_dir):
    base = load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir))
    return base.model_copy(update={"controlnets": CONTROLNETS})


def control_png(seed: int, height: int = SIZE[0], width: int = SIZE[1], fmt: str = "PNG") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def body(*controls, **fields) -> dict:
    return {"prompt": "a house", "size": f"{SIZE[1]}x{SIZE[0]}", "seed": 10, "num_inference_steps": 2,
            "control": list(controls), **fields}


def post(config, json_body=None, stages=None, **options):
    stages = stages or FakeStages()
    client = coordinator.client(config, stages)
    return client.post("/v1/images/generations", json=json_body, **options), stages


def assert_refused(response, stages, param, status=400, says=""):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"].startswith(f"{param}: ") and says in error["message"]
    assert stages.calls == []  # refused before any stage was called


# --- refusals: a 400 naming the field, no stage called ----------------------------------------------------------


@pytest.mark.parametrize("control, param, says", [
    ({"name": "pose"}, "control[0].name", "the ControlNets are canny, depth"),
    ({"name": "canny", "scale": 10.5}, "control[0].scale", "10"),
    ({"name": "canny", "scale": -1}, "control[0].scale", "0"),
    ({"name": "canny", "start": -0.1}, "control[0].start", "0"),
    ({"name": "canny", "end": 1.5}, "control[0].end", "1"),
    ({"name": "canny", "start": 0.6, "end": 0.6}, "control[0]", "must be below end"),
    ({"name": "canny", "colour": "red"}, "control[0].colour", "unknown parameter"),
    ({"scale": 1.0}, "control[0].name", "required"),
])
def test_a_bad_control_field_is_a_400_naming_it(config, control, param, says):
    control = {"image": b64(control_png(0)), **control}
    assert_refused(*post(config, body(control)), param, says=says)


def test_more_controls_than_the_preset_takes_is_a_400_naming_control(config):
    image = b64(control_png(0))
    response, stages = post(config, body(*({"name": "canny", "image": image} for _ in range(3))))
    assert_refused(response, stages, "control", says="at most 2 per request here (requests.max_controls), got 3")
    fewer = config.model_copy(update={"requests": config.requests.model_copy(update={"max_controls": 1})})
    assert_refused(*post(fewer, body({"name": "canny", "image": image}, {"name": "depth", "image": image})),
                   "control", says="at most 1")


@pytest.mark.parametrize("image, says", [
    (None, "required"),
    ("", "an empty file"),
    ("not base64 at all!", "not base64"),
    (b64(b"plain text, not an image"), "not a readable image file"),
    (b64(control_png(0)[:200]), "corrupt or truncated"),
    (b64(control_png(0, fmt="GIF")), "GIF files are not supported"),
    ("data:image/png;charset=utf-8,abc", "must be base64"),
])
def test_a_control_image_that_is_missing_or_unreadable_is_a_400_naming_it(config, image, says):
    control = {"name": "depth", **({"image": image} if image is not None else {})}
    good = {"name": "canny", "image": b64(control_png(1))}
    assert_refused(*post(config, body(good, control)), "control[1].image", says=says)


def test_a_control_image_not_at_the_output_size_is_refused_not_stretched(config):
    image = b64(control_png(0, height=SIZE[0], width=SIZE[1] + 16))
    response, stages = post(config, body({"name": "canny", "image": image}))
    assert_refused(response, stages, "control[0].image", says=f"{SIZE[1] + 16}x{SIZE[0]}, but the output is "
                   f"{SIZE[1]}x{SIZE[0]}")
    default_size = body({"name": "canny", "image": b64(control_png(0))})  # the preset's default size
    del default_size["size"]
    assert_refused(*post(config, default_size), "control[0].image", says=f"the output is {config.requests.default_width}x{config.requests.default_height}")


def test_an_oversized_control_image_is_a_413_naming_it(config):
    data = control_png(0)
    with pytest.raises(PayloadTooLargeError) as refused:  # told from the text's length, before decoding
        decode_base64_file(b64(data), len(data) - 200, "control[0].image")
    assert refused.value.param == "control[0].image"
    as_json = parse_request(body({"name": "canny", "image": b64(data)}))
    as_form = parse_request(body({"name": "canny"}), form=True)
    for request, files in ((as_json, None), (as_form, [data])):  # the upload check's own limit, as an edit's
        with pytest.raises(PayloadTooLargeError) as refused:
            load_control_images(request, files, len(data) - 1)
        assert refused.value.param == "control[0].image" and refused.value.status_code == 413


def test_control_where_no_controlnet_runs_is_a_400_naming_control(config, tiny_dir):
    control = {"name": "canny", "image": b64(control_png(0))}
    none_here = config.model_copy(update={"controlnets": {}})
    assert_refused(*post(none_here, body(control)), "control", says="holds no ControlNets")
    edit_preset = config.model_copy(update={"edit": EditConfig()})
    with pytest.raises(RequestError) as refused:
        plan_request(body(control), edit_preset)
    assert refused.value.param == "control" and "edits images" in str(refused.value)
    family_21 = config.model_copy(update={"family": "qwen-image-2.1"})
    with pytest.raises(RequestError) as refused:
        plan_request(body(control), family_21)
    assert refused.value.param == "control" and "2.1" in str(refused.value)
    # a masked edit on the text-to-image preset (its edits route) takes no ControlNet
    stages = FakeStages()
    mask = io.BytesIO()
    Image.fromarray(np.zeros((SIZE[0], SIZE[1], 4), np.uint8), mode="RGBA").save(mask, format="PNG")
    fields = {"prompt": "a house", "control": json.dumps([{"name": "canny"}])}
    response = coordinator.client(config, stages).post(
        "/v1/images/edits", data=fields, files=[("image", ("i.png", control_png(3))), ("mask", ("m.png", mask.getvalue()))])
    assert_refused(response, stages, "control", says="not with an image or a mask")


def test_multipart_control_images_must_match_the_controls(config):
    client_stages = FakeStages()
    client = coordinator.client(config, client_stages)
    fields = {"prompt": "a house", "size": f"{SIZE[1]}x{SIZE[0]}"}
    two = json.dumps([{"name": "canny"}, {"name": "depth"}])
    one_file = [("control_image", ("c.png", control_png(0)))]
    assert_refused(client.post("/v1/images/generations", data={**fields, "control": two}, files=one_file),
                   client_stages, "control_image", says="1 file(s) for 2 control(s)")
    assert_refused(client.post("/v1/images/generations", data=fields, files=one_file), client_stages,
                   "control_image", says="without `control`")
    inline = json.dumps([{"name": "canny", "image": b64(control_png(0))}])
    assert_refused(client.post("/v1/images/generations", data={**fields, "control": inline}, files=one_file),
                   client_stages, "control[0].image", says="`control_image` files")
    assert_refused(client.post("/v1/images/generations", data={**fields, "control": "[{"}, files=one_file),
                   client_stages, "control", says="a JSON list")


# --- accepted: JSON and multipart planned alike, and the request path's seeded control encodes ---------------------


def run_controls(config, **options):
    stages = FakeStages(**{k: v for k, v in options.items() if k == "lose"})
    client = coordinator.client(config, stages)
    response = client.post("/v1/images/generations", headers={"x-request-id": "r"},
                           **{k: v for k, v in options.items() if k != "lose"})
    assert response.status_code == 200, response.text
    return stages


def test_json_and_multipart_controls_run_alike_with_one_seeded_encode_per_image_and_control(config):
    files = [control_png(1), control_png(2, fmt="WEBP")]
    controls = [{"name": "depth", "scale": 0.5, "start": 0.1, "end": 0.9}, {"name": "canny"}]
    spelt = {
        "json": {"json": body(*({**c, "image": b64(f)} for c, f in zip(controls, files)), n=2)},
        "data URLs": {"json": body({**controls[0], "image": "data:image/png;base64," + b64(files[0])},
                                   {**controls[1], "image": "data:image/webp;base64," + b64(files[1])}, n=2)},
        "multipart": {"data": {**{k: str(v) for k, v in body(n=2).items() if k != "control"},
                               "control": json.dumps(controls)},
                      "files": [("control_image", ("a.png", files[0])), ("control_image", ("b.webp", files[1]))]},
        "multipart []": {"data": {**{k: str(v) for k, v in body(n=2).items() if k != "control"},
                                  "control": json.dumps(controls)},
                         "files": [("control_image[]", ("a.png", files[0])), ("control_image[]", ("b.webp", files[1]))]},
    }
    seen = {}
    for spelling, options in spelt.items():
        stages = run_controls(config, **options)
        puts = stages.calls_to("put_image")
        pixels = [np.asarray(Image.open(io.BytesIO(f)).convert("RGB")) for f in files]
        assert len(puts) == 2 and all(np.array_equal(p.args[0], want) for p, want in zip(puts, pixels))  # once each
        encodes = {call.args[0]: call for call in stages.calls_to("encode_image")}
        assert sorted(encodes) == ["r-0-control0", "r-0-control1", "r-1-control0", "r-1-control1"]
        by_suffix = {name.split("-", 1)[1]: call for name, call in encodes.items()}
        for image, seed in ((0, 10), (1, 11)):
            for k in (0, 1):
                call = by_suffix[f"{image}-control{k}"]
                assert call.args[1] is puts[k] and call.args[2:] == (seed, k)  # image i's seed, control k's draw
        denoises = sorted(stages.calls_to("denoise"), key=lambda call: call.args[1].seed)
        for image, call in enumerate(denoises):
            params, controls_sent = call.args[1], call.args[5]
            assert params.controls == (Control("depth", 0.5, 0.1, 0.9), Control("canny", 1.0, 0.0, 1.0))
            assert controls_sent == (by_suffix[f"{image}-control0"], by_suffix[f"{image}-control1"])
        seen[spelling] = ([d.args[1] for d in denoises], [p.args[0].tobytes() for p in puts])
    assert all(plans == seen["json"] for plans in seen.values())


def test_the_plan_carries_the_controls_and_their_pixels_without_base64(config):
    files = [control_png(1), control_png(2)]
    request = body({"name": "canny", "image": b64(files[0])}, {"name": "depth", "image": b64(files[1]), "end": 0.5})
    plan = plan_request(request, config)
    assert plan.controls == (Control("canny"), Control("depth", end=0.5))
    assert [image.shape for image in plan.control_images] == [(*SIZE, 3)] * 2
    assert plan.control_images[0].dtype == np.uint8
    assert all(control.image is None for control in plan.request.control)
    assert plan.denoise_params(1).controls == plan.controls and plan.denoise_params(1).seed == 11
    assert plan_request(body(), config).controls == ()  # an empty list is none


def test_a_lost_control_encode_is_issued_again_under_new_ids(config):
    files = [control_png(1), control_png(2)]
    request = body({"name": "canny", "image": b64(files[0])}, {"name": "depth", "image": b64(files[1])})
    stages = run_controls(config, json=request, lose={"encode_image": 1})
    names = sorted(call.args[0] for call in stages.calls_to("encode_image"))
    assert names == ["r-0-control0", "r-0-control1", "r-0-retry1-control0", "r-0-retry1-control1"]
    retried = [call for call in stages.calls_to("encode_image") if "retry" in call.args[0]]
    assert [call.args[2:] for call in retried] == [(10, 0), (10, 1)]
    first = [call for call in stages.calls_to("encode_image") if "retry" not in call.args[0]]
    assert all(call.cancelled for call in first)


def test_a_denoise_request_needs_one_control_latents_per_controlnet():
    params = DenoiseParams(64, 64, 2, 0, controls=(Control("canny"),))
    prompt = PromptEmbeds(np.zeros((4, 8)))
    with pytest.raises(ValueError, match="1 ControlNet"):
        DenoiseRequest("r", params, prompt)
    DenoiseRequest("r", params, prompt, controls=(Latents(None, 64, 64),))
