import json
import re

import pytest
import yaml
from conftest import REPO

from omni_ray import checkpoints
from omni_ray.config import ConfigError, PipelineConfig, load_config, parse_config

PRESETS = REPO / "stage_configs"


def tiny_preset(tiny_dir) -> dict:
    data = yaml.safe_load((PRESETS / "qwen_image_tiny.yaml").read_text())
    data["model"] = str(tiny_dir)
    return data


def test_tiny_preset_loads_with_model_override(tiny_dir):
    config = load_config(PRESETS / "qwen_image_tiny.yaml", model=str(tiny_dir))
    assert isinstance(config, PipelineConfig)
    assert config.model == str(tiny_dir.resolve())
    assert (config.encoder.dtype, config.dit.device, config.vae.deployment.num_gpus) == ("float32", "cpu", 0)


def test_overrides_lay_fields_over_the_preset(tiny_dir, tmp_path):
    """What a Serve config's ``args.overrides`` changes (``serve deploy``): mappings merged key by key, anything else
    replaced; an invalid override is refused naming its field."""
    adapter = tmp_path / "B.safetensors"
    adapter.write_bytes(b"")
    overrides = {"requests": {"default_steps": 3}, "dit": {"max_batch_tokens": 2048, "deployment": {"num_replicas": 2}},
                 "loras": {"B": str(adapter)}}
    config = load_config(PRESETS / "qwen_image_tiny.yaml", model=str(tiny_dir), overrides=overrides)
    base = load_config(PRESETS / "qwen_image_tiny.yaml", model=str(tiny_dir))
    assert config.requests.default_steps == 3
    assert (config.dit.max_batch_tokens, config.dit.deployment.num_replicas) == (2048, 2)
    assert config.requests.default_width == base.requests.default_width  # the rest of `requests` kept
    assert config.dit.deployment.max_ongoing_requests == base.dit.deployment.max_ongoing_requests
    assert list(config.loras) == ["B"]
    with pytest.raises(ConfigError, match=r"requests\.default_steps"):
        load_config(PRESETS / "qwen_image_tiny.yaml", model=str(tiny_dir), overrides={"requests": {"default_steps": 0}})


def test_real_preset_is_bf16_with_one_gpu_per_stage_replica():
    config = load_config(PRESETS / "qwen_image.yaml")
    assert config.model == "Qwen/Qwen-Image" and not config.is_local
    for stage in (config.encoder, config.dit, config.vae):
        assert stage.dtype == "bfloat16"
        assert stage.device == "cuda"
        assert stage.deployment.num_gpus == 1


def test_config_is_frozen(tiny_dir):
    config = parse_config(tiny_preset(tiny_dir))
    with pytest.raises(Exception):
        config.dit.max_batch_size = 3


