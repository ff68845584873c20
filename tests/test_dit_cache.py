"""DiT cache acceleration on the tiny checkpoint: decided per request (and per CFG pass) inside step batches.

The tiny model's residuals change fast between steps (first-block changes of 0.7 to 1.5, TeaCache's rescaled
changes 0.3 to 0.9 at 64x64), so the thresholds that make it reuse are larger than those used on real weights.
"""

import asyncio

import numpy as np
import pytest
import torch
from conftest import REPO
from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
from diffusers.hooks import FirstBlockCacheConfig

from omni_ray.api.planning import plan_request
from omni_ray.api.schema import parse_request
from omni_ray.config import CacheSettings, load_config, parse_config
from omni_ray.engine.core import EngineCore
from omni_ray.engine.dit_scheduler import DiTScheduler
from omni_ray.errors import RequestError
from omni_ray.pipeline import Pipeline
from omni_ray.records import DenoiseParams, DenoiseRequest
from omni_ray.runners.attention import use_real_rope
from omni_ray.runners.dit_cache import BranchCache, cached_forward
from testing.engines import run_to_completion
from testing.numerics import assert_reordered
from testing.reference import PromptEncoder

PROMPTS = ["a red cat", "an oil painting of a lighthouse on a cliff at sunset", "a cup", "a kite over a beach"]
NEGATIVES = ["blurry", "low quality", "dark, noisy, ugly, bad anatomy, watermark", " "]


def first_block(threshold):
    return CacheSettings(kind="first_block", threshold=threshold)


def teacache(threshold):
    return CacheSettings(kind="teacache", threshold=threshold)


@pytest.fixture(scope="module")
def embeds(tiny_dir):
    encoder = PromptEncoder(str(tiny_dir))
    return encoder.encode(PROMPTS), encoder.encode(NEGATIVES)


def denoise(runner, requests, max_batch_size=8):
    """The requests' finished latents, run through one engine core together (as one step batch)."""
    core = EngineCore(DiTScheduler(max_batch_size=max_batch_size, max_wait_steps=4), runner)
    for request in requests:
        core.add_request(request)
    return run_to_completion(core)[0]


def request(embeds, i, cache, steps=8, cfg=True, seed=None):
    prompts, negatives = embeds
    params = DenoiseParams(64, 64, steps, seed=100 + i if seed is None else seed, true_cfg_scale=4.0, cache=cache,
                           true_cfg=cfg)
    return DenoiseRequest(f"r{i}-{cache}", params, prompts[i], negatives[i] if cfg else None)


# --- 1. threshold 0 is the uncached result, bit for bit ------------------------------------------------------------


@pytest.mark.parametrize("cfg", [True, False])
def test_threshold_zero_gives_the_uncached_result_bit_for_bit(runner, embeds, cfg):
    plain = [request(embeds, i, None, cfg=cfg) for i in range(3)]
    zero = [request(embeds, i, cache, cfg=cfg) for i, cache in enumerate([first_block(0), teacache(0), None])]
    expected, got = denoise(runner, plain), denoise(runner, zero)
    for a, b in zip(plain, zero):
        assert torch.equal(got[b.request_id].latents, expected[a.request_id].latents)
        passes = 8 * (2 if cfg else 1)
        assert got[b.request_id].dit_passes == {"computed": passes, "reused": 0}


# --- 2. one request alone equals diffusers' FirstBlockCache ---------------------------------------------------------


@pytest.fixture(scope="module")
def diffusers_pipe(tiny_dir):
    return QwenImagePipeline.from_pretrained(tiny_dir)


def diffusers_with_cache(pipe, threshold, negative, seed, steps):
    """diffusers' image with FirstBlockCache at ``threshold``, and the passes that ran the second block."""
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    ran = []
    hook = pipe.transformer.transformer_blocks[1].attn.register_forward_pre_hook(lambda *_: ran.append(1))
    try:
        image = pipe("a red cat on a mat", negative_prompt=negative, true_cfg_scale=4.0, height=64, width=64,
                     num_inference_steps=steps, generator=torch.Generator("cpu").manual_seed(seed)).images[0]
    finally:
        hook.remove()
        pipe.transformer.disable_cache()
    return np.asarray(image), len(ran)


@pytest.fixture(scope="module")
def pipeline(tiny_dir):
    pipeline = Pipeline(load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir)))
    yield pipeline
    pipeline.shutdown()


@pytest.mark.parametrize("threshold, negative", [(0.5, "blurry"), (1.0, "blurry"), (1.3, "blurry"), (1.0, None)])
def test_first_block_alone_equals_diffusers_first_block_cache(diffusers_pipe, pipeline, threshold, negative):
    steps, seed = 10, 3
    expected, computed = diffusers_with_cache(diffusers_pipe, threshold, negative, seed, steps)
    body = {"prompt": "a red cat on a mat", "negative_prompt": negative, "size": "64x64", "seed": seed,
            "num_inference_steps": steps, "cache": {"kind": "first_block", "threshold": threshold}}
    (got,) = asyncio.run(pipeline.generate(body))
    passes = steps * (2 if negative else 1)
    assert got.dit_passes == {"computed": computed, "reused": passes - computed}  # the same decisions
    if threshold > 0.5:
        assert 0 < computed < passes  # it did reuse, and not everywhere
    assert np.abs(got.pixels.astype(int) - expected.astype(int)).max() <= 1


# --- 3. a mixed batch: each request as it is alone -----------------------------------------------------------------


