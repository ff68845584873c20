"""Admission that holds, without models: the DiT's estimate counts requests admitted but not yet at the DiT (their
reservations), the steps that later requests share, and other tenants' turns; a burst of deadline requests against a
busy replica (the DiT's engine core over the simulated runner, on a virtual clock) is admitted only as far as it can
finish in time, the rest refused at once. The coordinator's budget (``Admission``) and the router's promise are here
too."""

import asyncio
from types import SimpleNamespace

import pytest
import torch
import yaml

from deployments.admission import UNKNOWN_OUTSIDE_S, Admission
from omni_ray.config import DiTConfig
from omni_ray.engine.builders import create_policy, create_split
from omni_ray.engine.core import DiTEngineCore
from omni_ray.engine.dit_load import ARRIVALS_WINDOW_S, DiTLoad, StepFit, StepTimes, size_key
from omni_ray.engine.dit_scheduler import DiTScheduler
from omni_ray.records import DenoiseParams, DenoiseRequest, PromptEmbeds
from omni_ray.runners.simulated import SimulatedDenoiser
from tests.test_dit_load import bare_router, replica

PROMPT = PromptEmbeds(torch.zeros(12, 3584, dtype=torch.bfloat16))
NEGATIVE = PromptEmbeds(torch.zeros(3, 3584, dtype=torch.bfloat16))


