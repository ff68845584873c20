"""What a DiT replica has to do, in seconds: the signal its routing, its autoscaling and early refusal read.

``StepTimes`` learns how long this replica's steps take from the steps it runs: ``seconds = overhead + per_token *
tokens`` (``DenoiseRequest.work_tokens`` summed over the step's rows; on a gang, the busiest rank's times the ranks,
``dit_split.StepPlan.tokens``, so that sequence and rows steps lie on one line), a least-squares fit over recent
steps, so the same code serves a GPU, a CPU and the simulated runner. ``DiTLoad`` keeps each request's priority,
tokens and steps left, and turns them into cost-seconds: the time a request's remaining steps take on this replica
when batched as deep as the preset lets its key batch (on a gang, the deeper of the splits its policy weighs), the
step's fixed overhead shared between the rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omni_ray.engine.dit_split import FixedSplit, SplitPolicy


@dataclass(frozen=True, slots=True)
class StepFit:
    """``StepTimes``' fit as it stands: ``seconds = overhead_s + per_token_s * tokens``, from ``num_steps`` steps."""

    overhead_s: float = 0.0
    per_token_s: float = 0.0
    num_steps: int = 0


class StepTimes:
    """An exponentially weighted least-squares fit of step seconds against step tokens; until steps of two sizes
    were seen it is proportional (no overhead). A step ten times slower than the fit predicts (the first step of a
    shape that compiles, say) is left out once the fit has a few steps. Lives in the DiT's core, on the engine's
    thread; others read its ``snapshot()`` in the engine's stats."""

    def __init__(self, halflife_steps: float = 200.0):
        self.decay = 0.5 ** (1.0 / halflife_steps)
        self.sums = (0.0, 0.0, 0.0, 0.0, 0.0)  # weight, tokens, tokens^2, seconds, tokens*seconds
        self.fit: tuple[float, float] = (0.0, 0.0)  # (overhead s, s per token)
        self.num_steps = 0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or (self.num_steps >= 3 and seconds > 10 * self.seconds(tokens)):
            return
        d = self.decay
        weight, t, tt, y, ty = self.sums
        self.sums = (d * weight + 1, d * t + tokens, d * tt + tokens**2, d * y + seconds, d * ty + tokens * seconds)
        self.num_steps += 1
        self.fit = _solve(*self.sums)

    def seconds(self, tokens: int) -> float:
        overhead, per_token = self.fit
        return overhead + per_token * tokens

    def snapshot(self) -> StepFit:
        return StepFit(*self.fit, self.num_steps)


def _solve(w: float, t: float, tt: float, y: float, ty: float) -> tuple[float, float]:
    variance = w * tt - t * t
    if variance > 1e-6 * w * tt:  # steps of more than one size: a line
        per_token = (w * ty - t * y) / variance
        overhead = (y - per_token * t) / w
        if overhead >= 0 and per_token > 0:
            return overhead, per_token
    return 0.0, y / t  # one size so far (or a fit that makes no sense): proportional


@dataclass(slots=True)
class _Work:
    priority: int
    tokens: int  # work tokens per step
    steps_left: int
    passes: int  # 2 with true CFG, else 1


class DiTLoad:
    """The work a DiT replica holds, queued and running; changed on the replica's event loop."""

    def __init__(self, step_fit: Callable[[], StepFit], max_batch_size: int, max_batch_tokens: int | None,
                 by_priority: bool = True, split: SplitPolicy | None = None):
        """``step_fit()``: the engine's latest ``StepFit``; ``by_priority``: the scheduler runs the more urgent first
        (a FIFO one does not: all work is ahead); ``split``: the scheduler's (unset: one rank)."""
        split = split if split is not None else FixedSplit()
        shapes = split.shapes(max_batch_size, max_batch_tokens)
        self.step_fit = step_fit
        self.shapes = [shapes[name] for name in split.splits]
        self.by_priority = by_priority
        self.work: dict[str, _Work] = {}
        self.request_s = 0.0  # cost-seconds of a request as they arrive, a moving mean

    def add(self, request_id: str, priority: int, tokens: int, steps: int, passes: int = 1) -> None:
        self.work[request_id] = _Work(priority, tokens, steps, passes)
        self.request_s += 0.1 * (steps * self.row_seconds(tokens, passes) - self.request_s)

    def progress(self, request_id: str, done: int, total: int) -> None:
        if (work := self.work.get(request_id)) is not None:
            work.steps_left = total - done

    def remove(self, request_id: str) -> None:
        self.work.pop(request_id, None)

    def row_seconds(self, tokens: int, passes: int = 1) -> float:
        """One step of one request of ``tokens`` tokens in ``passes`` passes, in a step as full as its key batches."""
        rows = max(shape.depth(tokens, passes) for shape in self.shapes)
        fit = self.step_fit()
        return fit.overhead_s / rows + fit.per_token_s * tokens

    def seconds(self, max_priority: int | None = None) -> float:
        """Cost-seconds of every request held (of priority ``max_priority`` or more urgent, when given)."""
        held = list(self.work.values())  # one step under the GIL: the metrics thread reads it too
        return sum(w.steps_left * self.row_seconds(w.tokens, w.passes) for w in held
                   if max_priority is None or w.priority <= max_priority)

    def estimate(self, priority: int, tokens: int, steps: int, images: int = 1, passes: int = 1) -> float:
        """Seconds until a new request's ``images`` would be done here: the work as urgent or more that is ahead of
        it, and its own (0 until the replica has run a step: it has nothing to learn from)."""
        if self.step_fit().num_steps == 0:
            return 0.0
        ahead = self.seconds(priority if self.by_priority else None)
        return ahead + images * steps * self.row_seconds(tokens, passes)

