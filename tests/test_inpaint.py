"""Masked edits (OpenAI's `mask`, diffusers' inpainting) in process through the three engines, on the tiny
checkpoints: text-to-image inpainting equal to diffusers' QwenImageInpaintPipeline and masked edits equal to its
QwenImageEditInpaintPipeline within one level; every bad mask refused naming `mask`."""

import asyncio

import numpy as np
import pytest
from conftest import REPO
from PIL import Image

from omni_ray.api.images import load_masked_input
from omni_ray.api.planning import plan_request
from omni_ray.config import load_config
from omni_ray.errors import RequestError
from omni_ray.families.qwen_image.facts import INPAINT_STRENGTH, inpaint_start
from omni_ray.pipeline import Pipeline
from testing.reference import load_reference, openai_mask, reference_masked, source_image
from testing.serving import file_bytes as png

pytestmark = pytest.mark.vllm

SOURCE = (180, 100)  # input width, height


def disc(width: int, height: int) -> np.ndarray:
    """What to repaint: a disc right of centre (True inside)."""
    y, x = np.mgrid[0:height, 0:width]
    return (x - 0.6 * width) ** 2 + (y - 0.5 * height) ** 2 < (0.3 * height) ** 2


def diffusers_mask(repaint: np.ndarray) -> Image.Image:
    return Image.fromarray(np.where(repaint, 255, 0).astype(np.uint8), mode="L")


CASES = {
    # name: (negative prompt, strength): n=2 each
    "CFG on, strength 0.6 (diffusers' default)": ("blurry", None),
    "CFG off, strength 1": (None, 1.0),
    "CFG on, strength 0.3": ("dark", 0.3),
}


def run_cases(pipeline, config, size):
    source, repaint = source_image(*SOURCE, seed=4), disc(*SOURCE)
    inputs = load_masked_input(png(source), openai_mask(repaint), config, size)

    async def run():
        return await asyncio.gather(*(
            pipeline.generate({"prompt": "a red ball", "negative_prompt": negative, "num_inference_steps": 5,
                               "seed": 9, "n": 2, **({"strength": strength} if strength else {}),
                               **({"size": f"{size[1]}x{size[0]}"} if config.edit is None else {})}, inputs)
            for negative, strength in CASES.values()
        ))

    return source, repaint, asyncio.run(run())


def assert_equal_to_diffusers(results, reference, source, repaint, shape, **options):
    """Each case's n images against diffusers' pipeline at the image's seed, and the steps its strength runs."""
    for (case, (negative, strength)), images in zip(CASES.items(), results):
        strength = strength or INPAINT_STRENGTH
        for index, result in enumerate(images):
            expected = reference_masked(reference, source, diffusers_mask(repaint), seed=9 + index,
                                        prompt="a red ball", negative_prompt=negative, true_cfg_scale=4.0,
                                        num_inference_steps=5, strength=strength, **options)
            assert result.pixels.shape == expected.shape == shape
            assert np.abs(result.pixels.astype(int) - expected.astype(int)).max() <= 1, (case, index)
            steps = 5 - inpaint_start(5, strength)  # strength 0.3 runs 2 steps of 5, 0.6 runs 3, 1 all 5
            assert result.dit_passes["computed"] == steps * (2 if negative else 1), case


def test_text_to_image_inpainting_equals_diffusers_within_one_level(tiny_dir):
    from diffusers import QwenImageInpaintPipeline

    config = load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir))
    pipeline = Pipeline(config)
    try:
        source, repaint, results = run_cases(pipeline, config, (64, 96))  # diffusers stretches the image to it
    finally:
        pipeline.shutdown()
    reference = QwenImageInpaintPipeline.from_pretrained(tiny_dir)
    assert_equal_to_diffusers(results, reference, source, repaint, (64, 96, 3), height=64, width=96)


def test_masked_edits_equal_diffusers_edit_inpainting_within_one_level(edit_dir):
    from diffusers import QwenImageEditInpaintPipeline

    config = load_config(REPO / "stage_configs/qwen_image_edit_tiny.yaml", model=str(edit_dir))
    pipeline = Pipeline(config)
    try:
        source, repaint, results = run_cases(pipeline, config, None)
    finally:
        pipeline.shutdown()
    reference = load_reference(edit_dir, pipeline=QwenImageEditInpaintPipeline)
    assert_equal_to_diffusers(results, reference, source, repaint, (96, 160, 3),  # the image's working size
                              image_area=config.edit.image_area)


