"""Qwen-Image's full-size architecture as shipped (omni_ray/families/qwen_image/configs/): the configs load in diffusers',
transformers' and vLLM's config classes, and the models they build have the published sizes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

from omni_ray.checkpoints.full_size import CONFIG_DIR, published_configs
from omni_ray.families.qwen_image.facts import PUBLISHED_PARAMS
from omni_ray.families.qwen_image_2_1 import facts as qwen_image21


def test_gpu_dry_run_builds_the_full_size_models_with_the_published_parameter_counts(tmp_path):
    out = tmp_path / "dry.json"
    subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--counts", "--out", str(out)], cwd=REPO, check=True,
                   capture_output=True, timeout=300)
    report = json.loads(out.read_text())
    assert set(report["params"]) == {"transformer", "vae", "text_encoder"}
    for name, count in report["params"].items():
        assert abs(count / PUBLISHED_PARAMS[name] - 1) < 0.01, name
    assert list(report["params_by_configs"]) == published_configs() == [
        "qwen-image", "qwen-image-2.1", "qwen-image-edit-2511", "qwen-image-layered"]
    by_configs = report["params_by_configs"]
    assert all(by_configs[name] == report["params"] for name in ("qwen-image", "qwen-image-edit-2511"))
    # Layered: its "RGB or RGBA" timestep embedding (2 x 3072) and its VAE's fourth channel in and out (96 x 27
    # weights each way, and a bias)
    layered = {name: by_configs["qwen-image-layered"][name] - count for name, count in report["params"].items()}
    assert layered == {"transformer": 2 * 3072, "vae": 2 * 96 * 27 + 1, "text_encoder": 0}
    assert by_configs["qwen-image-2.1"] == qwen_image21.PUBLISHED_PARAMS  # another architecture (test_full_size21)
    assert 20.3e9 < report["params"]["transformer"] < 20.5e9
    placement = report["placement"]
    assert placement["preset"] == "stage_configs/qwen_image_shared.yaml"
    assert [s["stage"] for s in placement["stages"]] == ["encoder", "dit", "vae"]
    assert all(s["fits"] and s["need_gib"] <= s["share_gib"] for s in placement["stages"])
    assert {s["stage"]: s["share_gib"] for s in placement["stages"]} == {"encoder": 40.0, "dit": 80.0, "vae": 40.0}


def shared_preset() -> dict:
    import yaml

    return yaml.safe_load((REPO / "stage_configs/qwen_image_shared.yaml").read_text())


@pytest.mark.parametrize("breakage, field", [
    # 4 images of 2048x2048 per VAE call need about 68 GiB: more than half of an 80 GB GPU
    (lambda p: p["vae"].update(max_batch_size=4), "vae.deployment.num_gpus"),
    (lambda p: p["dit"]["deployment"].update(num_gpus=0.5), "dit.deployment.num_gpus"),  # 38 GiB of weights alone
    (lambda p: p.update(gpu_memory_gib=24), "encoder.deployment.num_gpus"),  # a 24 GB GPU: nothing fits
    (lambda p: p["encoder"].update(gpu_memory_utilization=0.9), "encoder.gpu_memory_utilization"),
])
def test_a_placement_that_cannot_fit_is_refused_naming_the_field(breakage, field):
    from omni_ray.config import ConfigError, parse_config

    preset = shared_preset()
    parse_config(preset)  # as shipped, it fits
    breakage(preset)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_config(preset)


@pytest.mark.parametrize("name", ["qwen_image_one_gpu.yaml", "qwen_image_one_gpu_dummy.yaml"])
def test_the_one_gpu_presets_fit_all_three_stages_on_one_80_gb_gpu(name):
    import yaml

    from omni_ray.config import ConfigError, parse_config
    from omni_ray.placement import stage_memory

    preset = yaml.safe_load((REPO / "stage_configs" / name).read_text())
    config = parse_config(preset)
    estimates = stage_memory(config, config.gpu_memory_gib)
    assert [e.stage for e in estimates] == ["encoder", "dit", "vae"] and all(e.fits for e in estimates)
    assert sum(getattr(config, s).deployment.num_gpus for s in ("encoder", "dit", "vae")) <= 1
    assert sum(e.need_gib for e in estimates) <= 80
    with_transformers = {**preset, "encoder": {**preset["encoder"], "runner": "transformers"}}
    assert all(e.fits for e in stage_memory(parse_config(with_transformers), 80))
    overfull = [
        ({"requests": {**preset["requests"], "max_side": 2048}}, "vae.deployment.num_gpus"),  # 17 GiB a decode
        ({"dit": {k: v for k, v in preset["dit"].items() if k != "max_batch_tokens"}},  # 8 rows at 1664x1664
         "dit.deployment.num_gpus"),
        ({"encoder": {**preset["encoder"], "kv_cache_memory_bytes": 8 << 30}}, "encoder.deployment.num_gpus"),
    ]
    for change, field in overfull:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            parse_config({**preset, **change})


def test_the_shipped_configs_are_qwen_image_s_in_diffusers_layout():
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import AutoConfig

    index = json.loads((CONFIG_DIR / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    assert index["transformer"] == ["diffusers", "QwenImageTransformer2DModel"]
    transformer = QwenImageTransformer2DModel.load_config(CONFIG_DIR / "transformer")
    assert (transformer["num_layers"], transformer["num_attention_heads"], transformer["attention_head_dim"],
            transformer["joint_attention_dim"], transformer["in_channels"]) == (60, 24, 128, 3584, 64)
    assert AutoencoderKLQwenImage.load_config(CONFIG_DIR / "vae")["z_dim"] == 16
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(CONFIG_DIR / "scheduler")
    assert scheduler.config.use_dynamic_shifting and scheduler.config.shift_terminal == 0.02
    text = AutoConfig.from_pretrained(CONFIG_DIR / "text_encoder")
    assert text.model_type == "qwen2_5_vl" and text.text_config.hidden_size == 3584
    assert (text.image_token_id, text.vision_start_token_id) == (151655, 151652)  # Qwen's special token ids


@pytest.mark.vllm  # imports vLLM in the test process
@pytest.mark.parametrize("vision", [False, True])
def test_vllm_takes_the_shipped_text_encoder_config(vision):
    import os

    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    from vllm.engine.arg_utils import EngineArgs

    model_config = EngineArgs(
        model=str(CONFIG_DIR / "text_encoder"), skip_tokenizer_init=True, runner="pooling", convert="embed",
        load_format="dummy", dtype="bfloat16", max_model_len=1058, language_model_only=not vision,
    ).create_model_config()
    assert model_config.get_hidden_size() == 3584
    assert model_config.get_vocab_size() == 152064
    assert model_config.is_multimodal_model


def test_the_qwen_image_2512_presets_load_and_are_qwen_image_s_but_for_their_names():
    """Qwen-Image-2512 publishes Qwen-Image's architecture (omni_ray/families/CONFIGS.md): its presets load, name
    its checkpoint, and build from the shipped configs, whose parameter counts the dry run above checks."""
    from omni_ray.config import load_config

    presets = REPO / "stage_configs"
    for name, twin in (("qwen_image_2512.yaml", "qwen_image.yaml"), ("qwen_image_2512_dummy.yaml",
                                                                      "qwen_image_dummy.yaml")):
        config, base = load_config(presets / name), load_config(presets / twin)
        assert config.name.startswith("qwen-image-2512") and config.edit is None
        assert config.model_dump(exclude={"name", "model"}) == base.model_dump(exclude={"name", "model"}), name
    assert load_config(presets / "qwen_image_2512.yaml").model == "Qwen/Qwen-Image-2512"


def test_the_edit_plus_and_2511_presets_load_and_are_edit_plus_presets_over_qwen_image_s_architecture(tmp_path):
    """Qwen-Image-Edit-2509 and 2511 are QwenImageEditPlusPipeline checkpoints with Qwen-Image's architecture, 2511's
    transformer with `zero_cond_t: true` (omni_ray/families/CONFIGS.md): their presets load, take up to three
    images, differ from each other only in their names, checkpoints and configs, and their dummy checkpoints are
    written in the Edit-Plus layout from configs with the published parameter counts."""
    from omni_ray import checkpoints
    from omni_ray.checkpoints.full_size import write_configs
    from omni_ray.config import PipelineConfig, load_config
    from testing.full_size import build_meta, parameter_counts

    # A preset's `configs` is any family's published folder, and nothing else.
    assert published_configs() == ["qwen-image", "qwen-image-2.1", "qwen-image-edit-2511", "qwen-image-layered"]
    assert [PipelineConfig._published(name) for name in published_configs()] == published_configs()
    with pytest.raises(ValueError, match="one of qwen-image, qwen-image-2.1, .*got 'qwen-image-3'"):
        PipelineConfig._published("qwen-image-3")
    presets = REPO / "stage_configs"
    for name in ("qwen_image_edit_plus", "qwen_image_edit_plus_dummy", "qwen_image_edit_plus_tiny",
                 "qwen_image_edit_2511", "qwen_image_edit_2511_dummy"):
        config = load_config(presets / f"{name}.yaml")
        assert (config.edit.plus, config.edit.max_images, config.edit.pipeline) == (
            True, 3, "QwenImageEditPlusPipeline"), name
        assert config.configs == ("qwen-image-edit-2511" if name == "qwen_image_edit_2511_dummy" else "qwen-image")
    for name, twin, fields in (("qwen_image_edit_2511", "qwen_image_edit_plus", {"name", "model"}),
                               ("qwen_image_edit_2511_dummy", "qwen_image_edit_plus_dummy",
                                {"name", "model", "configs"})):
        config, base = load_config(presets / f"{name}.yaml"), load_config(presets / f"{twin}.yaml")
        assert config.model_dump(exclude=fields) == base.model_dump(exclude=fields), name
    assert load_config(presets / "qwen_image_edit_plus.yaml").model == "Qwen/Qwen-Image-Edit-2509"
    assert load_config(presets / "qwen_image_edit_2511.yaml").model == "Qwen/Qwen-Image-Edit-2511"

    for name, zero_cond_t in (("qwen_image_edit_plus_dummy", False), ("qwen_image_edit_2511_dummy", True)):
        model = tmp_path / name
        checkpoints.ensure(load_config(presets / f"{name}.yaml", model=str(model)))
        assert json.loads((model / "model_index.json").read_text())["_class_name"] == "QwenImageEditPlusPipeline"
        assert (model / "processor").is_dir() and not list(model.rglob("*.safetensors"))
        assert json.loads((model / "transformer/config.json").read_text())["zero_cond_t"] is zero_cond_t, name
        for component in ("vae", "text_encoder", "scheduler"):  # only the transformer's config differs
            assert {p.name: p.read_bytes() for p in (model / component).iterdir()} == {
                p.name: p.read_bytes() for p in (CONFIG_DIR / component).iterdir()}, (name, component)

    assert build_meta(write_configs("qwen-image-edit-2511", tmp_path / "2511"))["transformer"].zero_cond_t
    counts = parameter_counts("qwen-image-edit-2511")
    assert counts == parameter_counts()  # zero_cond_t adds no parameters
    for name, count in counts.items():
        assert abs(count / PUBLISHED_PARAMS[name] - 1) < 0.01, name


def test_the_tensor_sharded_and_fp8_parameter_counts_are_the_full_size_models():
    """placement's per-rank estimate rests on these two counts: the Linears diffusers' _tp_plan shards, and those
    FP8 quantizes (all of them among the sharded)."""
    from omni_ray.families.qwen_image.facts import FP8_PARAMS, TENSOR_SHARDED_PARAMS
    from omni_ray.runners.parallel.tensor import planned_linears
    from omni_ray.runners.quantization import fp8_linears
    from testing.full_size import build_meta

    transformer = build_meta()["transformer"]
    modules = dict(transformer.named_modules())
    plan = planned_linears(transformer)
    assert sum(p.numel() for name in plan for p in modules[name].parameters()) == TENSOR_SHARDED_PARAMS
    quantized = fp8_linears(transformer)
    assert set(quantized) <= set(plan)
    assert sum(modules[name].weight.numel() for name in quantized) == FP8_PARAMS


GANG_PRESETS = {
    # preset: (the gang's world size, a change that no longer fits, the field it names)
    "qwen_image_48gb.yaml": (2, lambda p: p["dit"]["parallel"].update(tensor=1), "dit.deployment.num_gpus"),
    "qwen_image_24gb.yaml": (4, lambda p: p["dit"].pop("quantization"), "dit.deployment.num_gpus"),
    "qwen_image_8xh100.yaml": (4, lambda p: p["dit"]["deployment"].update(num_gpus=0.5), "dit.deployment.num_gpus"),
    "qwen_image_latency.yaml": (8, lambda p: p.update(gpus_per_node=4), "dit.parallel"),
}


@pytest.mark.parametrize("name", GANG_PRESETS)
def test_the_gang_presets_fit_their_gpus_and_an_overfull_one_names_the_field(name):
    import yaml

    from omni_ray.config import ConfigError, parse_config
    from omni_ray.placement import stage_memory

    world, overfill, field = GANG_PRESETS[name]
    preset = yaml.safe_load((REPO / "stage_configs" / name).read_text())
    config = parse_config(preset)
    assert config.dit.parallel.world_size == world
    assert all(e.fits for e in stage_memory(config, config.gpu_memory_gib))
    gpus = sum(getattr(config, s).deployment.num_gpus * getattr(config, s).deployment.num_replicas
               for s in ("encoder", "vae")) + config.dit.deployment.num_gpus * world * config.dit.deployment.num_replicas
    assert gpus <= config.gpus_per_node
    overfill(preset)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_config(preset)


CARD_PRESETS = {
    # preset: (a change that no longer fits its card, the field the refusal names)
    "qwen_image_24gb_card.yaml": (lambda p: p["dit"]["offload"].update(blocks_on_gpu=57), "card.stages"),
    "qwen_image_16gb_card.yaml": (lambda p: p["dit"]["offload"].update(blocks_on_gpu=45), "dit.deployment.num_gpus"),
    "qwen_image_edit_2511_24gb_card.yaml": (lambda p: p["encoder"].update(quantization="none"), "card.stages"),
    "qwen_image_edit_2511_16gb_card.yaml": (lambda p: p["dit"].pop("offload"), "dit.deployment.num_gpus"),
}


@pytest.mark.parametrize("name", CARD_PRESETS)
def test_the_one_card_presets_fit_their_card_and_an_overfull_one_names_the_field(name):
    """The DiT (a GGUF file, its published size for its quant type) and the VAE share the card; on 16 GB by
    fractional num_gpus, the encoder on the host's CPU: their estimates at the largest size fit their shares, which
    sum to the card; on 24 GB the three taking turns (``card``), the encoder's AWQ weights on the card only in its
    turns: what they hold between turns and the largest turn fit the card. A change past it is refused at load,
    naming the field."""
    import yaml

    from omni_ray.config import ConfigError, parse_config
    from omni_ray.placement import card_need_gib, stage_memory

    overfill, field = CARD_PRESETS[name]
    preset = yaml.safe_load((REPO / "stage_configs" / name).read_text())
    config = parse_config(preset)
    assert config.gpu_memory_gib in (16, 24) and config.dit.weights_file.endswith("Q4_K_M.gguf")
    estimates = {e.stage: e for e in stage_memory(config, config.gpu_memory_gib)}
    assert "12.2 GiB" in estimates["dit"].detail and "in bands" in estimates["vae"].detail
    if config.card is None:
        assert (config.encoder.device, config.encoder.deployment.num_gpus) == ("cpu", 0)
        assert set(estimates) == {"dit", "vae"} and all(e.fits for e in estimates.values())
        assert sum(e.need_gib for e in estimates.values()) <= config.gpu_memory_gib
    else:
        assert config.encoder.quantization == "awq" and "4-bit AWQ" in estimates["encoder"].detail
        need, largest = card_need_gib(list(estimates.values()))
        assert need <= config.gpu_memory_gib and largest.stage == "encoder"
    assert sum(getattr(config, s).deployment.num_gpus for s in ("encoder", "dit", "vae")) <= 1.0
    overfill(preset)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_config(preset)


def test_a_gguf_file_of_no_published_quant_type_needs_to_be_there_for_its_size(tmp_path):
    import yaml

    from omni_ray.config import ConfigError, parse_config

    preset = yaml.safe_load((REPO / "stage_configs" / "qwen_image_24gb_card.yaml").read_text())
    preset["dit"]["weights_file"] = str(tmp_path / "my-own-quant.gguf")
    with pytest.raises(ConfigError, match="dit.weights_file: .*carries no published quant type"):
        parse_config(preset)
    (tmp_path / "my-own-quant.gguf").write_bytes(b"GGUF" + bytes(100))
    parse_config(preset)  # its own size: 104 bytes


@pytest.mark.parametrize("name", CARD_PRESETS)
def test_auto_keeps_the_most_blocks_that_fit_each_one_card_preset(name):
    """``dit.offload.blocks_on_gpu: auto``: the most blocks whose estimate fits (one more would not), from the same
    check that refuses a preset; on the CPU (no GPU memory to fit) refused, naming the field."""
    import yaml

    from omni_ray.config import ConfigError, parse_config
    from omni_ray.placement import kept_blocks

    preset = yaml.safe_load((REPO / "stage_configs" / name).read_text())
    preset["dit"].setdefault("offload", {})["blocks_on_gpu"] = "auto"
    config = parse_config(preset)
    kept = kept_blocks(config, config.gpu_memory_gib)
    assert 1 < kept < 60
    preset["dit"]["offload"]["blocks_on_gpu"] = kept
    parse_config(preset)
    preset["dit"]["offload"]["blocks_on_gpu"] = kept + 1
    with pytest.raises(ConfigError, match=r"card\.stages|dit\.deployment\.num_gpus"):
        parse_config(preset)
    with pytest.raises(ConfigError, match="dit.offload.blocks_on_gpu: auto keeps as many blocks as fit"):
        parse_config({**preset, "gpu_memory_gib": None, "dit": {**preset["dit"], "offload": {"blocks_on_gpu": "auto"}}})
