"""The published full-size models on the meta device (no memory, a second), so that their sizes can be checked
anywhere against the published parameter counts (``omni_ray.qwen_image.PUBLISHED_PARAMS``, and
``omni_ray.qwen_image21.PUBLISHED_PARAMS`` for Qwen-Image 2.1's configs): for the tests and the GPU benchmark's dry
run."""

from __future__ import annotations

import json
import pathlib
import tempfile

from omni_ray.checkpoints.full_size import BASE_CONFIGS, CONFIG_DIR, write_configs


def build_meta(config_dir: str | pathlib.Path = CONFIG_DIR) -> dict:
    """The transformer, VAE and text encoder built from ``config_dir`` on the meta device, by component name:
    Qwen-Image's classes, or Qwen-Image 2.1's where ``model_index.json`` names ``QwenImage21Pipeline``."""
    import torch
    from transformers import AutoConfig

    config_dir = pathlib.Path(config_dir)
    if json.loads((config_dir / "model_index.json").read_text())["_class_name"] == "QwenImage21Pipeline":
        from diffusers import AutoencoderKLQwenImage21 as Vae
        from diffusers import QwenImage21Transformer2DModel as Transformer
        from transformers import Qwen3VLForConditionalGeneration as TextEncoder
    else:
        from diffusers import AutoencoderKLQwenImage as Vae
        from diffusers import QwenImageTransformer2DModel as Transformer
        from transformers import Qwen2_5_VLForConditionalGeneration as TextEncoder
    with torch.device("meta"):
        return {
            "transformer": Transformer.from_config(Transformer.load_config(config_dir / "transformer")),
            "vae": Vae.from_config(Vae.load_config(config_dir / "vae")),
            "text_encoder": TextEncoder._from_config(AutoConfig.from_pretrained(config_dir / "text_encoder"),
                                                     dtype=torch.bfloat16),
        }


def parameter_counts(configs: str = BASE_CONFIGS) -> dict[str, int]:
    """The transformer's, VAE's and text encoder's parameter counts under the published configs ``configs``."""
    with tempfile.TemporaryDirectory() as tmp:
        models = build_meta(write_configs(configs, pathlib.Path(tmp) / configs))
        return {name: sum(p.numel() for p in model.parameters()) for name, model in models.items()}


def vision_parameters(configs: str = BASE_CONFIGS) -> int:
    """The text encoder's vision tower's parameter count (``model.visual``) under the published configs ``configs``."""
    with tempfile.TemporaryDirectory() as tmp:
        encoder = build_meta(write_configs(configs, pathlib.Path(tmp) / configs))["text_encoder"]
        return sum(p.numel() for p in encoder.model.visual.parameters())
