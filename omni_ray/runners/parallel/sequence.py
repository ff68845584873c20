"""Sequence-parallel attention: each rank of a row's sequence group holds one shard of the row's tokens (the same
number on every rank) with all heads, and gets back the attention of its own queries over every shard's keys.

Ulysses (``mesh.ulysses``, U ranks): an all-to-all trades heads for tokens, so each rank attends H/U heads over the
U shards' tokens (gathered in ulysses rank order), and a second all-to-all trades them back, returning each rank its
own tokens with all heads. Ring (``mesh.ring``, R ranks): queries stay where they are; keys and values (and the key
mask) travel round the ring, and each rank merges the attention over each chunk it holds with online softmax, by
the chunk's log-sum-exp. The two compose (USP): Ulysses inside, the ring passing the Ulysses-gathered keys and
values among the ranks that hold the same heads. The order of the keys never matters to attention, only that keys,
values and their mask stay aligned; each query's output returns to the rank and position it came from.
"""

from __future__ import annotations

import torch

from omni_ray.runners.attention import sdpa
from omni_ray.runners.parallel.mesh import Comm, Mesh


class SequenceParallelAttention:
    """``attention.Attend`` over a sequence-parallel gang: query, key and value ``[B, heads, tokens_per_rank,
    head_dim]`` hold this rank's shard of each row's tokens and every head; ``key_mask`` ``[B, tokens_per_rank]``
    marks its shard's attended keys. With a sequence group of one rank it is ``sdpa``."""

    def __init__(self, mesh: Mesh):
        self.ulysses: Comm = mesh.ulysses
        self.ring: Comm = mesh.ring

    # Eager between compiled regions (``dit.compile``): traced by Dynamo, the gang's collectives hand attention an
    # int64 key mask, which it refuses (seen with torch 2.13); the blocks' other operations stay compiled.
    @torch.compiler.disable
    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 key_mask: torch.Tensor | None = None) -> torch.Tensor:
        heads = query.shape[1]
        if heads % self.ulysses.size:
            raise ValueError(f"attention heads ({heads}) must divide by parallel.ulysses ({self.ulysses.size})")
        # 1. Ulysses: heads scattered, tokens gathered -> [B, heads / U, tokens_per_rank * U, head_dim]
        query, key, value = (self.ulysses.all_to_all(t, scatter_dim=1, gather_dim=2) for t in (query, key, value))
        if key_mask is not None:
            key_mask = self.ulysses.all_gather(key_mask, dim=1)
        # 2. Attention over the ring's chunks of keys (one chunk without a ring).
        if self.ring.size == 1:
            out = sdpa(query, key, value, key_mask)
        else:
            out = self._ring_attention(query, key, value, key_mask)
        # 3. Ulysses back: this rank's tokens, every head.
        return self.ulysses.all_to_all(out, scatter_dim=2, gather_dim=1)

    def _ring_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        key_mask: torch.Tensor | None) -> torch.Tensor:
        """``query`` over the keys and values of every ring rank: this rank's chunk first, then each received from
        the previous rank, merged into a running output and log-sum-exp."""
        out, lse = partial_attention(query, key, value, key_mask)
        for _ in range(self.ring.size - 1):
            key, value, *mask = self.ring.shift([key, value] if key_mask is None else [key, value, key_mask])
            key_mask = mask[0] if mask else None
            out, lse = merge(out, lse, *partial_attention(query, key, value, key_mask))
        return out.to(query.dtype)


def partial_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      key_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over one chunk of keys, in float32: the output normalised over the chunk ``[B, H, queries, D]``
    and its log-sum-exp ``[B, H, queries]``; a row whose keys in the chunk are all masked has output 0 and
    log-sum-exp -inf, so it weighs nothing in ``merge``.

    The scores are computed explicitly because torch has no public attention that returns the log-sum-exp. The CPU
    flash kernel that does (``aten._scaled_dot_product_flash_attention_for_cpu``) is private, takes only additive
    float masks, and gives a fully masked row a log-sum-exp of 0 rather than -inf, which would weigh that row's
    zero output into the merge. The explicit scores cost ``[B, H, queries, keys]`` float32 of memory per chunk.
    """
    scores = query.float() @ key.float().transpose(-1, -2) * query.shape[-1] ** -0.5
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    lse = scores.logsumexp(dim=-1)
    weights = torch.exp(scores - _finite(lse)[..., None])
    return weights @ value.float(), lse


def merge(out: torch.Tensor, lse: torch.Tensor, chunk_out: torch.Tensor,
          chunk_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries over disjoint keys, as one: each output weighed by its share of
    the softmax denominator, ``exp(its lse - the joint lse)``."""
    joint_lse = torch.logaddexp(lse, chunk_lse)
    finite = _finite(joint_lse)[..., None]
    out = out * torch.exp(lse[..., None] - finite) + chunk_out * torch.exp(chunk_lse[..., None] - finite)
    return out, joint_lse


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (no attended key yet) as 0, so ``exp(-inf - lse)`` gives weight 0 instead of NaN."""
    return lse.masked_fill(lse.isneginf(), 0.0)


def sequence_bytes_per_call(batch: int, heads: int, tokens_per_rank: int, head_dim: int, element_size: int,
                            ulysses: int, ring: int, masked: bool = False) -> dict[str, int]:
    """Bytes one rank sends per ``SequenceParallelAttention`` call, by collective as ``Comm`` counts them: Ulysses
    sends ``(U - 1) / U`` of each of query, key, value and the output (each ``batch x heads x tokens_per_rank x
    head_dim``) and all-gathers the key mask; the ring sends the Ulysses-gathered key, value (the same size) and key
    mask ``R - 1`` times. ``masked``: the call has a key mask (bool, a byte a token)."""
    local = batch * heads * tokens_per_rank * head_dim * element_size
    mask = batch * tokens_per_rank if masked else 0
    sent = {}
    if ulysses > 1:
        sent["all_to_all"] = 4 * local * (ulysses - 1) // ulysses
        if masked:
            sent["all_gather"] = mask * (ulysses - 1)
    if ring > 1:
        sent["send"] = (ring - 1) * (2 * local + mask * ulysses)
    return sent
