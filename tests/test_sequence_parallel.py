"""Sequence-parallel attention on gangs of CPU processes (gloo): Ulysses, ring and both give each rank the attention
of its own tokens over the whole sequence, and send the bytes the formula says.

Tolerance: 1e-5 (float32). Ulysses alone runs torch's kernel over the same keys; the ring computes each chunk's
softmax apart in explicit float32 and merges the chunks by their log-sum-exp, the same sums in another order with
an extra exp and log, so outputs of size ~1 differ from one-process attention by a few float32 ulps.
"""

from __future__ import annotations

import pytest
import torch

from omni_ray.config import ParallelSettings
from omni_ray.runners.attention import JointAttention, RealRope, sdpa
from omni_ray.runners.parallel.mesh import Mesh
from omni_ray.runners.parallel.sequence import SequenceParallelAttention, sequence_bytes_per_call
from testing.gang import run_gang

ATOL = RTOL = 1e-5
BATCH, HEADS, HEAD_DIM = 2, 4, 8


def _cases(tokens: int, chunk: int) -> dict[str, tuple]:
    """(query, key, value, key_mask) over a whole sequence of ``tokens``: unmasked; and padded, row 0 with its last
    two keys masked (as padded image tokens), row 1 with its first ``chunk`` keys."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(BATCH, HEADS, tokens, HEAD_DIM, generator=generator) for _ in range(3))
    mask = torch.ones(BATCH, tokens, dtype=torch.bool)
    mask[0, -2:] = False
    mask[1, :chunk] = False
    return {"unmasked": (q, k, v, None), "padded": (q, k, v, mask)}


def _attend_shards(mesh: Mesh, cases: dict[str, tuple]) -> dict:
    """On one rank: its shard of each case attended, the bytes each call sent, and the error of an indivisible head
    count."""
    attend = SequenceParallelAttention(mesh)
    shard, shards = mesh.sequence.rank, mesh.sequence.size
    out = {"shard": shard, "outputs": {}, "sent": {}}
    for name, (q, k, v, mask) in cases.items():
        tokens = q.shape[2] // shards
        part = slice(shard * tokens, (shard + 1) * tokens)
        before = mesh.sent.copy()
        out["outputs"][name] = attend(q[:, :, part], k[:, :, part], v[:, :, part],
                                      None if mask is None else mask[:, part])
        out["sent"][name] = dict(mesh.sent - before)
    if mesh.ulysses.size > 1:
        q = torch.zeros(1, mesh.ulysses.size + 1, 2, HEAD_DIM)
        try:
            attend(q, q, q, None)
        except ValueError as error:
            out["error"] = str(error)
    return out


@pytest.mark.parametrize("ulysses, ring", [(2, 1), (1, 2), (2, 2)])
def test_sharded_attention_equals_one_process_attention(ulysses, ring):
    settings = ParallelSettings(ulysses=ulysses, ring=ring)
    tokens_per_rank = 3
    # row 1 of the padded case without its first ring chunk (the first ulysses group's shards), or without a ring
    # its first shard
    chunk = tokens_per_rank * (ulysses if ring > 1 else 1)
    cases = _cases(tokens_per_rank * settings.sequence, chunk)
    ranks = sorted(run_gang(_attend_shards, settings, cases), key=lambda rank: rank["shard"])
    for name, (q, k, v, mask) in cases.items():
        got = torch.cat([rank["outputs"][name] for rank in ranks], dim=2)
        torch.testing.assert_close(got, sdpa(q, k, v, mask), atol=ATOL, rtol=RTOL, msg=name)
        expected = sequence_bytes_per_call(BATCH, HEADS, tokens_per_rank, HEAD_DIM, q.element_size(), ulysses, ring,
                                           masked=mask is not None)
        assert all(rank["sent"][name] == expected for rank in ranks), (name, expected, ranks[0]["sent"][name])
    if ulysses > 1:
        assert all(rank["error"] == "attention heads (3) must divide by parallel.ulysses (2)" for rank in ranks)


def test_a_sequence_group_of_one_is_sdpa():
    q, k, v, mask = _cases(6, chunk=3)["padded"]
    assert torch.equal(SequenceParallelAttention(Mesh.single())(q, k, v, mask), sdpa(q, k, v, mask))


def test_the_formula_counts_each_collective():
    # 1 x 4 x 3 x 8 float32 = 384 bytes a tensor; 3 mask bytes
    assert sequence_bytes_per_call(1, 4, 3, 8, 4, 1, 1, masked=True) == {}
    assert sequence_bytes_per_call(1, 4, 3, 8, 4, 2, 1, masked=True) == {"all_to_all": 768, "all_gather": 3}
    assert sequence_bytes_per_call(1, 4, 3, 8, 4, 1, 3) == {"send": 2 * 768}
    assert sequence_bytes_per_call(1, 4, 3, 8, 4, 2, 2, masked=True) == {"all_to_all": 768, "all_gather": 3,
                                                                         "send": 768 + 6}


def test_padded_image_tokens_are_masked_keys():
    """A block run on image tokens padded at the end, ``image_mask`` False there (passed as diffusers passes
    processor arguments, through ``joint_attention_kwargs``), gives the real tokens what the unpadded block gives."""
    # imported here: every gang process imports this module (for _attend_shards), and diffusers takes seconds
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

    torch.manual_seed(0)
    block = QwenImageTransformerBlock(dim=32, num_attention_heads=2, attention_head_dim=16).eval()
    block.attn.set_processor(JointAttention())
    image, text, pad = 6, 4, 2
    hidden, encoder, temb = torch.randn(2, image + pad, 32), torch.randn(2, text, 32), torch.randn(2, 32)
    text_mask = torch.ones(2, text, dtype=torch.bool)
    text_mask[1, -1] = False
    angles = torch.randn(image + pad, 8), torch.randn(text, 8)
    rope = RealRope(angles[0].cos(), angles[0].sin(), angles[1].cos(), angles[1].sin())
    image_mask = torch.ones(2, image + pad, dtype=torch.bool)
    image_mask[:, image:] = False
    with torch.no_grad():
        padded_text, padded_image = block(hidden, encoder, text_mask, temb, rope,
                                          joint_attention_kwargs={"image_mask": image_mask})
        unpadded = RealRope(rope.image_cos[:image], rope.image_sin[:image], rope.text_cos, rope.text_sin)
        real_text, real_image = block(hidden[:, :image], encoder, text_mask, temb, unpadded)
    torch.testing.assert_close(padded_image[:, :image], real_image, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(padded_text, real_text, atol=ATOL, rtol=RTOL)
