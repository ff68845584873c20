"""Qwen2.5-VL's (and Qwen3-VL's) image processor on the encoder's host side: an edit's images as the vision tower
takes them, for the runners that run the tower themselves (``transformers_encoder``; vLLM runs the processor inside
its engine). ``to_pil`` is what every runner hands a processor: Qwen-Image 2.1's RGBA images with alpha over white."""

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
        return dict(self.processor(images=[to_pil(image) for image in images], return_tensors="pt"))

    def tokens(self, inputs: dict[str, torch.Tensor]) -> list[int]:
        """The vision tokens each image of ``inputs`` became: its patch grid, merged ``merge_size`` x
        ``merge_size``."""
        return [int(grid.prod()) // self.processor.merge_size**2 for grid in inputs["image_grid_thw"]]


def to_pil(image: np.ndarray) -> Image.Image:
    """An encoder's view of a uint8 image: RGB as it is; RGBA (Qwen-Image 2.1) composited over white, as
    ``QwenImage21Pipeline`` flattens the copy its encoder reads (Pillow's paste with the alpha as mask)."""
    picture = Image.fromarray(image)
    if picture.mode != "RGBA":
        return picture
    white = Image.new("RGB", picture.size, (255, 255, 255))
    white.paste(picture, mask=picture.getchannel("A"))
    return white
