"""Qwen-Image's full-size models on the meta device (no memory, a second), so that their sizes can be checked
anywhere against the published parameter counts (``omni_ray.qwen_image.PUBLISHED_PARAMS``): for the tests and the
GPU benchmark's dry run."""

from __future__ import annotations

import pathlib
import tempfile

from omni_ray.checkpoints.full_size import BASE_CONFIGS, CONFIG_DIR, write_configs


def build_meta(config_dir: str | pathlib.Path = CONFIG_DIR) -> dict:
    """The transformer, VAE and text encoder built from ``config_dir`` on the meta device, by component name."""
    import torch
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    config_dir = pathlib.Path(config_dir)
    with torch.device("meta"):
        return {
            "transformer": QwenImageTransformer2DModel.from_config(
                QwenImageTransformer2DModel.load_config(config_dir / "transformer")),
            "vae": AutoencoderKLQwenImage.from_config(AutoencoderKLQwenImage.load_config(config_dir / "vae")),
            "text_encoder": Qwen2_5_VLForConditionalGeneration._from_config(
                AutoConfig.from_pretrained(config_dir / "text_encoder"), dtype=torch.bfloat16),
        }


def parameter_counts(configs: str = BASE_CONFIGS) -> dict[str, int]:
    """The transformer's, VAE's and text encoder's parameter counts under the published configs ``configs``."""
    with tempfile.TemporaryDirectory() as tmp:
        models = build_meta(write_configs(configs, pathlib.Path(tmp) / configs))
        return {name: sum(p.numel() for p in model.parameters()) for name, model in models.items()}
