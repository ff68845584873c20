"""Qwen-Image's joint text-image attention with rotary embeddings in real arithmetic.

diffusers' ``QwenDoubleStreamAttnProcessor2_0`` rotates queries and keys by multiplying them, viewed as complex
numbers, with complex rotary tables. Inductor cannot generate code for complex operators, so a compiled block falls
back to eager kernels around them ("Torchinductor does not support code generation for complex operators"). Here the
tables are split once per forward into their cosines and sines (``RealRope``; the tables stay on the device, cached
by diffusers' ``QwenEmbedRope``), and each (even, odd) channel pair is rotated as
``(x0 cos - x1 sin, x0 sin + x1 cos)`` in float32: the same products and sums the complex multiplication makes, in
operations Inductor fuses with the norms before them. Everything else is the processor's arithmetic: projections,
per-head RMS norms, text before image in one attention call, the output projections.

The attention call itself is the processor's ``attend`` (``Attend``): ``sdpa`` in one process, or
``parallel.sequence.SequenceParallelAttention`` when each rank holds a shard of every row's tokens. Its key mask is
built from the text mask diffusers passes and an optional image-token mask (``image_mask``, passed to a block as
``joint_attention_kwargs={"image_mask": ...}``), which masks the image tokens a sequence-parallel split pads. A
forward may pass its own ``attend`` the same way: a gang's step that splits tokens attends over the gang, one that
runs rows whole attends alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class RealRope:
    """Rotary tables as cosines and sines of the rotation angles."""

    image_cos: torch.Tensor  # [image_tokens, head_dim / 2] float32, on the device
    image_sin: torch.Tensor  # [image_tokens, head_dim / 2]
    text_cos: torch.Tensor  # [text_tokens, head_dim / 2]
    text_sin: torch.Tensor  # [text_tokens, head_dim / 2]

    @classmethod
    def of(cls, complex_rope: tuple[torch.Tensor, torch.Tensor]) -> RealRope:
        """From ``QwenEmbedRope``'s (image, text) complex tables ``[tokens, head_dim / 2]``."""
        image, text = complex_rope
        return cls(image.real.contiguous(), image.imag.contiguous(), text.real.contiguous(), text.imag.contiguous())


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, S, H, D]`` with each channel pair (2i, 2i+1) rotated by the angle of ``cos``/``sin`` ``[S, D/2]``."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).type_as(x)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""``attend(query, key, value, key_mask)``: query, key and value ``[B, heads, tokens, head_dim]``, ``key_mask``
``[B, tokens]`` bool (True: attend to that key) or None; returns ``[B, heads, tokens, head_dim]``."""


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
         key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Every query over every unmasked key of the same row, in one process: ``Attend`` by torch's kernel."""
    mask = None if key_mask is None else key_mask[:, None, None, :]  # broadcast over heads and queries
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask)


def _joint_key_mask(text_mask: torch.Tensor | None, image_mask: torch.Tensor | None, text_tokens: int,
                   image_tokens: int) -> torch.Tensor | None:
    """``[B, text + image tokens]``, True where a key is attended (text first, as the joint sequence); None when
    neither stream has a mask."""
    if text_mask is None and image_mask is None:
        return None
    if text_mask is None:
        text_mask = image_mask.new_ones(image_mask.shape[0], text_tokens)
    if image_mask is None:
        image_mask = text_mask.new_ones(text_mask.shape[0], image_tokens)
    return torch.cat([text_mask, image_mask], dim=1)


class JointAttention:
    """Attention processor for ``QwenImageTransformerBlock.attn``: ``image_rotary_emb`` is ``RealRope`` (or the complex
    tables diffusers' forward passes, split at each block); the attention itself is ``attend`` (default ``sdpa``)."""

    def __init__(self, attend: Attend | None = None):
        self.attend = attend or sdpa

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,  # [B, image_tokens, dim]
        encoder_hidden_states: torch.Tensor,  # [B, text_tokens, dim]
        encoder_hidden_states_mask: torch.Tensor | None = None,  # [B, text_tokens] bool, None when unpadded
        attention_mask: None = None,
        image_rotary_emb: RealRope | tuple[torch.Tensor, torch.Tensor] | None = None,
        image_mask: torch.Tensor | None = None,  # [B, image_tokens] bool, False at padding; None when unpadded
        attend: Attend | None = None,  # this call's, over the processor's (a sequence-split forward's)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert attention_mask is None, "the joint mask is built from encoder_hidden_states_mask and image_mask"
        text_tokens = encoder_hidden_states.shape[1]
        head_dim = attn.inner_dim // attn.heads
        image = [proj(hidden_states).unflatten(-1, (-1, head_dim)) for proj in (attn.to_q, attn.to_k, attn.to_v)]
        text = [proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
                for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
        image[0], image[1] = attn.norm_q(image[0]), attn.norm_k(image[1])
        text[0], text[1] = attn.norm_added_q(text[0]), attn.norm_added_k(text[1])
        if image_rotary_emb is not None:
            # diffusers' own forward hands each block the complex tables
            rope = image_rotary_emb if isinstance(image_rotary_emb, RealRope) else RealRope.of(image_rotary_emb)
            image[0], image[1] = (rotate(x, rope.image_cos, rope.image_sin) for x in image[:2])
            text[0], text[1] = (rotate(x, rope.text_cos, rope.text_sin) for x in text[:2])
        # [B, heads, text + image tokens, head_dim]: the layout scaled_dot_product_attention takes
        query, key, value = (torch.cat([t, i], dim=1).transpose(1, 2) for t, i in zip(text, image))
        key_mask = _joint_key_mask(encoder_hidden_states_mask, image_mask, text_tokens, hidden_states.shape[1])
        joint = (attend or self.attend)(query, key, value, key_mask)
        joint = joint.transpose(1, 2).flatten(2, 3).to(query.dtype)
        image_out = attn.to_out[0](joint[:, text_tokens:].contiguous())
        text_out = attn.to_add_out(joint[:, :text_tokens].contiguous())
        return image_out, text_out


def use_real_rope(transformer, attend: Attend | None = None) -> None:
    """Gives every block of a ``QwenImageTransformer2DModel`` the real-arithmetic processor, attending with
    ``attend`` (default ``sdpa``)."""
    for block in transformer.transformer_blocks:
        block.attn.set_processor(JointAttention(attend))
