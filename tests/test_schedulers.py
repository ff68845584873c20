"""The DiT and VAE schedulers, driven by hand-built runner outputs: no model, no tensors beyond placeholders."""

import torch

from omni_ray.engine.dit_policy import FifoPolicy, PriorityPolicy
from omni_ray.engine.dit_scheduler import DiTScheduler
from omni_ray.engine.vae_scheduler import VaeScheduler
from omni_ray.records import (
    Decoded,
    DecodeRequest,
    DenoiseBatch,
    DenoiseOutput,
    DenoiseParams,
    DenoiseRequest,
    Latents,
    PromptEmbeds,
    VaeOutput,
)

SQUARE, WIDE = (64, 64), (64, 96)


def request(request_id, steps, size=SQUARE, cfg=False, priority=0, tenant=""):
    """A request of ``steps`` steps; its work is 16 image tokens (64x64) plus 3 text tokens a pass: 19, or 38 with
    true CFG."""
    negative = PromptEmbeds(torch.zeros(2, 4)) if cfg else None
    params = DenoiseParams(size[0], size[1], steps, seed=0, true_cfg_scale=4.0 if cfg else 1.0, true_cfg=cfg,
                           priority=priority, tenant=tenant)
    return DenoiseRequest(request_id, params, PromptEmbeds(torch.zeros(3, 4)), negative)


class FakeRunner:
    """Counts steps per request the way DenoiseRunner does, and fails the requests it is told to."""

    def __init__(self, fail=()):
        self.steps: dict[str, tuple[int, int]] = {}
        self.fail = set(fail)
        self.batches: list[DenoiseBatch] = []

    def execute_model(self, batch: DenoiseBatch) -> DenoiseOutput:
        self.batches.append(batch)
        for request_id in batch.freed_ids:
            del self.steps[request_id]
        output = DenoiseOutput(finished={}, errors={}, progress={})
        for new in batch.new_requests:
            if new.request_id in self.fail:
                output.errors[new.request_id] = "boom"
            else:
                self.steps[new.request_id] = (0, new.params.num_inference_steps)
        for request_id in batch.request_ids:
            if request_id not in self.steps:
                continue
            done, total = self.steps[request_id]
            self.steps[request_id] = (done + 1, total)
            output.progress[request_id] = (done + 1, total)
            if done + 1 == total:
                output.finished[request_id] = Latents(torch.zeros(1), 64, 64)
                del self.steps[request_id]
        return output


def step(scheduler, runner):
    """One engine step, as EngineCore.step runs it; returns (ids stepped, outputs)."""
    batch = scheduler.schedule()
    outputs = scheduler.update_from_output(batch, runner.execute_model(batch))
    return batch.request_ids, outputs


def run(scheduler, runner, num_steps):
    return [step(scheduler, runner)[0] for _ in range(num_steps)]


def assert_no_trace(scheduler, runner):
    assert not scheduler.has_requests()
    held = (scheduler.entries, scheduler.last_served, scheduler.shares.served)
    assert not any(held) and scheduler.freed_ids == []
    assert runner.steps == {}


def test_mixed_step_counts_leave_when_done():
    scheduler, runner = DiTScheduler(max_batch_size=8, max_wait_steps=4), FakeRunner()
    for request_id, steps in [("a", 2), ("b", 4), ("c", 3)]:
        scheduler.add_request(request(request_id, steps))
    assert run(scheduler, runner, 4) == [["a", "b", "c"], ["a", "b", "c"], ["b", "c"], ["b"]]
    assert_no_trace(scheduler, runner)


def test_new_requests_join_at_step_boundaries():
    scheduler, runner = DiTScheduler(max_batch_size=8, max_wait_steps=4), FakeRunner()
    scheduler.add_request(request("a", 3))
    assert run(scheduler, runner, 1) == [["a"]]
    scheduler.add_request(request("b", 2))
    ids, outputs = step(scheduler, runner)
    assert ids == ["a", "b"] and [r.request_id for r in runner.batches[-1].new_requests] == ["b"]
    assert [(o.request_id, o.progress, o.finished) for o in outputs] == [("a", (2, 3), False), ("b", (1, 2), False)]
    ids, outputs = step(scheduler, runner)
    assert ids == ["a", "b"]
    assert sorted(o.request_id for o in outputs if o.finished) == ["a", "b"]
    assert all(o.finish_reason == "stop" and isinstance(o.result, Latents) for o in outputs)
    assert_no_trace(scheduler, runner)


