"""The coordinator's own queues: a bounded number of slots for work it runs on threads (decoding uploads, writing image
files), handed out by priority, so that an urgent request never waits behind bulk work of the same replica."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator


class PrioritySlots:
    """At most ``size`` holders at once (an ``asyncio.Semaphore``); a freed slot goes to the waiter of the lowest
    priority value, then the one that asked first (vLLM's priority order, the API's ``priority``). Event-loop only."""

    def __init__(self, size: int):
        assert size > 0
        self.free = size
        self.waiters: list[tuple[int, int, asyncio.Future]] = []  # a heap of (priority, arrival, woken when given)
        self.arrivals = itertools.count()

    @contextlib.asynccontextmanager
    async def take(self, priority: int) -> AsyncIterator[None]:
        """Holds a slot for the block, waiting for one by ``priority`` (lower first)."""
        await self._acquire(priority)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, priority: int) -> None:
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return
        given = asyncio.get_running_loop().create_future()
        heapq.heappush(self.waiters, (priority, next(self.arrivals), given))
        try:
            await given
        except asyncio.CancelledError:
            if given.done() and not given.cancelled():  # a slot was handed over as the waiter was cancelled
                self._release()
            raise  # a cancelled waiter stays in the heap, done: ``_release`` skips it

    def _release(self) -> None:
        """Hands the slot to the most urgent waiter still waiting, or frees it."""
        while self.waiters:
            _, _, given = heapq.heappop(self.waiters)
            if not given.done():
                given.set_result(None)
                return
        self.free += 1
