"""Qwen-Image 2.1 in process, through the three engines (Qwen3-VL on vLLM's EngineCore, the block-causal DiT with
its per-request condition cache, the RGBA VAE): text to image and edits of one and two condition images of
different aspect ratios, CFG on and off, n=2, each image within one level of diffusers' QwenImage21Pipeline;
requests of different prompts sharing DiT steps; a request paused for a more urgent one ending equal to itself run
alone."""

import asyncio

import numpy as np
import pytest
from conftest import REPO

from omni_ray.api.images import load_input_images, working_size
from omni_ray.config import load_config
from omni_ray.pipeline import Pipeline
from testing.reference import reference21, source_image
from testing.serving import file_bytes as png

pytestmark = pytest.mark.vllm

PRESET = REPO / "stage_configs/qwen_image_2_1_tiny.yaml"
SOURCES = [(90, 40), (48, 100)]  # condition images' width, height: wide, then tall
CASES = {
    # name: (condition images, negative prompt, true CFG scale)
    "text, CFG off": (0, None, None),
    "text, CFG on": (0, "blurry", 3.0),
    "1 image, CFG off": (1, None, None),
    "2 images, CFG on": (2, "dark", 3.0),
}


@pytest.fixture(scope="module")
def config(tiny21_dir):
    return load_config(PRESET, model=str(tiny21_dir))


@pytest.fixture(scope="module")
def pipeline(config):
    pipeline = Pipeline(config)
    yield pipeline
    pipeline.shutdown()


@pytest.fixture(scope="module")
def reference(tiny21_dir):
    from diffusers import QwenImage21Pipeline

    pipe = QwenImage21Pipeline.from_pretrained(tiny21_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def sources(count: int):
    return [source_image(width, height, seed=i) for i, (width, height) in enumerate(SOURCES[:count])]


def body(prompt: str, negative: str | None, scale: float | None, **fields) -> dict:
    return {"prompt": prompt, "seed": 3, "n": 2, **({"negative_prompt": negative} if negative else {}),
            **({"true_cfg_scale": scale} if scale else {}), **fields}


def test_text_to_image_and_edits_equal_diffusers_within_one_level(pipeline, config, reference):
    prompt = "a lighthouse on the rocks at sunset"
    inputs = {case: load_input_images([png(image) for image in sources(count)], config) if count else None
              for case, (count, _, _) in CASES.items()}

    async def run():
        return await asyncio.gather(*(pipeline.generate(body(prompt, negative, scale), inputs[case])
                                      for case, (_, negative, scale) in CASES.items()))

    for (case, (count, negative, scale)), results in zip(CASES.items(), asyncio.run(run())):
        size = working_size(*SOURCES[count - 1], config.edit.image_area) if count else (64, 64)
        assert results[0].pixels.shape == (*size, 4), case  # RGBA, at the last condition image's working size
        for index, result in enumerate(results):
            kwargs = {"images": sources(count)} if count else {"height": 64, "width": 64}
            expected = reference21(reference, 3 + index, prompt=prompt, negative_prompt=negative,
                                   true_cfg_scale=scale or 1.0, image_area=config.edit.image_area, **kwargs)
            assert np.abs(result.pixels.astype(int) - expected.astype(int)).max() <= 1, (case, index)
        assert not np.array_equal(results[0].pixels, results[1].pixels)  # image i has seed + i


def test_requests_of_different_prompts_share_dit_steps(pipeline):
    prompts = ["a cat", "a red bicycle leaning on a wall", "fog", "an oil painting of two boats in a storm"]

    async def run():
        return await asyncio.gather(*(pipeline.generate({"prompt": p, "seed": i}) for i, p in enumerate(prompts)))

    before = dict(pipeline.stages.dit.stats.core.batch_sizes)
    asyncio.run(run())
    after = pipeline.stages.dit.stats.core.batch_sizes
    batched = {size: after[size] - before.get(size, 0) for size in after if size > 1}
    assert sum(batched.values()) > 0, after
