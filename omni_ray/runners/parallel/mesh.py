"""A rank's place in a gang: its coordinate on each parallel dimension, the process groups of each, and the
collectives the runner calls (each counting the bytes it sends, for ``benchmarks.parallel``).

Rank layout, innermost first: tensor, ulysses, ring, cfg, so ``rank = ((c * ring + r) * ulysses + u) * tensor + t``.
Tensor ranks are neighbours (the most traffic, an all-reduce per sub-block, on the closest links); a row's sequence
shard is ``r * ulysses + u``, so the sequence group gathers its shards in order. Every rank creates every group, in
the same order (``torch.distributed.new_group`` is collective); a group of one rank is None and its collectives are
no-ops, so the runner's code reads the same at world size 1. A VAE gang (``vae.parallel``) has none of the DiT's
dimensions (each of degree 1): its ranks are ``world`` alone.

Bytes sent by one rank, as each collective is counted: all-gather ``(n - 1) x`` its input, all-to-all
``(n - 1) / n x`` its input, all-reduce ``2 (n - 1) / n x`` its tensor (a ring all-reduce), send its tensor.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from omni_ray.config import GangSettings, ParallelSettings

DIMENSIONS = ("cfg", "ring", "ulysses", "tensor")  # outermost first


@dataclass
class Comm:
    """The collectives over one group of ranks (``group`` None: one rank, and each call returns its input)."""

    group: dist.ProcessGroup | None
    size: int
    rank: int  # in the group
    sent: Counter = field(default_factory=Counter)  # op -> bytes this rank sent

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's ``tensor`` (all the same shape) concatenated along ``dim``, in group rank order."""
        if self.group is None:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor, group=self.group)
        self.sent["all_gather"] += _nbytes(tensor) * (self.size - 1)
        return torch.cat(parts, dim=dim)

    def all_to_all(self, tensor: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        """``tensor`` split in ``size`` chunks along ``scatter_dim``, chunk i sent to rank i; what every rank sent
        this one, concatenated along ``gather_dim`` in rank order."""
        if self.group is None:
            return tensor
        chunks = [c.contiguous() for c in tensor.chunk(self.size, dim=scatter_dim)]
        received = [torch.empty_like(c) for c in chunks]
        dist.all_to_all(received, chunks, group=self.group)
        self.sent["all_to_all"] += sum(_nbytes(c) for i, c in enumerate(chunks) if i != self.rank)
        return torch.cat(received, dim=gather_dim)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the group's ranks, in place."""
        if self.group is None:
            return tensor
        dist.all_reduce(tensor, group=self.group)
        self.sent["all_reduce"] += _nbytes(tensor) * 2 * (self.size - 1) // self.size
        return tensor

    def shift(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor sent to the next rank round the ring; the previous rank's received (same shapes)."""
        if self.group is None:
            return tensors
        nxt = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)
        tensors = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, nxt, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, prev, self.group) for r in received]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        self.sent["send"] += sum(_nbytes(t) for t in tensors)
        return received


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Mesh:
    """This rank's coordinates and a ``Comm`` per dimension (``cfg``, ``ring``, ``ulysses``, ``tensor``), plus
    ``sequence`` (ring x ulysses: the ranks one row's tokens are split over, shard ``r * ulysses + u``), ``rows``
    (cfg x sequence: the ranks a step's rows spread over when it runs them whole) and ``world``."""

    def __init__(self, settings: GangSettings, rank: int, groups: dict[str, dist.ProcessGroup | None]):
        self.settings, self.rank = settings, rank
        degrees = self.degrees(settings)
        coords, rest = {}, rank
        for name in reversed(DIMENSIONS):
            coords[name], rest = rest % degrees[name], rest // degrees[name]
        self.coords = coords
        sequence = degrees["ring"] * degrees["ulysses"]
        sizes = {**degrees, "sequence": sequence, "rows": degrees["cfg"] * sequence, "world": settings.world_size}
        coords["sequence"] = coords["ring"] * degrees["ulysses"] + coords["ulysses"]
        coords["rows"] = coords["cfg"] * sequence + coords["sequence"]
        coords["world"] = rank
        self.comms = {name: Comm(groups.get(name), sizes[name], coords[name]) for name in sizes}

    @staticmethod
    def degrees(settings: GangSettings) -> dict[str, int]:
        """Each DiT dimension's degree; 1 for the dimensions ``settings`` has not (a VAE gang's)."""
        return {name: getattr(settings, name, 1) for name in DIMENSIONS}

    @classmethod
    def single(cls) -> Mesh:
        """World size 1: no groups, every collective a no-op."""
        return cls(ParallelSettings(), 0, {})

    @classmethod
    def init(cls, settings: GangSettings, rank: int, init_method: str, backend: str = "gloo") -> Mesh:
        """Joins the gang's process group (``init_method``: a ``tcp://host:port`` or ``file://`` rendezvous; NCCL
        on CUDA, gloo on the CPU) and creates every dimension's groups, collectives timing out after
        ``settings.timeout_s``."""
        timeout = timedelta(seconds=settings.timeout_s)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=settings.world_size,
                                timeout=timeout)
        groups = {}
        for name, members in cls.group_members(settings).items():
            for ranks in members:  # every rank creates every group, in the same order
                group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if rank in ranks:
                    groups[name] = group
        return cls(settings, rank, groups)

    @classmethod
    def group_members(cls, settings: GangSettings) -> dict[str, list[list[int]]]:
        """Each dimension's groups (and ``sequence``'s, ``world``'s) as lists of global ranks, in group rank
        order."""
        degrees = cls.degrees(settings)

        def rank_of(coords: dict[str, int]) -> int:
            rank = 0
            for name in DIMENSIONS:
                rank = rank * degrees[name] + coords[name]
            return rank

        def groups(varying: tuple[str, ...]) -> list[list[int]]:
            fixed = [name for name in DIMENSIONS if name not in varying]
            out = []
            for values in itertools.product(*(range(degrees[n]) for n in fixed)):
                base = dict(zip(fixed, values))
                out.append([rank_of({**base, **dict(zip(varying, v))})
                            for v in itertools.product(*(range(degrees[n]) for n in varying))])
            return out

        members = {name: groups((name,)) for name in DIMENSIONS}
        members["sequence"] = groups(("ring", "ulysses"))
        members["rows"] = groups(("cfg", "ring", "ulysses"))
        members["world"] = [list(range(settings.world_size))]
        return members

    def __getattr__(self, name: str) -> Comm:
        comms = self.__dict__.get("comms", {})
        if name in comms:
            return comms[name]
        raise AttributeError(name)

    @property
    def sent(self) -> Counter:
        """Bytes this rank sent since it started, by collective."""
        total = Counter()
        for comm in self.comms.values():
            total.update(comm.sent)
        return total

    @property
    def is_driver(self) -> bool:
        """Rank 0, whose output the engine reads."""
        return self.rank == 0

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
