"""A DiT gang's split per step: the rule on the scheduler (hand-built runner outputs, no model, no sleeping), what a
step holds under each split and the load's depth. The simulated gang's step times: tests/test_simulated.py."""

from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import REPO
from test_schedulers import FakeRunner, request, run, step

from omni_ray.config import CacheSettings, DiTConfig, parse_config
from omni_ray.engine.dit_load import DiTLoad, StepTimes
from omni_ray.engine.dit_policy import PriorityPolicy
from omni_ray.engine.dit_scheduler import DiTScheduler
from omni_ray.engine.dit_split import FixedSplit, PerStepSplit, StepShape
from omni_ray.placement import stage_memory
from omni_ray.records import DenoiseParams, DenoiseRequest, PromptEmbeds

ROW, CFG_ROW = 19, 38  # request()'s work tokens: one pass of 19, or two with true CFG


def gang(split=None, step_tokens=160, ranks=4):
    """A scheduler for a gang of ``ranks`` ranks: 32 rows and ``step_tokens`` tokens a step (a quarter a rank)."""
    return DiTScheduler(32, 4, PriorityPolicy(max_batch_tokens=step_tokens), split=split or PerStepSplit(ranks))


def first_step(scheduler, *requests):
    for r in requests:
        scheduler.add_request(r)
    batch = scheduler.schedule()
    return batch.split, batch.request_ids


def urgent(count, cfg=False):
    return [request(f"u{i}", 3, cfg=cfg, priority=0) for i in range(count)]


def batch(count, cfg=False):
    return [request(f"b{i}", 3, cfg=cfg, priority=1) for i in range(count)]


def test_urgent_requests_run_sequence_unless_their_passes_fill_every_rank_evenly():
    # Alone, or fewer passes than ranks: rows would idle ranks and run each pass at one GPU's speed.
    assert first_step(gang(), *urgent(1)) == ("sequence", ["u0"])
    assert first_step(gang(), *urgent(3))[0] == "sequence"
    assert first_step(gang(), *urgent(1, cfg=True))[0] == "sequence"  # two passes on two of four ranks
    # A pass a rank: the same busiest rank as sequence, without the all-to-alls.
    scheduler = gang()
    assert first_step(scheduler, *urgent(4)) == ("rows", ["u0", "u1", "u2", "u3"])
    assert scheduler.last_step_tokens == 4 * ROW
    assert first_step(gang(), *urgent(2, cfg=True)) == ("rows", ["u0", "u1"])  # two true-CFG rows: four passes
    # Five passes on four ranks: the busiest would hold two where sequence runs one and a quarter.
    assert first_step(gang(), *urgent(5)) == ("sequence", [f"u{i}" for i in range(5)])
    # Two a rank (a rank's share, 40 tokens, holds two): eight rows either way, rows.
    scheduler = gang()
    split, ids = first_step(scheduler, *urgent(9))
    assert (split, len(ids)) == ("rows", 8) and scheduler.splits == {"rows": 1}


def test_passes_over_a_ranks_share_go_one_a_rank_for_batch_work_and_sequence_for_urgent_work():
    # True-CFG rows of two 19-token passes, a rank's share 15 tokens: sequence holds one row, rows a pass a rank.
    scheduler = gang(step_tokens=60)
    assert first_step(scheduler, *batch(3, cfg=True)) == ("rows", ["b0", "b1"])
    assert scheduler.last_step_tokens == 4 * ROW
    assert first_step(gang(step_tokens=60), *urgent(3, cfg=True)) == ("sequence", ["u0"])
    assert first_step(gang(step_tokens=60), *batch(1, cfg=True)) == ("sequence", ["b0"])  # two ranks would idle


def test_an_urgent_row_shares_an_even_rows_step_with_batch_rows_but_is_never_slowed_by_one():
    assert first_step(gang(), *urgent(1), *batch(3)) == ("rows", ["u0", "b0", "b1", "b2"])
    # Over a rank's share: rows would run the urgent row's passes at one GPU's speed beside a batch row's; sequence
    # runs it alone, over the four ranks.
    assert first_step(gang(step_tokens=60), *urgent(1, cfg=True), *batch(3, cfg=True)) == ("sequence", ["u0"])


def test_a_rows_step_counts_as_the_sequence_steps_its_rows_would_take_in_the_keys_turns():
    # Two true-CFG rows over a rank's share, a pass a rank: as many rows as two sequence steps, in one GPU's pass. A
    # key of the same priority gets its turn after as much work either way (max_wait_steps 4), sooner as rows.
    def keys_run(split):
        scheduler, runner = gang(split, step_tokens=60), FakeRunner()
        for r in [*batch(4, cfg=True), request("other", 3, size=(64, 128), priority=1)]:
            scheduler.add_request(r)
        return [ids[0][0] for ids in run(scheduler, runner, 5)]

    assert keys_run(None) == ["b", "b", "o", "o", "o"]  # two rows steps of two rows each, then the other key
    assert keys_run(FixedSplit("sequence", 4)) == ["b", "b", "b", "b", "o"]


