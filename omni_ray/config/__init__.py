"""Pipeline presets: one validated, frozen config for the three stages, loaded from ``stage_configs/*.yaml``.

A preset names the checkpoint and, per stage, how its engine runs (dtype, device, batching limits) and how Ray Serve
places it (replicas, CPUs, GPUs). Everything is checked once here, and an invalid file fails with an error that
names the field, so nothing downstream handles a dict or a bad value.

Each part is one module: ``base`` (types, errors), ``deployment`` (how Serve places a stage), ``stages``
(the encoder, the DiT, the VAE), ``requests`` (limits, edits, the card), ``adapters`` (LoRA and recipes),
``pipeline`` (the preset as a whole), ``loading`` (YAML in, the checkpoint checked); everything is imported from
``omni_ray.config``.
"""

from omni_ray.config.adapters import (
    RECIPE_FILE,
    RECIPE_MAX_BYTES,
    RECIPE_SCHEDULER_KEYS,
    LoraEntry,
    LoraSettings,
    SamplingRecipe,
    read_recipe,
    recipe_file,
)
from omni_ray.config.base import ConfigError, Dtype, NonNegativeInt, Number, PositiveInt, describe, field_errors
from omni_ray.config.deployment import AutoscalingConfig, DeploymentConfig
from omni_ray.config.loading import (
    check_checkpoint,
    inpaint_controlnets,
    load_config,
    merged,
    parse_config,
    with_checkpoint_settings,
)
from omni_ray.config.pipeline import PipelineConfig
from omni_ray.config.requests import CardConfig, EditConfig, QualitySteps, RequestLimits
from omni_ray.config.stages import (
    CacheSettings,
    DiTConfig,
    EncoderConfig,
    GangSettings,
    OffloadSettings,
    ParallelSettings,
    VAEConfig,
    VaeParallelSettings,
)

__all__ = [
    "PositiveInt",
    "NonNegativeInt",
    "Dtype",
    "Number",
    "ConfigError",
    "field_errors",
    "describe",
    "AutoscalingConfig",
    "DeploymentConfig",
    "EncoderConfig",
    "CacheSettings",
    "GangSettings",
    "ParallelSettings",
    "VaeParallelSettings",
    "OffloadSettings",
    "DiTConfig",
    "VAEConfig",
    "EditConfig",
    "QualitySteps",
    "RequestLimits",
    "CardConfig",
    "RECIPE_SCHEDULER_KEYS",
    "RECIPE_MAX_BYTES",
    "RECIPE_FILE",
    "SamplingRecipe",
    "LoraEntry",
    "LoraSettings",
    "recipe_file",
    "read_recipe",
    "PipelineConfig",
    "load_config",
    "merged",
    "parse_config",
    "inpaint_controlnets",
    "with_checkpoint_settings",
    "check_checkpoint",
]
