"""Qwen-Image 2.1's full-size architecture as shipped (omni_ray/families/qwen_image_2_1/configs/qwen-image-2.1/): the
configs load in diffusers' and transformers' config classes, the models they build have the published sizes, and its
presets fit their GPUs (omni_ray/placement.py)."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import REPO

from omni_ray.checkpoints.full_size import configs_dir
from omni_ray.families.qwen_image_2_1 import facts as qwen_image21

CONFIGS = configs_dir("qwen-image-2.1")


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


PRESETS_21 = ("qwen_image_2_1.yaml", "qwen_image_2_1_48gb.yaml", "qwen_image_2_1_dummy.yaml")


def preset(name: str) -> dict:
    return yaml.safe_load((REPO / "stage_configs" / name).read_text())


@pytest.mark.parametrize("name", PRESETS_21)
def test_the_full_size_presets_load_and_fit_their_gpus(name):
    from omni_ray.config import load_config
    from omni_ray.placement import stage_memory

    config = load_config(REPO / "stage_configs" / name)
    assert (config.family, config.configs, config.pipeline) == (qwen_image21.FAMILY, "qwen-image-2.1",
                                                                qwen_image21.PIPELINE)
    assert (config.edit.max_images, config.edit.image_area, config.edit.plus) == (3, 1024 * 1024, False)
    requests = config.requests
    assert (requests.default_width, requests.default_height, requests.default_steps) == (1024, 1024, 40)
    assert all(side % qwen_image21.SIZE_MULTIPLE == 0 for side in (requests.min_side, requests.max_side))
    assert config.sample_sigmas is None  # the published checkpoint has none: default_steps shifted steps
    assert config.dit.cache_memory_bytes is not None
    # every stage on a GPU, each within its share; a one-GPU preset's shares add up to one GPU
    estimates = stage_memory(config, config.gpu_memory_gib)
    assert [e.stage for e in estimates] == ["encoder", "dit", "vae"] and all(e.fits for e in estimates)
    shares = {s: getattr(config, s).deployment.num_gpus for s in ("encoder", "dit", "vae")}
    if config.gpu_memory_gib == 80:
        assert sum(shares.values()) <= 1
    else:  # 48 GB cards: the DiT on one, the encoder and the VAE sharing another
        assert shares["dit"] == 1 and shares["encoder"] + shares["vae"] <= 1
    # the condition caches' budget holds one true-CFG edit with three images at the largest prompt
    from omni_ray.families.qwen_image_2_1.placement import dit_request_cache_bytes

    assert dit_request_cache_bytes(config) <= config.dit.cache_memory_bytes


def test_the_real_and_dummy_one_gpu_presets_differ_only_in_their_checkpoints():
    from omni_ray.config import load_config

    real = load_config(REPO / "stage_configs/qwen_image_2_1.yaml")
    dummy = load_config(REPO / "stage_configs/qwen_image_2_1_dummy.yaml")
    assert real.model == "Qwen/Qwen-Image-2.1" and (dummy.weights, dummy.build_if_missing) == ("dummy", "dummy")
    fields = {"name", "model", "weights", "build_if_missing"}
    assert real.model_dump(exclude=fields) == dummy.model_dump(exclude=fields)


@pytest.mark.parametrize("name", ["qwen_image_2_1.yaml", "qwen_image_2_1_dummy.yaml"])
@pytest.mark.parametrize("change, field", [
    # a 16 GB GPU: the first stage checked, the encoder (16.3 GiB of weights alone), has 4.8 GiB
    (lambda p: p.update(gpu_memory_gib=16), "encoder.deployment.num_gpus"),
    # a 24 GiB condition-cache budget on top of 13.3 GiB of weights and a step's 5.8 GiB: more than 40 GiB
    (lambda p: p["dit"].update(cache_memory_bytes=24 << 30), "dit.deployment.num_gpus"),
    (lambda p: p["vae"].update(max_batch_size=2), "vae.deployment.num_gpus"),  # two 1536x1536 decodes
    (lambda p: p["requests"].update(max_side=2048), "vae.deployment.num_gpus"),  # 25 GiB to decode 2048x2048
    (lambda p: p["encoder"].update(kv_cache_memory_bytes=8 << 30), "encoder.deployment.num_gpus"),
])
def test_a_2_1_placement_that_cannot_fit_is_refused_naming_the_stage(name, change, field):
    from omni_ray.config import ConfigError, parse_config

    data = preset(name)
    data["model"] = "Qwen/Qwen-Image-2.1"  # the dummy's checkpoint may not be written here
    parse_config(data)  # as shipped, it fits
    change(data)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_config(data)


def test_the_2_1_estimates_follow_the_settings_they_name():
    """What each 2.1 estimate counts: the vision tower only with edits (on vLLM), the DiT's condition caches from the
    budget (or the rows' own without one), and a step's tokens bounded by max_batch_tokens."""
    from omni_ray.config import ConfigError, parse_config
    from omni_ray.families.qwen_image_2_1.placement import (
        dit_condition_tokens,
        dit_request_cache_bytes,
        dit_row_tokens,
        dit_step_tokens,
    )
    from omni_ray.placement import GIB, stage_memory

    data = preset("qwen_image_2_1.yaml")
    config = parse_config(data)
    # three 1024x1024 images: 1,024 vision slots each in max_model_len's tokens, widened to 4,096 latent tokens each
    assert dit_condition_tokens(config) == 4096 + 3 * 3 * 1024
    assert dit_row_tokens(config) == 2 * ((1536 // 16) ** 2 + 4096 + 9 * 1024)
    assert dit_step_tokens(config) == dit_row_tokens(config)  # one such row a step: it passes max_batch_tokens
    assert dit_request_cache_bytes(config) == 2 * 2 * (4096 + 9 * 1024) * 32 * 4096 * 2
    need = {e.stage: e.need_gib for e in stage_memory(config, 80)}

    text_only = parse_config({k: v for k, v in data.items() if k != "edit"})
    text_need = {e.stage: e.need_gib for e in stage_memory(text_only, 80)}
    vision = qwen_image21.VISION_PARAMS * 2 / GIB
    assert text_need["encoder"] == pytest.approx(need["encoder"] - vision, abs=0.1)
    assert text_need["dit"] < need["dit"]  # a step's condition block is the prompt's alone
    transformers = parse_config({**data, "encoder": {**data["encoder"], "runner": "transformers"}})
    encoder = stage_memory(transformers, 80)[0]  # the vision tower always, no KV cache
    assert encoder.need_gib == pytest.approx(need["encoder"] - 2.0, abs=0.1)

    no_budget = parse_config({**data, "dit": {k: v for k, v in data["dit"].items() if k != "cache_memory_bytes"}})
    dit = stage_memory(no_budget, 80)[1]
    assert dit.need_gib == pytest.approx(need["dit"] - 18 + dit_request_cache_bytes(config) / GIB, abs=0.1)
    unbounded = config.model_copy(update={"dit": config.dit.model_copy(update={"max_batch_tokens": None})})
    assert dit_step_tokens(unbounded) == 8 * dit_row_tokens(config)  # max_batch_size rows: 47 GiB, refused
    with pytest.raises(ConfigError, match=r"dit\.deployment\.num_gpus"):
        parse_config({**data, "dit": {k: v for k, v in data["dit"].items() if k != "max_batch_tokens"}})


def test_the_dummy_preset_writes_a_weightless_2_1_checkpoint_in_the_published_layout(tmp_path):
    """`weights: dummy` for 2.1: ensure writes the shipped configs and processor/ (a tokenizer with Qwen's special
    token ids, Qwen3-VL's image processor with the published settings, a chat template whose system turn is the one
    the pipeline drops); no weights, no tokenizer/ folder. A condition image's vision slots are one per 32x32 tile."""
    import numpy as np
    from transformers import AutoProcessor

    from omni_ray import checkpoints
    from omni_ray.checkpoints.parts import SPECIAL_TOKENS
    from omni_ray.config import load_config

    model = tmp_path / "qwen-image-2.1-dummy"
    config = checkpoints.ensure(load_config(REPO / "stage_configs/qwen_image_2_1_dummy.yaml", model=str(model)))
    assert config.sample_sigmas is None and not list(model.rglob("*.safetensors"))
    assert sorted(p.name for p in model.iterdir()) == ["model_index.json", "processor", "scheduler", "text_encoder",
                                                       "transformer", "vae"]
    for component in ("model_index.json", "transformer/config.json", "vae/config.json", "text_encoder/config.json",
                      "scheduler/scheduler_config.json"):
        assert (model / component).read_bytes() == (CONFIGS / component).read_bytes(), component
    processor = AutoProcessor.from_pretrained(model, subfolder="processor")
    assert type(processor).__name__ == "Qwen3VLProcessor"
    tokenizer = processor.tokenizer
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(151643, 151643 + len(SPECIAL_TOKENS)))
    assert tokenizer.model_max_length == 262144
    published = json.loads((CONFIGS / "processor/preprocessor_config.json").read_text())
    image_processor = processor.image_processor
    assert (image_processor.size, image_processor.patch_size, image_processor.merge_size) == (
        published["size"], published["patch_size"], published["merge_size"])
    system = processor.apply_chat_template(
        [{"role": "system", "content": [{"type": "text", "text": qwen_image21.SYSTEM_PROMPT}]}], tokenize=True,
        return_dict=False)
    assert system[0] == tokenizer(qwen_image21.SYSTEM_TURN).input_ids  # the pipeline's _drop_idx
    image = np.zeros((1024, 768, 3), np.uint8)
    ids = processor(text=[qwen_image21.format_prompt("make it blue", 1)], images=[image]).input_ids[0]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|image_pad|>")) == qwen_image21.vision_slots(1024, 768)