def test_fixed_splits_run_every_step_one_way_within_the_same_bounds():
    assert first_step(gang(FixedSplit("rows", 4)), *urgent(1)) == ("rows", ["u0"])
    scheduler = gang(FixedSplit("sequence", 4))
    split, ids = first_step(scheduler, *urgent(9))
    assert (split, len(ids)) == ("sequence", 8) and scheduler.last_step_tokens == 8 * ROW
    assert first_step(gang(FixedSplit(), step_tokens=40), *urgent(3))[1] == ["u0", "u1"]  # one rank, as before


def test_a_step_holding_a_row_with_cache_acceleration_runs_sequence():
    def cached(request_id):
        params = DenoiseParams(64, 64, 3, seed=0, cache=CacheSettings(kind="teacache", threshold=0.2), priority=1)
        return DenoiseRequest(request_id, params, PromptEmbeds(torch.zeros(3, 4)))

    assert first_step(gang(FixedSplit("rows", 4)), cached("c0"), *batch(3)) == ("sequence", ["c0", "b0", "b1", "b2"])
    assert first_step(gang(), *batch(3), cached("c0"))[0] == "sequence"


def test_a_gang_step_runs_and_finishes_requests_like_any_other():
    scheduler, runner = gang(), FakeRunner()
    for r in urgent(4):
        scheduler.add_request(r)
    splits = []
    while scheduler.has_requests():
        scheduled = scheduler.schedule()
        splits.append(scheduled.split)
        scheduler.update_from_output(scheduled, runner.execute_model(scheduled))
    assert splits == ["rows"] * 3 and not scheduler.entries
    scheduler.add_request(urgent(1)[0])
    assert step(scheduler, runner)[0] == ["u0"] and scheduler.splits == {"rows": 3, "sequence": 1}


@pytest.mark.parametrize("tokens, passes", [(5, 1), (19, 1), (38, 2), (100, 2), (300, 1)])
@pytest.mark.parametrize("split", ["sequence", "rows"])
def test_a_shapes_depth_is_what_its_plan_takes_of_a_deep_queue(split, tokens, passes):
    shape = StepShape(split, 4, 32, 160)
    rows = [SimpleNamespace(tokens=tokens, passes=passes, priority=0) for _ in range(64)]
    assert len(shape.plan(rows).rows) == shape.depth(tokens, passes)


def test_the_load_counts_a_gangs_step_as_deep_as_its_deeper_split():
    times = StepTimes()
    times.observe(1000, 0.1 + 1e-4 * 1000)
    times.observe(3000, 0.1 + 1e-4 * 3000)
    one = DiTLoad(times.snapshot, max_batch_size=8, max_batch_tokens=16000)
    per_step = DiTLoad(times.snapshot, 8, 16000, split=PerStepSplit(4))
    assert one.row_seconds(12000, passes=2) == pytest.approx(0.1 + 1.2)  # alone in its step
    assert per_step.row_seconds(12000, passes=2) == pytest.approx(0.1 / 2 + 1.2)  # rows: a pass a rank
    assert per_step.row_seconds(2000) == pytest.approx(0.1 / 8 + 0.2)  # eight rows either way
    per_step.add("big", priority=1, tokens=12000, steps=10, passes=2)
    assert per_step.seconds() == pytest.approx(10 * (0.05 + 1.2))


def test_the_preset_names_the_split_and_refuses_one_without_ranks_to_spread_over():
    assert DiTConfig.model_validate({"parallel": {"ulysses": 2, "ring": 2, "split": "per_step"}}).parallel.sequence == 4
    with pytest.raises(ValueError, match="split: rows needs sequence ranks"):
        DiTConfig.model_validate({"parallel": {"split": "rows", "cfg": 2}})
    with pytest.raises(ValueError, match="simulated runner models sequence ranks"):
        DiTConfig.model_validate({"runner": "simulated", "parallel": {"cfg": 2}})


def test_a_gang_that_may_run_rows_is_placed_for_the_whole_passes_a_rank_then_holds():
    preset = yaml.safe_load((REPO / "stage_configs" / "qwen_image_latency.yaml").read_text())  # Ulysses 4 x CFG 2

    def dit_gib(split):
        preset["dit"]["parallel"]["split"] = split
        config = parse_config(preset)
        return next(e.need_gib for e in stage_memory(config, config.gpu_memory_gib) if e.stage == "dit")

    assert dit_gib("per_step") == dit_gib("rows") > dit_gib("sequence")  # a 2048x2048 pass whole, not an eighth