@pytest.mark.parametrize(
    ("edit", "field", "message"),
    [
        (lambda d: d["dit"].update(max_batch_sise=4), "dit.max_batch_sise", "unknown field"),
        (lambda d: d.update(colour="red"), "colour", "unknown field"),
        (lambda d: d["dit"].update(max_batch_size="eight"), "dit.max_batch_size", "valid integer"),
        (lambda d: d["encoder"].update(dtype="float64"), "encoder.dtype", "float32"),
        (lambda d: d["vae"]["deployment"].update(num_gpus="one"), "vae.deployment.num_gpus", "valid number"),
        (lambda d: d["dit"].update(max_batch_size=0), "dit.max_batch_size", "greater than 0"),
        (lambda d: d["vae"].update(max_batch_size=-2), "vae.max_batch_size", "greater than 0"),
        (lambda d: d["encoder"].update(max_num_seqs=0), "encoder.max_num_seqs", "greater than 0"),
        (lambda d: d["dit"].update(device="gpu"), "dit.device", "pattern"),
        (lambda d: d["vae"].update(runner="fake"), "vae.runner", "'model' or 'simulated'"),
        (lambda d: d["dit"]["deployment"].update(resources={"gpu_node": 0}), "dit.deployment.resources.gpu_node",
         "greater than 0"),
        (lambda d: d.pop("name"), "name", "required"),
        (lambda d: d["dit"].update(device="cuda"), "dit.deployment.num_gpus", "must be > 0"),
        (lambda d: d["dit"].update(quantization="int2"), "dit.quantization", "'none', 'fp8', 'int8' or 'int4'"),
        (lambda d: d["dit"].update(quantization="int4"), "dit.quantization", "runs on CUDA GPUs in bfloat16"),
        (lambda d: d["dit"].update(quantization="fp8"), "dit.quantization", "runs on CUDA GPUs"),
        (lambda d: d["vae"].update(parallel={"patches": 0}), "vae.parallel.patches", "greater than 0"),
        (lambda d: d["vae"].update(parallel={"patches": 2, "timeout_s": 0}), "vae.parallel.timeout_s",
         "greater than 0"),
        (lambda d: d["vae"].update(parallel={"pieces": 2}), "vae.parallel.pieces", "unknown field"),
        (lambda d: d["vae"].update(parallel={"patches": 5}), "vae.parallel.patches (5)",
         "latent rows of the smallest image (4: requests.min_side / 8)"),
        (lambda d: (d["dit"].update(quantization="fp8", device="cuda"), d["dit"]["deployment"].update(num_gpus=1)),
         "dit.quantization", "dit.dtype is float32"),
        (
            lambda d: d["dit"].update(max_batch_size=32),
            "dit.deployment.max_ongoing_requests",
            "at least dit.max_batch_size",
        ),
        (
            lambda d: d["dit"]["deployment"].update(autoscaling={"min_replicas": 1, "max_replicas": 2}),
            "num_replicas or autoscaling",
            "not both",
        ),
    ],
)
def test_invalid_configs_name_the_field(tiny_dir, edit, field, message):
    data = tiny_preset(tiny_dir)
    edit(data)
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="preset.yaml")
    text = str(info.value)
    assert text.startswith("preset.yaml: ")
    assert field in text and message in text, text


@pytest.mark.parametrize("model", ["/nonexistent/qwen-image", "~/no-such-omni-ray-ckpt", "./missing/dir"])
def test_missing_model_directory_is_rejected(tiny_dir, model):
    data = tiny_preset(tiny_dir)
    data["model"] = model
    del data["build_if_missing"]
    with pytest.raises(ConfigError, match=r"model: .* is not a checkpoint directory"):
        parse_config(data)


def test_a_missing_tiny_checkpoint_is_built_by_ensure_not_by_parsing(tiny_dir, tmp_path):
    data = tiny_preset(tiny_dir)
    data["model"] = str(tmp_path / "built")
    config = parse_config(data)
    assert not (tmp_path / "built").exists() and config.model == str(tmp_path / "built")
    assert checkpoints.ensure(config) == config
    assert (tmp_path / "built" / "model_index.json").is_file()


