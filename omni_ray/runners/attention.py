"""Qwen-Image's joint text-image attention with rotary embeddings in real arithmetic.

diffusers' ``QwenDoubleStreamAttnProcessor2_0`` rotates queries and keys by multiplying them, viewed as complex
numbers, with complex rotary tables. Inductor cannot generate code for complex operators, so a compiled block falls
back to eager kernels around them ("Torchinductor does not support code generation for complex operators"). Here the
tables are split once per forward into their cosines and sines (``RealRope``; the tables stay on the device, cached
by diffusers' ``QwenEmbedRope``), and each (even, odd) channel pair is rotated as
``(x0 cos - x1 sin, x0 sin + x1 cos)`` in float32: the same products and sums the complex multiplication makes, in
operations Inductor fuses with the norms before them. Everything else is the processor's arithmetic: projections,
per-head RMS norms, text before image in one attention call, the output projections.
"""

from __future__ import annotations

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


class JointAttention:
    """Attention processor for ``QwenImageTransformerBlock.attn``: ``image_rotary_emb`` is ``RealRope`` (or the complex
    tables diffusers' forward passes, split at each block)."""

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,  # [B, image_tokens, dim]
        encoder_hidden_states: torch.Tensor,  # [B, text_tokens, dim]
        encoder_hidden_states_mask: torch.Tensor | None = None,  # [B, text_tokens] bool, None when unpadded
        attention_mask: None = None,
        image_rotary_emb: RealRope | tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert attention_mask is None, "the joint mask is built from encoder_hidden_states_mask"
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
        mask = None
        if encoder_hidden_states_mask is not None:
            image_mask = encoder_hidden_states_mask.new_ones(hidden_states.shape[:2])
            mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)[:, None, None, :]
        joint = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
        joint = joint.transpose(1, 2).flatten(2, 3).to(query.dtype)
        image_out = attn.to_out[0](joint[:, text_tokens:].contiguous())
        text_out = attn.to_add_out(joint[:, :text_tokens].contiguous())
        return image_out, text_out


def use_real_rope(transformer) -> None:
    """Gives every block of a ``QwenImageTransformer2DModel`` the real-arithmetic processor."""
    for block in transformer.transformer_blocks:
        block.attn.set_processor(JointAttention())
