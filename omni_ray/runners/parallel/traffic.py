"""What one DiT step sends per rank, by collective, from the shapes alone: the formula ``benchmarks.parallel`` holds
the measured bytes (``Mesh.sent``) against, and the figure for full-size models on GPUs no one has measured here.

A step of ``rows`` requests of one batch key, without cache acceleration (a cached row adds two float64 sums per row
and decision over the sequence ranks), runs on rank 0 of each dimension:

1. its passes (``rows``, twice with true CFG), spread over the CFG ranks (``split.assign_passes``), or over the CFG
   and sequence ranks together for a rows-split step;
2. one forward of its passes, each block's attention over the sequence ranks
   (``sequence.sequence_bytes_per_call``: Ulysses all-to-alls, ring shifts) and four all-reduces over the tensor
   ranks (``tensor.tensor_bytes_per_forward``), on its chunk of the tokens; the image tokens' prediction gathered
   over the sequence ranks;
3. the passes' predictions (and a float32 flag each, their cache decision) gathered over the CFG ranks, each rank's
   padded to the most any rank ran.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from omni_ray.config import ParallelSettings
from omni_ray.runners.parallel.sequence import sequence_bytes_per_call
from omni_ray.runners.parallel.split import assign_passes
from omni_ray.runners.parallel.tensor import tensor_bytes_per_forward


@dataclass(frozen=True)
class Shapes:
    """What the bytes depend on: the transformer's and the step's."""

    layers: int
    heads: int
    head_dim: int
    out_channels: int  # a token's prediction: the transformer's out_channels x patch_size^2
    image_tokens: int  # a row's, an edit's input image tokens included
    text_tokens: int  # the step's text length (every pass's the same here: no text mask)
    element_size: int  # bytes per activation: 4 in float32, 2 in bfloat16


def step_bytes(settings: ParallelSettings, shapes: Shapes, rows: int, true_cfg: bool, split: str = "sequence"
               ) -> Counter:
    """Bytes rank 0 sends in one step of ``rows`` uncached rows."""
    passes = rows * (2 if true_cfg else 1)
    by_rows = split == "rows" and settings.sequence > 1
    sequence = 1 if by_rows else settings.sequence
    spread = settings.cfg * (settings.sequence if by_rows else 1)
    branches = [0] * rows + ([1] * rows if true_cfg else [])
    ranks = assign_passes([None] * passes, branches, true_cfg and not by_rows, spread)
    mine, most = ranks.count(0), max(ranks.count(r) for r in range(spread))
    sent = Counter()
    # 2. The forward of this rank's passes, on its chunk of the tokens.
    image = -(-shapes.image_tokens // sequence)
    text = -(-shapes.text_tokens // sequence)
    if sequence > 1:
        padded = image * sequence != shapes.image_tokens or text * sequence != shapes.text_tokens
        per_call = sequence_bytes_per_call(mine, shapes.heads // settings.tensor, image + text, shapes.head_dim,
                                           shapes.element_size, settings.ulysses, settings.ring, padded)
        for op, n in per_call.items():
            sent[op] += n * shapes.layers
        sent["all_gather"] += (sequence - 1) * mine * image * shapes.out_channels * shapes.element_size
    tensor = tensor_bytes_per_forward(shapes.layers, shapes.heads * shapes.head_dim, mine, image, text,
                                      settings.tensor, shapes.element_size)
    if tensor:
        sent["all_reduce"] += tensor
    # 3. The passes' predictions and cache flags, gathered over the ranks that shared them out.
    if spread > 1:
        sent["all_gather"] += (spread - 1) * most * (shapes.image_tokens * shapes.out_channels * shapes.element_size
                                                     + 4)
    return sent
