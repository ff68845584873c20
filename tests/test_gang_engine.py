"""Everything composes on a gang (issue 37): one scenario driven through ``DiTEngineCore.step()`` on the tiny
checkpoint, once on world size 1 and once on a gang of spawned gloo ranks, gives the same engine: the same requests
run in the same steps, with the same progress events, previews, finish order and transformer passes, and latents
equal within ``TOLERANCE``. The scenario is played by step number, not by time, so both runs see the same arrivals:
requests of two priorities on three batch keys (text to image, true CFG, an edit with an input image's latents), a
masked edit, first-block cache and TeaCache, previews, an urgent request pausing a running batch and one taking a
running request's row, an abort of a paused request whose adapter is removed before the next step (as
``LoraResidency`` evicts it once its last request lets go), and an adapter added mid-run, used, then removed. What
each rank holds (request states, resident adapters) is read on every rank through ``collective_rpc``.

Tolerance: the gang computes the same arithmetic in another grouping (a Ulysses rank's blocks see a chunk of the
tokens and attention gathers heads; a CFG rank runs only its passes, text padded to another length): float32 sums in
another order, a few ulps per operation, carried through up to six steps into latents of magnitude ~1. 1e-4 absolute
is that with a margin (as in tests/test_dit_parallel.py), far below one level of an 8-bit image after the VAE.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
import yaml
from conftest import REPO

from omni_ray.config import CacheSettings, parse_config
from omni_ray.engine.builders import build_dit_core
from omni_ray.engine.core import DiTEngineCore
from omni_ray.engine.executor import GangRunner
from omni_ray.records import DenoiseParams, DenoiseRequest, Inpaint, Latents, LoraRef, PromptEmbeds
from omni_ray.runners.lora import read_lora
from testing.ranks import holdings

TOLERANCE = 1e-4

# The requests each step runs, as the scenario below plays them (max_batch_size 3, priority scheduling).
EXPECTED_STEPS = [
    ["doomed", "mask", "slow"], ["doomed", "mask", "slow"],  # priority 2, "late" queued behind them
    ["urgent"], ["urgent"], ["urgent"],  # priority 0, another key: the batch pauses; "doomed" aborted while paused
    ["late", "mask", "slow"],  # "late" takes the aborted request's row
    ["mask", "slow", "styled"],  # priority 1, same key: "late" loses its row
    ["late", "slow", "styled"], ["late", "slow", "styled"],  # "mask" finished
    ["edit"], ["edit"],  # priority 1 on the edit's key, before "late"
    ["late"],
]


@dataclass
class Played:
    """What the scenario saw: per step, every output's (request id, progress, preview?, finish reason)."""

    events: list[list[tuple]] = field(default_factory=list)
    latents: dict[str, torch.Tensor] = field(default_factory=dict)  # request id -> final latents [tokens, 64]
    passes: dict[str, dict[str, int]] = field(default_factory=dict)  # request id -> transformer passes
    previews: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)  # (request id, step) -> latents
    held: dict[str, list] = field(default_factory=dict)  # moment -> every rank's holdings
    num_paused_steps: int = 0


def preset(tiny_dir, **parallel) -> dict:
    data = yaml.safe_load((REPO / "stage_configs" / "qwen_image_tiny.yaml").read_text())
    data["model"] = str(tiny_dir)
    data["dit"].update(max_batch_size=3, max_wait_steps=4, scheduling="priority", priority_aging_s=3600.0,
                       parallel={**parallel, "timeout_s": 60} if parallel else {})
    return data


def make_requests(dim: int, adapters: dict[str, str]) -> dict[str, DenoiseRequest]:
    generator = torch.Generator().manual_seed(0)
    short, long, negative = (PromptEmbeds(torch.randn(n, dim, generator=generator)) for n in (7, 12, 5))
    start = Latents(torch.randn(16, 64, generator=generator), 64, 64)  # a masked edit's start image, 4x4 tokens
    image = Latents(torch.randn(2 * 3, 64, generator=generator), 32, 48)  # an edit's input image, 2x3 tokens
    mask = np.zeros((8, 8), dtype=np.uint8)
    mask[2:6, 3:8] = 1  # repaint a block right of centre on the 8x8 latent grid

    def params(seed, steps, priority, **more):
        return DenoiseParams(64, 64, steps, seed=seed, priority=priority, **more)

    # Thresholds at which the tiny model's caches both reuse and run, every decision at least 0.13 from its threshold
    # (first block's changes 1.05 to 2.6; TeaCache's sums 0.37 and 0.47 reuse, 1.2 and 1.3 run), so that float noise
    # cannot flip one on the gang.
    tea, first_block = CacheSettings(kind="teacache", threshold=0.6), CacheSettings(kind="first_block", threshold=1.5)
    return {request.request_id: request for request in (
        DenoiseRequest("slow", params(1, 6, 2, previews=(2, 4), cache=tea), short),
        DenoiseRequest("mask", params(2, 6, 2, previews=(4,), inpaint=Inpaint(mask, 0.6)), long, start=start),
        DenoiseRequest("doomed", params(3, 4, 2, loras=(LoraRef("B", adapters["B"]),)), long),
        DenoiseRequest("late", params(4, 4, 2, cache=first_block), long),
        DenoiseRequest("urgent", params(5, 3, 0, previews=(1,), true_cfg=True, true_cfg_scale=4.0, cache=first_block),
                       short, negative),
        DenoiseRequest("styled", params(6, 3, 1, loras=(LoraRef("A", adapters["A"], 0.8),)), short),
        DenoiseRequest("edit", params(7, 2, 1), long, images=(image,)),
    )}