def test_batch_limit_admits_waiting_requests_as_slots_free():
    scheduler, runner = DiTScheduler(max_batch_size=2, max_wait_steps=4), FakeRunner()
    for request_id, steps in [("a", 1), ("b", 3), ("c", 2), ("d", 1)]:
        scheduler.add_request(request(request_id, steps))
    assert run(scheduler, runner, 4) == [["a", "b"], ["b", "c"], ["b", "c"], ["d"]]
    assert_no_trace(scheduler, runner)


def test_keys_never_share_a_batch_and_a_waiting_key_runs_when_the_running_one_drains():
    scheduler, runner = DiTScheduler(max_batch_size=8, max_wait_steps=10), FakeRunner()
    scheduler.add_request(request("a", 2))
    scheduler.add_request(request("wide", 2, size=WIDE))
    scheduler.add_request(request("b", 2))
    scheduler.add_request(request("cfg", 1, cfg=True))
    assert run(scheduler, runner, 5) == [["a", "b"], ["a", "b"], ["wide"], ["wide"], ["cfg"]]
    assert_no_trace(scheduler, runner)


def test_a_waiting_key_gets_the_engine_after_max_wait_steps():
    scheduler, runner = DiTScheduler(max_batch_size=8, max_wait_steps=2), FakeRunner()
    scheduler.add_request(request("long", 6))
    assert run(scheduler, runner, 1) == [["long"]]
    scheduler.add_request(request("wide", 3, size=WIDE))
    # "wide" waits two steps, then the keys take turns: each runs until the other has waited two steps.
    assert run(scheduler, runner, 8) == [
        ["long"], ["long"], ["wide"], ["wide"], ["long"], ["long"], ["wide"], ["long"],
    ]
    assert_no_trace(scheduler, runner)


def test_abort_running_and_waiting_requests():
    scheduler, runner = DiTScheduler(max_batch_size=2, max_wait_steps=4), FakeRunner()
    for request_id in "abc":
        scheduler.add_request(request(request_id, 4))
    assert run(scheduler, runner, 1) == [["a", "b"]]
    scheduler.finish_requests(["b", "c", "unknown"])  # b runs, c waits
    ids, _ = step(scheduler, runner)
    assert ids == ["a"] and runner.batches[-1].freed_ids == ["b"]
    assert "b" not in runner.steps
    assert run(scheduler, runner, 2) == [["a"], ["a"]]
    assert_no_trace(scheduler, runner)


def test_abort_of_the_last_request_still_frees_the_runner():
    scheduler, runner = DiTScheduler(max_batch_size=2, max_wait_steps=4), FakeRunner()
    scheduler.add_request(request("a", 4))
    run(scheduler, runner, 1)
    scheduler.finish_requests(["a"])
    assert not scheduler.has_unfinished_requests() and scheduler.has_requests()
    assert step(scheduler, runner)[0] == []
    assert_no_trace(scheduler, runner)


def test_a_failed_request_leaves_alone():
    scheduler, runner = DiTScheduler(max_batch_size=4, max_wait_steps=4), FakeRunner(fail={"bad"})
    scheduler.add_request(request("ok", 2))
    scheduler.add_request(request("bad", 2))
    ids, outputs = step(scheduler, runner)
    assert ids == ["ok", "bad"]
    errors = [o for o in outputs if o.finish_reason == "error"]
    assert [(o.request_id, o.error) for o in errors] == [("bad", "boom")]
    assert run(scheduler, runner, 1) == [["ok"]]
    assert_no_trace(scheduler, runner)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_step_takes_rows_within_its_token_budget_and_its_first_row_always():
    assert request("a", 1).work_tokens == 19 and request("a", 1, cfg=True).work_tokens == 38
    scheduler = DiTScheduler(max_batch_size=8, max_wait_steps=4, policy=PriorityPolicy(max_batch_tokens=40))
    runner = FakeRunner()
    for request_id in "abc":
        scheduler.add_request(request(request_id, 2))
    assert run(scheduler, runner, 4) == [["a", "b"], ["a", "b"], ["c"], ["c"]]
    assert scheduler.last_step_tokens == 19
    big = DiTScheduler(max_batch_size=8, max_wait_steps=4, policy=PriorityPolicy(max_batch_tokens=20))
    for request_id in "xy":
        big.add_request(request(request_id, 1, cfg=True))  # 38 tokens each: over the budget alone
    assert run(big, FakeRunner(), 2) == [["x"], ["y"]]


