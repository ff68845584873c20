"""`weights: dummy`: a weightless Qwen-Image (omni_ray.checkpoints.dummy) served by the real engines with random
weights."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import yaml
from conftest import REPO

from omni_ray.checkpoints.dummy import write_dummy_checkpoint
from omni_ray.checkpoints.parts import SPECIAL_TOKENS
from omni_ray.config import ConfigError, load_config, parse_config


@pytest.fixture(scope="module")
def reduced(tmp_path_factory):
    """Qwen-Image's widths with 1 transformer block and 1 language-model layer: the full-size code path at a size
    a CPU runs."""
    return write_dummy_checkpoint(tmp_path_factory.mktemp("dummy") / "qwen-image-1-layer", layers=1)


def test_the_dummy_checkpoint_has_the_configs_and_a_tokenizer_with_qwen_s_ids_but_no_weights(reduced):
    from transformers import AutoTokenizer

    from omni_ray.tokenizer import PromptTokenizer

    assert not list(reduced.rglob("*.safetensors"))
    assert json.loads((reduced / "transformer/config.json").read_text())["num_layers"] == 1
    assert json.loads((reduced / "transformer/config.json").read_text())["joint_attention_dim"] == 3584
    tokenizer = AutoTokenizer.from_pretrained(reduced / "tokenizer")
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(151643, 151643 + len(SPECIAL_TOKENS)))
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert PromptTokenizer(str(reduced)).num_tokens("a red cat").text > 0  # the prefix drops as Qwen's


def dummy_preset(model, **changes) -> dict:
    preset = yaml.safe_load((REPO / "stage_configs/qwen_image_tiny.yaml").read_text())
    preset.pop("build_if_missing")
    return {**preset, "name": "qwen-image-dummy-1-layer", "model": str(model), "weights": "dummy", **changes}


def test_presets_refuse_dummy_settings_that_cannot_work(reduced):
    with pytest.raises(ConfigError, match="build_if_missing: dummy writes no weights"):
        parse_config(dummy_preset(reduced, weights="checkpoint", build_if_missing="dummy"))
    shipped = load_config(REPO / "stage_configs/qwen_image_dummy.yaml", model=str(reduced))
    assert (shipped.weights, shipped.dit.dtype, shipped.dit.device) == ("dummy", "bfloat16", "cuda")


@pytest.mark.vllm  # the encoder is vLLM's, in this process
@pytest.mark.full_width
def test_a_reduced_dummy_app_runs_every_stage_and_returns_an_image(reduced):
    from omni_ray.pipeline import Pipeline

    pipeline = Pipeline(parse_config(dummy_preset(reduced)))
    try:
        body = {"prompt": "a lighthouse at dusk", "negative_prompt": "blurry", "size": "96x64", "seed": 3,
                "num_inference_steps": 2}
        (image,) = asyncio.run(pipeline.generate(body, output="both"))
    finally:
        pipeline.shutdown()
    assert image.pixels.shape == (64, 96, 3) and image.pixels.dtype == np.uint8
    assert image.latents.latents.shape == (4 * 6, 64)
    assert image.dit_passes == {"computed": 4, "reused": 0}  # 2 steps, true CFG


@pytest.mark.vllm  # the encoder is vLLM's, with its vision tower, in this process
@pytest.mark.full_width
def test_a_reduced_dummy_edit_app_edits_an_image(tmp_path):
    """Qwen-Image-Edit's layout without weights: vLLM's dummy load format builds the vision tower too."""
    from omni_ray.api.images import load_input_images
    from omni_ray.pipeline import Pipeline
    from testing.reference import source_image
    from testing.serving import file_bytes as png

    model = write_dummy_checkpoint(tmp_path / "qwen-image-edit-1-layer", layers=1, edit=True)
    assert json.loads((model / "model_index.json").read_text())["_class_name"] == "QwenImageEditPipeline"
    assert json.loads((model / "text_encoder/config.json").read_text())["vision_config"]["depth"] == 1
    edit = yaml.safe_load((REPO / "stage_configs/qwen_image_edit_tiny.yaml").read_text())
    edit.pop("build_if_missing")
    config = parse_config({**edit, "name": "qwen-image-edit-dummy-1-layer", "model": str(model), "weights": "dummy"})
    pipeline = Pipeline(config)
    try:
        pixels = load_input_images([png(source_image(180, 100, seed=2))], config).vae[0]
        body = {"prompt": "make the disc blue", "negative_prompt": "blurry", "seed": 3, "num_inference_steps": 2}
        (image,) = asyncio.run(pipeline.generate(body, pixels))
    finally:
        pipeline.shutdown()
    assert image.pixels.shape == pixels.shape and image.pixels.dtype == np.uint8
    assert image.dit_passes == {"computed": 4, "reused": 0}


@pytest.mark.full_width
def test_a_reduced_dummy_edit_2511_app_edits_two_images(tmp_path):
    """Qwen-Image-Edit-2511's layout without weights (Edit-Plus's pipeline, zero_cond_t): two input images through
    vLLM's vision path in one sequence, the VAE and the 1-layer transformer."""
    from omni_ray.api.images import load_input_images
    from omni_ray.pipeline import Pipeline
    from testing.reference import source_image
    from testing.serving import file_bytes as png

    model = write_dummy_checkpoint(tmp_path / "qwen-image-edit-2511-1-layer", layers=1, edit=True, plus=True,
                                   configs="qwen-image-edit-2511")
    assert json.loads((model / "model_index.json").read_text())["_class_name"] == "QwenImageEditPlusPipeline"
    assert json.loads((model / "transformer/config.json").read_text())["zero_cond_t"] is True
    preset = yaml.safe_load((REPO / "stage_configs/qwen_image_edit_plus_tiny.yaml").read_text())
    preset.pop("build_if_missing")
    config = parse_config({**preset, "name": "qwen-image-edit-2511-dummy-1-layer", "model": str(model),
                           "weights": "dummy", "configs": "qwen-image-edit-2511"})
    pipeline = Pipeline(config)
    try:
        inputs = load_input_images([png(source_image(180, 100, seed=2)), png(source_image(120, 240, seed=3))],
                                   config)
        body = {"prompt": "put the disc on the second", "negative_prompt": "blurry", "seed": 3,
                "num_inference_steps": 2}
        (image,) = asyncio.run(pipeline.generate(body, inputs))
        assert pipeline.stages.encoder.stats.core.encoded == 2  # the prompt and the negative, each with both images
    finally:
        pipeline.shutdown()
    assert image.pixels.shape == inputs.vae[-1].shape and image.pixels.dtype == np.uint8
    assert image.dit_passes == {"computed": 4, "reused": 0}


def test_random_weights_build_a_transformers_model_too_the_same_from_the_same_seed(tiny_dir):
    """``random_model`` for the encoder on the transformers runner (and diffusers' pipeline in the GPU plan): a
    transformers model has ``_from_config`` where a diffusers one has ``from_config``."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from omni_ray.runners.random_weights import random_model

    config = Qwen2_5_VLConfig.from_pretrained(tiny_dir / "text_encoder")
    first, again = (random_model(Qwen2_5_VLForConditionalGeneration, config, torch.bfloat16, "cpu") for _ in range(2))
    weights = first.state_dict()
    assert {w.dtype for w in weights.values() if w.is_floating_point()} == {torch.bfloat16}
    assert all(torch.equal(weights[name], w) for name, w in again.state_dict().items())
    assert any(w.float().std() > 0 for w in weights.values() if w.is_floating_point())
