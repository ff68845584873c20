"""Qwen-Image 2.1's transformer over a step batch whose rows each bring their own condition: a prefill per pass on
its first step, then one batched forward over the target tokens of every cached pass.

diffusers' ``QwenImage21Transformer2DModel.forward`` reads the joint layout (where the text, the condition images
and the target sit) from row 0, and right-padded text would shift the rotary positions of everything after it, so a
batch of different prompts cannot go through it. This is the same arithmetic over the model's own modules, each
pass laid out on its own:

- the joint sequence of a pass is its prompt's tokens (``txt_in``) with each condition image's vision slots widened
  to its 2x2 latent tokens and filled with its latents (``img_in``), then the target's tokens; its rotary positions
  are ``pos_embed``'s for that layout (``JointLayout``);
- ``prefill`` runs a whole pass with 2.1's block-causal attention (text causal, each image block bidirectional
  within itself, the target attending to everything), segment by segment as ``QwenImage21AttnProcessor`` does, and
  keeps every block's keys and values of the condition block after RoPE (``ConditionCache``): under
  ``causal_condition`` the condition modulates from t = 0, so these never change with the timestep;
- ``decode`` runs only the target tokens of many passes together: each row's queries attend to its own cached
  condition keys, right-padded to the longest row's and masked, then to the target's own keys.

The modulation is one shared projection of the timestep embedding; with ``causal_condition`` the condition tokens
read the t = 0 row and the target tokens their own timestep's, as diffusers' ``_select_modulation_rows``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from omni_ray.families.qwen_image_2_1.facts import TOKENS_PER_SLOT

Shape = tuple[int, int, int]  # (frames, latent rows, latent cols) of an image block


@dataclass(frozen=True, slots=True)
class JointLayout:
    """Where one pass's tokens sit in its joint sequence: text, condition images in their slots, the target last."""

    repeats: torch.Tensor  # long [encoder_tokens + target_tokens / 4]: 4 at an image slot, 1 at a text token
    image_tokens: torch.Tensor  # bool [joint_tokens]: the condition images' and the target's latent tokens
    target_tokens: torch.Tensor  # bool [joint_tokens]: the target's (the last block)
    rope: torch.Tensor  # complex64 [joint_tokens, head_dim / 2]: pos_embed's rotations
    segments: tuple[tuple[int, int, bool], ...]  # the condition block's runs (start, end, is_text), in order
    condition_tokens: int  # the tokens before the target: text and condition images

    @classmethod
    def of(cls, transformer, image_slots: torch.Tensor, shapes: list[Shape]) -> JointLayout:
        """``image_slots`` bool [encoder_tokens] marks the condition images' vision tokens; ``shapes`` are the
        condition images' then the target's. As diffusers' forward builds it for its row 0."""
        target_slots = math.prod(shapes[-1]) // TOKENS_PER_SLOT
        slots = torch.cat([image_slots, image_slots.new_ones(target_slots)])
        repeats = torch.where(slots, TOKENS_PER_SLOT, 1)
        image_tokens = torch.repeat_interleave(slots, repeats)
        device = next(transformer.parameters()).device
        rope = transformer.pos_embed(shapes, image_tokens, device=device)
        image_ids, target_tokens = transformer.build_token_metadata(image_tokens, shapes)
        condition_tokens = int((~target_tokens).sum())
        return cls(repeats, image_tokens, target_tokens, rope, _segments(image_ids[:condition_tokens].tolist()),
                   condition_tokens)


def _segments(image_ids: list[int]) -> tuple[tuple[int, int, bool], ...]:
    """Runs of equal block ids (-1: text) as (start, end, is_text): the block-causal mask's structure."""
    runs, start = [], 0
    for index in range(1, len(image_ids) + 1):
        if index == len(image_ids) or image_ids[index] != image_ids[start]:
            runs.append((start, index, image_ids[start] < 0))
            start = index
    return tuple(runs)


@dataclass(slots=True)
class ConditionCache:
    """What later steps need of one pass's condition block (its text and condition images): every block's keys and
    values of it after RoPE, and the target's rotary positions behind it. Made by the pass's first step."""

    keys: torch.Tensor  # [layers, condition_tokens, heads, head_dim]
    values: torch.Tensor  # [layers, condition_tokens, heads, head_dim]
    target_rope: torch.Tensor  # complex64 [target_tokens, head_dim / 2]

    @property
    def condition_tokens(self) -> int:
        return self.keys.shape[1]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.target_rope.nbytes


