"""The encoder stage's text side, without torch: Qwen-Image's prompt template around a prompt, its token ids, and
the tokens an edit's images become, as diffusers' ``QwenImagePipeline`` and ``QwenImageEditPipeline`` build them in
``encode_prompt``; Qwen-Image 2.1's raw template (``QwenImage21Pipeline._get_qwen_prompt_embeds``) with
``Qwen21Tokenizer``. The coordinator counts a prompt's tokens with it (its replica loads no torch); the encoder's
engine core tokenizes with it. The torch side (the vision tower's inputs, the embeddings) is the encoder runners'.
``tokenizer_for(config)`` picks the checkpoint's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

# The class AutoTokenizer picks for Qwen2.5-VL's tokenizer, imported directly: AutoTokenizer's module imports torch.
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer
from transformers.utils import cached_file

from omni_ray import qwen_image21, qwen_image_layered
from omni_ray.qwen_image import TEXT_TO_IMAGE, TOKENIZER_MAX_LENGTH, PromptTemplate, VisionPatches
from omni_ray.records import TokenCount

if TYPE_CHECKING:
    from omni_ray.config import PipelineConfig


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


@dataclass(frozen=True, slots=True)
class RawTemplate:
    """Qwen-Image 2.1's prompt template (``qwen_image21.template``): a raw string, not the chat template, the
    condition images' labelled slots opening the user turn. It stands where a ``PromptTemplate`` stands."""

    drop: int  # the chat template's system turn, in tokens: the pipeline's _drop_idx
    truncates: ClassVar[bool] = False  # QwenImage21Pipeline cuts nothing
    has_image: ClassVar[bool] = True  # up to MAX_IMAGES condition images, each one <|image_pad|> until expanded

    def format(self, prompt: str, num_images: int = 0) -> str:
        return qwen_image21.format_prompt(prompt, num_images)

    @property
    def key(self) -> str:
        """What tells it from other templates (the prompt cache's salt): the family and its one-image form."""
        return f"{qwen_image21.FAMILY}\0{qwen_image21.template(1)}"


class Qwen21Tokenizer(PromptTokenizer):
    """Qwen-Image 2.1's text side: the raw template per number of condition images, read by the tokenizer in the
    checkpoint's ``processor/`` (Qwen3-VL's processor; there is no ``tokenizer/``).

    ``tokenize`` gives one ``<|image_pad|>`` per image, which the vision path widens to the image's vision tokens (one
    per 32x32 tile at a working size, ``image_tokens``); ``image_slots`` marks those tokens, after the system turn's
    drop, as the pipeline's ``image_pad_mask``. The drop is counted as the pipeline counts it: the tokens the chat
    template makes of the system message.
    """

    def __init__(self, model: str):
        super().__init__(model, TEXT_TO_IMAGE, subfolder="processor")
        self.template = RawTemplate(system_turn_tokens(self.tokenizer))
        self.vision = VisionPatches.from_config(image_processor_config(model))

    def image_slots(self, token_ids: list[int], image_sizes: tuple[tuple[int, int], ...] = ()) -> np.ndarray:
        """Bool per token the encoder returns after the drop: True at the images' vision tokens (``token_ids`` as
        ``tokenize`` gave them, each ``<|image_pad|>`` widened for the image of ``image_sizes`` it stands for)."""
        ids = self.expand_images(token_ids, [self.image_tokens(*size) for size in image_sizes])
        return np.asarray(ids[self.template.drop :], dtype=np.int64) == self.image_token_id


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


def system_turn_tokens(tokenizer) -> int:
    """Tokens of the system turn Qwen-Image 2.1 drops, counted as ``QwenImage21Pipeline`` counts them: the chat
    template applied to its system message (the template's own text, ``SYSTEM_TURN``, where the tokenizer has no
    chat template)."""
    message = [{"role": "system", "content": [{"type": "text", "text": qwen_image21.SYSTEM_PROMPT}]}]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(message, tokenize=True, return_dict=False)
        return len(ids[0] if ids and isinstance(ids[0], list) else ids)
    return len(tokenizer(qwen_image21.SYSTEM_TURN).input_ids)


def tokenizer_for(config: PipelineConfig) -> PromptTokenizer:
    """The checkpoint's tokenizer: Qwen-Image 2.1's raw template (``family: qwen-image-2.1``), else the preset's
    Qwen-Image template."""
    if config.family == qwen_image21.FAMILY:
        return Qwen21Tokenizer(config.model)
    return PromptTokenizer(config.model, config.prompt_template)


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
