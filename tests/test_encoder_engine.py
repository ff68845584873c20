"""The encoder engine is vLLM's EngineCore: its embeddings and the images it leads to match diffusers."""

import asyncio

import numpy as np
import pytest
import torch
from conftest import REPO, encode_all
from diffusers import QwenImagePipeline

from omni_ray.config import load_config
from omni_ray.engine.builders import build_encoder_core
from omni_ray.pipeline import Pipeline
from omni_ray.records import EncodeRequest

pytestmark = pytest.mark.vllm

PROMPTS = ["a red cat", "an oil painting of a lighthouse on a cliff at sunset, waves crashing", "a cup", "night"]


@pytest.fixture(scope="module")
def config(tiny_dir):
    return load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir))


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return QwenImagePipeline.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def pipeline(config):
    pipeline = Pipeline(config)
    yield pipeline
    pipeline.shutdown()


def test_embeddings_match_diffusers_encode_prompt(pipeline, reference):
    requests = [EncodeRequest(f"e{i}", p, "blurry" if i % 2 else None) for i, p in enumerate(PROMPTS)]
    # Driven directly here: the engine's thread is idle while nothing is queued.
    results, steps = encode_all(pipeline.stages.encoder.core, requests)
    assert steps < len(PROMPTS) + 2  # vLLM's scheduler ran the six sequences together, not one step each
    for request in requests:
        expected, _ = reference.encode_prompt(request.prompt, device="cpu")
        got = results[request.request_id]
        assert got.prompt.embeds.shape == expected[0].shape
        assert (got.prompt.embeds - expected[0]).abs().max().item() < 1e-4
        if request.negative_prompt is None:
            assert got.negative is None
        else:
            negative, _ = reference.encode_prompt("blurry", device="cpu")
            assert (got.negative.embeds - negative[0]).abs().max().item() < 1e-4


def test_the_transformers_runner_gives_vllm_s_embeddings(pipeline, config):
    """``encoder.runner: transformers`` under the same engine core: the prompts batched (right-padded, masked), the
    same template and token drop, within float tolerance of vLLM's embeddings."""
    transformers_config = config.model_copy(update={"encoder": config.encoder.model_copy(
        update={"runner": "transformers", "max_num_seqs": 4})})
    core = build_encoder_core(transformers_config)
    requests = [EncodeRequest(f"t{i}", p, "blurry" if i % 2 else None) for i, p in enumerate(PROMPTS)]
    ours, steps = encode_all(core, requests)
    assert steps == 2  # six sequences, four a step
    vllm, _ = encode_all(pipeline.stages.encoder.core, [EncodeRequest(f"v{r.request_id}", r.prompt, r.negative_prompt)
                                                         for r in requests])
    for request in requests:
        got, expected = ours[request.request_id], vllm[f"v{request.request_id}"]
        assert got.prompt.embeds.shape == expected.prompt.embeds.shape
        assert (got.prompt.embeds - expected.prompt.embeds).abs().max().item() < 1e-4
        assert (got.negative is None) == (expected.negative is None)
        if got.negative is not None:
            assert (got.negative.embeds - expected.negative.embeds).abs().max().item() < 1e-4
    core.add_request(EncodeRequest("gone", "a red cat", "blurry"))
    core.abort_requests(["gone"])
    assert not core.has_unfinished_requests() and core.step() == [] and not core.encoder.waiting


def test_abort_before_the_step_leaves_nothing(pipeline):
    core = pipeline.stages.encoder.core
    core.add_request(EncodeRequest("gone", "a red cat", "blurry"))
    core.abort_requests(["gone"])
    assert not core.has_unfinished_requests() and core.step() == []


def test_whole_pipeline_matches_diffusers_within_one_level(pipeline, reference):
    cases = [
        {"prompt": "a red cat", "size": "64x64", "num_inference_steps": 4, "seed": 0},
        {"prompt": "a lighthouse at sunset", "negative_prompt": "blurry, low quality", "size": "96x64",
         "num_inference_steps": 3, "seed": 5, "true_cfg_scale": 4.0},
        {"prompt": "two children flying a kite", "negative_prompt": "dark", "size": "96x64", "num_inference_steps": 4,
         "seed": 9, "true_cfg_scale": 3.0},
    ]

    async def main():
        return await asyncio.gather(*(pipeline.generate(body) for body in cases))

    results = asyncio.run(main())
    for body, (result,) in zip(cases, results):
        width, height = map(int, body["size"].split("x"))
        expected = reference(
            body["prompt"], negative_prompt=body.get("negative_prompt"), true_cfg_scale=body.get("true_cfg_scale", 4.0),
            height=height, width=width, num_inference_steps=body["num_inference_steps"],
            generator=torch.Generator("cpu").manual_seed(body["seed"]),
        ).images[0]
        expected = np.asarray(expected)
        assert result.pixels.shape == expected.shape == (height, width, 3)
        assert expected.std() > 10
        assert np.abs(result.pixels.astype(int) - expected.astype(int)).max() <= 1


def test_latents_output_mode_skips_the_decode(pipeline):
    body = {"prompt": "a red cat", "size": "64x64", "num_inference_steps": 2, "seed": 0}
    (result,) = asyncio.run(pipeline.generate(body, output="latents"))
    assert result.pixels is None and result.latents.latents.shape == (16, 64)
    (both,) = asyncio.run(pipeline.generate(body, output="both"))
    assert both.pixels.shape == (64, 64, 3) and torch.equal(both.latents.latents, result.latents.latents)
