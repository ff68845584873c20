"""The encoder stage's host side: Qwen-Image's prompt template around a prompt, its tokens, and the template's
leading tokens dropped from the encoder's output, as diffusers' ``QwenImagePipeline`` and ``QwenImageEditPipeline``
do in ``encode_prompt``. The forward pass between them is vLLM's (``vllm_encoder``)."""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoImageProcessor, AutoTokenizer

from omni_ray.qwen_image import TEXT_TO_IMAGE, TOKENIZER_MAX_LENGTH, PromptTemplate
from omni_ray.records import PromptEmbeds, TokenCount


class PromptTokenizer:
    """Wraps a prompt in the pipeline's template and tokenises it.

    An edit template's image placeholders stay one ``<|image_pad|>`` token each here; the vision path expands each
    to its image's token count (``image_tokens``), as Qwen2.5-VL's processor does.
    """

    def __init__(self, model: str, template: PromptTemplate = TEXT_TO_IMAGE):
        self.template = template
        self.tokenizer = AutoTokenizer.from_pretrained(model, subfolder="tokenizer")
        self.pad_token_id = self.tokenizer.pad_token_id
        self.image_token_id = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.image_processor = (
            AutoImageProcessor.from_pretrained(model, subfolder="processor") if template.has_image else None
        )

    def image_tokens(self, height: int, width: int) -> int:
        """Tokens an image of this size becomes: the processor's patches, merged ``merge_size`` x ``merge_size``."""
        patches = self.image_processor.get_number_of_image_patches(height, width)
        return patches // self.image_processor.merge_size**2

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

    def vision_inputs(self, images: tuple[np.ndarray, ...]) -> dict[str, torch.Tensor]:
        """The images as Qwen2.5-VL's vision tower takes them: ``pixel_values`` and ``image_grid_thw``."""
        from PIL import Image

        return dict(self.image_processor(images=[Image.fromarray(image) for image in images], return_tensors="pt"))

    def expand_images(self, token_ids: list[int], counts: list[int]) -> list[int]:
        """Repeats the i-th ``<|image_pad|>`` token ``counts[i]`` times."""
        expanded, images = [], iter(counts)
        for token in token_ids:
            expanded.extend([token] * next(images) if token == self.image_token_id else [token])
        return expanded


def to_prompt_embeds(hidden: torch.Tensor, template: PromptTemplate, max_sequence_length: int) -> PromptEmbeds:
    """Drops the template's system tokens from one sequence's last hidden state ``[num_tokens, hidden]``."""
    hidden = hidden[template.drop :]
    if template.truncates:
        hidden = hidden[:max_sequence_length]
    return PromptEmbeds(hidden.detach().cpu().contiguous())
