"""What a DiT replica has to do, in seconds: the signal its routing, its autoscaling and early refusal read.

``StepTimes`` learns how long this replica's steps take from the steps it runs: ``seconds = overhead + per_token *
tokens`` (``DenoiseRequest.work_tokens`` summed over the step's rows; on a gang, the busiest rank's times the ranks,
``dit_split.StepPlan.tokens``, so that sequence and rows steps lie on one line), a least-squares fit over recent
steps, so the same code serves a GPU, a CPU and the simulated runner. ``DiTLoad`` keeps each request's priority,
tokens and steps left, and turns them into cost-seconds: the time a request's remaining steps take on this replica
when batched as deep as the preset lets its key batch (on a gang, the deeper of the splits its policy weighs), the
step's fixed overhead shared between the rows.

An estimate is a promise the coordinator refuses a request on (``DiTLoad.admit``), so it counts everything that will
run ahead of the request, as the scheduler (omni_ray/engine/dit_scheduler.py) orders work:

- work held here that is more urgent, or less urgent but able to age past it before its deadline;
- its own tenant's work at its priority (a tenant's requests run oldest first) and, for every other tenant at its
  priority, what it holds and will send meanwhile (at the rate it sent over the last ``ARRIVALS_WINDOW_S``), up to
  as much as the request's own tenant will run until it is done (the tenants take turns);
- requests admitted but not yet here: ``reserve`` records each admitted request's work under its id until its
  denoise calls arrive (``{id}-{index}``, ``request_path``) or a bound passes;
- its own steps as full ones (``full_steps_seconds``): rows that arrive later share them (under FIFO every
  request of its size does: no token budget);
- work that will arrive while it runs and go ahead of it (more urgent, or its own tenant's of another batch key,
  which takes turns): the rate it arrived at over the last ``ARRIVALS_WINDOW_S``, so the request gets the rest of
  the DiT: ``seconds / (1 - rate)``;
- and all of it times ``StepFit.slow``, how much slower than the fitted line steps of some size ran lately.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from omni_ray.engine.dit_split import FixedSplit, SplitPolicy

ARRIVALS_WINDOW_S = 60.0  # how far back the rate of work arriving ahead of a request is measured
MAX_ARRIVAL_RATE = 0.9  # past it a request is taken to get a tenth of the DiT (the estimate stays finite)
RESERVATION_HOLD_S = 60.0  # a reservation whose denoise calls have not come by then (or by the deadline) is dropped


@dataclass(frozen=True, slots=True)
class StepFit:
    """``StepTimes``' fit as it stands: ``seconds = overhead_s + per_token_s * tokens``, from ``num_steps`` steps;
    ``slow`` (at least 1): how much slower than the fit steps of some size have lately been (the fit is a line; a
    step's attention grows with the square of its tokens)."""

    overhead_s: float = 0.0
    per_token_s: float = 0.0
    num_steps: int = 0
    slow: float = 1.0
    max_tokens: float = math.inf  # the largest step in the fit (a fit given whole, not learned: any)


TRUSTED_AFTER_STEPS = 8  # steps in a replica's fit before its estimates may refuse a request (``DiTLoad.estimate``)
EXTRAPOLATE_AT_MOST = 2.0  # an estimate refuses a request only as large as this many times the fit's largest step


class StepTimes:
    """An exponentially weighted least-squares fit of step seconds against step tokens; until steps of two sizes
    were seen it is proportional (no overhead). Once the fit has a few steps, a step ten times slower than it
    predicts (the first step of a shape that compiles, say) is left out, and a step ten times faster starts the fit
    again from that step: the steps before it were a warm-up (a new replica's first steps beside a machine busy
    starting others) or a proportional fit from small steps, all overhead, that a larger one proved wrong. Beside
    it, for each size (tokens to a power of two), a moving mean of how much slower its steps ran than the fit said:
    the estimates' margin for the fit's error. Lives in the DiT's core, on the engine's thread; others read its
    ``snapshot()`` in the engine's stats.

    ``overhead_s``: a step's fixed cost known before any step ran (a streamed DiT's weight transfer, ``dit.offload``):
    while steps of one size only were seen, the fit keeps it (at most 99% of a step) and makes the rest
    proportional, so the first estimates already share the transfer between a step's rows."""

    def __init__(self, halflife_steps: float = 200.0, overhead_s: float = 0.0):
        self.decay = 0.5 ** (1.0 / halflife_steps)
        self.overhead_s = overhead_s
        self._clear()

    def _clear(self) -> None:
        self.sums = (0.0, 0.0, 0.0, 0.0, 0.0)  # weight, tokens, tokens^2, seconds, tokens*seconds
        self.fit: tuple[float, float] = (0.0, 0.0)  # (overhead s, s per token)
        self.num_steps = 0
        self.slow_by_size: dict[int, float] = {}  # tokens.bit_length() -> moving mean of seconds over the fit's
        self.max_tokens = 0  # the largest step in the fit

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or (self.num_steps >= 3 and seconds > 10 * self.seconds(tokens)):
            return
        if self.num_steps >= 3 and 10 * seconds < self.seconds(tokens):
            self._clear()
        if self.num_steps >= 3:
            size, ratio = tokens.bit_length(), seconds / self.seconds(tokens)
            mean = self.slow_by_size.get(size, ratio)
            self.slow_by_size[size] = mean + 0.1 * (ratio - mean)
        d = self.decay
        weight, t, tt, y, ty = self.sums
        self.sums = (d * weight + 1, d * t + tokens, d * tt + tokens**2, d * y + seconds, d * ty + tokens * seconds)
        self.num_steps += 1
        self.max_tokens = max(self.max_tokens, tokens)
        self.fit = _solve(*self.sums, self.overhead_s)

    def seconds(self, tokens: int) -> float:
        overhead, per_token = self.fit
        return overhead + per_token * tokens

    def snapshot(self) -> StepFit:
        return StepFit(*self.fit, self.num_steps, max([1.0, *self.slow_by_size.values()]), self.max_tokens)


def _solve(w: float, t: float, tt: float, y: float, ty: float, overhead_s: float = 0.0) -> tuple[float, float]:
    variance = w * tt - t * t
    if variance > 1e-6 * w * tt:  # steps of more than one size: a line
        per_token = (w * ty - t * y) / variance
        overhead = (y - per_token * t) / w
        if overhead >= 0 and per_token > 0:
            return overhead, per_token
    # one size so far (or a fit that makes no sense): the known overhead, the rest proportional
    overhead = min(overhead_s, 0.99 * y / w)
    return overhead, (y - overhead * w) / t


@dataclass(slots=True)
class _Work:
    priority: int
    tenant: str
    tokens: int  # work tokens per step
    steps_left: int
    passes: int  # 2 with true CFG, else 1
    images: int = 1  # a reservation holds all its request's images until each arrives
    expires_at: float = math.inf  # a reservation is dropped then


@dataclass(frozen=True, slots=True)
class _Arrival:
    at: float
    priority: int
    tenant: str
    key: tuple  # what it batches with (``size_key``)
    tokens: int
    steps: int
    passes: int


def size_key(height: int, width: int, true_cfg: bool) -> tuple[int, int, bool]:
    """What the estimate tells batch keys apart by (``BatchKey`` without an edit's input sizes): the coordinator
    names it from the plan, the DiT from the request, so that both agree whatever the prompts' token counts."""
    return height, width, true_cfg


def reservation_for(call_id: str, keys: Iterable[str]) -> str | None:
    """The reservation a DiT call belongs to: the request's id, which its calls' ids extend (``{id}-{index}``,
    ``{id}-{index}-retry{n}``: ``request_path._run_image``)."""
    return next((key for key in keys if call_id.startswith(key + "-")), None)


class DiTLoad:
    """The work a DiT replica holds, queued and running, and the work promised to it; changed on the replica's event
    loop."""

    def __init__(self, step_fit: Callable[[], StepFit], max_batch_size: int, max_batch_tokens: int | None,
                 by_priority: bool = True, split: SplitPolicy | None = None, aging_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """``step_fit()``: the engine's latest ``StepFit``; ``by_priority``: the scheduler runs the more urgent first
        and shares a priority's steps between tenants (a FIFO one does neither: all work is ahead); ``split``: the
        scheduler's (unset: one rank); ``aging_s``: its priority aging (unset: none)."""
        self.split = split if split is not None else FixedSplit()
        self.set_limits(max_batch_size, max_batch_tokens, aging_s)
        self.step_fit = step_fit
        self.by_priority = by_priority
        self.clock = clock
        self.work: dict[str, _Work] = {}  # request id -> its work, here
        self.reserved: dict[str, _Work] = {}  # admitted request's id -> its work, on its way
        self.arrivals: deque[_Arrival] = deque()  # the last ARRIVALS_WINDOW_S
        self.request_s = 0.0  # cost-seconds of a request as they arrive, a moving mean

    def set_limits(self, max_batch_size: int, max_batch_tokens: int | None, aging_s: float | None) -> None:
        """The scheduler's step limits and aging, as they change live (``DiTScheduler.set_limits``)."""
        shapes = self.split.shapes(max_batch_size, max_batch_tokens)
        self.shapes = [shapes[name] for name in self.split.splits]
        self.aging_s = aging_s

    def add(self, request_id: str, priority: int, tokens: int, steps: int, passes: int = 1, tenant: str = "",
            key: tuple | None = None) -> None:
        """A request arrived (``key``: its ``size_key``): its reservation (if any) gives up one image."""
        reserved = reservation_for(request_id, self.reserved)
        if reserved is not None:
            reservation = self.reserved[reserved]
            reservation.images -= 1
            if reservation.images <= 0:
                del self.reserved[reserved]
        self.work[request_id] = _Work(priority, tenant, tokens, steps, passes)
        self.request_s += 0.1 * (steps * self.row_seconds(tokens, passes) - self.request_s)
        key = key if key is not None else (tokens, passes)
        self.arrivals.append(_Arrival(self.clock(), priority, tenant, key, tokens, steps, passes))

    def progress(self, request_id: str, done: int, total: int) -> None:
        if (work := self.work.get(request_id)) is not None:
            work.steps_left = total - done

    def remove(self, request_id: str) -> None:
        self.work.pop(request_id, None)

    def reserve(self, key: str, priority: int, tokens: int, steps: int, images: int = 1, passes: int = 1,
                tenant: str = "", hold_s: float = RESERVATION_HOLD_S) -> None:
        """Counts a request admitted but not yet here (its calls' ids extend ``key``) until its calls arrive, or for
        ``hold_s`` at most (it failed before the DiT, or its caller left)."""
        self.reserved[key] = _Work(priority, tenant, tokens, steps, passes, images,
                                   self.clock() + min(hold_s, RESERVATION_HOLD_S))

    def release(self, key: str) -> None:
        """The request reserved under ``key`` will not come (refused after its admission): its work no longer counts."""
        self.reserved.pop(key, None)

    def row_seconds(self, tokens: int, passes: int = 1) -> float:
        """One step of one request of ``tokens`` tokens in ``passes`` passes, in a step as full as its key batches."""
        rows = max(shape.depth(tokens, passes) for shape in self.shapes)
        fit = self.step_fit()
        return fit.overhead_s / rows + fit.per_token_s * tokens

    def full_steps_seconds(self, tokens: int, passes: int = 1, images: int = 1) -> float:
        """One denoising step of a request's ``images`` when every step that runs them is full (the rows beside
        them, of requests that arrive later, cost it time too): their steps at the depth their key batches."""
        rows = max(shape.depth(tokens, passes) for shape in self.shapes)
        fit = self.step_fit()
        return -(-images // rows) * (fit.overhead_s + rows * fit.per_token_s * tokens)

    def seconds(self, max_priority: int | None = None) -> float:
        """Cost-seconds of every request held and reserved (of priority ``max_priority`` or more urgent, when
        given)."""
        return sum(self._cost(w) for w in self._all() if max_priority is None or w.priority <= max_priority)

    def estimate(self, priority: int, tokens: int, steps: int, images: int = 1, passes: int = 1, tenant: str = "",
                 deadline_s: float | None = None, key: tuple | None = None) -> float:
        """Seconds until a new request's ``images`` would be done here, the work that will go ahead of it included
        (the module's docstring says which); ``deadline_s`` bounds how far less urgent work may age; ``key``: its
        ``size_key``. 0 until the replica's fit holds ``TRUSTED_AFTER_STEPS`` steps: a new replica's first few steps
        (its start's, under whatever else the machine ran meanwhile) would refuse requests on a line through one or
        two points; 0 too for a request more than ``EXTRAPOLATE_AT_MOST`` times the largest step the fit saw: a line
        through small steps only, all overhead, put a 512x512 request of the tiny DiT past half an hour."""
        fit = self.step_fit()
        if fit.num_steps < TRUSTED_AFTER_STEPS or tokens > EXTRAPOLATE_AT_MOST * fit.max_tokens:
            return 0.0
        rank, own_tenant = self._rank(priority, tenant)
        own = steps * self.full_steps_seconds(tokens, passes, images)
        levels = math.ceil(deadline_s / self.aging_s) if self.aging_s and deadline_s else 0
        ahead = mine = 0.0
        others: dict[str, float] = {}
        for work in self._all():
            work_rank, work_tenant = self._rank(work.priority, work.tenant)
            if work_rank < rank or (self.by_priority and rank < work_rank <= rank + levels):
                ahead += self._cost(work)
            elif work_rank == rank and work_tenant == own_tenant:
                mine += self._cost(work)
            elif work_rank == rank:
                others[work_tenant] = others.get(work_tenant, 0.0) + self._cost(work)
        now = self.clock()
        while self.arrivals and self.arrivals[0].at < now - ARRIVALS_WINDOW_S:
            self.arrivals.popleft()
        key = key if key is not None else (tokens, passes)
        arriving = 0.0
        sending: dict[str, float] = {}  # other tenant at its rank -> cost-seconds it sent lately
        for arrival in self.arrivals:
            arrival_rank, arrival_tenant = self._rank(arrival.priority, arrival.tenant)
            cost = arrival.steps * self.row_seconds(arrival.tokens, arrival.passes)
            if arrival_rank < rank or (arrival_rank == rank and arrival_tenant == own_tenant and arrival.key != key):
                arriving += cost
            elif arrival_rank == rank and arrival_tenant != own_tenant:
                sending[arrival_tenant] = sending.get(arrival_tenant, 0.0) + cost
        ahead_rate = min(MAX_ARRIVAL_RATE, arriving / ARRIVALS_WINDOW_S)
        share = mine + own  # the most each other tenant at its priority runs before it is done: they take turns
        slow = fit.slow

        def finish(seconds: float) -> float:
            """When it is done if it is done in ``seconds``: other tenants take what they hold and send meanwhile,
            up to their share."""
            shared = sum(min(share, others.get(who, 0.0) + sending.get(who, 0.0) / ARRIVALS_WINDOW_S * seconds)
                         for who in others.keys() | sending.keys())
            return slow * (ahead + share + shared) / (1 - ahead_rate)

        seconds = finish(0.0)
        for _ in range(50):  # the least fixed point: finish() grows with its argument and is bounded
            seconds, before = finish(seconds), seconds
            if seconds - before < 1e-3:
                break
        return seconds

    def admit(self, request_id: str, budget_s: float, priority: int, tokens: int, steps: int, images: int = 1,
              passes: int = 1, tenant: str = "", deadline_s: float | None = None, key: tuple | None = None) -> float:
        """The ``estimate``; when it is within ``budget_s`` the request is admitted, and reserved under its id until
        its calls arrive (or its deadline, or ``RESERVATION_HOLD_S``, passes)."""
        seconds = self.estimate(priority, tokens, steps, images, passes, tenant, deadline_s, key)
        if seconds <= budget_s:
            self.reserve(request_id, priority, tokens, steps, images, passes, tenant,
                         deadline_s if deadline_s is not None else RESERVATION_HOLD_S)
        return seconds

    def _all(self) -> list[_Work]:
        """Held and reserved work, the expired reservations dropped (one step under the GIL: the metrics thread
        reads it too)."""
        now = self.clock()
        for key in [key for key, work in list(self.reserved.items()) if work.expires_at <= now]:
            self.reserved.pop(key, None)
        return list(self.work.values()) + list(self.reserved.values())

    def _cost(self, work: _Work) -> float:
        return work.images * work.steps_left * self.row_seconds(work.tokens, work.passes)

    def _rank(self, priority: int, tenant: str) -> tuple[int, str]:
        """Priority and tenant as the scheduler orders by them: a FIFO one gives every request the same."""
        return (priority, tenant) if self.by_priority else (0, "")
