"""Offline checkpoints in diffusers' layout, and the one step that writes the one a preset names.

``tiny`` writes a small random Qwen-Image (the CPU presets and the tests; ``tiny21`` Qwen-Image 2.1), ``dummy`` the
full-size published configs without weights (``weights: dummy``; Qwen-Image's or 2.1's), ``full_size`` holds those
configs. Loading a preset never writes; ``ensure`` does, and the app builder, the in-process pipeline and ``make``
call it.
"""

from __future__ import annotations

import pathlib

from omni_ray.config import PipelineConfig, check_checkpoint, with_sample_sigmas


def ensure(config: PipelineConfig) -> PipelineConfig:
    """Writes the checkpoint ``config.build_if_missing`` names when its directory is missing, then checks that
    ``config.model`` holds the preset's kind of checkpoint (ConfigError naming ``model`` otherwise)."""
    if not config.is_local:
        return config
    model_dir = pathlib.Path(config.model)
    edit = config.edit is not None
    plus = edit and config.edit.plus
    if config.build_if_missing == "dummy" and not model_dir.exists():
        from omni_ray.checkpoints.dummy import write_dummy_checkpoint

        if config.family == "qwen-image-2.1":  # one layout serves its generations and edits
            write_dummy_checkpoint(model_dir, configs=config.configs)
        else:
            write_dummy_checkpoint(model_dir, edit=edit, plus=plus, configs=config.configs)
    elif config.build_if_missing and not model_dir.exists() and config.family == "qwen-image-2.1":
        from omni_ray.checkpoints import tiny21

        tiny21.write_checkpoint(model_dir, seed=0, size=config.build_if_missing)
    elif config.build_if_missing and not model_dir.exists() and config.family == "qwen-image-layered":
        from omni_ray.checkpoints.tiny import write_checkpoint

        write_checkpoint(model_dir, seed=0, size=config.build_if_missing, layered=True)
    elif config.build_if_missing and not model_dir.exists():
        from omni_ray.checkpoints.tiny import write_checkpoint

        write_checkpoint(model_dir, seed=0, size=config.build_if_missing, edit=edit, plus=plus)
    check_checkpoint(config)
    return with_sample_sigmas(config)
