"""What ``/health`` answers: whether each stage has a replica that can take a call, from what this coordinator
replica already knows, so that a probe is answered at once whatever the cluster's state.

A handle's router holds the replicas Serve's controller says are running (``ray_private.running_replicas``); the
controller pushes every change, and the router drops a replica it saw die. Reading that asks neither the controller
nor the GCS, so ``/health`` answers in microseconds while the GCS is down or restarting (Serve's ``serve.status()``,
which it used to call, waits on both).

A replica leaves its routers' sets for a moment whenever Serve reconfigures it in place (a ``user_config`` change:
Serve marks it updating, then running again): a stage whose set has been empty for less than ``GRACE_S``, after it
had replicas, still counts as serving, as its calls wait in the router for that moment and are answered. A stage
empty for longer has none to take a call: while a changed ``args`` replaces the last old replica of a stage and
the new one has not started (no ``max_surge_percent``), ``/health`` says 503 naming that stage, as its requests wait
until the new replica runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable

GRACE_S = 3.0


class ReplicaWatch:
    """The stages without a replica to take a call, from ``counts()`` (each stage's replicas its routers hold)."""

    def __init__(self, counts: Callable[[], dict[str, int]], clock: Callable[[], float] = time.monotonic):
        self.counts = counts
        self.clock = clock
        self.seen: set[str] = set()  # stages that have had a replica
        self.empty_since: dict[str, float] = {}  # stage -> when it was first seen without one, since it last had one

    def __call__(self) -> list[str]:
        now = self.clock()
        waiting = []
        for stage, count in self.counts().items():
            if count > 0:
                self.seen.add(stage)
                self.empty_since.pop(stage, None)
                continue
            since = self.empty_since.setdefault(stage, now)
            if stage not in self.seen or now - since >= GRACE_S:
                waiting.append(stage)
        return sorted(waiting)