def test_an_urgent_request_pauses_running_ones_at_the_step_boundary_and_they_resume_where_they_were():
    scheduler, runner = DiTScheduler(max_batch_size=2, max_wait_steps=4), FakeRunner()
    scheduler.add_request(request("batch1", 4, priority=1))
    scheduler.add_request(request("batch2", 4, priority=1))
    assert run(scheduler, runner, 2) == [["batch1", "batch2"], ["batch1", "batch2"]]
    scheduler.add_request(request("urgent", 2, priority=0))
    ids, _ = step(scheduler, runner)
    assert ids == ["batch1", "urgent"] and scheduler.num_paused == 1  # batch2 sits this step out
    ids, _ = step(scheduler, runner)
    assert ids == ["batch1", "urgent"]
    # batch2 goes on from its third step: its state stayed in the runner, nothing restarted.
    assert runner.steps["batch2"] == (2, 4) and [r.request_id for r in runner.batches[-1].new_requests] == []
    assert run(scheduler, runner, 2) == [["batch2"], ["batch2"]]  # batch1 was done with "urgent"
    assert scheduler.num_paused_steps == 2
    assert_no_trace(scheduler, runner)


def test_an_urgent_request_of_another_size_takes_the_engine_at_once():
    scheduler, runner = DiTScheduler(max_batch_size=8, max_wait_steps=100), FakeRunner()
    scheduler.add_request(request("big", 5, size=WIDE, priority=1))
    run(scheduler, runner, 1)
    scheduler.add_request(request("small", 2, priority=0))
    assert run(scheduler, runner, 6) == [["small"], ["small"], ["big"], ["big"], ["big"], ["big"]]
    assert_no_trace(scheduler, runner)


def test_rows_go_round_robin_over_tenants_so_a_flood_does_not_starve_a_light_tenant():
    scheduler, runner = DiTScheduler(max_batch_size=2, max_wait_steps=4), FakeRunner()
    for i in range(6):
        scheduler.add_request(request(f"heavy{i}", 3, tenant="heavy"))
    assert run(scheduler, runner, 1) == [["heavy0", "heavy1"]]
    scheduler.add_request(request("light", 3, tenant="light"))
    # The light tenant's request takes a row at the next step (heavy1 pauses); the heavy tenant keeps the other.
    assert run(scheduler, runner, 3) == [["heavy0", "light"], ["heavy0", "light"], ["heavy1", "light"]]
    assert runner.steps["heavy1"] == (2, 3)  # it went on from its second step
    assert run(scheduler, runner, 1) == [["heavy1", "heavy2"]]
    fifo = DiTScheduler(max_batch_size=2, max_wait_steps=4, policy=FifoPolicy())
    for i in range(4):
        fifo.add_request(request(f"heavy{i}", 1, tenant="heavy"))
    fifo.add_request(request("light", 1, tenant="light"))
    assert run(fifo, FakeRunner(), 3) == [["heavy0", "heavy1"], ["heavy2", "heavy3"], ["light"]]


def test_waiting_ages_a_request_up_a_priority_level_every_aging_period_so_nothing_starves():
    clock = Clock()
    scheduler = DiTScheduler(max_batch_size=1, max_wait_steps=100, policy=PriorityPolicy(aging_s=10), clock=clock)
    runner = FakeRunner()
    scheduler.add_request(request("batch", 1, priority=2))
    stepped = []
    for second in range(0, 40, 5):  # an urgent request every 5 s, each taking the engine at once
        clock.now = second
        scheduler.add_request(request(f"urgent{second}", 1))
        stepped += run(scheduler, runner, 1)
    # At 20 s "batch" has waited two periods: priority 0 as the urgent request of 20 s, and older, so it runs first.
    assert stepped[:6] == [["urgent0"], ["urgent5"], ["urgent10"], ["urgent15"], ["batch"], ["urgent20"]]
    # Waiting behind requests as urgent as itself ages nothing: a flood of batch work never outranks an urgent request.
    clock.now = 0
    flood = DiTScheduler(max_batch_size=1, max_wait_steps=100, policy=PriorityPolicy(aging_s=10), clock=clock)
    for i in range(3):
        flood.add_request(request(f"batch{i}", 5, priority=1))
    for _ in range(6):
        clock.now += 100
        run(flood, runner, 1)
    flood.add_request(request("urgent", 1))
    assert run(flood, runner, 2) == [["urgent"], ["batch1"]]