@dataclass(frozen=True, slots=True)
class Modulation:
    """The shared modulation, per token: ``[rows, tokens or 1, dim]`` each, the gates through their tanh."""

    scale1: torch.Tensor
    gate1: torch.Tensor
    scale2: torch.Tensor
    gate2: torch.Tensor

    @classmethod
    def of(cls, params: torch.Tensor, target_tokens: torch.Tensor | None = None) -> Modulation:
        """From ``modulation(temb)`` ``[rows, 4 * dim]``. With ``target_tokens`` (bool [tokens]) ``params`` has one
        more row, t = 0's, which the other tokens read."""
        scale1, gate1, scale2, gate2 = (_per_token(p, target_tokens) for p in params.chunk(4, dim=-1))
        return cls(scale1, gate1.tanh(), scale2, gate2.tanh())


def _per_token(params: torch.Tensor, target_tokens: torch.Tensor | None) -> torch.Tensor:
    if target_tokens is None:
        return params.unsqueeze(1)
    return torch.where(target_tokens.view(1, -1, 1), params[:-1].unsqueeze(1), params[-1:].unsqueeze(0))


def prefill(
    transformer,
    latents: torch.Tensor,  # [1, target_tokens, in_channels]
    condition: torch.Tensor | None,  # [1, condition image tokens, in_channels], the images one after another
    text: torch.Tensor,  # [1, encoder_tokens, context_in_dim]
    timestep: torch.Tensor,  # [1], scaled to [0, 1]
    layout: JointLayout,
) -> tuple[torch.Tensor, ConditionCache]:
    """One pass's whole joint sequence: the prediction for its target tokens ``[1, target_tokens, out_channels]``
    and its condition cache."""
    # 1. The joint sequence: text projected, image slots widened to their latent tokens and filled.
    images = latents if condition is None else torch.cat([condition, latents], dim=1)
    hidden = transformer.img_in(images)
    text = transformer.txt_in(text)
    joint = torch.cat([text, text.new_zeros(1, latents.shape[1] // TOKENS_PER_SLOT, text.shape[2])], dim=1)
    joint = joint.repeat_interleave(layout.repeats, dim=1)
    joint[:, layout.image_tokens] = hidden
    # 2. The modulation: the target's timestep, and t = 0 for the condition.
    temb = transformer.time_text_embed(torch.cat([timestep, timestep.new_zeros(1)]).to(hidden.dtype), hidden)
    modulation = Modulation.of(transformer.modulation(temb), layout.target_tokens)
    # 3. The blocks, each keeping its condition keys and values.
    blocks = transformer.transformer_blocks
    condition_tokens, heads = layout.condition_tokens, blocks[0].attn.heads
    head_dim = blocks[0].attn.inner_dim // heads
    keys = joint.new_empty(len(blocks), condition_tokens, heads, head_dim)
    values = torch.empty_like(keys)
    rope = layout.rope[None]
    for index, block in enumerate(blocks):
        def attend(attn, x, index=index):
            query, key, value = _project(attn, x, rope)
            keys[index], values[index] = key[0, :condition_tokens], value[0, :condition_tokens]
            return _out(attn, _block_causal(query, key, value, layout.segments, condition_tokens))

        joint = _block(block, joint, modulation, attend)
    # 4. The target's prediction.
    prediction = transformer.proj_out(transformer.norm_out(joint[:, condition_tokens:], temb[:1]))
    return prediction, ConditionCache(keys, values, layout.rope[condition_tokens:].clone())


def decode(
    transformer,
    latents: torch.Tensor,  # [rows, target_tokens, in_channels]
    timesteps: torch.Tensor,  # [rows], scaled to [0, 1]
    caches: list[ConditionCache],  # each row's
) -> torch.Tensor:
    """The target tokens of passes that have their condition cache, one row each, in one forward: their
    predictions ``[rows, target_tokens, out_channels]``."""
    hidden = transformer.img_in(latents)
    temb = transformer.time_text_embed(timesteps.to(hidden.dtype), hidden)
    modulation = Modulation.of(transformer.modulation(temb))
    rope = torch.stack([cache.target_rope for cache in caches])
    key_mask = _key_mask(caches, latents.shape[1], latents.device)
    for index, block in enumerate(transformer.transformer_blocks):
        def attend(attn, x, index=index):
            query, key, value = _project(attn, x, rope)
            key = _behind([cache.keys[index] for cache in caches], key)
            value = _behind([cache.values[index] for cache in caches], value)
            return _out(attn, _attention(query, key, value, key_mask))

        hidden = _block(block, hidden, modulation, attend)
    return transformer.proj_out(transformer.norm_out(hidden, temb))


def _block(block, hidden: torch.Tensor, modulation: Modulation, attend) -> torch.Tensor:
    """``QwenImage21TransformerBlock.forward`` with the attention ``attend(attn, x)`` makes."""
    x = block.img_norm1(hidden) * (1 + modulation.scale1)
    hidden = hidden + modulation.gate1 * attend(block.attn, x)
    x = block.img_norm2(hidden) * (1 + modulation.scale2)
    hidden = hidden + modulation.gate2 * block.img_mlp(x)
    if hidden.dtype == torch.float16:
        hidden = hidden.clip(-65504, 65504)
    return hidden


def _project(attn, x: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value ``[rows, tokens, heads, head_dim]``: projected, their heads RMS-normed, query and key
    rotated by ``rope`` ``[rows, tokens, head_dim / 2]`` (complex)."""
    head_dim = attn.inner_dim // attn.heads
    query, key, value = (proj(x).unflatten(-1, (-1, head_dim)) for proj in (attn.to_q, attn.to_k, attn.to_v))
    query = attn.norm_q(query).to(value.dtype)
    key = attn.norm_k(key).to(value.dtype)
    return _rotate(query, rope), _rotate(key, rope), value


def _rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb_qwen(use_real=False)`` with a rotation per row: channel pairs as complex
    numbers, times ``rope`` broadcast over the heads."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * rope.unsqueeze(2)).flatten(3).type_as(x)


def _out(attn, attended: torch.Tensor) -> torch.Tensor:
    """The heads joined and projected out."""
    return attn.to_out[1](attn.to_out[0](attended.flatten(2, 3)))


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention on ``[rows, tokens, heads, head_dim]`` tensors; ``mask`` bool broadcastable to
    ``[rows, heads, queries, keys]``."""
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                         attn_mask=mask)
    return out.transpose(1, 2).type_as(query)


def _block_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  segments: tuple[tuple[int, int, bool], ...], condition_tokens: int) -> torch.Tensor:
    """2.1's block-causal attention over one pass (``QwenImage21AttnProcessor``'s prefill): each condition segment
    attends to the keys up to its end, causally within a text segment; the target attends to every key."""
    out = []
    for start, end, is_text in segments:
        mask = None
        if is_text:
            length = end - start
            mask = torch.ones(length, end, dtype=torch.bool, device=query.device).tril(start)
        out.append(_attention(query[:, start:end], key[:, :end], value[:, :end], mask))
    out.append(_attention(query[:, condition_tokens:], key, value))
    return torch.cat(out, dim=1)


def _behind(condition: list[torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """Each row's cached condition ``[tokens_i, heads, head_dim]``, right-padded with zeros to the longest, then
    its target tokens' ``target`` ``[rows, target_tokens, heads, head_dim]``: the keys (or values) a cached step
    attends to, made in one copy."""
    longest = max(cached.shape[0] for cached in condition)
    joint = target.new_empty(target.shape[0], longest + target.shape[1], *target.shape[2:])
    for row, cached in enumerate(condition):
        joint[row, : cached.shape[0]] = cached
        joint[row, cached.shape[0] : longest] = 0
    joint[:, longest:] = target
    return joint


def _key_mask(caches: list[ConditionCache], target_tokens: int, device: torch.device) -> torch.Tensor | None:
    """``[rows, 1, 1, longest condition + target_tokens]``, False at the keys that pad a shorter row's condition;
    None when no row is padded."""
    lengths = [cache.condition_tokens for cache in caches]
    longest = max(lengths)
    if all(length == longest for length in lengths):
        return None
    condition = torch.arange(longest, device=device)[None] < torch.tensor(lengths, device=device)[:, None]
    mask = torch.cat([condition, condition.new_ones(len(caches), target_tokens)], dim=1)
    return mask[:, None, None, :]
