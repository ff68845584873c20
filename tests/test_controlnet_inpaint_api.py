"""An inpainting ControlNet on the images API, without a Ray cluster: a control naming one takes a `mask` (OpenAI's
convention: a PNG of the control image's size whose fully transparent pixels mark what to repaint) as base64 in
JSON or as a `control_mask` file in a multipart body; every refusal a 400 naming its field before any stage runs;
the request path's encodes (the mask stored once, each image's inpainting control sampled with its seed apart from
the plain controls' draws); the preset reading which ControlNets inpaint from their folders."""

import base64
import io
import json

import numpy as np
import pytest
from conftest import REPO
from PIL import Image

from omni_ray.api.planning import plan_request
from omni_ray.config import ConfigError, load_config, parse_config
from omni_ray.records import Control, DenoiseParams
from omni_ray.runners.denoise_state import draw_noise
from testing import coordinator
from testing.fake_stages import FakeStages
from testing.reference import openai_mask

CONTROLNETS = {"canny": "/controlnets/canny", "inpaint": "/controlnets/inpaint"}
SIZE = (64, 96)  # height, width of the output, the control images and their masks


@pytest.fixture(scope="module")
def config(tiny_dir):
    base = load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir))
    return base.model_copy(update={"controlnets": CONTROLNETS, "inpaint_controlnets": ["inpaint"]})


def png(seed: int, height: int = SIZE[0], width: int = SIZE[1]) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def repaint(height: int = SIZE[0], width: int = SIZE[1]) -> np.ndarray:
    mask = np.zeros((height, width), bool)
    mask[10:40, 20:70] = True
    return mask


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def body(*controls, **fields) -> dict:
    return {"prompt": "a green taxi", "size": f"{SIZE[1]}x{SIZE[0]}", "seed": 10, "num_inference_steps": 2,
            "control": list(controls), **fields}


INPAINT = {"name": "inpaint", "image": b64(png(0)), "mask": b64(openai_mask(repaint()))}


def assert_refused(response, stages, param, says=""):
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: ") and says in error["message"], error
    assert stages.calls == []


def post(config, **options):
    stages = FakeStages()
    response = coordinator.client(config, stages).post("/v1/images/generations", headers={"x-request-id": "r"},
                                                       **options)
    return response, stages


@pytest.mark.parametrize("controls, param, says", [
    ([{"name": "canny", "image": b64(png(0)), "mask": b64(openai_mask(repaint()))}], "control[0].mask",
     "'canny' is not an inpainting ControlNet"),
    ([{"name": "inpaint", "image": b64(png(0))}], "control[0].mask", "required"),
    ([{"name": "canny", "image": b64(png(1))}, {**INPAINT, "mask": b64(openai_mask(repaint(SIZE[0], SIZE[1] + 16)))}],
     "control[1].mask", f"{SIZE[1] + 16}x{SIZE[0]}, but the image is {SIZE[1]}x{SIZE[0]}"),
    ([{**INPAINT, "mask": b64(png(3))}], "control[0].mask", "no alpha channel"),
    ([{**INPAINT, "mask": b64(openai_mask(np.zeros(SIZE, bool)))}], "control[0].mask", "fully opaque"),
    ([{**INPAINT, "mask": "not base64!"}], "control[0].mask", "not base64"),
    ([{**INPAINT, "mask": b64(b"text")}], "control[0].mask", "not a readable PNG"),
])
def test_a_bad_control_mask_is_a_400_naming_it(config, controls, param, says):
    assert_refused(*post(config, json=body(*controls)), param, says)


def test_multipart_control_masks_must_match_the_inpainting_controls(config):
    fields = {"prompt": "a taxi", "size": f"{SIZE[1]}x{SIZE[0]}"}
    both = json.dumps([{"name": "canny"}, {"name": "inpaint"}])
    images = [("control_image", ("a.png", png(1))), ("control_image", ("b.png", png(2)))]
    mask = ("control_mask", ("m.png", openai_mask(repaint())))
    assert_refused(*post(config, data={**fields, "control": both}, files=images), "control_mask",
                   "0 file(s) for 1 control(s) of an inpainting ControlNet")
    assert_refused(*post(config, data={**fields, "control": both}, files=[*images, mask, mask]), "control_mask",
                   "2 file(s) for 1")
    inline = json.dumps([{"name": "canny"}, {"name": "inpaint", "mask": b64(openai_mask(repaint()))}])
    assert_refused(*post(config, data={**fields, "control": inline}, files=[*images, mask]), "control[1].mask",
                   "`control_mask` files")
    plain = json.dumps([{"name": "canny"}])
    assert_refused(*post(config, data={**fields, "control": plain}, files=[images[0], mask]), "control_mask",
                   "1 file(s) for 0")
    assert_refused(*post(config, data={**fields, "control": both, "control_mask": "text"}, files=images),
                   "control_mask", "expected a file")


