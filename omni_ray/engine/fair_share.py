"""The order every omni-ray queue takes its waiting work in: the DiT's rows, the encoder's texts and captions, the
VAE's batches. One rule, so that a request is as urgent, and a tenant as fairly served, at every stage.

The most urgent level first (lower runs first: a request's priority, or the DiT's aged one). Within a level, each turn
goes to the tenant that used the stage least lately at that priority: the cost of its work over recent steps (halved
every ``halflife_steps`` steps), plus what it took earlier in the same pass; on a tie, the tenant served longest ago.
So a tenant sending a tenth of another's requests goes first and a flood shares the rest, and a tenant's batch jobs
do not spend the share of its interactive requests. A tenant's own work goes in the order it is handed in (the caller
sorts it: oldest first).

vLLM's V1 scheduler orders its waiting queue first come first served, or with ``policy="priority"`` by (priority,
arrival); it has no notion of tenants, so the stages keep their waiting work here and hand their engines what runs.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar


class Queued(Protocol):
    """What the order reads of a piece of waiting work."""

    @property
    def priority(self) -> int: ...  # lower runs first
    @property
    def tenant(self) -> str: ...  # whose share it spends


T = TypeVar("T", bound=Queued)


class FairShare:
    """Tenants' recent use of one stage, per priority, and the turn order it gives. Not thread-safe: a scheduler's,
    called from its engine's thread."""

    def __init__(self, halflife_steps: int = 50):
        assert halflife_steps > 0
        self.decay = 0.5 ** (1 / halflife_steps)
        self.usage: dict[tuple[int, str], float] = {}  # (priority, tenant) -> cost of its work, decayed every step
        self.served: dict[str, int] = {}  # tenant -> the step it last had work in
        self.num_steps = 0

    def in_turn(self, items: Iterable[T], cost: Callable[[T], float], limit: int | None = None,
                level: Callable[[T], int] | None = None) -> list[T]:
        """Up to ``limit`` of ``items`` in turn order. ``cost``: what an item spends of its tenant's share, in units
        of work (tokens: use below one is forgotten); ``level``: what ranks it (its priority by default)."""
        level = level or (lambda item: item.priority)
        levels: dict[int, dict[str, list[T]]] = defaultdict(lambda: defaultdict(list))
        for item in items:
            levels[level(item)][item.tenant].append(item)
        ordered: list[T] = []
        taken: Counter[str] = Counter()  # cost each tenant took in this pass
        for rank in sorted(levels):
            queues = {tenant: iter(queue) for tenant, queue in levels[rank].items()}
            heads = {tenant: next(queue) for tenant, queue in queues.items()}
            while heads and (limit is None or len(ordered) < limit):
                tenant = min(heads, key=lambda t: (self.usage.get((heads[t].priority, t), 0.0) + taken[t],
                                                   self.served.get(t, -1)))
                item = heads[tenant]
                ordered.append(item)
                taken[tenant] += cost(item)
                following = next(queues[tenant], None)
                if following is None:
                    del heads[tenant]
                else:
                    heads[tenant] = following
        return ordered

    def charge(self, ran: Iterable[T], cost: Callable[[T], float]) -> None:
        """One step ran ``ran``: every tenant's use decays by a step, then each item's cost is added to its tenant's
        at its priority."""
        self.num_steps += 1
        self.usage = {who: used * self.decay for who, used in self.usage.items() if used * self.decay >= 1}
        for item in ran:
            who = (item.priority, item.tenant)
            self.usage[who] = self.usage.get(who, 0.0) + cost(item)
            self.served[item.tenant] = self.num_steps

    def forget(self, tenants: set[str]) -> None:
        """Keeps when it last served only the ``tenants`` that still have work (their use decays away by itself)."""
        for tenant in [tenant for tenant in self.served if tenant not in tenants]:
            del self.served[tenant]
