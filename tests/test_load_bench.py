"""benchmarks.load's pieces without a cluster: the request mix is what the issue asks for and what the simulated
preset accepts, and the figures it derives from two Prometheus scrapes are read right."""

from __future__ import annotations

import itertools
import json

import pytest
from conftest import REPO

from benchmarks import load, parallel_choice, slo
from benchmarks.scale import bottleneck
from omni_ray.api.planning import plan_request
from omni_ray.config import load_config


def test_the_mix_spans_sizes_steps_cfg_n_and_streaming_and_each_body_is_valid(tiny_dir):
    config = load_config(REPO / "stage_configs/qwen_image_sim.yaml", model=str(tiny_dir))
    mix = list(itertools.islice(load.request_mix(seed=0), 400))
    plans = [plan_request(body, config) for body, _ in mix]
    sides = {(p.width, p.height) for p in plans}
    assert min(min(s) for s in sides) == 512 and max(max(s) for s in sides) == 1328
    assert any(w != h for w, h in sides)
    assert {p.num_inference_steps for p in plans} == {8, 20, 30, 50}
    assert 0.35 < sum(p.request.negative_prompt is not None for p in plans) / len(plans) < 0.65  # CFG on half
    assert {p.request.n for p in plans} == {1, 2}
    assert 0.15 < sum(streamed for _, streamed in mix) / len(mix) < 0.35
    assert mix[:20] == list(itertools.islice(load.request_mix(seed=0), 20))  # seeded: runs compare


def histogram(counts: dict[str, float], cpu_s: float, waits: dict[str, float] | None = None) -> dict:
    def buckets(name: str, counts: dict[str, float]) -> dict:
        return {(f"{name}_bucket", f'stage="coordinator",le="{le}"}}'): v for le, v in counts.items()}

    samples = buckets("ray_omni_event_loop_stall_seconds", counts)
    samples.update(buckets("ray_omni_event_loop_cpu_wait_seconds", waits or counts))
    samples[("ray_omni_process_cpu_seconds_total", 'stage="coordinator"}')] = cpu_s
    return samples


def test_coordinator_figures_read_the_stall_histogram_and_cpu_between_two_scrapes():
    before = histogram({"0.005": 90, "0.02": 99, "0.05": 100, "+Inf": 100}, cpu_s=10.0)
    after = histogram({"0.005": 180, "0.02": 196, "0.05": 200, "+Inf": 200}, cpu_s=14.0)
    figures = load.coordinator_figures(before, after, images=8)
    assert figures["event_loop_samples"] == 100
    assert figures["event_loop_stalls_over_20ms"] == 3  # 100 samples, 97 within 20 ms
    assert figures["event_loop_stall_max_ms_at_most"] == pytest.approx(50.0)  # all 100 within 50 ms
    assert figures["coordinator_cpu_ms_per_image"] == 500.0

    past_the_top = histogram({"0.005": 180, "0.02": 196, "0.05": 199, "+Inf": 200}, cpu_s=14.0)
    assert load.coordinator_figures(before, past_the_top, images=8)["event_loop_stall_max_ms_at_most"] is None

    quiet = histogram({"0.005": 185, "0.02": 200, "0.05": 200, "+Inf": 200}, cpu_s=14.0)
    assert load.coordinator_figures(before, quiet, images=8)["event_loop_stall_max_ms_at_most"] == 20.0

    # The time the loop's thread waited for a CPU is read apart from the stalls.
    busy_machine = histogram({"0.005": 185, "0.02": 199, "0.05": 200, "+Inf": 200}, cpu_s=14.0,
                             waits={"0.005": 150, "0.02": 190, "0.05": 200, "+Inf": 200})
    figures = load.coordinator_figures(before, busy_machine, images=8)
    assert figures["event_loop_stalls_over_20ms"] == 0
    assert (figures["event_loop_cpu_waits_over_20ms"], figures["event_loop_cpu_wait_max_ms_at_most"]) == (9, 50.0)


def test_summary_counts_only_what_finished_in_the_window_and_names_the_bottleneck():
    outcomes = [load.Outcome(0.0, 5.0, 200, 1, [{"encoder": 1.0, "dit": 900.0, "vae": 2.0}]),  # warm-up
                load.Outcome(8.0, 20.0, 200, 2, [{"encoder": 3.0, "dit": 700.0, "vae": 5.0}] * 2),
                load.Outcome(9.0, 25.0, 200, 1, [{"encoder": 5.0, "dit": 500.0, "vae": 9.0}]),
                load.Outcome(12.0, 26.0, 503, 0),
                load.Outcome(30.0, 45.0, 200, 1, [{}])]  # after the window
    summary = load.summarize(outcomes, (10.0, 40.0))
    assert (summary["requests"], summary["images"]) == (2, 3)
    assert summary["throughput_img_s"] == pytest.approx(0.1)
    assert summary["queued_ms"]["dit"]["mean"] == pytest.approx(633.333, abs=1e-3)
    assert summary["errors"] == {"503": 1}
    assert bottleneck(summary, coordinators=1).startswith("dit")
    assert bottleneck({**summary, "coordinator_cpu_ms_per_image": 9000.0}, coordinators=1) == "coordinator CPU"


def test_an_idle_process_watches_its_event_loop_as_the_coordinator_does():
    idle = load._idle_process(0.0, 0.5)
    figures = json.loads(idle.communicate(timeout=60)[0])
    assert 5 <= figures["samples"] <= 10  # a sample per 50 ms sleep
    assert 0 <= figures["stalls_over_20ms"] <= figures["late_over_20ms"] <= figures["samples"]
    assert figures["late_max_ms"] >= 0
    assert 0 <= figures["host_steal_share"] < 1
    assert 0 <= figures["samples_with_over_20ms_stolen"] <= figures["samples"]


def test_the_parallel_choice_benchmark_replays_the_same_arrivals_on_each_split_on_a_virtual_clock():
    plan = slo.arrivals(0, 150, [(rate * 3, kind, tenant) for rate, kind, tenant in slo.MIX])
    runs = {split: parallel_choice.run(split, plan) for split in parallel_choice.SPLITS}
    for run in runs.values():
        assert sum(figures["requests"] for figures in run["latency_s"].values()) == len(plan)
        assert run["latency_s"]["interactive"]["p50"] >= 20 * 0.08  # 20 steps of at least Ulysses 4's 512x512 step
    assert runs["sequence"]["steps"].keys() == {"sequence"} and runs["rows"]["steps"].keys() == {"rows"}
    assert runs["per_step"]["steps"].keys() == {"sequence", "rows"}
    errors = runs["rows"]["step_fit_error"]
    assert errors["reported_tokens"]["rows"] < errors["plain_sum"]["rows"]  # uneven rows steps, counted by the busiest


def test_the_soak_s_late_growth_is_the_trend_not_two_samples():
    """A replica whose RSS swings by 15 MB (the VAE's allocator) reads flat; one that rises reads its rise."""
    from benchmarks.soak import trend_mb

    swinging = [(2.0 * i, 584.0 if i % 7 < 3 else 599.0) for i in range(300)]
    assert abs(trend_mb(swinging)) < 2 and abs(swinging[-1][1] - swinging[0][1]) == 15
    rising = [(2.0 * i, 500.0 + 0.05 * i + (3 if i % 2 else 0)) for i in range(300)]
    assert trend_mb(rising) == pytest.approx(0.05 * 299, abs=0.5)
    assert trend_mb([(0.0, 1.0)]) is None