def test_json_and_multipart_masks_run_alike(config):
    mask_png = openai_mask(repaint())
    controls = [{"name": "canny", "scale": 0.5}, {"name": "inpaint", "end": 0.8}]
    spelt = {
        "json": {"json": body({**controls[0], "image": b64(png(1))},
                              {**controls[1], "image": b64(png(2)), "mask": b64(mask_png)}, n=2)},
        "multipart": {"data": {**{k: str(v) for k, v in body(n=2).items() if k != "control"},
                               "control": json.dumps(controls)},
                      "files": [("control_image", ("a.png", png(1))), ("control_image", ("b.png", png(2))),
                                ("control_mask", ("m.png", mask_png))]},
    }
    seen = []
    for options in spelt.values():
        response, stages = post(config, **options)
        assert response.status_code == 200, response.text
        puts = stages.calls_to("put_image")
        assert len(puts) == 3  # two images and the mask, each stored once for both images of the request
        stored_mask = puts[2].args[0]
        assert stored_mask.dtype == np.uint8 and np.array_equal(stored_mask, repaint().astype(np.uint8))
        encodes = {call.args[0].split("-", 1)[1]: call for call in stages.calls_to("encode_image")}
        for image, seed in ((0, 10), (1, 11)):
            assert encodes[f"{image}-control0"].args[1:] == (puts[0], seed, 0)  # the plain control: draw 0
            # the inpainting one: its own first draw of the seed, and its mask
            assert encodes[f"{image}-control1"].args[1:] == (puts[1], seed, 0, puts[2])
        params = sorted((call.args[1] for call in stages.calls_to("denoise")), key=lambda p: p.seed)
        assert params[0].controls == (Control("canny", 0.5), Control("inpaint", end=0.8, mask=True))
        seen.append(([p.args[0].tobytes() for p in puts], params))
    assert seen[0] == seen[1]


def test_the_plan_keeps_the_mask_and_no_base64(config):
    plan = plan_request(body({"name": "canny", "image": b64(png(1))}, INPAINT), config)
    assert plan.control_masks[0] is None and plan.control_masks[1].shape == SIZE
    assert all(c.image is None and c.mask is None for c in plan.request.control)
    assert plan.controls[1].mask and not plan.controls[0].mask


def test_the_noise_skips_plain_controls_samples_only():
    """QwenImageControlNetInpaintPipeline samples its control image from torch's global generator: the noise is the
    image generator's first draw; a plain control's sample comes before it."""
    import torch

    base = DenoiseParams(64, 96, 2, 5)
    inpaint = DenoiseParams(64, 96, 2, 5, controls=(Control("inpaint", mask=True),))
    plain = DenoiseParams(64, 96, 2, 5, controls=(Control("canny"),))
    both = DenoiseParams(64, 96, 2, 5, controls=(Control("inpaint", mask=True), Control("canny")))
    noise = [draw_noise(p, 16, torch.float32) for p in (base, inpaint, plain, both)]
    assert torch.equal(noise[0], noise[1]) and torch.equal(noise[2], noise[3])
    assert not torch.equal(noise[0], noise[2])


def test_the_preset_reads_which_controlnets_inpaint(tiny_dir, tmp_path):
    preset = {"name": "tiny", "model": str(tiny_dir)}
    for name, extra in (("plain", 0), ("inpaint", 4)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"extra_condition_channels": extra}))
    nets = {"plain": str(tmp_path / "plain"), "inpaint": str(tmp_path / "inpaint"), "remote": "/elsewhere/net"}
    assert parse_config({**preset, "controlnets": nets}).inpaint_controlnets == ["inpaint"]
    declared = parse_config({**preset, "controlnets": nets, "inpaint_controlnets": ["remote"]})
    assert declared.inpaint_controlnets == ["inpaint", "remote"]
    with pytest.raises(ConfigError, match="inpaint_controlnets: 'nope' is not one of `controlnets`"):
        parse_config({**preset, "controlnets": nets, "inpaint_controlnets": ["nope"]})
