"""Qwen-Image 2.1's text side, without torch: its raw template (``QwenImage21Pipeline._get_qwen_prompt_embeds``)
around the prompt and the condition images' slots, tokenized by the checkpoint's ``processor/`` tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from omni_ray.families.qwen_image_2_1 import facts
from omni_ray.tokenizer import PromptTokenizer, VisionPatches, image_processor_config


@dataclass(frozen=True, slots=True)
class RawTemplate:
    """Qwen-Image 2.1's prompt template (``facts.template``): a raw string, not the chat template, the
    condition images' labelled slots opening the user turn. It stands where a ``PromptTemplate`` stands."""

    drop: int  # the chat template's system turn, in tokens: the pipeline's _drop_idx
    truncates: ClassVar[bool] = False  # QwenImage21Pipeline cuts nothing
    has_image: ClassVar[bool] = True  # up to MAX_IMAGES condition images, each one <|image_pad|> until expanded

    def format(self, prompt: str, num_images: int = 0) -> str:
        return facts.format_prompt(prompt, num_images)

    @property
    def key(self) -> str:
        """What tells it from other templates (the prompt cache's salt): the family and its one-image form."""
        return f"{facts.FAMILY}\0{facts.template(1)}"


class Qwen21Tokenizer(PromptTokenizer):
    """Qwen-Image 2.1's text side: the raw template per number of condition images, read by the tokenizer in the
    checkpoint's ``processor/`` (Qwen3-VL's processor; there is no ``tokenizer/``).

    ``tokenize`` gives one ``<|image_pad|>`` per image, which the vision path widens to the image's vision tokens (one
    per 32x32 tile at a working size, ``image_tokens``); ``image_slots`` marks those tokens, after the system turn's
    drop, as the pipeline's ``image_pad_mask``. The drop is counted as the pipeline counts it: the tokens the chat
    template makes of the system message.
    """

    def __init__(self, model: str):
        super().__init__(model, subfolder="processor")
        self.template = RawTemplate(system_turn_tokens(self.tokenizer))
        self.vision = VisionPatches.from_config(image_processor_config(model))

    def image_slots(self, token_ids: list[int], image_sizes: tuple[tuple[int, int], ...] = ()) -> np.ndarray:
        """Bool per token the encoder returns after the drop: True at the images' vision tokens (``token_ids`` as
        ``tokenize`` gave them, each ``<|image_pad|>`` widened for the image of ``image_sizes`` it stands for)."""
        ids = self.expand_images(token_ids, [self.image_tokens(*size) for size in image_sizes])
        return np.asarray(ids[self.template.drop :], dtype=np.int64) == self.image_token_id


def system_turn_tokens(tokenizer) -> int:
    """Tokens of the system turn Qwen-Image 2.1 drops, counted as ``QwenImage21Pipeline`` counts them: the chat
    template applied to its system message (the template's own text, ``SYSTEM_TURN``, where the tokenizer has no
    chat template)."""
    message = [{"role": "system", "content": [{"type": "text", "text": facts.SYSTEM_PROMPT}]}]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(message, tokenize=True, return_dict=False)
        return len(ids[0] if ids and isinstance(ids[0], list) else ids)
    return len(tokenizer(facts.SYSTEM_TURN).input_ids)
