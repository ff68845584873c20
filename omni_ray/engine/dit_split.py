"""How a DiT gang runs each step (``DenoiseBatch.split``), and the policy that decides it.

A replica whose ``dit.parallel`` has sequence ranks (ulysses x ring > 1) runs a step over its N = cfg x sequence
ranks one of two ways, as ``DenoiseRunner.predict`` does:

- **sequence**: every pass's tokens split over the sequence ranks (all-to-alls around attention), a true-CFG row's
  two passes on the two CFG ranks. A row's step takes about 1/N of its one-GPU compute, plus the fixed per-step
  overhead and the all-to-alls (``runners/gpu_costs.py``): the lowest latency for each row.
- **rows**: the step's passes (a row's, and its unconditional one with true CFG) dealt over the N ranks in turn, each
  run whole: no all-to-alls, and each rank batches its own; the step lasts as long as its busiest rank. The most
  throughput, when every rank has passes.

Either way a step holds ``max_batch_size`` rows and ``max_batch_tokens`` work tokens, the step's first row always; a
rows step also keeps each rank within an Nth of the tokens (a rank holding one pass always fits), as a sequence step
puts an Nth on each. So both end in about the time of a one-GPU step of an Nth of the budget, and the time a step
takes per work token lies on one line for both: ``StepPlan.tokens`` is what the DiT's ``StepTimes`` learns from. A
step holding a row with cache acceleration runs sequence: its cache holds each rank's chunk of its tokens.

``FixedSplit`` runs every step one way; ``PerStepSplit`` chooses each step's from the rows it would run each way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

Split = Literal["sequence", "rows"]  # DenoiseBatch.split
URGENT_PRIORITY = 0  # the API's default priority: requests that did not mark themselves as batch work
# A rows step may load its busiest rank this much over the mean: what a sequence step loses to its all-to-alls. On 4
# ranks they are 8% of a 1024x1024 true-CFG step, but a fifth of a step of a few 512x512 rows, where 240 collectives'
# fixed latency weighs most (runners/gpu_costs.py): five such rows (ten passes, 3/3/2/2, 1.2 the mean) end sooner dealt
# as rows than split as sequence.
EVEN = 1.2


class Row(Protocol):
    tokens: int  # work tokens per step, every pass's (DenoiseRequest.work_tokens)
    passes: int  # 2 with true CFG, else 1
    priority: int  # the request's own, lower is more urgent


@dataclass(frozen=True, slots=True)
class StepPlan:
    """The rows a step would run under one split, and the work tokens that would fall on each rank."""

    split: Split
    rows: list  # the rows taken, in the order they were offered
    loads: list[float]  # [ranks] work tokens on each rank

    @property
    def busiest(self) -> float:
        """Work tokens on the busiest rank: what the step's time goes by."""
        return max(self.loads)

    @property
    def tokens(self) -> int:
        """The step's work tokens as its time counts them: the busiest rank's times the ranks (a sequence step's are
        its rows'; an uneven rows step counts its idle ranks' share too)."""
        return round(self.busiest * len(self.loads))


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step of a gang of ``ranks`` ranks may hold under ``split``: ``max_rows`` rows and ``max_tokens`` work
    tokens (None: no token bound), rows within an Nth of them on each rank."""

    split: Split
    ranks: int
    max_rows: int
    max_tokens: int | None

    def loads(self, rows: list[Row]) -> list[float]:
        """Work tokens on each rank for ``rows``: an even share, or the passes dealt over the ranks in turn (every
        row's first pass, then the unconditional ones)."""
        if self.split == "sequence":
            return [sum(row.tokens for row in rows) / self.ranks] * self.ranks
        loads = [0.0] * self.ranks
        for index, row in enumerate(self._passes(rows)):
            loads[index % self.ranks] += row.tokens / row.passes
        return loads

    def fits(self, rows: list[Row]) -> bool:
        """Whether ``rows`` fit one step (the first row always does)."""
        if len(rows) > self.max_rows:
            return False
        if len(rows) == 1 or self.max_tokens is None:
            return True
        if self.split == "sequence":
            return sum(row.tokens for row in rows) <= self.max_tokens
        single = len(self._passes(rows)) <= self.ranks  # one pass a rank: each holds one pass, which always fits
        return single or max(self.loads(rows)) <= self.max_tokens / self.ranks

    def plan(self, offered: list[Row]) -> StepPlan:
        """The step's rows: ``offered`` in order while they fit."""
        rows: list[Row] = []
        for row in offered:
            if rows and not self.fits(rows + [row]):
                break
            rows.append(row)
        return StepPlan(self.split, rows, self.loads(rows))

    def depth(self, tokens: int, passes: int = 1) -> int:
        """Rows of ``tokens`` work tokens in ``passes`` passes that one step holds at most (what ``plan`` takes of a
        deep queue of them)."""
        if self.max_tokens is None:
            return self.max_rows
        if self.split == "sequence":
            return max(1, min(self.max_rows, self.max_tokens // tokens))
        per_rank = max(1, (self.max_tokens // self.ranks) // (tokens // passes))  # passes a rank holds
        return max(1, min(self.max_rows, per_rank * self.ranks // passes))

    @staticmethod
    def _passes(rows: list[Row]) -> list[Row]:
        """The step's passes in the runner's order, each as its row: every row once, then each true-CFG row again."""
        return list(rows) + [row for row in rows if row.passes == 2]


class SplitPolicy(ABC):
    """Which split each step runs, among the plans of the splits it weighs."""

    ranks: int  # the ranks a step's rows spread over: cfg x sequence
    splits: tuple[Split, ...]  # the splits it plans each step under

    def shapes(self, max_rows: int, max_tokens: int | None) -> dict[Split, StepShape]:
        """A step's shape under each split, for bounds of ``max_rows`` rows and ``max_tokens`` tokens a step."""
        return {split: StepShape(split, self.ranks, max_rows, max_tokens) for split in ("sequence", "rows")}

    @abstractmethod
    def choose(self, plans: dict[Split, StepPlan]) -> Split:
        """The split to run, given the step's plan under each of ``splits`` (each with a row at least)."""


@dataclass(frozen=True)
class FixedSplit(SplitPolicy):
    """Every step one way (one rank: there is only one way)."""

    split: Split = "sequence"
    ranks: int = 1

    @property
    def splits(self) -> tuple[Split, ...]:
        return (self.split,)

    def choose(self, plans: dict[Split, StepPlan]) -> Split:
        return self.split


@dataclass(frozen=True)
class PerStepSplit(SplitPolicy):
    """Each step's split chosen from the queue: rows when they keep every rank evenly busy and slow no urgent row;
    else sequence.

    - **Even.** Over the same rows, a rows step whose ranks are evenly loaded ends no later than a sequence step (it
      does the same compute and saves the all-to-alls), and an uneven one ends later for every row in it (five
      passes on four ranks: the busiest holds two passes, where sequence runs one and a quarter plus its
      all-to-alls). So rows only when every rank has passes and the busiest holds at most ``EVEN`` times the mean.
    - **Urgent.** The two plans differ where a pass is larger than a rank's share of the budget: rows runs one on
      every rank, sequence one row over all of them, so rows finishes N passes in a GPU's time for one and sequence
      a row in an Nth of its time. That is throughput against latency, and urgency decides: when the sequence plan
      holds urgent rows (priority ``URGENT_PRIORITY`` or more urgent), rows must hold every one of them and load its
      busiest rank no more than sequence's (``EVEN`` aside); batch work takes the throughput. So an urgent request
      alone, or with fewer passes than ranks, runs sequence: rows would idle ranks and run it at one GPU's speed.

    Urgent requests waiting outside the step do not count: the split does not trade batch work for their wait.
    While they wait, batch work aged to their priority (``priority_aging_s``) takes turns with them by keys
    (``max_wait_steps``), and a rows step over large rows, a pass a rank, counts in that turn as the sequence steps its
    rows would take (``DiTScheduler``): so a turn runs as much batch work either way, and as rows it ends sooner (two
    1328x1328 true-CFG rows in one GPU's pass, 0.23 s, where sequence takes 0.16 s for each). Counted by steps, a
    rows turn ran twice the work in 1.45 times a sequence turn's time, and an urgent request waiting through three
    of them had near 2.5 times slo's mix a p99 1.16 times a fixed sequence gang's (benchmarks/parallel_choice.py);
    running such turns as sequence instead (when urgent requests wait, or only a few) gave up fixed rows' throughput,
    up to 17% at 6 times the mix. Nor does a split shorten the step an urgent request arrives during: after a rows
    step over large rows it waits for one GPU's pass.
    """

    ranks: int
    splits: ClassVar[tuple[Split, ...]] = ("sequence", "rows")

    def choose(self, plans: dict[Split, StepPlan]) -> Split:
        sequence, rows = plans["sequence"], plans["rows"]
        if min(rows.loads) == 0 or rows.busiest > EVEN * sum(rows.loads) / self.ranks:
            return "sequence"  # uneven: the busiest rank would outlast a sequence step over the same rows
        urgent = [row for row in sequence.rows if row.priority <= URGENT_PRIORITY]
        held = {id(row) for row in rows.rows}
        if urgent and (any(id(row) not in held for row in urgent) or rows.busiest > EVEN * sequence.busiest):
            return "sequence"  # rows would leave an urgent row out of the step, or end the step later
        return "rows"
