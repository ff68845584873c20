"""ControlNet end to end in process (issue 39): the tiny Qwen-Image preset with a tiny ControlNet-Union, requests
carrying one and two control images (the `control` field, base64 as the API takes it) through the three engines,
each image within one level of diffusers' QwenImageControlNetPipeline (one image) and QwenImageMultiControlNetModel
(two), CFG on and off, n=2."""

import asyncio
import base64

import numpy as np
import pytest
import yaml
from conftest import REPO

from omni_ray.config import parse_config
from omni_ray.pipeline import Pipeline
from testing.reference import reference_controlnet, source_image
from testing.serving import file_bytes

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def controlnet_dir(tiny_dir, tmp_path_factory):
    from omni_ray.checkpoints.tiny import write_controlnet

    return write_controlnet(tmp_path_factory.mktemp("controlnet") / "union", tiny_dir, seed=1)


@pytest.fixture(scope="module")
def pipeline(tiny_dir, controlnet_dir):
    preset = yaml.safe_load((REPO / "stage_configs/qwen_image_tiny.yaml").read_text())
    config = parse_config({**preset, "model": str(tiny_dir), "controlnets": {"union": str(controlnet_dir)}})
    pipeline = Pipeline(config)
    yield pipeline
    pipeline.shutdown()


@pytest.fixture(scope="module")
def references(tiny_dir, controlnet_dir):
    from diffusers import (
        QwenImageControlNetModel,
        QwenImageControlNetPipeline,
        QwenImageMultiControlNetModel,
        QwenImagePipeline,
    )

    base = QwenImagePipeline.from_pretrained(tiny_dir)
    net = QwenImageControlNetModel.from_pretrained(controlnet_dir)
    one = QwenImageControlNetPipeline(controlnet=net, **base.components)
    two = QwenImageControlNetPipeline(controlnet=QwenImageMultiControlNetModel([net]), **base.components)
    for pipe in (one, two):
        pipe.set_progress_bar_config(disable=True)
    return {1: one, 2: two}


CONTROLS = [source_image(96, 64, seed=7), source_image(96, 64, seed=8)]
CASES = {
    # name: (control images, their scales, start, end, negative prompt)
    "one, CFG off": (1, [0.8], [0.0], [1.0], None),
    "one, CFG on, a window": (1, [1.2], [0.25], [0.75], "blurry"),
    "two, CFG on": (2, [0.6, 1.0], [0.0, 0.0], [1.0, 0.5], "dark"),
}


def b64(image) -> str:
    return base64.b64encode(file_bytes(image)).decode()


def test_controlled_generations_equal_diffusers_within_one_level(pipeline, references):
    prompt = "a lighthouse on a cliff"

    def body(count, scales, starts, ends, negative):
        control = [{"name": "union", "image": b64(CONTROLS[k]), "scale": scales[k], "start": starts[k],
                    "end": ends[k]} for k in range(count)]
        return {"prompt": prompt, "size": "96x64", "seed": 11, "n": 2, "num_inference_steps": 4,
                "control": control, **({"negative_prompt": negative} if negative else {})}

    async def run():
        return await asyncio.gather(*(pipeline.generate(body(*case)) for case in CASES.values()))

    for (name, (count, scales, starts, ends, negative)), results in zip(CASES.items(), asyncio.run(run())):
        for index, result in enumerate(results):
            many = count > 1
            expected = reference_controlnet(
                references[count], CONTROLS[:count], 11 + index, prompt=prompt, negative_prompt=negative,
                true_cfg_scale=4.0, num_inference_steps=4,
                controlnet_conditioning_scale=scales if many else scales[0],
                control_guidance_start=starts if many else starts[0],
                control_guidance_end=ends if many else ends[0])
            assert np.abs(result.pixels.astype(int) - expected.astype(int)).max() <= 1, (name, index)
        assert not np.array_equal(results[0].pixels, results[1].pixels)
