"""Qwen-Image 2.1's full-size architecture as shipped (omni_ray/model_configs/qwen-image-2.1/): the configs load in
diffusers' and transformers' config classes, the models they build have the published sizes, and its presets fit
their GPUs (omni_ray/placement.py)."""

from __future__ import annotations

import json

import pytest

from omni_ray import qwen_image21
from omni_ray.checkpoints.full_size import MODEL_CONFIGS

CONFIGS = MODEL_CONFIGS / "qwen-image-2.1"


def test_the_shipped_configs_are_qwen_image_2_1_s_in_diffusers_layout():
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel
    from transformers import AutoConfig

    index = json.loads((CONFIGS / "model_index.json").read_text())
    assert index["_class_name"] == qwen_image21.PIPELINE
    assert (index["transformer"], index["processor"]) == (["diffusers", "QwenImage21Transformer2DModel"],
                                                          ["transformers", "Qwen3VLProcessor"])
    assert "sample_sigmas" not in index  # the base checkpoint samples default_steps shifted steps
    transformer = QwenImage21Transformer2DModel.load_config(CONFIGS / "transformer")
    assert (transformer["num_layers"], transformer["num_attention_heads"], transformer["attention_head_dim"],
            transformer["context_in_dim"], transformer["in_channels"], transformer["patch_size"],
            transformer["causal_condition"]) == (32, 32, 128, qwen_image21.TEXT_HIDDEN, 64, 1, True)
    vae = AutoencoderKLQwenImage21.load_config(CONFIGS / "vae")
    assert (vae["z_dim"], vae["in_channels"], vae["out_channels"], vae["scale_factor_spatial"]) == (
        qwen_image21.LATENT_CHANNELS, qwen_image21.IMAGE_CHANNELS, qwen_image21.IMAGE_CHANNELS,
        qwen_image21.VAE_COMPRESSION)
    assert len(vae["latents_mean"]) == len(vae["latents_std"]) == qwen_image21.LATENT_CHANNELS
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(CONFIGS / "scheduler")
    assert scheduler.config.use_dynamic_shifting and scheduler.config.shift_terminal == 0.02
    text = AutoConfig.from_pretrained(CONFIGS / "text_encoder")
    assert text.model_type == "qwen3_vl" and text.text_config.hidden_size == qwen_image21.TEXT_HIDDEN
    assert (text.image_token_id, text.vision_start_token_id) == (151655, 151652)  # Qwen's special token ids
    preprocessor = json.loads((CONFIGS / "processor/preprocessor_config.json").read_text())
    patch, merge = preprocessor["patch_size"], preprocessor["merge_size"]
    assert patch * merge == qwen_image21.SIZE_MULTIPLE  # one vision token per 32x32 tile
    assert merge**2 == qwen_image21.TOKENS_PER_SLOT * (patch // qwen_image21.VAE_COMPRESSION) ** 2


def test_the_full_size_models_have_the_published_parameter_counts():
    from testing.full_size import parameter_counts, vision_parameters

    counts = parameter_counts("qwen-image-2.1")
    assert counts == qwen_image21.PUBLISHED_PARAMS
    assert 7.0e9 < counts["transformer"] < 7.2e9  # "7B"
    assert vision_parameters("qwen-image-2.1") == qwen_image21.VISION_PARAMS


@pytest.mark.vllm  # imports vLLM in the test process
def test_vllm_takes_the_shipped_text_encoder_config():
    import os

    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    from vllm.engine.arg_utils import EngineArgs

    model_config = EngineArgs(
        model=str(CONFIGS / "text_encoder"), skip_tokenizer_init=True, runner="pooling", convert="embed",
        load_format="dummy", dtype="bfloat16", max_model_len=4096,
    ).create_model_config()
    assert model_config.get_hidden_size() == qwen_image21.TEXT_HIDDEN
    assert model_config.get_vocab_size() == 151936
    assert model_config.is_multimodal_model
