"""Qwen-Image 2.1 in the images API: the checkpoint's defaults, its sizes, RGBA files, and what each family refuses
(a 400 naming the field)."""

import io

import numpy as np
import pytest
from conftest import REPO
from PIL import Image


@pytest.fixture(scope="module")
def config21(tiny21_dir):
    from omni_ray.config import load_config

    return load_config(REPO / "stage_configs" / "qwen_image_2_1_tiny.yaml", model=str(tiny21_dir))


@pytest.fixture(scope="module")
def config(tiny_dir):
    from omni_ray.config import load_config

    return load_config(REPO / "stage_configs" / "qwen_image_tiny.yaml", model=str(tiny_dir))


def refused(body, config, **kwargs):
    from omni_ray.api.planning import plan_request
    from omni_ray.errors import RequestError

    with pytest.raises(RequestError) as err:
        plan_request(body, config, **kwargs)
    return err.value


def test_a_request_left_at_the_checkpoints_defaults_takes_its_sigmas_without_guidance(config21):
    from omni_ray.api.planning import plan_request

    plan = plan_request({"prompt": "a cat", "negative_prompt": "blurry"}, config21)
    params = plan.denoise_params(0)
    assert config21.sample_sigmas == (1.0, 0.75, 0.5, 0.25)  # read from the checkpoint's model_index.json
    assert (params.num_inference_steps, params.sigmas) == (4, config21.sample_sigmas)
    assert not params.true_cfg and params.true_cfg_scale == 1.0  # the pipeline's default scale: CFG off
    assert (params.height, params.width) == (64, 64)

    asked = plan_request({"prompt": "a cat", "negative_prompt": "blurry", "true_cfg_scale": 3.0,
                          "num_inference_steps": 6}, config21).denoise_params(0)
    assert asked.true_cfg and asked.sigmas is None and asked.num_inference_steps == 6
    assert plan_request({"prompt": "a cat", "quality": "low"}, config21).denoise_params(0).sigmas is None


def test_each_family_refuses_the_others_features_naming_the_field(config21, config):
    from omni_ray.api.planning import plan_request

    assert refused({"prompt": "a cat", "background": "transparent"}, config).param == "background"
    assert plan_request({"prompt": "a cat", "background": "transparent"}, config21).rgba
    assert refused({"prompt": "a cat", "cache": {"kind": "teacache", "threshold": 0.2}}, config21).param == "cache"
    assert refused({"prompt": "a cat", "size": "48x64"}, config21).param == "size"  # sides are multiples of 32
    assert plan_request({"prompt": "a cat", "size": "48x64"}, config).width == 48
    assert refused({"prompt": "<|image_pad|> a cat"}, config21).param == "prompt"
    image = np.zeros((64, 64, 4), np.uint8)
    mask = np.zeros((8, 8), np.uint8)
    from omni_ray.records import InputImages

    assert refused({"prompt": "a cat"}, config21, image=InputImages((image,), (image,), mask)).param == "mask"


def test_rgba_files_keep_alpha_but_in_jpeg_or_when_opaque_is_asked():
    from omni_ray.api.images import write_image_file

    pixels = np.random.default_rng(0).integers(0, 256, (32, 48, 4), dtype=np.uint8)
    png = Image.open(io.BytesIO(write_image_file(pixels, "png")))
    assert png.mode == "RGBA" and np.array_equal(np.asarray(png), pixels)
    assert Image.open(io.BytesIO(write_image_file(pixels, "png", alpha=False))).mode == "RGB"
    jpeg = Image.open(io.BytesIO(write_image_file(pixels, "jpeg")))
    assert jpeg.mode == "RGB" and jpeg.size == (48, 32)


def test_condition_images_keep_their_alpha_at_their_working_size(config21):
    from omni_ray.api.images import load_input_images

    buffer = io.BytesIO()
    Image.fromarray(np.full((40, 90, 4), 128, np.uint8)).save(buffer, format="PNG")
    rgb = io.BytesIO()
    Image.fromarray(np.full((90, 40, 3), 9, np.uint8)).save(rgb, format="PNG")
    inputs = load_input_images([buffer.getvalue(), rgb.getvalue()], config21)
    assert [image.shape for image in inputs.vae] == [(32, 96, 4), (96, 32, 4)]  # 64x64's area, sides of 32
    assert inputs.encoder == inputs.vae and inputs.vae[1][..., 3].min() == 255  # RGB reads as opaque
