"""References for the tests and benchmarks: the stages chained as diffusers batches them, diffusers'
QwenImageEditPipeline with the preset's working area, and photo-like test images.

``ReferencePipeline`` runs the three stage runners in one process without any engine, batching as diffusers'
``QwenImagePipeline`` batches (all prompts together, the negative prompts in a second encoder pass, CFG's two
passes separately, one decode): the same operations on the same values, so its pixels equal diffusers' exactly.

diffusers' QwenImageEditPipeline is the reference for edits, with two settings:

1. The working area. diffusers resizes the input image to 1024x1024 pixels (a constant in ``__call__``); the tiny
   preset uses 128x128, so the reference is run with ``calculate_dimensions`` given the preset's area.
2. M-RoPE. diffusers 0.42 calls the text encoder with ``input_ids``, ``attention_mask``, ``pixel_values`` and
   ``image_grid_thw`` but not the ``mm_token_type_ids`` its own processor returns; transformers 5 needs them to
   give the image tokens their 2D rotary positions and otherwise falls back to 1D positions, which Qwen2.5-VL was
   not trained with. The reference's text encoder gets them (the processor's values: 1 on image tokens), so it runs
   Qwen2.5-VL as transformers' processor and model run it together, and as vLLM runs it.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import torch
from diffusers import QwenImageEditPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit
from PIL import Image

from omni_ray.config import PipelineConfig
from omni_ray.stages.decode import VaeRunner
from omni_ray.stages.denoise import DenoiseParams, DenoiseRunner, uses_true_cfg
from omni_ray.stages.encode import PromptEncoder, template_for


class ReferencePipeline:
    """Loads each stage runner from a preset and runs requests through them as diffusers batches them."""

    def __init__(self, config: PipelineConfig):
        self.config = config
        self.encoder = PromptEncoder(
            config.model, getattr(torch, config.encoder.dtype), config.encoder.device,
            config.encoder.max_sequence_length, template_for(config),
        )
        self.denoiser = DenoiseRunner.load(config.model, getattr(torch, config.dit.dtype), config.dit.device)
        self.decoder = VaeRunner.load(config.model, getattr(torch, config.vae.dtype), config.vae.device)

    def generate(self, prompts, *, seeds, height, width, num_inference_steps, negative_prompts=None,
                 true_cfg_scale=4.0, image=None) -> np.ndarray:
        """Images for ``prompts`` (one seed each), as uint8 ``[B, H, W, 3]``; an edit preset edits ``image``
        (uint8 ``[H, W, 3]`` at its working size)."""
        assert len(seeds) == len(prompts) and (image is not None) == (self.config.edit is not None)
        prompt_embeds = self.encoder.encode(prompts, image)
        use_cfg = uses_true_cfg(true_cfg_scale, negative_prompts is not None)
        negative_embeds = self.encoder.encode(negative_prompts, image) if use_cfg else [None] * len(prompts)
        image_latents = self.decoder.encode([image])[0] if image is not None else None
        states = [
            self.denoiser.prepare(
                DenoiseParams(height, width, num_inference_steps, seed, true_cfg_scale), prompt, negative, image_latents
            )
            for prompt, negative, seed in zip(prompt_embeds, negative_embeds, seeds)
        ]
        for _ in range(num_inference_steps):
            self.denoiser.step(states, fuse_cfg=False)
        return self.decoder.decode([self.denoiser.finish(state) for state in states])


def load_reference(checkpoint, token_types: bool = True) -> QwenImageEditPipeline:
    pipe = QwenImageEditPipeline.from_pretrained(checkpoint)
    if token_types:
        text_encoder = pipe.text_encoder
        forward = text_encoder.forward
        image_token_id = text_encoder.config.image_token_id

        def forward_with_token_types(input_ids=None, **kwargs):
            kwargs.setdefault("mm_token_type_ids", (input_ids == image_token_id).long())
            return forward(input_ids=input_ids, **kwargs)

        text_encoder.forward = forward_with_token_types
    return pipe


def reference_edit(pipe: QwenImageEditPipeline, image_area: int, image: Image.Image, seed: int, **kwargs) -> np.ndarray:
    """uint8 ``[H, W, 3]``: diffusers' edit of ``image`` with its working area set to ``image_area``."""
    calculate = pipeline_qwenimage_edit.calculate_dimensions
    with mock.patch.object(
        pipeline_qwenimage_edit, "calculate_dimensions", lambda _, ratio: calculate(image_area, ratio)
    ):
        pixels = pipe(image=image, generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **kwargs)
    return (pixels.images[0] * 255).round().astype(np.uint8)


def source_image(width: int, height: int, seed: int) -> Image.Image:
    """A photo-like input for tests and benchmarks: smooth colour gradients, a bright disc, and some noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    cx, cy = rng.uniform(0.2, 0.8, 2) * (width / max(width, height), height / max(width, height))
    disc = ((x - cx) ** 2 + (y - cy) ** 2 < 0.04)[..., None]
    base = np.stack([x, y, 1 - x * y], axis=-1) * rng.uniform(120, 255, 3)
    pixels = np.where(disc, rng.uniform(0, 255, 3), base) + rng.normal(0, 8, (height, width, 3))
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))
