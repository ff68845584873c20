"""The encoder stage's forward pass without vLLM: Qwen2.5-VL through transformers (``encoder.runner:
transformers``), for platforms vLLM has no build for.

It stands where ``VllmEncoder`` stands, under the same engine core (``engine.encoder_core``): token ids (and for an
edit its images) in, each token's last hidden state out. Each step runs up to ``max_num_seqs`` queued text sequences
as one right-padded batch with an attention mask, as diffusers' ``encode_prompt`` runs them, or one sequence with
images alone, each placeholder expanded to its image's tokens, as diffusers' edit pipelines run each prompt with its
images. It is slower than vLLM (no continuous batching, padding) and holds the vision tower even for text to image,
but needs nothing beyond transformers: pick it where vLLM cannot be installed.

For Qwen-Image 2.1 (``model_kind`` ``qwen3-vl``) the model is Qwen3-VL, its image processor the one in
``processor/``, and the state it returns is the last decoder layer's before the final norm, as
``QwenImage21Pipeline`` hooks it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from omni_ray.runners.vision import VisionInputs
from omni_ray.tokenizer import PromptTokenizer


@dataclass(slots=True)
class _Sequence:
    token_ids: list[int]
    images: tuple[np.ndarray, ...]


class TransformersEncoder:
    def __init__(self, model: str, tokenizer: PromptTokenizer, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", max_num_seqs: int = 8, dummy: bool = False,
                 model_kind: str = "qwen2.5-vl"):
        from transformers import (
            Qwen2_5_VLConfig,
            Qwen2_5_VLForConditionalGeneration,
            Qwen3VLConfig,
            Qwen3VLForConditionalGeneration,
        )

        from omni_ray.runners.random_weights import random_model
        from omni_ray.runners.vllm_encoder import local_subfolder

        qwen3 = model_kind == "qwen3-vl"
        model_class, config_class = ((Qwen3VLForConditionalGeneration, Qwen3VLConfig) if qwen3
                                     else (Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig))
        path = local_subfolder(model, "text_encoder")
        if dummy:
            self.model = random_model(model_class, config_class.from_pretrained(path), dtype, device)
        else:
            self.model = model_class.from_pretrained(path, dtype=dtype).to(device).eval()
        if qwen3:  # the pipeline's hook: the final norm hands on its input
            self.model.model.language_model.norm.register_forward_hook(lambda module, args, output: args[0])
        self.tokenizer = tokenizer
        self.vision = VisionInputs(model) if tokenizer.template.has_image else None
        self.max_num_seqs = max_num_seqs
        self.waiting: OrderedDict[str, _Sequence] = OrderedDict()

    def device_modules(self) -> list[torch.nn.Module]:
        """What it holds on its device (the captioner's weights are the same)."""
        return [self.model]

    def add(self, sequence_id: str, token_ids: list[int], images: tuple[np.ndarray, ...] = ()) -> None:
        self.waiting[sequence_id] = _Sequence(token_ids, images)

    def abort(self, sequence_ids: list[str]) -> None:
        for sequence_id in sequence_ids:
            self.waiting.pop(sequence_id, None)

    def step(self) -> dict[str, torch.Tensor]:
        """Runs the oldest sequence with images alone, or up to ``max_num_seqs`` text sequences together."""
        if not self.waiting:
            return {}
        first_id, first = next(iter(self.waiting.items()))
        if first.images:
            del self.waiting[first_id]
            vision = self.vision(first.images)
            ids = self.tokenizer.expand_images(first.token_ids, self.vision.tokens(vision))
            return {first_id: last_hidden_states(self.model, [ids], self.tokenizer.pad_token_id, vision)[0]}
        batch = [sid for sid, sequence in self.waiting.items() if not sequence.images][: self.max_num_seqs]
        sequences = [self.waiting.pop(sid) for sid in batch]
        hidden = last_hidden_states(self.model, [s.token_ids for s in sequences], self.tokenizer.pad_token_id)
        return dict(zip(batch, hidden))

    def shutdown(self) -> None:
        self.waiting.clear()


@torch.no_grad()
def last_hidden_states(model, token_ids: list[list[int]], pad_token_id: int,
                       vision: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Each sequence's last hidden state ``[num_tokens_i, hidden]`` from transformers' Qwen2.5-VL, the sequences run
    as one right-padded batch with an attention mask. With ``vision`` (its images' ``pixel_values`` and
    ``image_grid_thw``) the one sequence holds those images' tokens, already expanded."""
    assert vision is None or len(token_ids) == 1, "images ride in one sequence"
    device = model.device
    max_len = max(len(ids) for ids in token_ids)
    input_ids = torch.full((len(token_ids), max_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(token_ids), max_len), dtype=torch.long)
    for row, ids in enumerate(token_ids):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
    vision = {name: value.to(device) for name, value in (vision or {}).items()}
    if vision:
        vision["pixel_values"] = vision["pixel_values"].to(model.dtype)
        # Which tokens are the image's: transformers 5 places M-RoPE's 2D positions by these (without them it falls
        # back to 1D positions, which is what diffusers 0.42's edit pipeline gets).
        vision["mm_token_type_ids"] = (input_ids == model.config.image_token_id).long().to(device)
    out = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), output_hidden_states=True,
                **vision)
    hidden = out.hidden_states[-1]
    return [hidden[row, : len(ids)] for row, ids in enumerate(token_ids)]


class TransformersCaptioner:
    """Qwen-Image-Layered's captions with transformers' ``generate`` on the encoder's Qwen2.5-VL (``model``, shared
    with ``TransformersEncoder``): greedy (``do_sample=False``; the checkpoint's repetition penalty, as the pipeline's
    ``generate`` applies it), at most ``max_tokens`` new tokens. Each step writes the oldest caption whole, so a
    caption holds the encoder's thread for its whole generation: this is the slow path where vLLM has no build."""

    def __init__(self, model, vision: VisionInputs, max_tokens: int):
        self.model = model
        self.vision = vision
        self.max_tokens = max_tokens
        self.waiting: OrderedDict[str, tuple[list[int], np.ndarray]] = OrderedDict()

    def add(self, sequence_id: str, token_ids: list[int], image: np.ndarray) -> None:
        self.waiting[sequence_id] = (token_ids, image)

    def abort(self, sequence_ids: list[str]) -> None:
        for sequence_id in sequence_ids:
            self.waiting.pop(sequence_id, None)

    @torch.no_grad()
    def step(self) -> dict[str, list[int]]:
        if not self.waiting:
            return {}
        from omni_ray.runners.vllm_captioner import caption_view

        sequence_id, (token_ids, image) = self.waiting.popitem(last=False)
        device = self.model.device
        inputs = dict(self.vision.processor(images=[caption_view(image)], return_tensors="pt"))
        (count,) = self.vision.tokens(inputs)
        image_token = self.model.config.image_token_id
        ids = [t for token in token_ids for t in ([token] * count if token == image_token else [token])]
        input_ids = torch.tensor([ids], device=device)
        out = self.model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
            pixel_values=inputs["pixel_values"].to(device, self.model.dtype),
            image_grid_thw=inputs["image_grid_thw"].to(device),
            mm_token_type_ids=(input_ids == image_token).long(),  # the processor's: M-RoPE's 2D positions
            max_new_tokens=self.max_tokens, do_sample=False,
        )
        return {sequence_id: out[0, len(ids):].tolist()}

    def shutdown(self) -> None:
        self.waiting.clear()
