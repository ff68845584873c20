"""The encoder stage's text side, without torch: Qwen-Image's prompt template around a prompt, its token ids, and
the tokens an edit's images become, as diffusers' ``QwenImagePipeline`` and ``QwenImageEditPipeline`` build them in
``encode_prompt``. The coordinator counts a prompt's tokens with it (its replica loads no torch); the encoder's
engine core tokenizes with it. The torch side (the vision tower's inputs, the embeddings) is the encoder runners'.
"""

from __future__ import annotations

import json

# The class AutoTokenizer picks for Qwen2.5-VL's tokenizer, imported directly: AutoTokenizer's module imports torch.
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer
from transformers.utils import cached_file

from omni_ray.qwen_image import TEXT_TO_IMAGE, TOKENIZER_MAX_LENGTH, PromptTemplate, VisionPatches
from omni_ray.records import TokenCount


class PromptTokenizer:
    """Wraps a prompt in the pipeline's template and tokenises it.

    An edit template's image placeholders stay one ``<|image_pad|>`` token each here; the vision path expands each
    to its image's token count (``image_tokens``), as Qwen2.5-VL's processor does.
    """

    def __init__(self, model: str, template: PromptTemplate = TEXT_TO_IMAGE):
        self.template = template
        self.tokenizer = Qwen2Tokenizer.from_pretrained(model, subfolder="tokenizer")
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