def ranks_holdings(core: DiTEngineCore) -> list:
    """Every rank's (request states, resident adapters)."""
    if isinstance(core.runner, GangRunner):
        return core.runner.executor.collective_rpc(holdings)
    return [holdings(core.runner)]


def play(core: DiTEngineCore, requests: dict[str, DenoiseRequest], adapters: dict[str, str]) -> Played:
    played = Played()

    def run(steps: int) -> None:
        for _ in range(steps):
            outputs = core.step()
            played.events.append([(o.request_id, o.progress, o.preview is not None, o.finish_reason)
                                  for o in outputs])
            for o in outputs:
                if o.preview is not None:
                    played.previews[o.request_id, o.progress[0]] = o.preview.latents
                if o.finish_reason == "stop":
                    played.latents[o.request_id] = o.result.latents
                    played.passes[o.request_id] = o.result.dit_passes

    def add_lora(name: str) -> None:
        core.add_lora((name, adapters[name]), read_lora(adapters[name], core.lora_shapes))

    # 1. Four requests of priority 2 on one key, one with adapter B: three run, "late" waits for a row.
    add_lora("B")
    for rid in ("slow", "mask", "doomed", "late"):
        core.add_request(requests[rid])
    run(2)
    # 2. An urgent true-CFG request (another key) pauses the three. One of them is aborted while paused, and its
    # adapter removed before the next step (as LoraResidency evicts an adapter its last request let go).
    core.add_request(requests["urgent"])
    run(1)
    core.abort_requests(["doomed"])
    core.remove_lora(("B", adapters["B"]))
    run(1)
    played.held["after the abort"] = ranks_holdings(core)
    run(2)
    # 3. Adapter A arrives mid-run; a priority-1 request using it takes a running request's row, an edit waits.
    add_lora("A")
    core.add_request(requests["styled"])
    core.add_request(requests["edit"])
    run(1)
    played.held["adapter in use"] = ranks_holdings(core)
    run(2)
    # 4. Its request done, the adapter leaves every rank; the rest run out.
    assert "styled" in played.latents
    core.remove_lora(("A", adapters["A"]))
    played.held["adapter removed"] = ranks_holdings(core)
    while core.scheduler.has_requests():
        run(1)
    played.held["at the end"] = ranks_holdings(core)
    played.num_paused_steps = core.scheduler.num_paused_steps
    return played


def play_on(tiny_dir, adapters: dict[str, str], **parallel) -> Played:
    config = parse_config(preset(tiny_dir, **parallel))
    dim = json.loads((tiny_dir / "transformer" / "config.json").read_text())["joint_attention_dim"]
    core = build_dit_core(config)
    try:
        assert isinstance(core.runner, GangRunner) == bool(parallel)
        return play(core, make_requests(dim, adapters), adapters)
    finally:
        core.shutdown()


@pytest.fixture(scope="module")
def alone(tiny_dir, tiny_adapters) -> Played:
    played = play_on(tiny_dir, tiny_adapters)
    # The scenario does what it claims: preemption, abort, previews, adapters, every request but the aborted one done.
    assert [sorted(rid for rid, *_ in step) for step in played.events] == EXPECTED_STEPS
    assert played.num_paused_steps > 0
    assert sorted(played.latents) == ["edit", "late", "mask", "slow", "styled", "urgent"]
    assert sorted(played.previews) == [("mask", 2), ("slow", 2), ("slow", 4), ("urgent", 1)]
    assert all(played.passes[rid]["reused"] > 0 for rid in ("late", "slow", "urgent"))  # the caches did reuse
    assert (played.latents["slow"] - played.latents["styled"]).abs().max() > 0.1  # results differ
    assert played.held == {"after the abort": [(["mask", "slow", "urgent"], [])],
                           "adapter in use": [(["late", "slow", "styled"], [("A", tiny_adapters["A"])])],
                           "adapter removed": [(["late"], [])], "at the end": [([], [])]}
    return played


@pytest.mark.parametrize("parallel", [{"ulysses": 2}, {"ulysses": 2, "cfg": 2}], ids=["ulysses2", "ulysses2xcfg2"])
def test_a_gang_runs_the_whole_engine_as_one_rank_does(tiny_dir, tiny_adapters, alone, parallel, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # one torch thread per spawned rank: more threads than cores crawl
    gang = play_on(tiny_dir, tiny_adapters, **parallel)
    world = parallel.get("ulysses", 1) * parallel.get("cfg", 1)
    assert gang.events == alone.events  # the same steps, progress, previews and finish order
    assert gang.passes == alone.passes  # the caches decided alike
    assert gang.held == {moment: held * world for moment, held in alone.held.items()}  # every rank, as the one
    for kind, ours, theirs in (("latents", gang.latents, alone.latents), ("preview", gang.previews, alone.previews)):
        assert ours.keys() == theirs.keys()
        for key, expected in theirs.items():
            difference = (ours[key] - expected).abs().max().item()
            assert difference <= TOLERANCE, f"{kind} {key}: {difference}"
