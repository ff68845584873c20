"""Offline checkpoints in diffusers' layout, and the one step that writes the one a preset names.

``tiny`` writes a small random Qwen-Image (the CPU presets and the tests; each family's package has its own
writer where its layout differs: ``families.qwen_image_2_1.tiny``), ``dummy`` the
full-size published configs without weights (``weights: dummy``; Qwen-Image's or 2.1's), ``full_size`` holds those
configs. Loading a preset never writes; ``ensure`` does, and the app builder, the in-process pipeline and ``make``
call it.
"""

from __future__ import annotations

import pathlib

from omni_ray.config import PipelineConfig, check_checkpoint, with_checkpoint_settings
from omni_ray.families import family_of


def ensure(config: PipelineConfig) -> PipelineConfig:
    """Writes the checkpoint ``config.build_if_missing`` names when its directory is missing (its family writes it),
    then checks that ``config.model`` holds the preset's kind of checkpoint (ConfigError naming ``model``
    otherwise)."""
    if not config.is_local:
        return config
    model_dir = pathlib.Path(config.model)
    if config.build_if_missing and not model_dir.exists():
        family_of(config).write_checkpoint(model_dir, config)
    check_checkpoint(config)
    return with_checkpoint_settings(config)
