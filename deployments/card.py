"""The turns on a shared card (a preset's ``card``), granted by one Ray actor per app (omni_ray/engine/card.py says
what a turn is).

The actor (``omni_ray_card/<app>`` in the ``omni_ray`` namespace, detached, restarted if it dies) grants turns in
the order asked. A stage replica that dies holding the turn would stall the card: while a turn is asked for and
another has been held ``HOLDER_CHECK_S``, the actor asks the holder's replica whether it is alive, and ends the turn
of a dead one (its replacement starts with nothing on the card). A restarted actor starts with no holder; the turn a
replica was in ends as usual.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time

import ray

from omni_ray.engine.card import CardLedger, CardStats

HOLDER_CHECK_S = 5.0  # a turn held this long while another is asked for: is its replica alive?
PING_TIMEOUT_S = 5.0
STATS_TIMEOUT_S = 2.0


class CardTurns:
    """The actor's state and methods (``CardActor`` is this class as a Ray actor)."""

    def __init__(self):
        self.ledger = CardLedger()
        self.changed = asyncio.Condition()
        self.queue: collections.deque[object] = collections.deque()
        self.replicas: dict[str, ray.actor.ActorHandle] = {}  # stage -> its replica, to ask whether it lives

    async def register(self, stage: str, replica) -> None:
        """A stage's replica starting (before its first turn): its predecessor, if any, holds nothing now."""
        async with self.changed:
            self.replicas[stage] = replica
            if self.ledger.holder == stage:  # its predecessor died in its turn
                self.ledger.forget(stage)
            else:
                self.ledger.stats.held_bytes[stage] = 0
            self.changed.notify_all()

    async def take(self, stage: str) -> float:
        """Returns (the seconds it waited) when it is ``stage``'s turn."""
        ticket, asked = object(), time.monotonic()
        async with self.changed:
            self.queue.append(ticket)
            try:
                while not (self.queue[0] is ticket and self.ledger.holder is None):
                    try:
                        async with asyncio.timeout(HOLDER_CHECK_S):  # wait_for can swallow the caller's cancellation
                            await self.changed.wait()
                    except TimeoutError:
                        await self._end_dead_holder()
            except BaseException:
                self.queue.remove(ticket)
                self.changed.notify_all()
                raise
            self.queue.popleft()
            waited = time.monotonic() - asked
            self.ledger.begin(stage, waited)
            return waited

    async def give(self, stage: str, peak_bytes: int, held_bytes: int) -> None:
        async with self.changed:
            self.ledger.end(stage, peak_bytes, held_bytes)
            self.changed.notify_all()

    def stats(self) -> CardStats:
        return self.ledger.stats

    async def _end_dead_holder(self) -> None:
        holder = self.ledger.holder
        replica = self.replicas.get(holder) if holder is not None else None
        if replica is None:
            return
        try:
            async with asyncio.timeout(PING_TIMEOUT_S):
                await replica.__ray_ready__.remote()
        except ray.exceptions.RayActorError:
            if self.ledger.holder == holder:
                self.ledger.forget(holder)
                self.changed.notify_all()
        except TimeoutError:  # alive but slow to answer: its turn goes on
            pass


CardActor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(CardTurns)


class RayCard:
    """A stage replica's side of the app's card (``engine.card.Card``): called on its engine's thread."""

    NAMESPACE = "omni_ray"

    def __init__(self, app_name: str):
        self.actor = CardActor.options(name=self.actor_name(app_name), namespace=self.NAMESPACE,
                                       lifetime="detached", get_if_exists=True).remote()
        self.turns = 0
        self.waited_s = 0.0
        self.held_bytes = 0
        self.turn_peak_bytes = 0

    @staticmethod
    def actor_name(app_name: str) -> str:
        return f"omni_ray_card/{app_name}"

    def take(self, stage: str) -> None:
        self.waited_s += ray.get(self.actor.take.remote(stage))
        self.turns += 1

    def register(self, stage: str) -> None:
        """This replica is the stage's on the card (called as it starts, before its first turn)."""
        ray.get(self.actor.register.remote(stage, ray.get_runtime_context().current_actor))

    def give(self, stage: str, peak_bytes: int, held_bytes: int) -> None:
        self.held_bytes = held_bytes
        self.turn_peak_bytes = max(self.turn_peak_bytes, peak_bytes)
        self.actor.give.remote(stage, peak_bytes, held_bytes)  # ordered before this replica's next take

    def figures(self) -> dict:
        """This stage's turns, and the card's ledger (every stage's; None if the actor does not answer within
        ``STATS_TIMEOUT_S``), for its stats."""
        try:
            ledger = dataclasses.asdict(ray.get(self.actor.stats.remote(), timeout=STATS_TIMEOUT_S))
        except (ray.exceptions.RayError, TimeoutError):
            ledger = None
        return {"turns": self.turns, "waited_s": round(self.waited_s, 3), "held_bytes": self.held_bytes,
                "turn_peak_bytes": self.turn_peak_bytes, "card": ledger}
