"""Qwen-Image-Layered in process, through the three engines (Qwen2.5-VL on vLLM's EngineCore, captioning and
encoding; the DiT's layered rows; the RGBA VAE): with a prompt and with an empty one (captioned), 2 and 4 layers,
CFG off and on, each layer within one level of diffusers' QwenImageLayeredPipeline, alpha included; the caption
equal to the pipeline's (transformers' greedy generate), and a repeated image's caption from the encoder's cache."""

import asyncio

import numpy as np
import pytest
from conftest import REPO

from omni_ray.api.images import load_input_images
from omni_ray.config import load_config
from omni_ray.pipeline import Pipeline
from testing.reference import reference_layers, rgba_source
from testing.serving import file_bytes as png

pytestmark = pytest.mark.vllm

PRESET = REPO / "stage_configs/qwen_image_layered_tiny.yaml"
CASES = {
    # name: (prompt, layers, negative prompt, cfg_normalize, caption language)
    "prompt, 2 layers, CFG off": ("a red ball in front of a blue wall", 2, None, False, "en"),
    "empty prompt, 4 layers, CFG on, normalized": ("", 4, " ", True, "en"),
    "empty prompt, 2 layers, zh caption, CFG on": ("", 2, "blurry", False, "zh"),
}
STEPS = 3


@pytest.fixture(scope="module")
def config(layered_dir):
    return load_config(PRESET, model=str(layered_dir))


@pytest.fixture(scope="module")
def pipeline(config):
    pipeline = Pipeline(config)
    yield pipeline
    pipeline.shutdown()


@pytest.fixture(scope="module")
def reference(layered_dir):
    from diffusers import QwenImageLayeredPipeline

    pipe = QwenImageLayeredPipeline.from_pretrained(layered_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_layers_equal_diffusers_within_one_level_with_and_without_a_prompt(pipeline, config, reference):
    source = rgba_source(60, 44, seed=1)
    bucket = config.edit.resolutions[0]
    inputs = load_input_images([png(source)], config, bucket)

    def body(prompt, layers, negative, normalize, language):
        return {"prompt": prompt, "seed": 5, "n": 2, "layers": layers, "num_inference_steps": STEPS,
                "cfg_normalize": normalize, "caption_language": language,
                **({"negative_prompt": negative} if negative else {})}

    async def run():
        return await asyncio.gather(*(pipeline.generate(body(*case), inputs) for case in CASES.values()))

    for (name, (prompt, layers, negative, normalize, language)), results in zip(CASES.items(), asyncio.run(run())):
        assert results[0].pixels.shape == (layers, *inputs.sizes[0], 4), name
        for index, result in enumerate(results):
            expected, caption = reference_layers(
                reference, source, bucket, 5 + index, config.encoder.caption_max_tokens, prompt=prompt,
                negative_prompt=negative, layers=layers, num_inference_steps=STEPS, cfg_normalize=normalize,
                use_en_prompt=language == "en")
            assert result.revised_prompt == caption, name  # None with a prompt
            assert len(expected) == layers
            for k, layer in enumerate(expected):
                assert np.abs(result.pixels[k].astype(int) - layer.astype(int)).max() <= 1, (name, index, k)
        assert not np.array_equal(results[0].pixels, results[1].pixels)  # image i has seed + i
        assert results[0].revised_prompt == results[1].revised_prompt  # one caption for the request's images


def test_a_repeated_image_is_captioned_from_the_cache(pipeline, config):
    inputs = load_input_images([png(rgba_source(52, 52, seed=9))], config)
    encoder = pipeline.stages.encoder

    first = asyncio.run(pipeline.generate({"prompt": "", "layers": 2, "num_inference_steps": 1, "seed": 1}, inputs))
    before = encoder.stats.core
    again = asyncio.run(pipeline.generate({"prompt": "", "layers": 2, "num_inference_steps": 1, "seed": 2}, inputs))
    after = encoder.stats.core
    assert first[0].revised_prompt == again[0].revised_prompt
    assert after.captioned == before.captioned and after.caption_hits == before.caption_hits + 1
