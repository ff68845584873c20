"""Qwen-Image-Layered's DiT on the tiny layered checkpoint: the runner's final latents are diffusers'
``QwenImageLayeredPipeline``'s for the same embeddings, input image and seed, with and without true CFG and its
``cfg_normalize``; layered rows batch with each other and never with an edit's.

diffusers 0.42.1's ``output_type="latent"`` ends in an UnboundLocalError (it sets ``image``, returns ``images``), so
the pipeline's last latents are read by its own ``callback_on_step_end`` instead, and it decodes as usual.

The pipeline only takes the 640 and 1024 buckets; the tests shrink the bucket's area by patching the pipeline
module's ``calculate_dimensions`` (nothing else of the pipeline changes) and ask our runner for the same working
size (``qwen_image_layered.working_size`` at that area)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage import pipeline_qwenimage_layered as layered_module
from PIL import Image

from omni_ray.engine.core import EngineCore
from omni_ray.engine.dit_scheduler import DiTScheduler
from omni_ray.families.qwen_image.facts import dit_work_tokens, image_tokens
from omni_ray.families.qwen_image_layered.facts import working_size
from omni_ray.records import DenoiseParams, DenoiseRequest, Latents, PromptEmbeds
from omni_ray.runners.denoise import DenoiseRunner
from testing.numerics import assert_reordered

SMALL_RESOLUTION = 48  # the tests' bucket: 48 * 48 pixels of working area
IMAGE_SIZE = (32, 64)  # (height, width) of the input image: its working size at that area is the same
STEPS = 3


@pytest.fixture(scope="module")
def pipe(layered_dir):
    from diffusers import QwenImageLayeredPipeline

    pipe = QwenImageLayeredPipeline.from_pretrained(str(layered_dir))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def runner(layered_dir):
    return DenoiseRunner.load(str(layered_dir))


@pytest.fixture
def small_bucket(monkeypatch):
    original = layered_module.calculate_dimensions
    monkeypatch.setattr(layered_module, "calculate_dimensions",
                        lambda target_area, ratio: original(SMALL_RESOLUTION ** 2, ratio))


def rgba_image(seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (*IMAGE_SIZE, 4), dtype=np.uint8)
    return Image.fromarray(pixels, "RGBA")


def embeds(seed: int, tokens: int) -> torch.Tensor:
    return torch.randn((1, tokens, 64), generator=torch.Generator().manual_seed(seed))  # the tiny text width


def condition_latents(pipe, image: Image.Image, height: int, width: int) -> Latents:
    """The input image's packed latents as the pipeline makes them (resize, preprocess, ``prepare_latents``'s VAE
    encode and packing): what the VAE stage hands our DiT."""
    resized = pipe.image_processor.resize(image, height, width)
    pixels = pipe.image_processor.preprocess(resized, height, width).unsqueeze(2)
    _, packed = pipe.prepare_latents(pixels, 1, 16, height, width, 2, torch.float32, "cpu", torch.Generator())
    return Latents(packed[0].contiguous(), height, width)


def run_alone(runner: DenoiseRunner, params: DenoiseParams, prompt, negative, image: Latents) -> Latents:
    state = runner.prepare(params, PromptEmbeds(prompt[0]), PromptEmbeds(negative[0]) if negative is not None else None,
                           images=(image,))
    while not state.is_finished:
        runner.step([state])
    return runner.finish(state)


@pytest.mark.parametrize("layers", [2, 4])
@pytest.mark.parametrize("cfg,cfg_normalize", [(False, False), (True, False), (True, True)])
def test_layered_latents_match_the_pipeline(pipe, runner, small_bucket, layers, cfg, cfg_normalize):
    height, width = working_size(*IMAGE_SIZE, resolution=SMALL_RESOLUTION)
    image = rgba_image(layers)
    prompt, negative = embeds(1, 7), (embeds(2, 5) if cfg else None)
    seed, scale = 11 + layers, 4.0 if cfg else 1.0
    seen = []

    def keep_latents(pipeline, step, timestep, kwargs):
        seen.append(kwargs["latents"])
        return {}

    pipe(
        image=image, prompt="given as embeddings", prompt_embeds=prompt, negative_prompt_embeds=negative,
        true_cfg_scale=scale, layers=layers, num_inference_steps=STEPS, generator=torch.Generator().manual_seed(seed),
        output_type="np", cfg_normalize=cfg_normalize, callback_on_step_end=keep_latents,
    )
    assert len(seen) == STEPS
    expected = seen[-1][0]
    params = DenoiseParams(height, width, STEPS, seed, true_cfg_scale=scale, true_cfg=cfg, layers=layers,
                           cfg_normalize=cfg_normalize)
    result = run_alone(runner, params, prompt, negative, condition_latents(pipe, image, height, width))
    assert (result.height, result.width, result.layers) == (height, width, layers)
    assert result.latents.shape == ((layers + 1) * image_tokens(height, width), 64) == expected.shape
    scale_of = expected.abs().max().item()
    assert (result.latents - expected).abs().max().item() <= 1e-4 * max(1.0, scale_of)


def test_cfg_normalize_changes_the_result(pipe, runner):
    """The rescale is read from the request: without it the guided prediction keeps its own norm."""
    height, width = IMAGE_SIZE
    image = condition_latents(pipe, rgba_image(0), height, width)
    prompt, negative = embeds(1, 7), embeds(2, 5)
    results = [run_alone(runner, DenoiseParams(height, width, 2, 0, true_cfg_scale=4.0, true_cfg=True, layers=2,
                                               cfg_normalize=normalize), prompt, negative, image)
               for normalize in (False, True)]
    assert (results[0].latents - results[1].latents).abs().max().item() > 1e-3


def test_layered_rows_batch_together_and_never_with_an_edit(pipe, runner, edit_dir):
    height, width = IMAGE_SIZE
    image = condition_latents(pipe, rgba_image(0), height, width)
    other = condition_latents(pipe, rgba_image(1), height, width)

    def layered(request_id, seed, prompt_seed, picture, layers=2, steps=2):
        params = DenoiseParams(height, width, steps, seed, true_cfg_scale=4.0, true_cfg=True, layers=layers)
        return DenoiseRequest(request_id, params, PromptEmbeds(embeds(prompt_seed, 6 + seed)[0]),
                              PromptEmbeds(embeds(99, 4)[0]), images=(picture,))

    requests = [layered("a", 0, 1, image), layered("b", 1, 2, other, steps=3), layered("c", 2, 3, image, layers=3)]
    edit = DenoiseRequest("e", DenoiseParams(height, width, 2, 0), PromptEmbeds(embeds(4, 6)[0]),
                          images=(Latents(torch.zeros(image_tokens(height, width), 64), height, width),))
    keys = {r.request_id: r.batch_key for r in requests + [edit]}
    assert keys["a"] == keys["b"] and len({keys["a"], keys["c"], keys["e"]}) == 3

    def run(batch):
        core = EngineCore(DiTScheduler(max_batch_size=8, max_wait_steps=8), runner)
        for request in batch:
            core.add_request(request)
        results, steps = {}, []
        while core.has_unfinished_requests():
            outputs = core.step()
            steps.append(sorted(o.request_id for o in outputs))
            results.update({o.request_id: o.result for o in outputs if o.finish_reason == "stop"})
        return results, steps

    together, steps = run(requests[:2])
    assert steps[:2] == [["a", "b"], ["a", "b"]]  # one forward for both
    for request in requests[:2]:
        alone = run([request])[0][request.request_id]
        assert alone.layers == 2
        assert_reordered(together[request.request_id].latents, alone.latents)
    assert (together["a"].latents - together["b"].latents).abs().max() > 0.1

    edit_runner = DenoiseRunner.load(str(edit_dir))  # a plain edit row is another model's: refused here, by name
    with pytest.raises(ValueError, match="layers"):
        runner.prepare(edit.params, edit.prompt, images=edit.images)
    with pytest.raises(ValueError, match="layers"):
        edit_runner.prepare(requests[0].params, requests[0].prompt, requests[0].negative, images=requests[0].images)


def test_layered_rows_refuse_what_the_pipeline_has_not(pipe, runner):
    height, width = IMAGE_SIZE
    image = condition_latents(pipe, rgba_image(0), height, width)
    prompt = PromptEmbeds(embeds(1, 6)[0])
    params = DenoiseParams(height, width, 2, 0, layers=2)
    with pytest.raises(ValueError, match="^image:"):
        runner.prepare(params, prompt)  # no input image
    with pytest.raises(ValueError, match="^image:"):
        runner.prepare(params, prompt, images=(image, image))
    with pytest.raises(ValueError, match="^image:"):
        runner.prepare(DenoiseParams(height * 2, width, 2, 0, layers=2), prompt, images=(image,))
    from omni_ray.records import Inpaint

    mask = np.ones((height // 8, width // 8), dtype=np.uint8)
    with pytest.raises(ValueError, match="^inpaint:"):
        runner.prepare(DenoiseParams(height, width, 2, 0, layers=2, inpaint=Inpaint(mask, 0.5)), prompt,
                       images=(image,), start=image)


def test_previews_and_cache_of_layered_rows(pipe, runner):
    """A preview is the step's predicted clean latents of every frame, its layers set; a cached row runs."""
    from omni_ray.config import CacheSettings

    height, width = IMAGE_SIZE
    image = condition_latents(pipe, rgba_image(0), height, width)
    prompt = PromptEmbeds(embeds(1, 6)[0])
    requests = [DenoiseRequest("p", DenoiseParams(height, width, 4, 0, layers=2, previews=(2,)), prompt,
                               images=(image,)),
                DenoiseRequest("c", DenoiseParams(height, width, 4, 0, layers=2,
                                                  cache=CacheSettings(kind="first_block", threshold=0.5)), prompt,
                               images=(image,))]
    core = EngineCore(DiTScheduler(max_batch_size=8, max_wait_steps=8), runner)
    results = {}
    for request in requests:
        core.add_request(request)
    while core.has_unfinished_requests():
        results.update({o.request_id: o.result for o in core.step() if o.finish_reason == "stop"})
    assert results["c"].layers == 2 and results["c"].dit_passes["computed"] >= 2
    tokens = 3 * image_tokens(height, width)
    assert results["p"].latents.shape == (tokens, 64)
    preview = runner_preview(runner, requests[0])
    assert preview.layers == 2 and preview.latents.shape == (tokens, 64)