class Clock:
    """Time that passes only when the simulated runner sleeps, or the test says."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


def linear_load(clock, **kwargs) -> DiTLoad:
    """A load whose steps take 0.1 s plus 0.1 ms a token; two rows of 2000 tokens fit a step."""
    times = StepTimes()
    for tokens in (1000, 4000, 2000) * 3:  # past the steps a replica's estimates are trusted after, up to a full step
        times.observe(tokens, 0.1 + 1e-4 * tokens)
    return DiTLoad(times.snapshot, max_batch_size=8, max_batch_tokens=4000, clock=clock.monotonic, **kwargs)


def test_a_reservation_counts_until_its_calls_arrive_or_its_bound_passes():
    clock = Clock()
    load = linear_load(clock)
    alone = load.estimate(priority=1, tokens=8000, steps=10)
    assert alone == pytest.approx(10 * 0.9)  # its own steps, each a step of its own (8000 tokens fill one)
    assert load.admit("r1", budget_s=30, priority=1, tokens=8000, steps=10, images=2, deadline_s=30) == pytest.approx(
        2 * alone)
    assert load.seconds() == pytest.approx(2 * 10 * 0.9)  # counted before any of its calls is here
    assert load.estimate(priority=1, tokens=8000, steps=10) == pytest.approx(3 * alone)
    load.add("r1-0", priority=1, tokens=8000, steps=10)  # image 0 arrives: the reservation keeps image 1
    assert load.seconds() == pytest.approx(2 * 10 * 0.9)
    load.add("r1-1", priority=1, tokens=8000, steps=10)
    assert load.reserved == {} and load.seconds() == pytest.approx(2 * 10 * 0.9)
    assert load.admit("r2", budget_s=5, priority=1, tokens=8000, steps=10) > 5  # not admitted: nothing reserved
    assert load.reserved == {}
    load.admit("r3", budget_s=100, priority=1, tokens=8000, steps=10, deadline_s=20)  # its caller went away
    assert "r3" in load.reserved
    clock.now += 20
    assert load.seconds() == pytest.approx(2 * 10 * 0.9) and load.reserved == {}  # dropped at its deadline
    load.add("r30-0", priority=1, tokens=8000, steps=10)  # an id that merely starts like another's takes nothing
    load.admit("r4", budget_s=100, priority=1, tokens=8000, steps=10)
    load.add("r40-0", priority=1, tokens=8000, steps=10)
    assert "r4" in load.reserved


def test_the_estimate_counts_other_tenants_turns_later_arrivals_and_the_fits_error():
    clock = Clock()
    load = linear_load(clock)
    load.add("bulk-0", priority=1, tokens=8000, steps=100, tenant="bulk")  # 90 s of work
    clock.now += ARRIVALS_WINDOW_S + 1  # arrived long ago: no rate of arrivals, and its tenant is idle
    own = 10 * 0.9
    # Another tenant's work at its priority runs beside it, turn for turn, as long as its own: not all 90 s of it.
    assert load.estimate(priority=1, tokens=8000, steps=10, tenant="light") == pytest.approx(2 * own)
    assert load.estimate(priority=1, tokens=8000, steps=10, tenant="bulk") == pytest.approx(90 + own)  # behind its own
    fifo = linear_load(clock, by_priority=False)  # FIFO: everything held is ahead
    fifo.add("bulk-0", priority=1, tokens=8000, steps=100, tenant="bulk")
    clock.now += ARRIVALS_WINDOW_S + 1
    assert fifo.estimate(priority=0, tokens=8000, steps=10, tenant="light") == pytest.approx(90 + own)
    # More urgent work arriving at 1 s of work a 4 s leaves it three quarters of the DiT.
    for i in range(15):
        load.add(f"urgent{i}-0", priority=0, tokens=2000, steps=4, tenant="light")  # 1 s each: 4 steps of 0.25
        load.remove(f"urgent{i}-0")
        clock.now += 4
    assert load.estimate(priority=1, tokens=8000, steps=10, tenant="light") == pytest.approx(2 * own / 0.75)
    # Its own tenant's requests of its size batch beside it, not ahead of it, however long their prompts were (the
    # coordinator counts a prompt's tokens before the encoder does); those of another size take turns with it.
    large = size_key(1328, 1328, True)
    for i in range(4):
        load.add(f"same{i}-0", priority=1, tokens=8000 + 7 * i, steps=10, tenant="light", key=large)
        load.remove(f"same{i}-0")
    assert load.estimate(priority=1, tokens=8000, steps=10, tenant="light", key=large) == pytest.approx(2 * own / 0.75)
    assert load.estimate(priority=1, tokens=8000, steps=10, tenant="light", key=size_key(1024, 1024, True)
                         ) > 2 * own / 0.75
    # A tenant that sends a tenth of what the DiT does takes a tenth of it meanwhile, not a full share.
    shared = linear_load(clock)
    shared.add("heavy-0", priority=0, tokens=8000, steps=10, tenant="heavy")  # 9 s, held
    clock.now += ARRIVALS_WINDOW_S + 1
    for i in range(6):  # 1 s of work every 10 s
        shared.add(f"light{i}-0", priority=0, tokens=2000, steps=4, tenant="light")
        shared.remove(f"light{i}-0")
        clock.now += 10
    assert shared.estimate(priority=0, tokens=8000, steps=10, tenant="heavy") == pytest.approx((9 + own) / 0.9,
                                                                                              rel=1e-3)
    # Less urgent work that could age past it before its deadline counts too.
    aging = linear_load(clock, aging_s=120)
    aging.add("old-0", priority=2, tokens=8000, steps=10)
    clock.now += ARRIVALS_WINDOW_S + 1
    assert aging.estimate(priority=1, tokens=8000, steps=10, deadline_s=30) == pytest.approx(2 * own)
    assert linear_load(clock).estimate(priority=1, tokens=8000, steps=10, deadline_s=30) == pytest.approx(own)
    # Steps that ran slower than the fit said make every estimate longer by as much.
    slow = DiTLoad(lambda: StepFit(0.1, 1e-4, 10, slow=1.25), 8, 4000, clock=clock.monotonic)
    assert slow.estimate(priority=1, tokens=8000, steps=10) == pytest.approx(1.25 * own)


def test_step_times_learn_how_much_slower_than_their_line_some_sizes_run():
    times = StepTimes()
    for _ in range(30):  # a cost that grows with the square of the tokens: no line fits the three sizes
        for tokens in (2000, 4000, 14000):
            times.observe(tokens, 0.07 + 1e-5 * tokens + 1e-9 * tokens**2)
    fit = times.snapshot()
    worst = max((0.07 + 1e-5 * t + 1e-9 * t**2) / (fit.overhead_s + fit.per_token_s * t) for t in (2000, 4000, 14000))
    assert fit.slow == pytest.approx(worst, rel=0.02) and fit.slow > 1


# --- a burst of deadline requests against a busy replica -----------------------------------------------------------


def sim_stage() -> DiTConfig:
    dit = yaml.safe_load(open("stage_configs/qwen_image_sim.yaml").read())["dit"]
    return DiTConfig.model_validate(dit)


def request(request_id: str, size: int, steps: int, priority: int, tenant: str) -> DenoiseRequest:
    params = DenoiseParams(size, size, steps, seed=0, true_cfg_scale=4.0, true_cfg=True, priority=priority,
                           tenant=tenant)
    return DenoiseRequest(request_id, params, PROMPT, NEGATIVE)


def replay_burst(reserve: bool, scheduling: str = "priority", tenants: int = 1, delay_s: float = 2.0,
                 deadline_s: float = 100.0) -> tuple[list[float], int]:
    """A replica busy with bulk work (priority 1, another tenant) takes a burst of 12 deadline requests (1328x1328,
    50 steps, true CFG, priority 1; from ``tenants`` tenants) 0.1 s apart, each reaching the DiT ``delay_s`` after it
    was admitted (its prompt's encoding), so the whole burst is decided before the first is there. Returns the
    admitted requests' times to done (from admission) and how many were refused."""
    stage = sim_stage().model_copy(update={"scheduling": scheduling})
    clock = Clock()
    policy = create_policy(stage)
    scheduler = DiTScheduler(stage.max_batch_size, stage.max_wait_steps, policy, clock.monotonic, create_split(stage))
    core = DiTEngineCore(scheduler, SimulatedDenoiser(torch.bfloat16, clock=clock), clock.monotonic)
    load = DiTLoad(core.step_times.snapshot, stage.max_batch_size, policy.max_batch_tokens, policy.by_priority,
                   aging_s=stage.priority_aging_s if policy.by_priority else None, clock=clock.monotonic)
    arrivals: list[tuple[float, DenoiseRequest]] = []  # (time it reaches the DiT, request)
    admitted: dict[str, float] = {}  # request id -> admitted at
    done: dict[str, float] = {}
    refused = 0

    def add(req: DenoiseRequest) -> None:
        p = req.params
        load.add(req.request_id, p.priority, req.work_tokens, p.num_inference_steps, 2, p.tenant,
                 size_key(p.height, p.width, p.true_cfg))
        core.add_request(req)

    def step() -> None:
        for output in core.step():
            assert output.error is None
            if output.finished:
                load.remove(output.request_id)
                done[output.request_id] = clock.now
            elif output.progress is not None:
                load.progress(output.request_id, *output.progress)

    for i in range(3):  # the bulk: three large requests, then a few steps so the replica knows its step times
        add(request(f"bulk{i}-0", 1328, 50, 1, "bulk"))
    for _ in range(20):
        step()
    work_tokens = request("x", 1328, 50, 1, "x").work_tokens
    for i in range(12):
        key, tenant = f"burst{i}", f"burst{i % tenants}"
        budget = (deadline_s - 1.0) / 1.1  # what the coordinator leaves the DiT: 1 s for the other stages, 10%
        if reserve:
            estimate = load.admit(key, budget, 1, work_tokens, 50, 1, 2, tenant, deadline_s, size_key(1328, 1328, True))
        else:  # the estimate as it was: only what is at the DiT
            estimate = load.estimate(1, work_tokens, 50, 1, 2, tenant, deadline_s, size_key(1328, 1328, True))
        if estimate <= budget:
            admitted[f"{key}-0"] = clock.now
            arrivals.append((clock.now + delay_s, request(f"{key}-0", 1328, 50, 1, tenant)))
        else:
            refused += 1
        clock.now += 0.1
    while arrivals or core.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= clock.now:
            add(arrivals.pop(0)[1])
        if core.has_unfinished_requests():
            step()
        else:
            clock.now = arrivals[0][0]
    return [done[rid] - at for rid, at in admitted.items()], refused


# FIFO batches every request of a size into one step (no token budget): a request's steps are taken as full
# ones, 8 rows of 1328x1328, so it promises less and needs a longer deadline to admit one.
@pytest.mark.parametrize("scheduling,tenants,deadline_s", [("priority", 1, 100), ("priority", 3, 100),
                                                          ("fifo", 1, 200)])
def test_a_burst_of_deadline_requests_admits_what_can_finish_in_time_and_refuses_the_rest(scheduling, tenants,
                                                                                         deadline_s):
    times, refused = replay_burst(reserve=True, scheduling=scheduling, tenants=tenants, deadline_s=deadline_s)
    assert times and refused  # some admitted, some refused
    assert max(times) <= deadline_s, times  # every admitted one finished within its deadline
    if scheduling == "priority" and tenants == 1:
        assert len(times) >= 2  # a burst from one tenant queues up: more than one fits the deadline


def test_without_reservations_the_same_burst_is_admitted_past_what_the_dit_can_finish():
    times, _ = replay_burst(reserve=False)
    assert max(times) > 100.0  # the test above could fail


# --- the coordinator's budget and the router's promise -------------------------------------------------------------


def plan(height=512, n=1, timeout_s=30.0):
    return SimpleNamespace(height=height, width=height, inputs=None, control_images=(), layers=0, caption=None,
                           request=SimpleNamespace(n=n), timeout_s=timeout_s)


def test_the_budget_leaves_the_other_stages_their_measured_time_and_a_margin():
    admission = Admission(margin=0.1, margin_s=0.5)
    assert admission.budget_s(plan()) == pytest.approx((30 - UNKNOWN_OUTSIDE_S - 0.5) / 1.1)  # nothing seen yet
    admission.observe(plan(), image_s=3.0, dit_s=2.6)
    admission.observe(plan(), image_s=3.5, dit_s=2.7)
    assert admission.outside_s(plan()) == pytest.approx(0.8)  # the slowest of the last few
    assert admission.outside_s(plan(height=1328)) == pytest.approx(0.8)  # a kind not seen: the slowest of any
    admission.observe(plan(height=1328), image_s=21.0, dit_s=20.0)
    assert admission.budget_s(plan(height=1328)) == pytest.approx((30 - 1.0 - 0.5) / 1.1)


def test_the_router_sends_a_requests_calls_to_the_replica_that_admitted_it():
    busy, idle = replica("busy", 30.0), replica("idle", 1.0)
    router = bare_router([busy, idle])

    def call(method, *args, **kwargs):
        return SimpleNamespace(args=list(args), kwargs=kwargs,
                               metadata=SimpleNamespace(call_method=method, multiplexed_model_id=""))

    router.on_request_routed(call("estimate", 1, 2, reservation="r1"), "busy", None)  # admitted by "busy"
    order = asyncio.run(router.choose_replicas([busy, idle], call("denoise", "r1-0")))
    assert [r.replica_id for [r] in order] == ["busy", "idle"]  # though "idle" has less work by now
    retry = asyncio.run(router.choose_replicas([idle], call("denoise", "r1-0-retry1")))  # "busy" was lost
    assert [r.replica_id for [r] in retry] == ["idle"]
    other = asyncio.run(router.choose_replicas([busy, idle], call("denoise", "r10-0")))
    assert [r.replica_id for [r] in other] == ["idle", "busy"]
    # Refused after its admission (its key's quota): the release goes where the reservation is, and ends the promise.
    release = call("release", "r1")
    assert [r.replica_id for [r] in asyncio.run(router.choose_replicas([busy, idle], release))] == ["busy", "idle"]
    router.on_request_routed(release, "busy", None)
    assert "r1" not in router._promised


def test_a_released_reservation_no_longer_counts():
    load = DiTLoad(lambda: StepFit(0.1, 1e-4, 10), max_batch_size=1, max_batch_tokens=None)
    load.reserve("r1", 0, 64, 10)
    load.reserve("r2", 0, 64, 10)
    both = load.seconds()
    load.release("r1")
    load.release("never-reserved")  # a no-op
    assert list(load.reserved) == ["r2"] and load.seconds() == pytest.approx(both / 2)
