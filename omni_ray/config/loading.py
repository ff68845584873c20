"""Reading a preset (YAML, overrides, a local checkpoint's settings) and its errors, each naming the field."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import yaml
from pydantic import ValidationError

from omni_ray.config.adapters import read_recipe, recipe_file
from omni_ray.config.base import ConfigError, describe
from omni_ray.config.pipeline import PipelineConfig
from omni_ray.families import FAMILIES, family_of


def load_config(path: str | pathlib.Path, model: str | None = None,
                overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Reads a preset from YAML; ``model`` overrides the preset's checkpoint, and ``overrides`` (a preset fragment:
    ``{"dit": {"max_batch_tokens": 4096}}``) its fields, mappings merged key by key and anything else replaced.

    A relative local ``model`` resolves against the current directory; ``~`` expands.
    """
    path = pathlib.Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such stage config") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of fields, got {type(data).__name__}")
    if overrides:
        data = merged(data, overrides)
    if model is not None:
        data["model"] = model
    return parse_config(data, source=str(path))


def merged(base: dict[str, Any], fragment: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``fragment`` laid over it: where both hold a mapping, merged key by key; else the fragment's."""
    out = dict(base)
    for key, value in fragment.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def parse_config(data: dict[str, Any], source: str = "<config>") -> PipelineConfig:
    """Validates a preset given as a mapping; raises ConfigError naming the field. Reads the checkpoint's
    ``model_index.json`` when it exists; writes nothing (a checkpoint that ``build_if_missing`` names and that is not
    there yet is written by ``omni_ray.checkpoints.ensure``)."""
    try:
        config = PipelineConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source}: {describe(err)}") from None
    loras = dict(config.loras)
    for name, entry in config.loras.items():
        beside = recipe_file(entry.path)
        if entry.recipe is None and beside.is_file():  # the operator's own files: read where the preset is read
            try:
                loras[name] = entry.model_copy(update={"recipe": read_recipe(beside)})
            except ValueError as err:
                raise ConfigError(f"{source}: loras.{name}.recipe: {err}") from None
    config = config.model_copy(update={"loras": loras, "inpaint_controlnets": inpaint_controlnets(config)})
    if not config.is_local:
        return config
    model_dir = pathlib.Path(config.model).expanduser()
    config = config.model_copy(update={"model": str(model_dir.resolve())})
    if config.build_if_missing and not model_dir.exists():
        return config
    check_checkpoint(config, source)
    return with_checkpoint_settings(config)


def inpaint_controlnets(config: PipelineConfig) -> list[str]:
    """The preset's ``inpaint_controlnets``, and each of its ``controlnets`` whose folder's ``config.json`` gives it
    extra condition channels (an inpainting ControlNet: the control mask rides beside the control image's
    latents), in ``controlnets``' order."""
    found = []
    for name, path in config.controlnets.items():
        settings = pathlib.Path(path).expanduser() / "config.json"
        try:
            extra = json.loads(settings.read_text()).get("extra_condition_channels") if settings.is_file() else 0
        except (OSError, ValueError):
            extra = 0  # the DiT reads it again when it loads the ControlNet, and says what is wrong
        if extra or name in config.inpaint_controlnets:
            found.append(name)
    return found


def with_checkpoint_settings(config: PipelineConfig) -> PipelineConfig:
    """The preset with what its local checkpoint fixes and the preset left out (Qwen-Image 2.1's ``sample_sigmas``),
    as its family reads them."""
    return family_of(config).with_checkpoint_settings(config)


def check_checkpoint(config: PipelineConfig, source: str = "<config>") -> None:
    """Raises ConfigError unless a local ``model`` holds a checkpoint of the preset's kind (reads
    ``model_index.json``)."""
    index = pathlib.Path(config.model) / "model_index.json"
    if not index.is_file():
        raise ConfigError(
            f"{source}: model: {config.model!r} is not a checkpoint directory (no model_index.json); "
            "build the tiny one with `python -m omni_ray.checkpoints.tiny DIR` (`--edit` or `--edit-plus` for an edit "
            "checkpoint)"
        )
    pipeline = json.loads(index.read_text()).get("_class_name")
    expected = config.pipeline
    family = family_of(config)
    owner = next((family_of(name) for name in FAMILIES if pipeline in family_of(name).pipelines), None)
    if pipeline != expected and owner is not None and owner is not family:  # another family's checkpoint
        raise ConfigError(
            f"{source}: family: {config.family!r}, but model: {config.model!r} is a {pipeline} checkpoint (a "
            f"{expected} one is needed; family {family.name} is for {', '.join(family.pipelines)} checkpoints, "
            f"family {owner.name} for {pipeline})"
        )
    family.check_checkpoint(config, source)
    if pipeline != expected:
        raise ConfigError(
            f"{source}: model: {config.model!r} is a {pipeline} checkpoint, but this preset "
            f"{'edits' if config.edit is not None else 'generates'} images and needs a {expected} one "
            f"(`edit:` is set for Qwen-Image-Edit checkpoints only, `edit.plus` for Edit-2509/2511's)"
        )
