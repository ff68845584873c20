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

    The edit template's image placeholder stays one ``<|image_pad|>`` token here; the vision path expands it to the
    image's token count (``image_tokens``), as Qwen2.5-VL's processor does.
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

    def num_tokens(self, prompt: str, image_size: tuple[int, int] | None = None) -> TokenCount:
        """Tokens of the templated prompt, untruncated: its text's, and with ``image_size`` (height, width) the edit
        image's (which replace the template's one image placeholder)."""
        count = len(self.tokenizer(self.template.text.format(prompt)).input_ids)
        if not self.template.has_image:
            return TokenCount(count)
        return TokenCount(count - 1, self.image_tokens(*image_size))

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of the templated prompt, truncated as diffusers truncates."""
        text = self.template.text.format(prompt)
        if not self.template.truncates:
            return self.tokenizer(text).input_ids
        return self.tokenizer(text, max_length=TOKENIZER_MAX_LENGTH + self.template.drop, truncation=True).input_ids

    def vision_inputs(self, image: np.ndarray) -> dict[str, torch.Tensor]:
        """The image as Qwen2.5-VL's vision tower takes it: ``pixel_values`` and ``image_grid_thw``."""
        from PIL import Image

        return dict(self.image_processor(images=[Image.fromarray(image)], return_tensors="pt"))

    def expand_image(self, token_ids: list[int], num_image_tokens: int) -> list[int]:
        """Repeats the one ``<|image_pad|>`` token ``num_image_tokens`` times."""
        at = token_ids.index(self.image_token_id)
        return token_ids[:at] + [self.image_token_id] * num_image_tokens + token_ids[at + 1 :]


def to_prompt_embeds(hidden: torch.Tensor, template: PromptTemplate, max_sequence_length: int) -> PromptEmbeds:
    """Drops the template's system tokens from one sequence's last hidden state ``[num_tokens, hidden]``."""
    hidden = hidden[template.drop :]
    if template.truncates:
        hidden = hidden[:max_sequence_length]
    return PromptEmbeds(hidden.detach().cpu().contiguous())
