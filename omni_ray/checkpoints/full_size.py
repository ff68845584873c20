"""Qwen-Image's real architecture, shipped with the package: its configs in diffusers' layout, without weights.

``CONFIG_DIR`` holds ``model_index.json``, ``transformer/config.json`` (QwenImageTransformer2DModel: 60 layers, 24
heads of 128, joint attention dim 3584, 64 input channels), ``vae/config.json`` (AutoencoderKLQwenImage),
``text_encoder/config.json`` (Qwen2.5-VL-7B, its language model and vision tower), ``scheduler/`` and the
tokenizer's settings, as published with Qwen/Qwen-Image; they were written through diffusers' and transformers'
own config classes, whose defaults for these models are the published ones. Nothing here downloads anything.

Each family keeps its published configs in its package (``omni_ray/families/<family>/configs/<name>/``, the names
``PipelineConfig.configs`` takes; ``omni_ray/families/CONFIGS.md`` gives their sources). Other checkpoints of
Qwen-Image's architecture differ from it in a few files: their folder holds only those (``qwen-image-edit-2511/``: the
transformer's ``zero_cond_t: true``), and ``write_configs`` lays them over Qwen-Image's. A folder with a
``model_index.json`` of its own is complete and written alone: ``qwen-image-2.1/`` (QwenImage21Pipeline: its
transformer, 16x RGBA VAE, Qwen3-VL text encoder, scheduler and ``processor/`` settings).

"""

from __future__ import annotations

import json
import pathlib
import shutil

FAMILIES_DIR = pathlib.Path(__file__).resolve().parents[1] / "families"
BASE_CONFIGS = "qwen-image"


def _folders() -> dict[str, pathlib.Path]:
    return {folder.name: folder for folder in sorted(FAMILIES_DIR.glob("*/configs/*")) if folder.is_dir()}


def configs_dir(configs: str) -> pathlib.Path:
    """The folder of the published configs ``configs`` names, in its family's package."""
    folders = _folders()
    if configs not in folders:
        raise ValueError(f"configs must be one of {published_configs()}, got {configs!r}")
    return folders[configs]


CONFIG_DIR = configs_dir(BASE_CONFIGS)


def published_configs() -> list[str]:
    """The names of the published config folders (``PipelineConfig.configs``'s values), Qwen-Image's first."""
    others = sorted(name for name in _folders() if name != BASE_CONFIGS)
    return [BASE_CONFIGS, *others]


def write_configs(configs: str, out: str | pathlib.Path, ignore=None) -> pathlib.Path:
    """Writes the published configs ``configs`` names to ``out``: a complete folder (one with its own
    ``model_index.json``) as it is, any other as Qwen-Image's with the files of ``configs_dir(configs)`` over
    them. ``ignore`` is ``shutil.copytree``'s."""
    folder = configs_dir(configs)
    out = pathlib.Path(out)
    if is_complete(configs):
        return pathlib.Path(shutil.copytree(folder, out, ignore=ignore))
    shutil.copytree(CONFIG_DIR, out, ignore=ignore)
    if configs != BASE_CONFIGS:
        shutil.copytree(folder, out, ignore=ignore, dirs_exist_ok=True)
    return out


def is_complete(configs: str) -> bool:
    """Whether the folder ``configs`` names holds a whole checkpoint's configs (its own ``model_index.json``) rather
    than the files in which it differs from Qwen-Image."""
    return (configs_dir(configs) / "model_index.json").is_file()


def pipeline_class(configs: str) -> str:
    """diffusers' pipeline class the published configs ``configs`` are for (``model_index.json``'s ``_class_name``;
    Qwen-Image's for a folder laid over it)."""
    folder = configs_dir(configs) if is_complete(configs) else CONFIG_DIR
    return json.loads((folder / "model_index.json").read_text())["_class_name"]