def test_a_masked_edit_at_a_named_size_equals_diffusers_edit_inpainting_at_that_size(edit_dir):
    """OpenAI's client names a size with a mask; diffusers' edit inpaint pipeline edits and draws at its dimensions,
    so the image and the mask are prepared at the size the request names (here not the image's working size)."""
    from diffusers import QwenImageEditInpaintPipeline

    from testing.coordinator import coordinator

    config = load_config(REPO / "stage_configs/qwen_image_edit_tiny.yaml", model=str(edit_dir))
    source, repaint = source_image(*SOURCE, seed=4), disc(*SOURCE)
    body = {"prompt": "a red ball", "negative_prompt": "blurry", "num_inference_steps": 5, "seed": 9,
            "size": "128x96"}
    planned = asyncio.run(coordinator(config).plan(body, png(source), mask=openai_mask(repaint)))  # the API's path
    assert (planned.height, planned.width) == planned.inputs.vae[0].shape[:2] == (96, 128)
    assert planned.inputs.mask.shape == (96 // 8, 128 // 8)
    pipeline = Pipeline(config)
    try:
        (result,) = asyncio.run(pipeline.generate(body, planned.inputs))
    finally:
        pipeline.shutdown()
    reference = load_reference(edit_dir, pipeline=QwenImageEditInpaintPipeline)
    expected = reference_masked(reference, source, diffusers_mask(repaint), seed=9, dimensions=(96, 128),
                                prompt="a red ball", negative_prompt="blurry", true_cfg_scale=4.0,
                                num_inference_steps=5, strength=INPAINT_STRENGTH)
    assert result.pixels.shape == expected.shape == (96, 128, 3)
    assert np.abs(result.pixels.astype(int) - expected.astype(int)).max() <= 1


def bad_mask(config, mask: bytes, image: bytes | None = None, size=(64, 96)):
    with pytest.raises(RequestError) as info:
        load_masked_input(image or png(source_image(*SOURCE, 0)), mask, config, size)
    return info.value


def test_every_bad_mask_is_refused_naming_mask(tiny_dir, edit_dir, edit_plus_dir):
    config = load_config(REPO / "stage_configs/qwen_image_edit_tiny.yaml", model=str(edit_dir))
    good = disc(*SOURCE)
    rgb = png(Image.fromarray(np.zeros((100, 180, 3), np.uint8)))
    opaque = openai_mask(np.zeros_like(good))
    small = openai_mask(disc(90, 50))
    jpeg = png(Image.fromarray(np.zeros((100, 180, 3), np.uint8)), "JPEG")
    for mask, message in [(rgb, "no alpha channel"), (opaque, "fully opaque"), (small, "90x50, but the image is "
                          "180x100"), (jpeg, "JPEG files are not supported"), (b"not a png", "not a readable PNG"),
                          (b"", "an empty file")]:
        error = bad_mask(config, mask)
        assert error.param == "mask" and message in str(error), (message, str(error))

    # A palette PNG with a transparent index is a mask too; what it marks is what an RGBA one marks.
    palette = Image.fromarray(np.where(good, 0, 1).astype(np.uint8), mode="P")
    palette.putpalette([0, 0, 0, 255, 255, 255])
    palette.info["transparency"] = 0
    as_palette = load_masked_input(png(source_image(*SOURCE, 0)), png(palette), config, None)
    as_rgba = load_masked_input(png(source_image(*SOURCE, 0)), openai_mask(good), config, None)
    assert np.array_equal(as_palette.mask, as_rgba.mask) and 0 < as_rgba.mask.mean() < 1

    plus = load_config(REPO / "stage_configs/qwen_image_edit_plus_tiny.yaml", model=str(edit_plus_dir))
    with pytest.raises(RequestError, match="mask: .* edits several images") as info:
        plan_request({"prompt": "x"}, plus, image=load_masked_input(png(source_image(*SOURCE, 0)), openai_mask(good),
                                                                    config, None))
    assert info.value.param == "mask"
    with pytest.raises(RequestError, match="strength: only with a `mask`") as info:
        plan_request({"prompt": "x", "strength": 0.5}, config, image=as_rgba.vae[0])
    assert info.value.param == "strength"
    with pytest.raises(RequestError, match="size: 64x64, but the masked edit's image was prepared at 160x96") as info:
        plan_request({"prompt": "x", "size": "64x64"}, config, image=as_rgba)
    assert info.value.param == "size"
    text_to_image = load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir))
    with pytest.raises(RequestError, match="send a .mask. with the image") as info:
        plan_request({"prompt": "x"}, text_to_image, image=as_rgba.vae[0])
    assert info.value.param == "image"


def test_a_strength_that_runs_no_step_is_a_400_and_never_reaches_a_stage(edit_dir):
    """strength 1e-17 of 20 steps rounds to none: refused naming `strength`, as diffusers refuses it, rather than
    failing in the DiT (or, streamed with previews, hanging until the deadline)."""
    config = load_config(REPO / "stage_configs/qwen_image_edit_tiny.yaml", model=str(edit_dir))
    inputs = load_masked_input(png(source_image(*SOURCE, 0)), openai_mask(disc(*SOURCE)), config, None)
    with pytest.raises(RequestError, match="strength: 1e-17 of 20 steps runs none") as info:
        plan_request({"prompt": "x", "strength": 1e-17, "num_inference_steps": 20, "stream": True,
                      "partial_images": 2}, config, image=inputs)
    assert info.value.param == "strength"
    plan = plan_request({"prompt": "x", "strength": 0.01, "num_inference_steps": 20}, config, image=inputs)
    assert plan.steps_run == 1
    with pytest.raises(RequestError, match="prompt: must not contain Qwen2.5-VL's vision tokens") as info:
        plan_request({"prompt": "a <|image_pad|> cat"}, config, image=inputs.vae[0])
    assert info.value.param == "prompt"
