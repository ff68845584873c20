"""Qwen-Image's real architecture, shipped with the package: its configs in diffusers' layout, without weights.

``CONFIG_DIR`` holds ``model_index.json``, ``transformer/config.json`` (QwenImageTransformer2DModel: 60 layers, 24
heads of 128, joint attention dim 3584, 64 input channels), ``vae/config.json`` (AutoencoderKLQwenImage),
``text_encoder/config.json`` (Qwen2.5-VL-7B, its language model and vision tower), ``scheduler/`` and the
tokenizer's settings, as published with Qwen/Qwen-Image; they were written through diffusers' and transformers'
own config classes, whose defaults for these models are the published ones. Nothing here downloads anything.

``build_meta`` builds the three models on the meta device (no memory, a second) so that their sizes can be checked
anywhere, against the published parameter counts (``omni_ray.qwen_image.PUBLISHED_PARAMS``).
"""

from __future__ import annotations

import pathlib

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "model_configs" / "qwen-image"



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


def parameter_counts(config_dir: str | pathlib.Path = CONFIG_DIR) -> dict[str, int]:
    return {name: sum(p.numel() for p in model.parameters()) for name, model in build_meta(config_dir).items()}
