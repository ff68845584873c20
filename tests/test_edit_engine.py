"""Edits through the three engines, the encoder being vLLM's EngineCore on Qwen2.5-VL's vision path: its embeddings
match transformers' Qwen2.5-VL, and the edits match diffusers' QwenImageEditPipeline."""

import asyncio
import io

import numpy as np
import pytest
import torch
from conftest import REPO, encode_all
from PIL import Image
from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

from omni_ray.api.images import load_input_images
from omni_ray.config import load_config
from omni_ray.engine.builders import build_encoder_core
from omni_ray.families.qwen_image.facts import EDIT
from omni_ray.pipeline import Pipeline
from omni_ray.records import EncodeRequest
from testing.reference import load_reference, reference_edit, source_image

pytestmark = pytest.mark.vllm

SOURCES = {"wide": (180, 100), "tall": (120, 240)}  # input width, height


@pytest.fixture(scope="module")
def config(edit_dir):
    return load_config(REPO / "stage_configs/qwen_image_edit_tiny.yaml", model=str(edit_dir))


@pytest.fixture(scope="module")
def pipeline(config):
    pipeline = Pipeline(config)
    yield pipeline
    pipeline.shutdown()


def working_image(config, name: str, seed: int = 0) -> np.ndarray:
    buffer = io.BytesIO()
    source_image(*SOURCES[name], seed).save(buffer, format="PNG")
    return load_input_images([buffer.getvalue()], config).vae[0]


def test_vision_embeddings_match_transformers_qwen2_5_vl(pipeline, config, edit_dir):
    """transformers as its docs run Qwen2.5-VL: the processor on text and image, its whole output into the model."""
    processor = AutoProcessor.from_pretrained(edit_dir, subfolder="processor")
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(edit_dir, subfolder="text_encoder").eval()
    images = {name: working_image(config, name) for name in SOURCES}
    requests = [
        EncodeRequest("wide", "make the disc blue", "blurry", (images["wide"],)),
        EncodeRequest("tall", "turn it into an oil painting of a lighthouse at sunset", None, (images["tall"],)),
    ]
    # Driven directly here: the engine's thread is idle while nothing is queued.
    results, steps = encode_all(pipeline.stages.encoder.core, requests)
    assert steps <= 2  # vLLM ran the three sequences (and their images) together
    for request in requests:
        texts = {"prompt": request.prompt, "negative": request.negative_prompt}
        for part, text in texts.items():
            got = getattr(results[request.request_id], part)
            if text is None:
                assert got is None
                continue
            inputs = processor(text=[EDIT.text.format(text)], images=Image.fromarray(request.images[0]), return_tensors="pt")
            with torch.no_grad():
                hidden = model(**inputs, output_hidden_states=True).hidden_states[-1][0]
            expected = hidden[EDIT.drop:]
            image_tokens = int((inputs["input_ids"] == model.config.image_token_id).sum())
            assert image_tokens > 10 and got.embeds.shape == expected.shape
            assert (got.embeds - expected).abs().max().item() < 1e-4, (request.request_id, part)


def test_the_transformers_runner_gives_vllm_s_vision_embeddings(pipeline, config):
    """``encoder.runner: transformers`` on the edit path: each sequence with its image alone, the placeholder expanded
    to the image's tokens, within float tolerance of vLLM's embeddings."""
    core = build_encoder_core(config.model_copy(update={"encoder": config.encoder.model_copy(
        update={"runner": "transformers"})}))
    images = {name: working_image(config, name) for name in SOURCES}
    requests = [EncodeRequest("wide", "make the disc blue", "blurry", (images["wide"],)),
                EncodeRequest("tall", "an oil painting", None, (images["tall"],))]
    ours, steps = encode_all(core, requests)
    assert steps == 3  # one sequence with an image a step
    vllm, _ = encode_all(pipeline.stages.encoder.core, [EncodeRequest(f"v{r.request_id}", r.prompt, r.negative_prompt,
                                                                      r.images) for r in requests])
    for request in requests:
        for part in ("prompt", "negative"):
            got, expected = getattr(ours[request.request_id], part), getattr(vllm[f"v{request.request_id}"], part)
            assert (got is None) == (expected is None)
            if got is not None:
                assert got.embeds.shape == expected.embeds.shape and got.embeds.shape[0] > 10
                assert (got.embeds - expected.embeds).abs().max().item() < 1e-4, (request.request_id, part)


def test_engine_edits_match_diffusers_within_one_level(pipeline, config, edit_dir):
    reference = load_reference(edit_dir)
    cases = [(name, negative) for name in SOURCES for negative in (None, "blurry")]
    images = {name: working_image(config, name, seed=3) for name in SOURCES}

    async def run():
        return await asyncio.gather(*(
            pipeline.generate({"prompt": "make the disc blue", "negative_prompt": negative, "num_inference_steps": 3,
                               "seed": 11, "true_cfg_scale": 4.0}, images[name])
            for name, negative in cases
        ))

    results = asyncio.run(run())
    for (name, negative), (result,) in zip(cases, results):
        expected = reference_edit(
            reference, config.edit.image_area, source_image(*SOURCES[name], 3), seed=11, prompt="make the disc blue",
            negative_prompt=negative, true_cfg_scale=4.0, num_inference_steps=3,
        )
        assert result.pixels.shape == expected.shape == images[name].shape
        assert np.abs(result.pixels.astype(int) - expected.astype(int)).max() <= 1, (name, negative)


def test_an_edit_with_first_block_cache_matches_diffusers_with_it(pipeline, config, edit_dir):
    """The edit image's tokens ride in every pass, cached ones too: same decisions and image as diffusers' cache."""
    from diffusers.hooks import FirstBlockCacheConfig

    reference = load_reference(edit_dir)
    reference.transformer.enable_cache(FirstBlockCacheConfig(threshold=1.0))
    ran = []
    reference.transformer.transformer_blocks[1].attn.register_forward_pre_hook(lambda *_: ran.append(1))
    kwargs = {"prompt": "make the disc blue", "negative_prompt": "blurry", "true_cfg_scale": 4.0,
              "num_inference_steps": 8}
    expected = reference_edit(reference, config.edit.image_area, source_image(*SOURCES["wide"], 3), seed=11, **kwargs)
    body = {**kwargs, "seed": 11, "cache": {"kind": "first_block", "threshold": 1.0}}
    (result,) = asyncio.run(pipeline.generate(body, working_image(config, "wide", seed=3)))
    assert result.dit_passes == {"computed": len(ran), "reused": 16 - len(ran)} and 0 < len(ran) < 16
    assert np.abs(result.pixels.astype(int) - expected.astype(int)).max() <= 1


def test_the_prompt_cache_tells_input_images_apart_by_one_pixel(pipeline, config):
    core = pipeline.stages.encoder.core
    image = working_image(config, "wide", seed=5)
    other = image.copy()
    other[0, 0, 0] ^= 1  # one level of one channel of one pixel
    before = core.num_encoded
    first, _ = encode_all(core, [EncodeRequest("p1", "make it red", None, (image,))])
    results, _ = encode_all(core, [EncodeRequest("p2", "make it red", None, (other,)),
                                   EncodeRequest("p3", "make it red", None, (image.copy(),))])
    assert core.num_encoded == before + 2  # p3's text and image were encoded before: not again
    assert torch.equal(results["p3"].prompt.embeds, first["p1"].prompt.embeds)
    assert not torch.equal(results["p2"].prompt.embeds, first["p1"].prompt.embeds)
