"""The DiT's load figures (step times learned from its steps, work in cost-seconds, finish estimates) and what reads
them in Serve: the least-work router's order and the autoscaling policy. No model, no cluster."""

import asyncio
from types import SimpleNamespace

import pytest

from deployments.autoscaling import QueuedWorkPolicy
from deployments.routing import LeastWorkRouter
from omni_ray.engine.dit_load import DiTLoad, StepTimes


def test_step_times_learn_the_overhead_and_the_cost_per_token_from_the_steps_run():
    times = StepTimes()
    for tokens in (1000, 2000, 4000, 1000, 3000):
        times.observe(tokens, 0.07 + 2e-5 * tokens)
    overhead, per_token = times.fit
    assert overhead == pytest.approx(0.07, rel=1e-6) and per_token == pytest.approx(2e-5, rel=1e-6)
    times.observe(2000, 30.0)  # a step that compiled: left out
    assert times.seconds(2000) == pytest.approx(0.11, rel=1e-6)
    one_size = StepTimes()
    one_size.observe(500, 0.5)
    assert one_size.fit == (0.0, 0.001)  # one size seen: proportional


def test_a_replica_s_first_step_is_left_out_of_its_step_times():
    """The first step a DiT core runs pays one-time costs: counted, it made a new replica's estimates refuse
    requests (503) while it was the only step seen."""
    from omni_ray.engine.core import DiTEngineCore
    from omni_ray.engine.output import EngineCoreOutput

    clock = SimpleNamespace(now=0.0, durations=iter([20.0, 0.2, 0.4]))
    scheduler = SimpleNamespace(has_requests=lambda: True, last_step_tokens=1000,
                                schedule=lambda: SimpleNamespace(request_ids=["r"]),
                                update_from_output=lambda *_: [EngineCoreOutput("r", None, None)])

    def execute_model(_):
        clock.now += next(clock.durations)

    core = DiTEngineCore(scheduler, SimpleNamespace(execute_model=execute_model), clock=lambda: clock.now)
    core.step()
    assert core.step_times.num_steps == 0  # the 20 s cold step
    core.step()
    scheduler.last_step_tokens = 2000
    core.step()
    assert core.step_times.fit == pytest.approx((0.0, 2e-4))


def test_a_step_ten_times_faster_than_the_fit_starts_it_again():
    """Steps slowed by a machine busy starting other replicas, or a proportional fit from small steps that are all
    overhead, once made the estimates refuse requests that would have finished in seconds (503)."""
    warm_up = StepTimes()
    for _ in range(3):
        warm_up.observe(100, 5.0)
    warm_up.observe(100, 0.01)
    assert warm_up.num_steps == 1 and warm_up.seconds(100) == pytest.approx(0.01)
    small = StepTimes()
    for _ in range(8):
        small.observe(40, 0.02)  # tiny steps, all overhead: 0.5 ms a token, proportional
    small.observe(1100, 0.03)  # a 512x512 one: the fit said 0.55 s
    assert small.num_steps == 1 and small.max_tokens == 1100 and small.seconds(1100) == pytest.approx(0.03)


def test_an_estimate_refuses_no_request_much_larger_than_the_steps_the_fit_saw():
    times = StepTimes()
    for tokens in (40, 80) * 4:
        times.observe(tokens, 0.02 + 1e-4 * tokens)
    load = DiTLoad(times.snapshot, max_batch_size=1, max_batch_tokens=None)
    assert times.snapshot().max_tokens == 80
    assert load.estimate(priority=0, tokens=160, steps=20) == pytest.approx(20 * (0.02 + 0.016))
    assert load.estimate(priority=0, tokens=161, steps=20) == 0  # a line through 40 and 80 tokens says little of it


