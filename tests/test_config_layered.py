"""Qwen-Image-Layered's presets (family qwen-image-layered): they validate, build and check their checkpoint, and
refuse what the layered path does not have, naming the field."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import REPO

from omni_ray.checkpoints import ensure
from omni_ray.checkpoints.full_size import pipeline_class, published_configs
from omni_ray.config import ConfigError, parse_config
from omni_ray.families.qwen_image.facts import TEXT_TO_IMAGE

PRESETS = REPO / "stage_configs"
LAYERED_PRESETS = ("qwen_image_layered.yaml", "qwen_image_layered_dummy.yaml", "qwen_image_layered_tiny.yaml")


def preset(name: str) -> dict:
    return yaml.safe_load((PRESETS / name).read_text())


def tiny_preset(layered_dir) -> dict:
    return {**preset("qwen_image_layered_tiny.yaml"), "model": str(layered_dir), "build_if_missing": None}


@pytest.mark.parametrize("name", LAYERED_PRESETS)
def test_the_layered_presets_validate_as_layered_edits(name):
    data = {**preset(name), "model": "Qwen/Qwen-Image-Layered"}  # the checkpoint may not be built here
    config = parse_config(data, source=name)
    assert config.family == "qwen-image-layered" and config.pipeline == "QwenImageLayeredPipeline"
    assert config.edit is not None and config.edit.max_images == 1 and not config.edit.plus
    assert config.prompt_template == TEXT_TO_IMAGE  # its prompt is encoded as text only
    if name != "qwen_image_layered_tiny.yaml":
        assert config.configs == "qwen-image-layered" and config.dit.device == "cuda"
        assert config.dit.dtype == config.encoder.dtype == config.vae.dtype == "bfloat16"
        assert all(getattr(config, s).deployment.num_gpus == 1 for s in ("encoder", "dit", "vae"))


def test_the_tiny_preset_leaves_room_for_a_caption():
    config = parse_config({**preset("qwen_image_layered_tiny.yaml"), "model": "Qwen/Qwen-Image-Layered"})
    assert config.encoder.max_sequence_length == 512
    assert config.encoder.max_model_len >= 921 + 512  # the Chinese template and a 4:1 image in the tiny tokenizer
    assert (config.encoder.device, config.encoder.dtype) == ("cpu", "float32")


@pytest.mark.parametrize("change, field", [
    (lambda p: p.pop("edit"), "edit"),
    (lambda p: p["edit"].update(max_images=2), "edit.max_images"),
    (lambda p: p["edit"].update(plus=True), "edit.max_images"),
    (lambda p: p.update(controlnets={"union": "/nowhere"}), "controlnets"),
    (lambda p: p["dit"].update(compile=True), "dit.compile"),
    (lambda p: p["dit"].update(runner="simulated"), "runner"),
    (lambda p: p["vae"].update(tiling=True), "vae.tiling"),
    (lambda p: p["dit"].update(parallel={"cfg": 2}), "dit.parallel"),
    (lambda p: p.update(sample_sigmas=[1.0, 0.5]), "sample_sigmas"),
    (lambda p: p["edit"].pop("resolutions"), "edit.resolutions"),
    (lambda p: p.update(family="qwen-image"), "edit.resolutions"),  # buckets are Layered's alone
])
def test_a_layered_preset_refuses_what_its_runners_do_not_have(change, field):
    data = {**preset("qwen_image_layered_tiny.yaml"), "model": "Qwen/Qwen-Image-Layered"}
    data["edit"] = dict(data["edit"])
    data["dit"] = dict(data["dit"])
    data["vae"] = dict(data["vae"])
    change(data)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_config(data)


def test_fp8_is_refused_for_layered():
    data = {**preset("qwen_image_layered.yaml")}
    data["dit"] = {**data["dit"], "quantization": "fp8"}
    with pytest.raises(ConfigError, match=r"dit\.quantization"):
        parse_config(data)


def test_a_layered_dummy_preset_is_written_from_layered_configs():
    data = {**preset("qwen_image_layered_dummy.yaml"), "configs": "qwen-image"}
    with pytest.raises(ConfigError, match="configs"):
        parse_config(data)
    assert "qwen-image-layered" in published_configs()
    assert pipeline_class("qwen-image-layered") == "QwenImageLayeredPipeline"


def test_the_tiny_preset_loads_the_layered_checkpoint_and_refuses_others(layered_dir, edit_dir):
    config = parse_config(tiny_preset(layered_dir))
    assert config.model == str(layered_dir.resolve())
    with pytest.raises(ConfigError, match="family qwen-image-layered is for QwenImageLayeredPipeline"):
        parse_config({**tiny_preset(layered_dir), "model": str(edit_dir)})
    with pytest.raises(ConfigError, match="QwenImageLayeredPipeline"):  # an edit preset on a layered checkpoint
        parse_config({**preset("qwen_image_edit_tiny.yaml"), "model": str(layered_dir), "build_if_missing": None})


def test_build_if_missing_writes_the_layered_checkpoints(tmp_path):
    tiny = parse_config({**preset("qwen_image_layered_tiny.yaml"), "model": str(tmp_path / "tiny")})
    ensure(tiny)
    index = json.loads((tmp_path / "tiny" / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageLayeredPipeline" and "processor" in index
    transformer = json.loads((tmp_path / "tiny" / "transformer" / "config.json").read_text())
    assert transformer["use_layer3d_rope"] and transformer["use_additional_t_cond"]

    dummy = parse_config({**preset("qwen_image_layered_dummy.yaml"), "model": str(tmp_path / "dummy")})
    ensure(dummy)
    folder = tmp_path / "dummy"
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == "QwenImageLayeredPipeline"
    assert json.loads((folder / "vae" / "config.json").read_text())["input_channels"] == 4
    assert (folder / "processor").is_dir() and (folder / "tokenizer").is_dir()
    assert not list(folder.rglob("*.safetensors"))
