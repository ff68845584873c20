"""Qwen-Image 2.1's DiT under the engine core (the preset's scheduler, the 2.1 runner): a request paused for a more
urgent one, its condition cache kept meanwhile, ends equal to itself run alone; requests of different prompts share
steps."""

import pytest
import torch
from conftest import REPO

from omni_ray.config import load_config
from omni_ray.engine.builders import build_dit_core
from omni_ray.records import DenoiseParams, DenoiseRequest, PromptEmbeds
from testing.numerics import assert_reordered


@pytest.fixture(scope="module")
def config(tiny21_dir):
    return load_config(REPO / "stage_configs/qwen_image_2_1_tiny.yaml", model=str(tiny21_dir))


def request(request_id: str, tokens: int, seed: int, priority: int = 0, steps: int = 6) -> DenoiseRequest:
    embeds = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(seed))
    params = DenoiseParams(64, 96, steps, seed, priority=priority)
    return DenoiseRequest(request_id, params, PromptEmbeds(embeds))


def run(core, requests: list[DenoiseRequest], arrivals: dict[int, DenoiseRequest] = None) -> dict:
    """Steps ``core`` until every request finished, adding ``arrivals`` before the step of their number; returns the
    finished latents by request id."""
    for r in requests:
        core.add_request(r)
    arrivals, results, step = arrivals or {}, {}, 0
    while core.has_unfinished_requests() or step in arrivals:
        if step in arrivals:
            core.add_request(arrivals.pop(step))
        for output in core.step():
            if output.finished:
                assert output.error is None, output.error
                results[output.request_id] = output.result.latents
        step += 1
    return results


def test_a_paused_request_ends_equal_to_itself_run_alone(config):
    alone = run(build_dit_core(config), [request("slow", 11, seed=1, priority=5)])["slow"]
    one_row = config.model_copy(update={"dit": config.dit.model_copy(update={"max_batch_size": 1})})
    core = build_dit_core(one_row)  # one row a step: the urgent request takes it
    both = run(core, [request("slow", 11, seed=1, priority=5)],
               arrivals={2: request("urgent", 7, seed=2, priority=-5, steps=3)})
    assert core.stats().paused_request_steps >= 3  # the slow one sat out the urgent one's steps
    assert_reordered(both["slow"], alone)


def test_requests_of_different_prompts_share_steps_and_equal_each_alone(config):
    prompts = {"a": (5, 1), "b": (13, 2), "c": (9, 3)}  # id: (prompt tokens, seed)
    core = build_dit_core(config)
    together = run(core, [request(rid, tokens, seed) for rid, (tokens, seed) in prompts.items()])
    assert max(core.stats().batch_sizes) == 3
    for rid, (tokens, seed) in prompts.items():
        alone = run(build_dit_core(config), [request(rid, tokens, seed)])[rid]
        assert_reordered(together[rid], alone, rid)