def test_work_counts_remaining_steps_at_the_depth_each_key_batches_and_estimates_by_priority():
    times = StepTimes()
    for tokens in (1000, 3000) * 3 + (1000,):
        times.observe(tokens, 0.1 + 1e-4 * tokens)
    clock = SimpleNamespace(now=0.0)
    early = DiTLoad(times.snapshot, max_batch_size=8, max_batch_tokens=4000, clock=lambda: clock.now)
    early.add("batch", priority=1, tokens=8000, steps=50)
    assert early.estimate(priority=1, tokens=2000, steps=20) == 0  # 7 steps: too few to refuse anyone on
    times.observe(3000, 0.1 + 1e-4 * 3000)
    clock.monotonic = lambda: clock.now
    load = DiTLoad(times.snapshot, max_batch_size=8, max_batch_tokens=4000, clock=clock.monotonic)
    assert load.row_seconds(2000) == pytest.approx(0.1 / 2 + 0.2)  # two rows of 2000 tokens fit a step
    assert load.row_seconds(8000) == pytest.approx(0.1 + 0.8)  # alone in its step
    load.add("batch", priority=1, tokens=8000, steps=50)
    load.add("urgent", priority=0, tokens=2000, steps=20)
    load.progress("batch", 10, 50)
    assert load.seconds() == pytest.approx(40 * 0.9 + 20 * 0.25)
    clock.now += 61  # the two arrived long ago: no rate of work arriving
    # A priority-0 request waits only for priority-0 work (it pauses the rest); a priority-1 one for both. Its own
    # steps count as full ones (rows that arrive later share them): two rows of 2000 tokens, 0.5 s.
    assert load.full_steps_seconds(2000) == pytest.approx(0.1 + 2 * 0.2)
    assert load.estimate(priority=0, tokens=2000, steps=20) == pytest.approx(5 + 20 * 0.5)
    assert load.estimate(priority=1, tokens=2000, steps=20, images=2) == pytest.approx(36 + 5 + 20 * 0.5)
    assert load.estimate(priority=1, tokens=2000, steps=20, images=3) == pytest.approx(36 + 5 + 2 * 20 * 0.5)
    load.remove("batch")
    load.remove("urgent")
    assert load.seconds() == 0
    fifo = DiTLoad(times.snapshot, max_batch_size=8, max_batch_tokens=4000, by_priority=False, clock=clock.monotonic)
    fifo.add("batch", priority=1, tokens=8000, steps=50)
    clock.now += 61
    assert fifo.estimate(priority=0, tokens=2000, steps=20) == pytest.approx(45 + 10)  # FIFO: everything is ahead
    assert DiTLoad(StepTimes().snapshot, 8, None).estimate(0, 2000, 20) == 0  # nothing learned yet: refuses nothing


def replica(name, work, at=1.0, request_s=2.0):
    return SimpleNamespace(replica_id=name, routing_stats={"queued_work_s": work, "at": at, "request_s": request_s})


def bare_router(replicas):
    """The router's own logic on fake replicas: Serve's constructor (a controller and handles) is not the subject."""
    router = LeastWorkRouter.__new__(LeastWorkRouter)
    router.initialize_state()
    router._replica_queue_len_cache = SimpleNamespace(get=lambda replica_id: None)
    router._replicas = {r.replica_id: r for r in replicas}
    return router


def test_the_router_ranks_replicas_by_work_counting_calls_sent_since_their_last_report():
    busy, idle, middle = replica("busy", 30.0), replica("idle", 1.0), replica("middle", 6.0)
    router = bare_router([busy, idle, middle])
    ranks = asyncio.run(router.choose_replicas([busy, idle, middle]))
    assert [[r.replica_id for r in rank] for rank in ranks] == [["idle"], ["middle"], ["busy"]]
    denoise = SimpleNamespace(args=["r1-0"], kwargs={},
                              metadata=SimpleNamespace(call_method="denoise", multiplexed_model_id=""))
    for _ in range(3):  # three denoise calls to "idle" since its report: 1 + 3 x 2 s of work
        router.on_request_routed(denoise, "idle", None)
    assert [r.replica_id for [r] in asyncio.run(router.choose_replicas([busy, idle, middle], denoise))] == [
        "middle", "idle", "busy"]
    idle.routing_stats = {"queued_work_s": 1.0, "at": 2.0, "request_s": 2.0}  # a new report counts them itself
    assert router._work(idle) == (1.0, 0)


def test_a_stack_goes_first_to_the_replicas_holding_more_of_its_adapters_then_to_the_least_loaded():
    replicas = [replica("none-busy", 9.0), replica("one", 5.0), replica("both", 8.0), replica("both-idle", 1.0),
                replica("none-idle", 0.5), replica("other", 0.1)]
    held = {"none-busy": {"C", "D"}, "one": {"B", "C"}, "both": {"A", "B"}, "both-idle": {"B", "A"},
            "none-idle": set(), "other": {"C"}}
    for r in replicas:
        r.multiplexed_model_ids = held[r.replica_id]
    router = bare_router(replicas)
    router._get_replica_ids_with_fewest_multiplexed_models = lambda: {"none-idle"}
    stack = SimpleNamespace(args=["r1"], kwargs={}, metadata=SimpleNamespace(call_method="estimate",
                                                                             multiplexed_model_id="A,B"))
    assert [r.replica_id for [r] in asyncio.run(router.choose_replicas(replicas, stack))] == [
        "both-idle", "both", "one", "none-idle", "other", "none-busy"]


def test_the_autoscaling_policy_asks_for_the_work_over_its_target():
    policy = QueuedWorkPolicy(target_work_s=20)
    context = SimpleNamespace(aggregated_metrics={"queued_work_s": {"a": 35.0, "b": 25.0}}, target_num_replicas=2)
    assert policy(context) == (3.0, {})
    assert policy(SimpleNamespace(aggregated_metrics={}, target_num_replicas=2)) == (2, {})