def test_no_new_request_is_admitted_while_more_than_max_paused_would_sit_out():
    scheduler = DiTScheduler(max_batch_size=1, max_wait_steps=100, policy=PriorityPolicy(max_paused=1))
    runner = FakeRunner()
    scheduler.add_request(request("low", 3, priority=2))
    run(scheduler, runner, 1)
    scheduler.add_request(request("mid", 3, priority=1))
    assert run(scheduler, runner, 1) == [["mid"]] and scheduler.num_paused == 1
    scheduler.add_request(request("high", 2, priority=0))
    # Admitting "high" would leave two paused: it waits (holding no state) until "mid" is done.
    assert run(scheduler, runner, 5) == [["mid"], ["mid"], ["high"], ["high"], ["low"]]
    assert scheduler.num_paused == 0


def test_fifo_ignores_priorities_and_budgets():
    scheduler, runner = DiTScheduler(max_batch_size=2, max_wait_steps=4, policy=FifoPolicy()), FakeRunner()
    scheduler.add_request(request("first", 2, priority=5))
    scheduler.add_request(request("second", 2, priority=5))
    scheduler.add_request(request("urgent", 1, priority=0))
    assert run(scheduler, runner, 3) == [["first", "second"], ["first", "second"], ["urgent"]]


def test_the_same_requests_run_by_priority_tenant_and_budget_under_one_policy_and_in_arrival_order_under_the_other():
    def schedule(policy):
        scheduler, runner = DiTScheduler(max_batch_size=4, max_wait_steps=4, policy=policy), FakeRunner()
        for i in range(3):
            scheduler.add_request(request(f"heavy{i}", 1, priority=1, tenant="heavy"))
        scheduler.add_request(request("light", 1, priority=1, tenant="light"))
        scheduler.add_request(request("urgent", 1, priority=0, tenant="heavy"))
        return scheduler, run(scheduler, runner, 3)

    # The urgent request first, the light tenant's before the heavy one's older ones, two rows of 19 tokens a step.
    by_priority, stepped = schedule(PriorityPolicy(max_batch_tokens=38))
    assert stepped == [["light", "urgent"], ["heavy0", "heavy1"], ["heavy2"]]
    assert by_priority.policy.by_priority and by_priority.max_batch_tokens == 38
    fifo, stepped = schedule(FifoPolicy())
    assert stepped == [["heavy0", "heavy1", "heavy2", "light"], ["urgent"], []]
    assert not fifo.policy.by_priority and fifo.max_batch_tokens is None


def decode_request(request_id, size):
    return DecodeRequest(request_id, Latents(torch.zeros(1), *size))


def test_vae_batches_same_size_oldest_first():
    scheduler = VaeScheduler(max_batch_size=2)
    for request_id, size in [("a", SQUARE), ("w1", WIDE), ("b", SQUARE), ("c", SQUARE), ("w2", WIDE)]:
        scheduler.add_request(decode_request(request_id, size))
    scheduler.finish_requests(["c"])
    batches = []
    while scheduler.has_requests():
        batch = scheduler.schedule()
        batches.append([r.request_id for r in batch.requests])
        result = VaeOutput(finished={r.request_id: Decoded(None, None) for r in batch.requests}, errors={})
        outputs = scheduler.update_from_output(batch, result)
        assert [o.request_id for o in outputs] == batches[-1] and all(o.finished for o in outputs)
    assert batches == [["a", "b"], ["w1", "w2"]]


def test_vae_decodes_previews_apart_from_final_images_and_after_them():
    scheduler = VaeScheduler(max_batch_size=4)
    scheduler.add_request(DecodeRequest("p1", Latents(torch.zeros(1), *SQUARE), preview=True))
    scheduler.add_request(decode_request("a", SQUARE))
    scheduler.add_request(DecodeRequest("p2", Latents(torch.zeros(1), *SQUARE), preview=True))
    scheduler.add_request(decode_request("b", SQUARE))
    batches = []
    while scheduler.has_requests():
        batch = scheduler.schedule()
        batches.append([r.request_id for r in batch.requests])
        scheduler.update_from_output(batch, VaeOutput(finished={r: Decoded(None, None) for r in batches[-1]}))
    assert batches == [["a", "b"], ["p1", "p2"]]
