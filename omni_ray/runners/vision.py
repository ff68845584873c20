"""Qwen2.5-VL's image processor on the encoder's host side: an edit's images as the vision tower takes them, for the
runners that run the tower themselves (``transformers_encoder``; vLLM runs the processor inside its engine)."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from transformers import AutoImageProcessor


class VisionInputs:
    """The checkpoint's ``processor/``: images to ``pixel_values`` and ``image_grid_thw``."""

    def __init__(self, model: str):
        self.processor = AutoImageProcessor.from_pretrained(model, subfolder="processor")

    def __call__(self, images: tuple[np.ndarray, ...]) -> dict[str, torch.Tensor]:
        return dict(self.processor(images=[Image.fromarray(image) for image in images], return_tensors="pt"))

    def tokens(self, inputs: dict[str, torch.Tensor]) -> list[int]:
        """The vision tokens each image of ``inputs`` became: its patch grid, merged ``merge_size`` x
        ``merge_size``."""
        return [int(grid.prod()) // self.processor.merge_size**2 for grid in inputs["image_grid_thw"]]