def test_a_reduced_dummy_keeps_2_1_s_widths():
    """--layers: the same widths with fewer blocks, the vision tower's deepstack within its depth."""
    import tempfile

    from omni_ray.checkpoints.dummy import write_dummy_checkpoint
    from testing.full_size import build_meta

    with pytest.raises(ValueError, match="one layout"):
        write_dummy_checkpoint("/nonexistent", edit=True, configs="qwen-image-2.1")
    with tempfile.TemporaryDirectory() as tmp:
        model = write_dummy_checkpoint(f"{tmp}/reduced", layers=1, configs="qwen-image-2.1")
        models = build_meta(model)
    assert len(models["transformer"].transformer_blocks) == 1 and models["transformer"].inner_dim == 4096
    text = models["text_encoder"].config
    assert (text.text_config.num_hidden_layers, text.text_config.hidden_size) == (1, qwen_image21.TEXT_HIDDEN)
    assert (text.vision_config.depth, text.vision_config.deepstack_visual_indexes) == (1, [0])


@pytest.mark.vllm  # the encoder is vLLM's, with its vision tower, in this process
@pytest.mark.full_width
def test_a_reduced_dummy_2_1_app_generates_and_edits_at_full_width(tmp_path):
    """Qwen-Image 2.1's widths (Qwen3-VL-8B's 4,096, the transformer's 32 heads of 128, the VAE's 64 channels) with
    one block and one language-model layer, random weights, through the three engines: the full-size code path at a
    size a CPU runs, a generation with true CFG and an edit of two condition images."""
    import asyncio

    import yaml

    from omni_ray.api.images import load_input_images
    from omni_ray.api.planning import plan_request
    from omni_ray.checkpoints.dummy import write_dummy_checkpoint
    from omni_ray.config import ConfigError, parse_config
    from omni_ray.errors import RequestError
    from omni_ray.pipeline import Pipeline
    from omni_ray.tokenizer import tokenizer_for
    from testing.reference import source_image
    from testing.serving import file_bytes

    model = write_dummy_checkpoint(tmp_path / "qwen-image-2.1-1-layer", layers=1, configs="qwen-image-2.1")
    preset = yaml.safe_load((REPO / "stage_configs/qwen_image_2_1_tiny.yaml").read_text())
    preset.pop("build_if_missing")
    preset = {**preset, "name": "qwen-image-2.1-dummy-1-layer", "model": str(model), "weights": "dummy",
              "configs": "qwen-image-2.1"}
    with pytest.raises(ConfigError, match="edit.image_area: 4096 pixels is below the 65536"):
        parse_config(preset)  # the published processor's floor: smaller condition images would not line up
    files = [file_bytes(source_image(90, 40, 1)), file_bytes(source_image(48, 100, 2))]
    at_floor = parse_config({**preset, "edit": {**preset["edit"], "image_area": 256 * 256}})
    with pytest.raises(RequestError, match="150 vision tokens, not the 132") as err:  # 384x160 rounds below it
        plan_request({"prompt": "add snow"}, at_floor, tokenizer_for(at_floor).num_tokens,
                     load_input_images(files, at_floor))
    assert err.value.param == "image"
    config = parse_config({**preset, "edit": {**preset["edit"], "image_area": 320 * 320}})
    pipeline = Pipeline(config)
    try:
        body = {"prompt": "a lighthouse at dusk", "negative_prompt": "blurry", "true_cfg_scale": 3.0,
                "size": "96x64", "seed": 3, "num_inference_steps": 2}
        (image,) = asyncio.run(pipeline.generate(body, output="both"))
        inputs = load_input_images(files, config)
        # a small output: the condition images take the full-width path, and a 320x320 decode made the test 91 s
        # against 75 (the default size, the last image's, is tests/test_pipeline21.py's)
        (edited,) = asyncio.run(pipeline.generate({"prompt": "add snow", "seed": 4, "num_inference_steps": 2,
                                                   "size": "96x64"}, inputs))
    finally:
        pipeline.shutdown()
    assert image.pixels.shape == (64, 96, 4) and image.pixels.dtype == "uint8"
    assert image.latents.latents.shape == (4 * 6, 64)
    assert image.dit_passes == {"computed": 4, "reused": 0}  # 2 steps, true CFG
    assert edited.pixels.shape == (64, 96, 4)
