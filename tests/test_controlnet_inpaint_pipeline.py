"""An inpainting ControlNet end to end in process: the tiny Qwen-Image preset holding a tiny inpainting ControlNet
(read as one from its folder), requests whose `control` carries the control image and OpenAI's mask (base64, as the
API takes them) through the three engines, each image within one level of diffusers'
QwenImageControlNetInpaintPipeline (whose control sample comes from torch's global generator: the reference seeds it
with the image's seed first), CFG on and off, n=2; and a plain control beside it."""

import asyncio
import base64

import numpy as np
import pytest
import yaml
from conftest import REPO
from PIL import Image

from omni_ray.config import parse_config
from omni_ray.pipeline import Pipeline
from testing.reference import openai_mask, reference_controlnet_inpaint, source_image
from testing.serving import file_bytes

pytestmark = pytest.mark.vllm

HEIGHT, WIDTH = 64, 96


@pytest.fixture(scope="module")
def controlnet_dirs(tiny_dir, tmp_path_factory):
    from omni_ray.checkpoints.tiny import write_controlnet

    root = tmp_path_factory.mktemp("controlnets")
    return {"inpaint": write_controlnet(root / "inpaint", tiny_dir, seed=2, inpaint=True),
            "union": write_controlnet(root / "union", tiny_dir, seed=1)}


@pytest.fixture(scope="module")
def pipeline(tiny_dir, controlnet_dirs):
    preset = yaml.safe_load((REPO / "stage_configs/qwen_image_tiny.yaml").read_text())
    config = parse_config({**preset, "model": str(tiny_dir),
                           "controlnets": {name: str(path) for name, path in controlnet_dirs.items()}})
    assert config.inpaint_controlnets == ["inpaint"]
    pipeline = Pipeline(config)
    yield pipeline
    pipeline.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_dir, controlnet_dirs):
    from diffusers import QwenImageControlNetInpaintPipeline, QwenImageControlNetModel

    pipe = QwenImageControlNetInpaintPipeline.from_pretrained(
        tiny_dir, controlnet=QwenImageControlNetModel.from_pretrained(controlnet_dirs["inpaint"]))
    pipe.set_progress_bar_config(disable=True)
    return pipe


CONTROL = np.asarray(source_image(WIDTH, HEIGHT, seed=5))


def repaint() -> np.ndarray:
    mask = np.zeros((HEIGHT, WIDTH), bool)
    mask[12:50, 20:75] = True
    return mask


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


CASES = {"CFG off": (0.9, None), "CFG on": (1.2, "blurry")}


def test_inpainting_control_generations_equal_diffusers_within_one_level(pipeline, reference):
    prompt = "a green taxi on the road"

    def body(scale, negative, extra=()):
        control = [{"name": "inpaint", "image": b64(file_bytes(Image.fromarray(CONTROL))), "mask": b64(openai_mask(repaint())),
                    "scale": scale}, *extra]
        return {"prompt": prompt, "size": f"{WIDTH}x{HEIGHT}", "seed": 21, "n": 2, "num_inference_steps": 4,
                "control": control, **({"negative_prompt": negative} if negative else {})}

    async def run(bodies):
        return await asyncio.gather(*(pipeline.generate(b) for b in bodies))

    worst = 0
    for (name, (scale, negative)), results in zip(CASES.items(), asyncio.run(run([body(*c) for c in CASES.values()]))):
        for index, result in enumerate(results):
            expected = reference_controlnet_inpaint(
                reference, CONTROL, repaint(), 21 + index, prompt=prompt, negative_prompt=negative,
                true_cfg_scale=4.0, num_inference_steps=4, controlnet_conditioning_scale=scale)
            diff = np.abs(result.pixels.astype(int) - expected.astype(int)).max()
            worst = max(worst, diff)
            assert diff <= 1, (name, index)
        assert not np.array_equal(results[0].pixels, results[1].pixels)
    print(f"inpainting ControlNet end to end: max |ours - diffusers| = {worst} levels")
    # a plain control beside it changes the image (its sample drawn from the image's generator before the noise)
    union = {"name": "union", "image": b64(file_bytes(source_image(WIDTH, HEIGHT, seed=6)))}
    alone, with_union = asyncio.run(run([body(0.9, None), body(0.9, None, [union])]))
    assert np.abs(alone[0].pixels.astype(int) - with_union[0].pixels.astype(int)).max() > 1