@pytest.mark.parametrize("cfg", [True, False])
def test_a_batch_mixing_kinds_and_thresholds_keeps_each_requests_result(runner, embeds, cfg):
    caches = [None, first_block(1.0), teacache(1.5), first_block(1.3)]
    requests = [request(embeds, i, cache, steps=6 + i, cfg=cfg) for i, cache in enumerate(caches)]
    alone = {r.request_id: denoise(runner, [r])[r.request_id] for r in requests}
    together = denoise(runner, requests)
    for r in requests:
        assert_reordered(together[r.request_id].latents, alone[r.request_id].latents)
        assert together[r.request_id].dit_passes == alone[r.request_id].dit_passes
    passes = [together[r.request_id].dit_passes for r in requests]
    assert passes[0]["reused"] == 0 and all(p["reused"] > 0 for p in passes[1:])  # rows that reuse beside rows
    # that compute, in one step
    assert (together[requests[1].request_id].latents - together[requests[3].request_id].latents).abs().max() > 0.1


def test_each_cfg_pass_decides_on_its_own_residual(runner, embeds):
    """The conditional and unconditional passes of one request keep apart caches: their decisions differ here."""
    params = DenoiseParams(64, 64, 12, 5, 4.0, first_block(1.0), true_cfg=True)
    state = runner.prepare(params, embeds[0][1], embeds[1][2])
    decisions = []
    while not state.is_finished:
        before = [c.reused for c in state.caches]
        runner.step([state])
        decisions.append(tuple(c.reused - b for c, b in zip(state.caches, before)))
    assert len(set(decisions)) > 1 and any(cond != uncond for cond, uncond in decisions)


# --- the forward itself ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_the_forward_is_diffusers_op_for_op(zero_cond_t):
    """Our forward (which the caches need), with our real-arithmetic rotary attention, gives diffusers' forward
    (complex rotary tables, its own processor) bit for bit, padded text and Qwen-Image-Edit 2511's zero_cond_t
    included; a sub-batch gives each row within the batching tolerance."""
    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=3, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=16, axes_dims_rope=(4, 6, 6), zero_cond_t=zero_cond_t,
    ).eval()
    rows, tokens = 3, 16
    latents = torch.randn(rows, 2 * tokens, 16)  # the noisy tokens, then an edit image's
    img_shapes = [[(1, 4, 4), (1, 4, 4)]] * rows
    embeds, mask = torch.randn(rows, 7, 16), torch.ones(rows, 7, dtype=torch.long)
    mask[1, 5:] = 0
    timestep = torch.tensor([0.9, 0.5, 0.2])
    with torch.no_grad():
        expected = transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=embeds,
                               encoder_hidden_states_mask=mask, img_shapes=img_shapes, return_dict=False)[0]
        use_real_rope(transformer)
        got, _ = cached_forward(transformer, latents, timestep, embeds, mask, img_shapes, [None] * rows,
                                [(0, 4)] * rows, ())
        assert torch.equal(got, expected)
        # Row 1 reuses (a threshold no change exceeds), so rows 0 and 2 run the remaining blocks as a sub-batch.
        caches = [None, BranchCache(first_block(2.0)), None]
        _, caches = cached_forward(transformer, latents, timestep, embeds, mask, img_shapes, caches, [(0, 4)] * 3, ())
        sub, caches = cached_forward(transformer, latents, timestep, embeds, mask, img_shapes, caches, [(1, 4)] * 3, ())
    assert caches[1].reused == 1 and caches[1].computed == 1
    assert_reordered(sub[[0, 2]], expected[[0, 2]])
    assert torch.allclose(sub[1], expected[1], atol=1e-5)  # the same input again: the reused residual is exact


# --- API and config -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def config(tiny_dir):
    return load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir))


def test_cache_field_defaults_to_the_preset_and_null_turns_it_off(config):
    assert plan_request({"prompt": "a cat"}, config).cache is None
    preset = config.model_copy(update={"dit": config.dit.model_copy(update={"cache": teacache(0.3)})})
    assert plan_request({"prompt": "a cat"}, preset).cache == teacache(0.3)
    assert plan_request({"prompt": "a cat", "cache": None}, preset).cache is None
    body = {"prompt": "a cat", "cache": {"kind": "first_block", "threshold": 1}}
    assert plan_request(body, preset).cache == first_block(1.0)
    form = parse_request({"prompt": "a cat", "cache": '{"kind": "teacache", "threshold": 0.2}'}, form=True)
    assert form.cache == teacache(0.2)


@pytest.mark.parametrize("cache, param", [
    ({"kind": "magcache", "threshold": 0.1}, "cache.kind"),
    ({"kind": "first_block", "threshold": -0.1}, "cache.threshold"),
    ({"kind": "first_block", "threshold": "high"}, "cache.threshold"),
    ({"kind": "first_block"}, "cache.threshold"),
    ({"kind": "first_block", "threshold": 0.1, "warmup": 2}, "cache.warmup"),
    ("first_block", "cache"),
])
def test_bad_cache_fields_are_named(config, cache, param):
    with pytest.raises(RequestError) as err:
        plan_request({"prompt": "a cat", "cache": cache}, config)
    assert err.value.param == param and str(err.value).startswith(param)


def test_preset_cache_is_validated():
    base = {"name": "x", "model": "Qwen/Qwen-Image"}
    assert parse_config({**base, "dit": {"cache": {"kind": "teacache", "threshold": 0.4}}}).dit.cache == teacache(0.4)
    with pytest.raises(ValueError, match="dit.cache.kind"):
        parse_config({**base, "dit": {"cache": {"kind": "fast", "threshold": 0.4}}})
    with pytest.raises(ValueError, match="dit.teacache_coefficients"):
        parse_config({**base, "dit": {"teacache_coefficients": []}})
