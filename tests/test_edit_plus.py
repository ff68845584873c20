"""Multi-image edits (Qwen-Image-Edit-2509/2511, diffusers' QwenImageEditPlusPipeline) on the tiny Edit-Plus
checkpoint, in process through the three engines (vLLM's EngineCore reading every image in one sequence): equal to
diffusers within one level, edits whose image sizes match batched together, and the checks on the uploads."""

import asyncio

import numpy as np
import pytest
from conftest import REPO

from omni_ray.api.images import load_input_images, working_size
from omni_ray.config import load_config
from omni_ray.errors import RequestError
from omni_ray.families.qwen_image.facts import EDIT_PLUS
from omni_ray.pipeline import Pipeline
from omni_ray.tokenizer import PromptTokenizer
from testing.reference import load_reference, reference_edit_plus, source_image
from testing.serving import file_bytes as png

pytestmark = pytest.mark.vllm

PRESET = REPO / "stage_configs/qwen_image_edit_plus_tiny.yaml"
SOURCES = [(180, 100), (120, 240), (150, 150)]  # input width, height: wide, tall, square
CASES = {
    # name: (how many of SOURCES, negative prompt)
    "2 images, CFG on": (2, "blurry"),
    "2 images, CFG off": (2, None),
    "3 images, CFG on": (3, "dark"),
    "3 images, CFG off": (3, None),
}


@pytest.fixture(scope="module")
def config(edit_plus_dir):
    return load_config(PRESET, model=str(edit_plus_dir))


@pytest.fixture(scope="module")
def pipeline(config):
    pipeline = Pipeline(config)
    yield pipeline
    pipeline.shutdown()


def sources(count: int, seed: int = 0):
    return [source_image(width, height, seed + i) for i, (width, height) in enumerate(SOURCES[:count])]


def test_edits_of_two_and_three_images_equal_diffusers_edit_plus_within_one_level(pipeline, config, edit_plus_dir):
    from diffusers import QwenImageEditPlusPipeline

    reference = load_reference(edit_plus_dir, pipeline=QwenImageEditPlusPipeline)
    inputs = {case: load_input_images([png(image) for image in sources(count)], config)
              for case, (count, _) in CASES.items()}
    prompt = "put the disc of the first picture on the second"

    async def run():
        return await asyncio.gather(*(
            pipeline.generate({"prompt": prompt, "negative_prompt": negative, "num_inference_steps": 3, "seed": 7,
                               "n": 2, "true_cfg_scale": 4.0}, inputs[case])
            for case, (_, negative) in CASES.items()
        ))

    for (case, (count, negative)), results in zip(CASES.items(), asyncio.run(run())):
        # The output takes the last image's working size, as diffusers' does.
        assert results[0].pixels.shape[:2] == working_size(*SOURCES[count - 1], config.edit.image_area)
        for index, result in enumerate(results):
            expected = reference_edit_plus(
                reference, config.edit, sources(count), seed=7 + index, prompt=prompt, negative_prompt=negative,
                true_cfg_scale=4.0, num_inference_steps=3,
            )
            assert result.pixels.shape == expected.shape, case
            assert np.abs(result.pixels.astype(int) - expected.astype(int)).max() <= 1, (case, index)
        assert not np.array_equal(results[0].pixels, results[1].pixels)  # image i has seed + i


def test_edits_whose_image_sizes_match_share_dit_steps_and_others_do_not(pipeline, config):
    same = [load_input_images([png(image) for image in sources(2, seed)], config) for seed in (0, 5)]
    swapped = load_input_images([png(image) for image in reversed(sources(2))], config)
    dit = pipeline.stages.dit
    body = {"prompt": "swap them", "num_inference_steps": 4, "seed": 1, "size": "64x64"}

    async def run(inputs):
        return await asyncio.gather(*(pipeline.generate(body, images) for images in inputs))

    before = dit.stats.core.batch_sizes
    run_results = asyncio.run(run(same))
    assert max(size for size, count in dit.stats.core.batch_sizes.items() if count > before.get(size, 0)) == 2
    assert not np.array_equal(run_results[0][0].pixels, run_results[1][0].pixels)  # the images steer each
    before = dit.stats.core.batch_sizes
    asyncio.run(run([same[0], swapped]))  # the same sizes in another order: another key
    assert {size for size, count in dit.stats.core.batch_sizes.items() if count > before.get(size, 0)} == {1}


def test_every_image_counts_against_the_encoder_and_each_error_names_image(config, edit_plus_dir):
    tokenizer = PromptTokenizer(str(edit_plus_dir), EDIT_PLUS)
    files = [png(image) for image in sources(3)]
    inputs = load_input_images(files, config)
    # The encoder reads each image at the condition area, the VAE at the working area.
    assert [image.shape[:2] for image in inputs.encoder] == [working_size(w, h, config.edit.condition_area)
                                                             for w, h in SOURCES]
    assert inputs.sizes == tuple(working_size(w, h, config.edit.image_area) for w, h in SOURCES)
    one, three = tokenizer.num_tokens("a cat", inputs.sizes[:1]), tokenizer.num_tokens("a cat", inputs.sizes)
    assert three.image > one.image > 0 and three.text > one.text  # "Picture 2: ", "Picture 3: "
    text = EDIT_PLUS.format("a cat", 2)
    assert text.count("<|image_pad|>") == 2 and "Picture 1: <|vision_start|>" in text and "Picture 2: " in text

    for bad, message in [
        (files + files[:1], "at most 3 images per request, got 4"),
        ([], "required"),
        ([files[0], b"not an image"], "image 2 of 2: not a readable image file"),
        ([files[0], png(source_image(500, 20, 0))], "image 2 of 2: a 500x20 image's working width"),
    ]:
        with pytest.raises(RequestError, match=message) as info:
            load_input_images(bad, config)
        assert info.value.param == "image"
