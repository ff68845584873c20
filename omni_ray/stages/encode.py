"""Encode stage: Qwen-Image's prompt template, tokens in, per-token prompt embeddings out.

The stage is split where the engine needs it: ``tokenize`` (template and tokenizer, on the host), a forward pass
from token ids to last hidden states (``TransformersTextEncoder`` here; vLLM's engine core in the encoder engine),
and ``to_prompt_embeds`` (drop the template's 34 tokens, keep at most ``max_sequence_length``), as diffusers'
``QwenImagePipeline.encode_prompt`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

# diffusers' QwenImagePipeline.prompt_template_encode and prompt_template_encode_start_idx.
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
PROMPT_TEMPLATE_DROP = 34
TOKENIZER_MAX_LENGTH = 1024  # diffusers' tokenizer_max_length; the template's 34 tokens come on top


@dataclass(slots=True)
class PromptEmbeds:
    """One prompt's embeddings, as they travel to the DiT stage (CPU, contiguous)."""

    embeds: torch.Tensor  # [num_tokens, hidden]

    @property
    def num_tokens(self) -> int:
        return self.embeds.shape[0]


class PromptTokenizer:
    """Wraps a prompt in Qwen-Image's template and tokenises it."""

    def __init__(self, model: str):
        self.tokenizer = AutoTokenizer.from_pretrained(model, subfolder="tokenizer")
        self.pad_token_id = self.tokenizer.pad_token_id

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of the templated prompt, truncated as diffusers truncates."""
        return self.tokenizer(
            PROMPT_TEMPLATE.format(prompt), max_length=TOKENIZER_MAX_LENGTH + PROMPT_TEMPLATE_DROP, truncation=True
        ).input_ids


def to_prompt_embeds(hidden: torch.Tensor, max_sequence_length: int) -> PromptEmbeds:
    """Drops the template's tokens from one sequence's last hidden state ``[num_tokens, hidden]``."""
    return PromptEmbeds(hidden[PROMPT_TEMPLATE_DROP:][:max_sequence_length].detach().cpu().contiguous())


class TransformersTextEncoder:
    """Token ids to last hidden states with transformers' Qwen2.5-VL (the reference forward pass).

    Sequences run as one right-padded batch with an attention mask, exactly as diffusers runs them.
    """

    def __init__(self, model: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        self.device = torch.device(device)
        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model, subfolder="text_encoder", dtype=dtype)
        self.model.to(self.device).eval()

    @torch.no_grad()
    def __call__(self, token_ids: list[list[int]], pad_token_id: int) -> list[torch.Tensor]:
        """Returns each sequence's last hidden state, ``[num_tokens_i, hidden]``."""
        max_len = max(len(ids) for ids in token_ids)
        input_ids = torch.full((len(token_ids), max_len), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(token_ids), max_len), dtype=torch.long)
        for row, ids in enumerate(token_ids):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
        out = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            output_hidden_states=True,
        )
        hidden = out.hidden_states[-1]
        return [hidden[row, : len(ids)] for row, ids in enumerate(token_ids)]


class PromptEncoder:
    """Prompts to ``PromptEmbeds`` with the transformers forward pass; the encoder engine swaps in vLLM's."""

    def __init__(
        self, model: str, dtype: torch.dtype = torch.float32, device: str = "cpu", max_sequence_length: int = 512
    ):
        self.tokenizer = PromptTokenizer(model)
        self.text_encoder = TransformersTextEncoder(model, dtype, device)
        self.max_sequence_length = max_sequence_length

    def encode(self, prompts: list[str]) -> list[PromptEmbeds]:
        token_ids = [self.tokenizer.tokenize(prompt) for prompt in prompts]
        hidden = self.text_encoder(token_ids, self.tokenizer.pad_token_id)
        return [to_prompt_embeds(h, self.max_sequence_length) for h in hidden]
