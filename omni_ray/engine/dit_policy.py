"""The DiT's scheduling policies, one class each, as vLLM V1 keeps each policy a request queue of its own. A policy
decides what ranks a request and what bounds a step; ``DiTScheduler`` (omni_ray/engine/dit_scheduler.py) applies
whichever it is given the same way and never asks which one it is.

- ``PriorityPolicy``: a request's own ``priority`` and ``tenant``, improved one level for every ``aging_s`` seconds
  it sat out steps that ran more urgent requests; a step takes at most ``max_batch_tokens`` work tokens, and at most
  ``max_paused`` admitted requests sit a step out.
- ``FifoPolicy``: the scheduling before priorities: every request the same priority and tenant, no aging, no token
  budget and no bound on pauses.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from omni_ray.records import DenoiseRequest


class SchedulingPolicy(ABC):
    """What ranks a request and what bounds a step."""

    by_priority: ClassVar[bool]  # the more urgent requests run first, so only work as urgent is ahead of a request
    max_batch_tokens: int | None  # work tokens one step may take (its first row always runs); None: no bound
    max_paused: int | None  # admitted requests that may sit a step out before new ones wait instead; None: no bound

    @abstractmethod
    def priority_and_tenant(self, request: DenoiseRequest) -> tuple[int, str]:
        """The priority (lower is more urgent) and the tenant the request is scheduled under."""

    @abstractmethod
    def effective_priority(self, priority: int, starved_s: float) -> int:
        """The priority a request of ``priority`` ranks at once it sat out ``starved_s`` seconds of steps that ran
        more urgent requests."""


@dataclass(frozen=True)
class PriorityPolicy(SchedulingPolicy):
    max_batch_tokens: int | None = None
    max_paused: int | None = None
    aging_s: float | None = None  # None: a request never ages
    by_priority: ClassVar[bool] = True

    def priority_and_tenant(self, request: DenoiseRequest) -> tuple[int, str]:
        return request.params.priority, request.params.tenant

    def effective_priority(self, priority: int, starved_s: float) -> int:
        return priority if self.aging_s is None else priority - int(starved_s // self.aging_s)


@dataclass(frozen=True)
class FifoPolicy(SchedulingPolicy):
    by_priority: ClassVar[bool] = False
    max_batch_tokens: ClassVar[None] = None
    max_paused: ClassVar[None] = None

    def priority_and_tenant(self, request: DenoiseRequest) -> tuple[int, str]:
        return 0, ""

    def effective_priority(self, priority: int, starved_s: float) -> int:
        return priority
