"""diffusers' QwenImageEditPipeline as the reference for omni-ray's edits (tests and benchmarks), with two settings.

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
