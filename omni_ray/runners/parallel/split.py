"""How one DiT step's work splits over a gang: which CFG rank runs each pass, and each rank's share of a row's tokens.

**Passes over the CFG ranks.** A step runs passes: every row's conditional pass, and with true CFG its unconditional
one. With ``cfg: 2``, a true-CFG batch runs the conditional passes on CFG rank 0 and the unconditional ones on rank 1
(each pass's cache stays on its rank, since a pass's branch never changes). A batch without true CFG splits its rows
between the two ranks instead of idling one: a row with a cache stays on the rank that holds its cache (its
``home``, chosen once at admission, the less loaded rank), and the others fill up the less loaded rank. Every rank
computes the same assignment from the same states, so no rank asks another what it runs.

**Tokens over the sequence ranks.** With Ulysses or ring attention, each row's image tokens and text tokens are split
in equal contiguous chunks over the sequence ranks, chunk ``r * ulysses + u`` on rank (r, u); the token counts are
padded up to a multiple of the sequence degree, and padded tokens are masked as keys and dropped from the output.
Every operation of a block but attention is per token, so a rank runs the blocks on its chunk alone; cache decisions
sum their per-row norms over the chunks (``TokenShard.total``), so every rank decides the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_ray.runners.parallel.mesh import Comm


def assign_passes(homes: list[int | None], branches: list[int], true_cfg: bool, size: int) -> list[int]:
    """The CFG rank that runs each pass: its branch with true CFG; otherwise its row's ``home`` when it has one (a
    cached row), else the rank with the fewest passes so far (the lowest on a tie)."""
    if size == 1:
        return [0] * len(branches)
    if true_cfg:
        return list(branches)
    load = [0] * size
    for home in homes:
        if home is not None:
            load[home] += 1
    ranks = []
    for home in homes:
        if home is None:
            home = min(range(size), key=lambda r: (load[r], r))
            load[home] += 1
        ranks.append(home)
    return ranks


def gather_passes(comm: Comm, ranks: list[int], local: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Every pass's tensor in pass order, from each CFG rank's ``local`` (its passes' rows, in pass order; None
    when it ran none): one all-gather, each rank's rows padded to the most any rank ran. ``like`` is one row's
    shape and dtype."""
    if comm.size == 1:
        return local
    most = max(ranks.count(r) for r in range(comm.size))
    padded = like.new_zeros((most, *like.shape))
    if local is not None:
        padded[: local.shape[0]] = local
    gathered = comm.all_gather(padded)
    seen = [0] * comm.size
    order = []
    for rank in ranks:
        order.append(rank * most + seen[rank])
        seen[rank] += 1
    return gathered[torch.tensor(order, device=gathered.device)]


@dataclass(frozen=True)
class TokenShard:
    """One sequence rank's chunk of each row's image and text tokens (``comm``: the sequence group)."""

    comm: Comm
    image_tokens: int  # a row's, before padding
    text_tokens: int

    @property
    def image_chunk(self) -> int:
        return -(-self.image_tokens // self.comm.size)

    @property
    def text_chunk(self) -> int:
        return -(-self.text_tokens // self.comm.size)

    @property
    def padded(self) -> bool:
        return self.image_chunk * self.comm.size != self.image_tokens or \
            self.text_chunk * self.comm.size != self.text_tokens

    def image(self, x: torch.Tensor, dim: int = 1, fill: float = 0) -> torch.Tensor:
        """This rank's chunk of image tokens along ``dim`` (padded with ``fill`` past the last token)."""
        return _chunk(x, dim, self.image_tokens, self.image_chunk, self.comm.rank, fill)

    def text(self, x: torch.Tensor, dim: int = 1, fill: float = 0) -> torch.Tensor:
        return _chunk(x, dim, self.text_tokens, self.text_chunk, self.comm.rank, fill)

    def image_mask(self, rows: int, device: torch.device) -> torch.Tensor:
        """``[rows, image_chunk]`` bool: True where this rank's image token is a real one."""
        return self.image(torch.ones(rows, self.image_tokens, dtype=torch.bool, device=device))

    def gather_image(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's chunk of image tokens ``[rows, image_chunk, ...]`` as the row's whole ``[rows,
        image_tokens, ...]``."""
        return self.comm.all_gather(x, dim=1)[:, : self.image_tokens]

    def total(self, sums: torch.Tensor) -> torch.Tensor:
        """Per-row sums over this rank's tokens, summed over the sequence ranks (in float64, so that the total does
        not depend on how the tokens were split beyond rounding)."""
        return self.comm.all_reduce(sums.double())


def _chunk(x: torch.Tensor, dim: int, tokens: int, chunk: int, index: int, fill: float) -> torch.Tensor:
    start, stop = index * chunk, min((index + 1) * chunk, tokens)
    part = x.narrow(dim, start, max(stop - start, 0))
    missing = chunk - part.shape[dim]
    if missing:
        shape = list(x.shape)
        shape[dim] = missing
        part = torch.cat([part, x.new_full(shape, fill)], dim=dim)
    return part
