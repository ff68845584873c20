"""Qwen-Image 2.1: Qwen3-VL reading the prompt and up to three condition images in one raw template, a block-causal
single-stream transformer that caches its condition's keys and values across steps, a 16x RGBA VAE. Everything of it
is in this package: its facts (``facts``), tokenizer, runners (``denoise``, ``state``, ``forward``, ``vae``,
``vae_frame``), memory estimate (``placement``) and tiny checkpoint writer (``tiny``)."""

from __future__ import annotations

import json
import pathlib

from omni_ray.errors import RequestError
from omni_ray.families.base import Family
from omni_ray.families.qwen_image_2_1 import facts


class QwenImage21(Family):
    name = facts.FAMILY
    title = "Qwen-Image 2.1"
    pipeline_class = facts.PIPELINE
    side_multiple = facts.SIZE_MULTIPLE
    rgba = True
    dit_cache = False  # it keeps its condition's keys and values across steps instead
    condition_cache = True
    vision_in_every_prompt = True
    encoder_model = "qwen3-vl"
    default_true_cfg_scale = 1.0  # it samples without guidance unless asked, as its pipeline

    def check_preset(self, config) -> None:
        """What a Qwen-Image 2.1 preset cannot ask for: Edit-Plus's settings, and the Qwen-Image DiT's features the
        2.1 runner does not have."""
        super().check_preset(config)
        if config.edit is not None and config.edit.plus:
            raise ValueError("edit.plus: Edit-Plus is Qwen-Image's; Qwen-Image 2.1 takes several images without it")
        if config.dit.cache is not None:
            raise ValueError("dit.cache: cache acceleration is Qwen-Image's; Qwen-Image 2.1 caches its condition's "
                             "keys and values instead (dit.cache_memory_bytes)")
        not_yet = {  # what the Qwen-Image runners have and the 2.1 ones do not yet
            "dit.compile": config.dit.compile, "dit.quantization": config.dit.quantization != "none",
            "dit.weights_file": config.dit.weights_file is not None, "dit.offload": config.dit.offload is not None,
            "dit.parallel": config.dit.parallel.world_size > 1, "vae.parallel": config.vae.parallel.world_size > 1,
            "vae.tiling": config.vae.tiling, "controlnets": bool(config.controlnets),
            "runner": "simulated" in (config.encoder.runner, config.dit.runner, config.vae.runner),
        }
        for name, asked in not_yet.items():
            if asked:
                raise ValueError(f"{name}: not available for Qwen-Image 2.1 yet (docs/qwen-image-2.1.md)")
        if config.build_if_missing == "dummy" and config.configs != self.name:
            raise ValueError("configs: a Qwen-Image 2.1 dummy checkpoint is written from qwen-image-2.1's configs")

    def with_checkpoint_settings(self, config):
        """The preset with its local checkpoint's ``sample_sigmas`` (``model_index.json``'s) when it sets none, as
        the pipeline reads them."""
        index = pathlib.Path(config.model) / "model_index.json"
        if config.sample_sigmas is not None or not index.is_file():
            return config
        sigmas = json.loads(index.read_text()).get("sample_sigmas")
        return config.model_copy(update={"sample_sigmas": tuple(sigmas)}) if sigmas else config

    def check_checkpoint(self, config, source: str) -> None:
        """An edit preset's condition images, at ``edit.image_area``, must not be below the pixels Qwen3-VL's
        processor takes (it would read them larger than their latents: one vision token no longer stands for one
        32x32 tile)."""
        from omni_ray.config import ConfigError
        from omni_ray.families.base import read_image_processor
        from omni_ray.tokenizer import VisionPatches

        settings = read_image_processor(config.model) if config.edit is not None else None
        if settings is None:
            return
        floor = VisionPatches.from_config(settings).min_pixels
        if config.edit.image_area < floor:
            raise ConfigError(f"{source}: edit.image_area: {config.edit.image_area} pixels is below the {floor} "
                              f"Qwen3-VL's processor takes ({config.model}/processor); condition images would not "
                              "line up with their latents")

    def write_checkpoint(self, model_dir: pathlib.Path, config) -> None:
        """One layout serves its generations and edits."""
        if config.build_if_missing == "dummy":
            from omni_ray.checkpoints.dummy import write_dummy_checkpoint

            write_dummy_checkpoint(model_dir, configs=config.configs)
        else:
            from omni_ray.families.qwen_image_2_1 import tiny

            tiny.write_checkpoint(model_dir, seed=0, size=config.build_if_missing)

    def check_route(self, config, has_image: bool, has_mask: bool) -> None:
        """Generations always; edits (condition images) with the preset's ``edit``; no masks."""
        if has_mask:
            raise RequestError(f"mask: {config.name!r} is a Qwen-Image 2.1 model, which diffusers defines no masked "
                               "edit for; masks work on Qwen-Image and Qwen-Image-Edit presets", param="mask")
        if has_image and config.edit is None:
            raise RequestError(f"image: {config.name!r} takes no condition images (its preset has no `edit`); use "
                               "/v1/images/generations", param="image")

    def check_image_tokens(self, image_tokens: int, image_sizes: tuple[tuple[int, int], ...]) -> None:
        """Each condition image's vision tokens must be its 32x32 tiles, which stand for its latents."""
        slots = sum(facts.vision_slots(*size) for size in image_sizes)
        if image_tokens != slots:
            sizes = ", ".join(f"{width}x{height}" for height, width in image_sizes)
            raise RequestError(f"image: at their working sizes ({sizes}) Qwen3-VL's processor reads the images as "
                               f"{image_tokens} vision tokens, not the {slots} their latents make: a working size "
                               "outside the processor's pixel range (edit.image_area)", param="image")

    def tokenizer(self, config):
        from omni_ray.families.qwen_image_2_1.tokenizer import Qwen21Tokenizer

        return Qwen21Tokenizer(config.model)

    def build_dit_runner(self, config, mesh=None):
        import torch

        from omni_ray.families.qwen_image_2_1.denoise import Denoise21Runner

        stage = config.dit
        return Denoise21Runner.load(config.model, getattr(torch, stage.dtype), stage.device,
                                    dummy=config.weights == "dummy", max_loras=stage.max_loras, mesh=mesh)

    def build_vae_runner(self, config, mesh=None):
        import torch

        from omni_ray.families.qwen_image_2_1.vae import VaeRunner21

        stage = config.vae
        return VaeRunner21.load(config.model, getattr(torch, stage.dtype), stage.device,
                                dummy=config.weights == "dummy", tiling=bool(stage.tiling), mesh=mesh)

    def stage_memory(self, config, gpu_memory_gib: float) -> list:
        from omni_ray.families.qwen_image_2_1.placement import stage_memory

        return stage_memory(config, gpu_memory_gib)
