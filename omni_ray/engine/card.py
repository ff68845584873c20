"""Stages taking turns on one card (a preset's ``card``).

On one small GPU the encoder, the DiT and the VAE cannot each keep their working memory at once: a 16 GB card holds
a Q4 DiT's kept blocks and the VAE, but not also the encoder's weights and every stage's activations. Their work
never needed to overlap there anyway: one card runs one process's kernels at a time. So the stages named in
``card.stages`` take turns: each engine step that runs the model (a DiT step, a VAE call, an encoder batch) is one
turn, granted in the order asked (first come, first served, so no stage starves), and between its turns a stage holds
only its resident bytes: the DiT its kept blocks, the VAE its weights, the encoder nothing (its weights leave the card
at the end of each turn and come back at the start of the next: ``Weights``). The placement check
(``omni_ray.placement``) proves the residents plus the largest turn fit the card; the ledger here records what each
stage held at each turn's end and the card's peak (the turn's peak plus what the others held meanwhile), which
replicas report in their stats.

A turn's transfers are paid once per step, whatever its batch: a queue of prompts shares the encoder's weights coming
in, as a step batch shares streamed DiT blocks.

``CardLedger`` is the bookkeeping; ``LocalCard`` grants turns between threads of one process (the in-process
``Pipeline``, tests); the Serve app grants them from one Ray actor per card (``deployments.card``). ``TakingTurns``
wraps a stage's engine core.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


class Card(Protocol):
    """Grants turns on one card."""

    def take(self, stage: str) -> None:
        """Returns when it is ``stage``'s turn (the turns asked before it have ended)."""

    def give(self, stage: str, peak_bytes: int, held_bytes: int) -> None:
        """Ends ``stage``'s turn: the most bytes it held on the card during it, and what it keeps there until its
        next one."""


class Weights(Protocol):
    """A stage's weights that leave the card between its turns (the encoder's)."""

    def bring(self) -> None: ...
    def send_away(self) -> None: ...


class TurnMemory(Protocol):
    """What a stage holds on its device: a turn's peak, and what it keeps after it."""

    def start(self) -> None: ...
    def peak(self) -> int: ...
    def held(self) -> int: ...
    def release(self) -> None: ...  # hands back to the card what the stage keeps but no longer uses


@dataclass(slots=True)
class CardStats:
    turns: dict[str, int] = field(default_factory=dict)  # per stage
    waited_s: dict[str, float] = field(default_factory=dict)  # per stage, all its turns together
    held_bytes: dict[str, int] = field(default_factory=dict)  # per stage, at its last turn's end
    turn_peak_bytes: dict[str, int] = field(default_factory=dict)  # per stage, its largest turn
    peak_bytes: int = 0  # the card's: a turn's peak plus what the other stages held meanwhile
    overlaps: int = 0  # turns begun while another was running (never, unless the card is broken)


class CardLedger:
    """Who holds the turn, and what every stage holds on the card: bookkeeping only (the waiting is its owner's)."""

    def __init__(self) -> None:
        self.holder: str | None = None
        self.stats = CardStats()

    def begin(self, stage: str, waited_s: float) -> None:
        stats = self.stats
        if self.holder is not None:
            stats.overlaps += 1
        self.holder = stage
        stats.turns[stage] = stats.turns.get(stage, 0) + 1
        stats.waited_s[stage] = stats.waited_s.get(stage, 0.0) + waited_s

    def end(self, stage: str, peak_bytes: int, held_bytes: int) -> None:
        stats = self.stats
        others = sum(held for other, held in stats.held_bytes.items() if other != stage)
        stats.peak_bytes = max(stats.peak_bytes, others + peak_bytes)
        stats.turn_peak_bytes[stage] = max(stats.turn_peak_bytes.get(stage, 0), peak_bytes)
        stats.held_bytes[stage] = held_bytes
        if self.holder == stage:
            self.holder = None

    def forget(self, stage: str) -> None:
        """A stage's process ended holding the turn (the Ray actor found it dead): its turn ends, holding nothing."""
        self.end(stage, 0, 0)
        self.holder = None


class LocalCard:
    """Turns between the threads of one process, in the order asked."""

    def __init__(self) -> None:
        self.ledger = CardLedger()
        self._changed = threading.Condition()
        self._queue: collections.deque[object] = collections.deque()

    def take(self, stage: str) -> None:
        ticket, asked = object(), time.monotonic()
        with self._changed:
            self._queue.append(ticket)
            self._changed.wait_for(lambda: self._queue[0] is ticket and self.ledger.holder is None)
            self._queue.popleft()
            self.ledger.begin(stage, time.monotonic() - asked)

    def give(self, stage: str, peak_bytes: int, held_bytes: int) -> None:
        with self._changed:
            self.ledger.end(stage, peak_bytes, held_bytes)
            self._changed.notify_all()

    def stats(self) -> CardStats:
        with self._changed:
            return CardStats(**{name: _copy(getattr(self.ledger.stats, name)) for name in CardStats.__slots__})


def _copy(value: Any) -> Any:
    return dict(value) if isinstance(value, dict) else value


def startup_turn(card: Card | None, stage: str) -> Card | None:
    """A stage's start on a shared card is a turn (``card`` None: it is on none): its weights arrive, and an
    encoder's leave again, while no other stage computes or starts. ``TakingTurns`` ends it, once the core is
    built; a build that fails ends its process, whose turn the card then ends (``deployments.card``)."""
    if card is not None:
        card.take(stage)
    return card


class TakingTurns:
    """A stage's engine core on a shared card: every step that runs the model is one turn, its ``weights`` (if
    they leave the card between turns) brought in first and sent away after, and what it held reported to the card.
    With ``keeps_work`` the stage keeps its working memory between turns (the DiT, whose every step needs the same
    again); without, it hands it back after each turn (the encoder and the VAE, whose calls are few and large).
    Steps with nothing for the model (a step answering prompt-cache hits) take no turn. Everything else is the
    core's own (limits, adapters, stats)."""

    def __init__(self, core, card: Card, stage: str, memory: TurnMemory, weights: Weights | None = None,
                 keeps_work: bool = False):
        self.core = core
        self.card = card
        self.stage = stage
        self.memory = memory
        self.weights = weights
        self.keeps_work = keeps_work
        self._needs_card: Callable[[], bool] = getattr(core, "needs_device", core.has_unfinished_requests)
        # Its start was its first turn (``take`` before the build, ``startup_turn``): what the build held at most,
        # then the weights off the card until its next turn, and what it keeps.
        peak = memory.peak()
        if weights is not None:
            weights.send_away()
        if not keeps_work:
            memory.release()
        card.give(stage, peak, memory.held())

    def step(self):
        if not self._needs_card():
            return self.core.step()
        self.card.take(self.stage)
        peak = 0
        try:
            self.memory.start()
            if self.weights is not None:
                self.weights.bring()
            outputs = self.core.step()
            peak = self.memory.peak()
        finally:
            if self.weights is not None:
                self.weights.send_away()
            if not self.keeps_work:
                self.memory.release()
            held = self.memory.held()
            self.card.give(self.stage, max(peak, held), held)
        return outputs

    def __getattr__(self, name: str):
        return getattr(self.core, name)
