"""The encoder stage's text side, without torch: Qwen-Image's prompt template around a prompt, its token ids, and
the tokens an edit's images become, as diffusers' ``QwenImagePipeline`` and ``QwenImageEditPipeline`` build them in
``encode_prompt`` (a family with a template of its own subclasses ``PromptTokenizer``: Qwen-Image 2.1's is in its
package). The coordinator counts a prompt's tokens with it (its replica loads no torch); the encoder's
engine core tokenizes with it. The torch side (the vision tower's inputs, the embeddings) is the encoder runners'.
``tokenizer_for(config)`` asks the preset's family for the checkpoint's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

# The class AutoTokenizer picks for Qwen2.5-VL's tokenizer, imported directly: AutoTokenizer's module imports torch.
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer
from transformers.utils import cached_file

from omni_ray.families import family_of
from omni_ray.families.qwen_image.facts import TEXT_TO_IMAGE, TOKENIZER_MAX_LENGTH, PromptTemplate
from omni_ray.families.qwen_image_layered import facts as qwen_image_layered
from omni_ray.records import TokenCount

if TYPE_CHECKING:
    from omni_ray.config import PipelineConfig


@dataclass(frozen=True, slots=True)
class VisionPatches:
    """Qwen2.5-VL's and Qwen3-VL's image processor settings (``processor/preprocessor_config.json``): how an image is
    resized to whole merged patches within a pixel range, and so how many tokens it becomes."""

    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    @classmethod
    def from_config(cls, config: dict) -> VisionPatches:
        """The settings of a ``preprocessor_config.json``: ``size``'s edges, which ``min_pixels`` and
        ``max_pixels`` override when given (as transformers reads older files)."""
        size = config.get("size") or {}
        return cls(config.get("patch_size", cls.patch_size), config.get("merge_size", cls.merge_size),
                   config.get("min_pixels") or size.get("shortest_edge", cls.min_pixels),
                   config.get("max_pixels") or size.get("longest_edge", cls.max_pixels))

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """The size the processor resizes an image to: each side rounded to whole merged patches, then scaled as
        one (keeping the aspect) into ``min_pixels``..``max_pixels``, rounding down when shrinking and up when
        growing."""
        unit = self.patch_size * self.merge_size
        rows, cols = round(height / unit) * unit, round(width / unit) * unit
        if rows * cols > self.max_pixels:
            scale = math.sqrt(height * width / self.max_pixels)
            rows = max(unit, math.floor(height / scale / unit) * unit)
            cols = max(unit, math.floor(width / scale / unit) * unit)
        elif rows * cols < self.min_pixels:
            scale = math.sqrt(self.min_pixels / (height * width))
            rows, cols = math.ceil(height * scale / unit) * unit, math.ceil(width * scale / unit) * unit
        return rows, cols

    def tokens(self, height: int, width: int) -> int:
        """The vision tokens an image of ``height`` x ``width`` pixels becomes: its patches, merged ``merge_size``
        x ``merge_size``."""
        rows, cols = self.resized(height, width)
        return (rows // self.patch_size) * (cols // self.patch_size) // self.merge_size**2



class PromptTokenizer:
    """Wraps a prompt in the pipeline's template and tokenises it.

    An edit template's image placeholders stay one ``<|image_pad|>`` token each here; the vision path expands each
    to its image's token count (``image_tokens``), as Qwen2.5-VL's processor does.
    """

    def __init__(self, model: str, template: PromptTemplate = TEXT_TO_IMAGE, subfolder: str = "tokenizer"):
        self.template = template
        self.tokenizer = Qwen2Tokenizer.from_pretrained(model, subfolder=subfolder)
        self.pad_token_id = self.tokenizer.pad_token_id
        self.image_token_id = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.vision = VisionPatches.from_config(image_processor_config(model)) if template.has_image else None

    def image_tokens(self, height: int, width: int) -> int:
        """Tokens an image of this size becomes (``qwen_image.VisionPatches``)."""
        return self.vision.tokens(height, width)

    def num_tokens(self, prompt: str, image_sizes: tuple[tuple[int, int], ...] = ()) -> TokenCount:
        """Tokens of the templated prompt, untruncated: its text's, and the edit images' of ``image_sizes``
        ((height, width) each, as the encoder reads them), which replace their placeholders."""
        count = len(self.tokenizer(self.template.format(prompt, len(image_sizes))).input_ids)
        if not self.template.has_image:
            return TokenCount(count)
        return TokenCount(count - len(image_sizes), sum(self.image_tokens(*size) for size in image_sizes))

    def tokenize(self, prompt: str, num_images: int = 0) -> list[int]:
        """Token ids of the templated prompt (an edit's with ``num_images`` placeholders), truncated as diffusers
        truncates."""
        text = self.template.format(prompt, num_images)
        if not self.template.truncates:
            return self.tokenizer(text).input_ids
        return self.tokenizer(text, max_length=TOKENIZER_MAX_LENGTH + self.template.drop, truncation=True).input_ids

    def expand_images(self, token_ids: list[int], counts: list[int]) -> list[int]:
        """Repeats the i-th ``<|image_pad|>`` token ``counts[i]`` times."""
        expanded, images = [], iter(counts)
        for token in token_ids:
            expanded.extend([token] * next(images) if token == self.image_token_id else [token])
        return expanded

    def image_slots(self, token_ids: list[int], image_sizes: tuple[tuple[int, int], ...] = ()) -> np.ndarray | None:
        """Qwen-Image 2.1's: which of the encoder's tokens are image slots. Qwen-Image's embeddings carry none."""
        return None


class CaptionTokenizer:
    """Qwen-Image-Layered's caption side: the caption template's token ids (one ``<|image_pad|>``, which the vision
    path widens to the image's tokens as Qwen2.5-VL's processor does) and the generated ids back to text, both with
    the tokenizer of the checkpoint's ``processor/``, which ``get_image_caption`` runs."""

    def __init__(self, model: str):
        self.tokenizer = Qwen2Tokenizer.from_pretrained(model, subfolder="processor")
        self._token_ids = {language: self.tokenizer(template).input_ids
                           for language, template in qwen_image_layered.CAPTION_TEMPLATES.items()}

    def tokenize(self, language: str) -> list[int]:
        """The template of ``language`` ("en" or "zh") as token ids."""
        return list(self._token_ids[language])

    @property
    def max_template_tokens(self) -> int:
        """The longer template's tokens (its image placeholder one token)."""
        return max(len(ids) for ids in self._token_ids.values())

    def decode(self, token_ids: list[int] | tuple[int, ...]) -> str:
        """The caption as the pipeline reads it: special tokens skipped, spaces not cleaned up, stripped."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False).strip()


def tokenizer_for(config: PipelineConfig) -> PromptTokenizer:
    """The checkpoint's tokenizer, as its family builds it (Qwen-Image's: the preset's prompt template)."""
    return family_of(config).tokenizer(config)


def image_processor_config(model: str) -> dict:
    """The checkpoint's image processor settings: ``processor/preprocessor_config.json`` as the published
    checkpoints have it, or the ``image_processor`` of ``processor_config.json`` as transformers 5 writes one."""
    path = cached_file(model, "preprocessor_config.json", subfolder="processor",
                       _raise_exceptions_for_missing_entries=False)
    if path is not None:
        with open(path) as file:
            return json.load(file)
    with open(cached_file(model, "processor_config.json", subfolder="processor")) as file:
        return json.load(file)["image_processor"]