def test_tiny_edit_preset_builds_an_edit_checkpoint_when_missing(tmp_path):
    data = yaml.safe_load((PRESETS / "qwen_image_edit_tiny.yaml").read_text())
    data["model"] = str(tmp_path / "built")
    config = checkpoints.ensure(parse_config(data))
    index = json.loads((tmp_path / "built" / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPipeline" and (tmp_path / "built" / "processor").is_dir()
    assert config.edit.image_area == 128 * 128


def test_tiny_edit_plus_preset_builds_an_edit_plus_checkpoint_when_missing(tmp_path):
    config = load_config(PRESETS / "qwen_image_edit_plus_tiny.yaml", model=str(tmp_path / "built"))
    checkpoints.ensure(config)
    index = json.loads((tmp_path / "built" / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPlusPipeline" and (tmp_path / "built" / "processor").is_dir()
    assert (config.edit.max_images, config.edit.image_area, config.edit.condition_area) == (3, 128 * 128, 64 * 64)


def test_several_images_need_an_edit_plus_preset():
    data = yaml.safe_load((PRESETS / "qwen_image_edit.yaml").read_text())
    data["edit"]["max_images"] = 2
    with pytest.raises(ConfigError, match=r"^preset\.yaml: edit\.max_images: "):
        parse_config(data, source="preset.yaml")
    data["edit"]["plus"] = True
    assert parse_config(data).edit.max_images == 2


@pytest.mark.parametrize(("preset", "checkpoint", "has", "needs"), [
    ("qwen_image_edit_plus_tiny.yaml", "edit_dir", "QwenImageEditPipeline", "QwenImageEditPlusPipeline"),
    ("qwen_image_edit_tiny.yaml", "edit_plus_dir", "QwenImageEditPlusPipeline", "QwenImageEditPipeline"),
])
def test_an_edit_preset_refuses_the_other_edit_pipeline_s_checkpoint_naming_model(preset, checkpoint, has, needs,
                                                                                   request):
    model = request.getfixturevalue(checkpoint)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(PRESETS / preset))}: model: .* is a {has} checkpoint, "
                       rf".* needs a {needs} one"):
        load_config(PRESETS / preset, model=str(model))


def test_directory_without_checkpoint_is_rejected(tiny_dir, tmp_path):
    with pytest.raises(ConfigError, match="no model_index.json"):
        load_config(PRESETS / "qwen_image_tiny.yaml", model=str(tmp_path))


def test_unreadable_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such stage config"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(tmp_path / "list.yaml")


def test_every_field_is_described():
    def walk(model: type) -> None:
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            annotation = field.annotation
            for candidate in getattr(annotation, "__args__", (annotation,)):
                if isinstance(candidate, type) and hasattr(candidate, "model_fields"):
                    walk(candidate)

    walk(PipelineConfig)


def test_every_preset_validates():
    presets = sorted(PRESETS.glob("*.yaml"))
    assert {p.name for p in presets} >= {"qwen_image.yaml", "qwen_image_tiny.yaml", "qwen_image_edit.yaml",
                                         "qwen_image_edit_tiny.yaml", "qwen_image_sim.yaml",
                                         "qwen_image_dummy.yaml", "qwen_image_edit_dummy.yaml",
                                         "qwen_image_edit_plus.yaml", "qwen_image_edit_plus_tiny.yaml",
                                         "qwen_image_edit_plus_dummy.yaml", "qwen_image_edit_2511.yaml",
                                         "qwen_image_edit_2511_dummy.yaml"}
    for path in presets:
        data = yaml.safe_load(path.read_text())
        data["model"] = "Qwen/Qwen-Image"  # the checkpoint may not be built here; the rest must validate
        parse_config(data, source=str(path))


def test_deployment_options_carry_threads_and_custom_resources(tiny_dir):
    from deployments.app import deployment_options

    data = tiny_preset(tiny_dir)
    data["dit"]["deployment"]["resources"] = {"omni_dit_node": 1}
    config = parse_config(data)
    dit = deployment_options(config.dit.deployment)["ray_actor_options"]
    assert dit["resources"] == {"omni_dit_node": 1.0}
    assert dit["runtime_env"]["env_vars"] == {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "2"}
    assert "resources" not in deployment_options(config.vae.deployment)["ray_actor_options"]
    # Replaced (a changed app), the tiny preset's replicas serve until their replacements run; the GPU presets'
    # stop first, as Serve does by default (a surge replica would need a spare GPU).
    assert {deployment_options(d)["max_surge_percent"] for d in (config.coordinator, config.encoder.deployment,
                                                                 config.dit.deployment, config.vae.deployment)} == {100}
    assert deployment_options(load_config(PRESETS / "qwen_image.yaml").dit.deployment)["max_surge_percent"] == 0


def test_a_dit_gang_takes_a_placement_group_per_replica(tiny_dir):
    """dit.parallel above world size 1: the replica's bundle (its CPUs and custom resources, no GPU), then one per
    rank with the preset's GPUs, packed on one node; world size 1 keeps today's options."""
    from deployments.app import gang_options

    data = yaml.safe_load((PRESETS / "qwen_image.yaml").read_text())
    assert "placement_group_bundles" not in gang_options(parse_config(data).dit, "dit")
    data["dit"]["parallel"] = {"ulysses": 2, "tensor": 2, "rank_num_cpus": 2}
    data["dit"]["deployment"]["resources"] = {"omni_dit_node": 1}
    options = gang_options(parse_config(data).dit, "dit")  # Ray is not initialised here: no node to compare with
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["placement_group_bundles"] == [{"CPU": 4.0, "omni_dit_node": 1.0}] + [{"CPU": 2.0, "GPU": 1.0}] * 4
    assert options["ray_actor_options"]["num_gpus"] == 0


def test_a_vae_gang_takes_a_placement_group_per_replica():
    """vae.parallel.patches above one: the VAE's replica gets the same placement group as a DiT gang's."""
    from deployments.app import gang_options

    data = yaml.safe_load((PRESETS / "qwen_image.yaml").read_text())
    assert "placement_group_bundles" not in gang_options(parse_config(data).vae, "vae")
    data["vae"]["parallel"] = {"patches": 2, "rank_num_cpus": 2, "timeout_s": 60}
    vae = parse_config(data).vae
    assert (vae.parallel.world_size, vae.parallel.timeout_s) == (2, 60)
    options = gang_options(vae, "vae")
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["placement_group_bundles"] == [{"CPU": 4.0}] + [{"CPU": 2.0, "GPU": 1.0}] * 2
    assert options["ray_actor_options"]["num_gpus"] == 0


@pytest.mark.parametrize("stage, edits, top, field", [
    ("dit", {"parallel": {"cfg": 2}, "deployment": {"num_gpus": 0.5}}, {}, "dit.deployment.num_gpus (0.5)"),
    ("dit", {"parallel": {"tensor": 8}}, {"gpus_per_node": 4}, "dit.parallel: a gang of 8 ranks with 1 GPU(s) each"),
    ("dit", {"parallel": {"cfg": 2}, "deployment": {"num_cpus": 0}}, {}, "dit.deployment.num_cpus"),
    ("vae", {"parallel": {"patches": 2}, "deployment": {"num_gpus": 0.5}}, {}, "vae.deployment.num_gpus (0.5)"),
    ("vae", {"parallel": {"patches": 8}}, {"gpus_per_node": 4}, "vae.parallel: a gang of 8 ranks with 1 GPU(s) each"),
    ("vae", {"parallel": {"patches": 2}, "deployment": {"num_cpus": 0}}, {}, "vae.deployment.num_cpus"),
])
def test_a_gang_that_cannot_be_placed_is_refused_naming_the_field(stage, edits, top, field):
    data = yaml.safe_load((PRESETS / "qwen_image.yaml").read_text())
    for name, value in edits.items():
        data[stage][name] = {**data[stage].get(name, {}), **value}
    data.update(top)
    with pytest.raises(ConfigError, match=re.escape(field)):
        parse_config(data)
    data[stage]["parallel"] = {}
    parse_config(data)  # one rank: none of it applies


def test_largest_shortfall_packs_every_bundle_on_one_node():
    from omni_ray.placement import largest_shortfall

    bundles = [{"CPU": 1}, {"CPU": 2, "GPU": 1}, {"CPU": 2, "GPU": 1}]
    assert largest_shortfall(bundles, [{"CPU": 8, "GPU": 2}]) is None
    assert largest_shortfall(bundles, [{"CPU": 4, "GPU": 2}, {"CPU": 64, "GPU": 1}]) == {"CPU": 5, "GPU": 2}