def runner_preview(runner: DenoiseRunner, request: DenoiseRequest) -> Latents:
    """The preview the runner hands out for a request stepped alone to its preview step."""
    from omni_ray.records import DenoiseBatch

    output = runner.execute_model(DenoiseBatch([request], [request.request_id], []))
    while request.request_id not in output.previews:
        output = runner.execute_model(DenoiseBatch([], [request.request_id], []))
    runner.states.pop(request.request_id, None)
    return output.previews[request.request_id]


def test_work_tokens_count_every_frame():
    text = 10
    assert dit_work_tokens(64, 64, text, False, ((64, 64),), layers=4) == 5 * 16 + 16 + text
    assert dit_work_tokens(64, 64, text, True, ((64, 64),), layers=2) == 2 * (3 * 16 + 16 + text)
    request = DenoiseRequest("r", DenoiseParams(64, 64, 2, 0, layers=4), PromptEmbeds(torch.zeros(text, 64)),
                             images=(Latents(torch.zeros(16, 64), 64, 64),))
    assert request.work_tokens == 5 * 16 + 16 + text


def test_the_tiny_layered_checkpoint_loads_as_published(layered_dir, pipe):
    t, vae = pipe.transformer.config, pipe.vae.config
    assert t.use_layer3d_rope and t.use_additional_t_cond and not t.zero_cond_t
    assert vae.input_channels == 4
    assert pipe.text_encoder.model.visual is not None and pipe.processor is not None
