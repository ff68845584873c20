"""Step-level continuous batching for the DiT, by priority, fair between tenants, within a budget of work.

Every ``schedule()`` picks one batch key (image size, true CFG on or off, an edit's input image sizes) and the rows
of that key the step runs. Admitted requests keep their state in the runner, so any of them can sit out a step and
go on later from where it was: that is how keys take turns, and how a request is paused. The scheduler is given a
policy (omni_ray/engine/dit_policy.py) that sets each request's priority and tenant, how it ages, the token budget and
the bound on pauses: ``PriorityPolicy``, or ``FifoPolicy`` (one priority and tenant for all, no budget, no bound, no
aging: the oldest key's requests in arrival order, up to ``max_batch_size``).

- **Key.** The key of the most urgent request: the lowest effective priority wins: its priority, aged by the time
  the request sat out steps that ran more urgent requests, so nothing starves behind a flood of more urgent work
  (waiting behind requests as urgent as itself ages nothing: there, turns are fair). Among keys holding that
  priority the DiT stays on its current key until another has waited ``max_wait_steps`` steps, then switches to the
  one that waited longest. A rows step counts there as the sequence steps its rows would take (``num_turns``): a
  turn holds as much work whatever the split, so a gang's rows step over two large rows does not make it longer.
- **Rows.** The key's requests by effective priority; within a priority, each row goes to the tenant that has used
  the DiT least lately at that priority (its rows' tokens over recent steps, ``USAGE_HALFLIFE_STEPS``, plus those it
  took in this step: ``FairShare``, the rule every stage's queue follows, omni_ray/engine/fair_share.py), so a tenant
  sending a tenth of another's requests gets its rows first and a flood shares the rest; a tenant's admitted requests
  go before its waiting ones, oldest first. Rows are added while the step stays within ``max_batch_size`` requests
  and the policy's ``max_batch_tokens`` tokens (``DenoiseRequest.work_tokens``; the first row always runs). A running
  request that loses its row to a more urgent one, or to another tenant's turn, is paused: its state stays in the
  runner.
- **Paused.** A step admits no new request while more than the policy's ``max_paused`` admitted ones would sit
  outside it: new requests then wait in the queue, where they hold no state.
- **Split.** On a gang with sequence ranks, the step's rows are taken as far as they fit each split its split policy
  weighs (omni_ray/engine/dit_split.py: a rows step also keeps each rank within its share of the budget):
  ``FixedSplit`` one, ``PerStepSplit`` both, and it chooses which the step runs (``DenoiseBatch.split``). A step
  holding a row with cache acceleration runs sequence, as the runner would.
- **Condition cache.** Qwen-Image 2.1 keeps each request's condition cache (its text and condition-image keys and
  values, per CFG branch) from its first step to its end, paused or not, as an LLM keeps its KV cache. Given a budget
  (``cache_memory_bytes``, and ``cache_bytes``: a request's bytes), the scheduler admits a request only while the
  bytes of the admitted ones (unfinished, not aborted) and its own fit it; they are released when it finishes, fails
  or is aborted. Waiting requests are taken for admission in the order a step takes rows: by effective priority,
  then by tenant turns, then by arrival; the first one that does not fit stops admission for the step, so no request
  behind it in that order (as urgent and a later turn, or less urgent) slips into the room it waits for: only more
  urgent requests go ahead of it, and aging lifts it above those in time, so it is never starved. Admitted requests
  keep stepping meanwhile and free the room as they finish. A request whose cache alone passes the budget fails at
  once (``add_request`` raises EngineError): it could never run.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from omni_ray.engine.dit_policy import PriorityPolicy, SchedulingPolicy
from omni_ray.engine.dit_split import FixedSplit, Split, SplitPolicy, StepPlan
from omni_ray.engine.fair_share import FairShare
from omni_ray.engine.output import EngineCoreOutput
from omni_ray.engine.scheduler import Scheduler
from omni_ray.engine.stats import ConditionCacheStats
from omni_ray.errors import EngineError
from omni_ray.records import BatchKey, DenoiseBatch, DenoiseOutput, DenoiseRequest

USAGE_HALFLIFE_STEPS = 50


@dataclass(slots=True)
class _Entry:
    request: DenoiseRequest
    key: BatchKey
    tokens: int  # work tokens per step
    passes: int  # 2 with true CFG, else 1
    cached: bool  # with cache acceleration: its cache holds each rank's chunk of its tokens, so its steps run sequence
    priority: int
    tenant: str
    arrived_turn: float  # turns run before it arrived (DiTScheduler.num_turns)
    seq: int  # arrival number
    cache_bytes: int = 0  # its condition cache, held from its admission to its end (0 when not counted)
    admitted: bool = False  # the runner holds its state
    starved_s: float = 0.0  # time it sat out steps that ran more urgent requests


class DiTScheduler(Scheduler[DenoiseRequest, DenoiseBatch, DenoiseOutput]):
    def __init__(self, max_batch_size: int, max_wait_steps: int, policy: SchedulingPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic, split: SplitPolicy | None = None,
                 cache_bytes: Callable[[DenoiseRequest], int] | None = None, cache_memory_bytes: int | None = None):
        """``policy`` unset: priorities and tenants with no token budget, no bound on pauses and no aging. ``split``
        unset: one rank. ``cache_bytes``: the bytes of a request's condition cache (Qwen-Image 2.1), counted while it
        is admitted; unset, nothing is counted. ``cache_memory_bytes``: what the admitted requests' caches may take
        together (needs ``cache_bytes``); unset, no bound."""
        assert max_batch_size > 0 and max_wait_steps > 0
        assert cache_memory_bytes is None or (cache_bytes is not None and cache_memory_bytes > 0)
        self.cache_bytes = cache_bytes
        self.cache_memory_bytes = cache_memory_bytes
        self.max_batch_size = max_batch_size
        self.max_wait_steps = max_wait_steps
        self.policy = policy if policy is not None else PriorityPolicy()
        self.clock = clock
        self.split = split if split is not None else FixedSplit()
        self.shapes = self.split.shapes(max_batch_size, self.policy.max_batch_tokens)
        self.entries: dict[str, _Entry] = {}  # every unfinished request, in arrival order
        self.last_served: dict[BatchKey, float] = {}  # key -> turns run when it last ran (its step included)
        self.shares = FairShare(USAGE_HALFLIFE_STEPS)  # tenants' recent use of the DiT: their rows' tokens
        self.freed_ids: list[str] = []  # left the runner's care since the last step
        self.current_key: BatchKey | None = None
        self.num_steps = 0
        self.num_turns = 0.0  # steps run, a rows step counted as the sequence steps its rows would take
        self.num_arrivals = 0
        self.last_step_tokens = 0  # work tokens of the step last scheduled, as its time counts them (StepPlan.tokens)
        self.batch_sizes: Counter[int] = Counter()  # requests per step -> steps run with that many
        self.splits: Counter[Split] = Counter()  # split -> steps run that way
        self.passed_over: list[_Entry] = []  # sat out the last step, which ran more urgent requests
        self.last_step_at: float | None = None  # the clock when the last step was scheduled
        self.num_paused = 0  # admitted requests the last step did not run
        self.num_paused_steps = 0  # request-steps admitted requests sat out
        self.num_cache_waiting = 0  # waiting requests the last step left in the queue for want of cache room

    def set_limits(self, max_batch_size: int, max_wait_steps: int, policy: SchedulingPolicy) -> None:
        """New step limits and policy knobs (a live change, between two steps): the next step is planned with them;
        the requests it holds keep their places."""
        assert max_batch_size > 0 and max_wait_steps > 0
        self.max_batch_size, self.max_wait_steps, self.policy = max_batch_size, max_wait_steps, policy
        self.shapes = self.split.shapes(max_batch_size, policy.max_batch_tokens)

    @property
    def max_batch_tokens(self) -> int | None:
        """Work tokens one step may take, the policy's; None: no bound."""
        return self.policy.max_batch_tokens

    @property
    def cache_bytes_held(self) -> int:
        """Bytes of the condition caches the admitted requests hold (0 when not counted)."""
        return sum(entry.cache_bytes for entry in self.entries.values() if entry.admitted)

    def cache_stats(self) -> ConditionCacheStats | None:
        """The condition caches' figures; None when they are not counted (``cache_bytes`` unset)."""
        if self.cache_bytes is None:
            return None
        return ConditionCacheStats(self.cache_bytes_held, self.cache_memory_bytes, self.num_cache_waiting)

    # --- the scheduler contract ------------------------------------------------------------------------------------

    def add_request(self, request: DenoiseRequest) -> None:
        """Raises EngineError, holding nothing, when the request's condition cache alone passes the budget."""
        assert request.request_id not in self.entries, f"duplicate request id {request.request_id}"
        cache_bytes = self.cache_bytes(request) if self.cache_bytes is not None else 0
        if self.cache_memory_bytes is not None and cache_bytes > self.cache_memory_bytes:
            raise EngineError(f"request {request.request_id}: its condition cache takes {cache_bytes} bytes, more than "
                              f"the DiT's whole budget for them (dit.cache_memory_bytes: {self.cache_memory_bytes} "
                              "bytes): it could never run")
        priority, tenant = self.policy.priority_and_tenant(request)
        self.entries[request.request_id] = _Entry(
            request, request.batch_key, request.work_tokens, 2 if request.params.true_cfg else 1,
            request.params.cache is not None, priority, tenant, self.num_turns, self.num_arrivals, cache_bytes)
        self.num_arrivals += 1

    def finish_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            entry = self.entries.pop(request_id, None)
            if entry is not None and entry.admitted:
                self.freed_ids.append(request_id)
        self._forget_idle_keys()

    def schedule(self) -> DenoiseBatch:
        freed = self.take_freed_ids()
        self._age()
        admissible = self._admissible([e for e in self.entries.values() if not e.admitted])
        plan = self._plan([e for e in self.entries.values() if e.admitted or id(e) in admissible])
        max_paused = self.policy.max_paused
        if plan is not None and max_paused is not None and self._paused_after(plan.rows) > max_paused:
            plan = self._plan([e for e in self.entries.values() if e.admitted])  # the queue waits instead
        self.num_steps += 1
        self.num_turns += 1 if plan is None else self._turns_taken(plan)
        if plan is None:
            self.current_key = None
            self.last_step_tokens = self.num_paused = 0
            return DenoiseBatch(new_requests=[], request_ids=[], freed_ids=freed)
        rows: list[_Entry] = sorted(plan.rows, key=lambda entry: entry.seq)
        most_urgent = min(entry.priority for entry in rows)
        ran = {id(entry) for entry in rows}
        self.passed_over = [e for e in self.entries.values() if e.priority > most_urgent and id(e) not in ran]
        new = [entry.request for entry in rows if not entry.admitted]
        self.shares.charge(rows, cost=_tokens)
        for entry in rows:
            entry.admitted = True
        self.current_key = rows[0].key
        self.last_served[self.current_key] = self.num_turns
        self.last_step_tokens = plan.tokens
        self.batch_sizes[len(rows)] += 1
        self.splits[plan.split] += 1
        self.num_paused = sum(entry.admitted for entry in self.entries.values()) - len(rows)
        self.num_paused_steps += self.num_paused
        return DenoiseBatch(new_requests=new, request_ids=[entry.request.request_id for entry in rows],
                            freed_ids=freed, split=plan.split)

    def update_from_output(self, scheduler_output: DenoiseBatch, runner_output: DenoiseOutput
                           ) -> list[EngineCoreOutput]:
        outputs = [
            EngineCoreOutput(request_id, progress=progress, preview=runner_output.previews.get(request_id))
            for request_id, progress in runner_output.progress.items()
            if request_id not in runner_output.finished
        ]
        for request_id, latents in runner_output.finished.items():
            outputs.append(EngineCoreOutput(request_id, latents, "stop", progress=runner_output.progress[request_id]))
        outputs += [EngineCoreOutput.failed(request_id, error) for request_id, error in runner_output.errors.items()]
        for output in outputs:
            if output.finished:
                self.entries.pop(output.request_id, None)
        self._forget_idle_keys()
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.entries)

    def has_finished_requests(self) -> bool:
        return bool(self.freed_ids)

    def take_freed_ids(self) -> list[str]:
        """The requests that left the runner's care since the last step, handed out once: ``schedule()`` hands them
        to the runner with the step's batch, or the core before it removes an adapter (``DiTEngineCore``)."""
        freed, self.freed_ids = self.freed_ids, []
        return freed

    # --- the rules ------------------------------------------------------------------------------------------------

    def _plan(self, candidates: list[_Entry]) -> StepPlan | None:
        """The step among ``candidates``: its rows as far as they fit each split weighed, and the split chosen."""
        if not candidates:
            return None
        offered = self._turns(candidates, self.max_batch_size)  # no step holds more
        plans = {split: self.shapes[split].plan(offered) for split in self.split.splits}
        if "rows" in plans and any(entry.cached for entry in plans["rows"].rows):
            return plans.get("sequence") or self.shapes["sequence"].plan(offered)
        return plans[self.split.choose(plans)]

    def _admissible(self, waiting: list[_Entry]) -> set[int]:
        """The ``id`` of each waiting request this step may admit: all of them without a cache budget; with one,
        those taken in turn order (``_in_turn``) until the first whose cache does not fit the room the admitted ones
        leave (and those before it take)."""
        if self.cache_memory_bytes is None:
            self.num_cache_waiting = 0
            return {id(entry) for entry in waiting}
        room = self.cache_memory_bytes - self.cache_bytes_held
        admissible: set[int] = set()
        for entry in self._in_turn(waiting, self._urgency(waiting), len(waiting)):
            if entry.cache_bytes > room:
                break
            room -= entry.cache_bytes
            admissible.add(id(entry))
        self.num_cache_waiting = len(waiting) - len(admissible)
        return admissible

    def _urgency(self, entries: list[_Entry]) -> dict[int, int]:
        """``id`` of each entry -> its effective priority."""
        return {id(entry): self.policy.effective_priority(entry.priority, entry.starved_s) for entry in entries}

    def _turns(self, candidates: list[_Entry], limit: int) -> list[_Entry]:
        """Up to ``limit`` of the key's rows among ``candidates`` in the order a step takes them: by urgency and tenant
        turns."""
        urgency = self._urgency(candidates)
        key = self._pick_key(candidates, urgency)
        return self._in_turn([e for e in candidates if e.key == key], urgency, limit)

    def _in_turn(self, entries: list[_Entry], urgency: dict[int, int], limit: int) -> list[_Entry]:
        """Up to ``limit`` of ``entries`` in the order a step takes rows: by urgency; within it, each to the tenant
        that used the DiT least lately, a tenant's admitted requests before its waiting ones, oldest first."""
        mine = sorted(entries, key=lambda e: (not e.admitted, e.seq))  # a tenant's own order
        return self.shares.in_turn(mine, _tokens, limit, level=lambda e: urgency[id(e)])

    def _age(self) -> None:
        """Adds the time since the last step to the requests that step passed over for more urgent ones."""
        now = self.clock()
        if self.last_step_at is not None:
            for entry in self.passed_over:
                entry.starved_s += now - self.last_step_at
        self.last_step_at, self.passed_over = now, []

    def _pick_key(self, candidates: list[_Entry], urgency: dict[int, int]) -> BatchKey:
        """The current key while it holds the most urgent priority and no other key of that priority has waited
        too long; else the key of that priority that waited longest."""
        best = min(urgency.values())
        keys = {entry.key for entry in candidates if urgency[id(entry)] == best}
        if self.current_key in keys:
            starving = [key for key in keys if key != self.current_key and self._waited(key) >= self.max_wait_steps]
            if not starving:
                return self.current_key
            keys = set(starving)
        return min(keys, key=lambda key: (-self._waited(key), self._oldest(key)[1]))

    def _waited(self, key: BatchKey) -> float:
        """Turns run without the key since it last ran, or since its oldest request arrived if that was later."""
        return self.num_turns - max(self.last_served.get(key, 0.0), self._oldest(key)[0])

    def _oldest(self, key: BatchKey) -> tuple[float, int]:
        """(arrival step, arrival number) of the key's oldest request."""
        return min((e.arrived_turn, e.seq) for e in self.entries.values() if e.key == key)

    def _turns_taken(self, plan: StepPlan) -> float:
        """The turns a step counts for in other keys' wait: one, or for a rows step the sequence steps its rows
        would take (two large true-CFG rows, a pass a rank, count two)."""
        if plan.split != "rows":
            return 1.0
        first = plan.rows[0]
        return max(1.0, len(plan.rows) / self.shapes["sequence"].depth(first.tokens, first.passes))

    def _paused_after(self, rows: list[_Entry]) -> int:
        """Admitted requests that would sit outside a step running ``rows``."""
        return sum(entry.admitted for entry in self.entries.values()) + sum(not e.admitted for e in rows) - len(rows)

    def _forget_idle_keys(self) -> None:
        """Keeps no trace of keys and tenants without requests."""
        keys = {entry.key for entry in self.entries.values()}
        for key in [key for key in self.last_served if key not in keys]:
            del self.last_served[key]
        self.shares.forget({entry.tenant for entry in self.entries.values()})


def _tokens(entry: _Entry) -> int:
    return entry.tokens
