"""ControlNet (issue 39) on the tiny checkpoint: the DiT runner's final latents equal diffusers'
QwenImageControlNetPipeline's (one controlnet, CFG on and off, a start/end window; two control images through
QwenImageMultiControlNetModel at different scales), and a step batch mixing rows with and without control, with
different controlnets, a LoRA adapter and cache acceleration equals each row run alone.

The tiny controlnets (``checkpoints.tiny.write_controlnet``) have every weight drawn, so their residuals move the
image (the real initialisation zeroes them); the tests check that they do.
"""

import pytest
import torch
from diffusers import QwenImageControlNetModel, QwenImageControlNetPipeline, QwenImageMultiControlNetModel
from diffusers.pipelines.qwenimage.pipeline_qwenimage_controlnet import retrieve_latents

from omni_ray.checkpoints.tiny import main as tiny_main
from omni_ray.checkpoints.tiny import write_controlnet
from omni_ray.config import CacheSettings, ParallelSettings
from omni_ray.records import Control, DenoiseParams, Inpaint, Latents, LoraRef, PromptEmbeds
from omni_ray.runners.denoise import DenoiseRunner
from omni_ray.runners.lora import read_lora
from testing.gang import run_gang
from testing.numerics import assert_reordered
from testing.parallel import denoise_controls

PIPELINE_TOLERANCE = 1e-4  # our runner against diffusers' pipeline (different attention kernels and rope arithmetic)


@pytest.fixture(scope="module")
def controlnet_dirs(tiny_dir, tmp_path_factory):
    """Two tiny controlnets: "a" (2 blocks, seed 0) written by the command users run, "b" (seed 1) by the function."""
    root = tmp_path_factory.mktemp("controlnets")
    tiny_main([str(root / "a"), "--controlnet", "--from", str(tiny_dir)])
    return {"a": str(root / "a"), "b": str(write_controlnet(root / "b", tiny_dir / "transformer", seed=1))}


@pytest.fixture(scope="module")
def pipe(tiny_dir, controlnet_dirs):
    return QwenImageControlNetPipeline.from_pretrained(
        tiny_dir, controlnet=QwenImageControlNetModel.from_pretrained(controlnet_dirs["a"]))


@pytest.fixture(scope="module")
def runner(tiny_dir, controlnet_dirs):
    return DenoiseRunner.load(str(tiny_dir), controlnets=controlnet_dirs, max_loras=1)


def control_image(height: int, width: int, seed: int) -> torch.Tensor:
    """A smooth control image in [-1, 1] ``[1, 3, H, W]`` (the pipeline takes a tensor as it is)."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand((1, 3, height // 16, width // 16), generator=g) * 2 - 1
    return torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)


def control_latents(pipe, images: list[torch.Tensor], seed: int) -> tuple[Latents, ...]:
    """The control images' latents as the pipeline makes them: each VAE sample drawn from the request's generator,
    the k-th after k others, normalised and packed."""
    vae = pipe.vae
    generator = torch.Generator("cpu").manual_seed(seed)
    mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
    out = []
    with torch.no_grad():
        for image in images:
            sample = retrieve_latents(vae.encode(image.unsqueeze(2)), generator=generator)
            sample = ((sample - mean) * inv_std).permute(0, 2, 1, 3, 4)
            packed = pipe._pack_latents(sample, 1, 16, sample.shape[3], sample.shape[4])
            out.append(Latents(packed[0], image.shape[2], image.shape[3]))
    return tuple(out)


def embeds(pipe, prompt: str) -> PromptEmbeds:
    """The pipeline's own prompt embeddings (one prompt: no padding)."""
    with torch.no_grad():
        values, mask = pipe.encode_prompt(prompt, device="cpu")
    assert mask is None
    return PromptEmbeds(values[0])


def run_together(runner, requests) -> tuple[list[torch.Tensor], list]:
    """Steps the requests as one batch to the end: their final latents and states."""
    states = [runner.prepare(params, prompt, negative, controls=controls)
              for params, prompt, negative, controls in requests]
    while not states[0].is_finished:
        runner.step(states)
    return [runner.finish(state).latents for state in states], states


def run_alone(runner, params, prompt, negative=None, controls=()) -> torch.Tensor:
    return run_together(runner, [(params, prompt, negative, controls)])[0][0]


PARITY = {
    "CFG, whole schedule": {"cfg": True, "scale": 1.0, "start": 0.0, "end": 1.0},
    "no CFG, scale 0.7": {"cfg": False, "scale": 0.7, "start": 0.0, "end": 1.0},
    "CFG, window 0.25..0.75": {"cfg": True, "scale": 1.3, "start": 0.25, "end": 0.75},
}


@pytest.mark.parametrize("case", list(PARITY))
def test_one_controlnet_equals_diffusers_pipeline(pipe, runner, case):
    c = PARITY[case]
    height, width, steps, seed = 64, 96, 4, 5
    image = control_image(height, width, 1)
    prompt, negative = embeds(pipe, "a red cat"), embeds(pipe, "blurry, low quality")
    expected = pipe(
        prompt_embeds=prompt.embeds[None], negative_prompt_embeds=negative.embeds[None] if c["cfg"] else None,
        true_cfg_scale=4.0 if c["cfg"] else 1.0, height=height, width=width, num_inference_steps=steps,
        control_image=image, controlnet_conditioning_scale=c["scale"], control_guidance_start=c["start"],
        control_guidance_end=c["end"], generator=torch.Generator("cpu").manual_seed(seed), output_type="latent",
    ).images[0]
    params = DenoiseParams(height, width, steps, seed, 4.0, true_cfg=c["cfg"],
                           controls=(Control("a", c["scale"], c["start"], c["end"]),))
    got = run_alone(runner, params, prompt, negative if c["cfg"] else None,
                    control_latents(pipe, [image], seed))
    diff = (got - expected).abs().max().item()
    print(f"{case}: max |ours - diffusers| = {diff:.2e}")
    assert diff <= PIPELINE_TOLERANCE
    # the control moved the image: the same request without it ends elsewhere
    plain = DenoiseParams(height, width, steps, seed, 4.0, true_cfg=c["cfg"])
    assert (run_alone(runner, plain, prompt, negative if c["cfg"] else None) - got).abs().max() > 0.05


def test_two_control_images_equal_diffusers_multi_controlnet(pipe, runner):
    """Two control images through the union controlnet (QwenImageMultiControlNetModel, which sums them), at
    different scales and windows, with true CFG; the noise is drawn after both samples."""
    height, width, steps, seed = 64, 64, 4, 9
    images = [control_image(height, width, 2), control_image(height, width, 3)]
    prompt, negative = embeds(pipe, "a lighthouse at sunset"), embeds(pipe, "dark")
    multi = QwenImageControlNetPipeline(pipe.scheduler, pipe.vae, pipe.text_encoder, pipe.tokenizer, pipe.transformer,
                                        QwenImageMultiControlNetModel([pipe.controlnet]))
    expected = multi(
        prompt_embeds=prompt.embeds[None], negative_prompt_embeds=negative.embeds[None], true_cfg_scale=4.0,
        height=height, width=width, num_inference_steps=steps, control_image=images,
        controlnet_conditioning_scale=[0.6, 1.4], control_guidance_start=[0.0, 0.25],
        control_guidance_end=[1.0, 0.75], generator=torch.Generator("cpu").manual_seed(seed), output_type="latent",
    ).images[0]
    controls = (Control("a", 0.6), Control("a", 1.4, 0.25, 0.75))
    params = DenoiseParams(height, width, steps, seed, 4.0, true_cfg=True, controls=controls)
    got = run_alone(runner, params, prompt, negative, control_latents(pipe, images, seed))
    diff = (got - expected).abs().max().item()
    print(f"two controls: max |ours - diffusers| = {diff:.2e}")
    assert diff <= PIPELINE_TOLERANCE
    one = DenoiseParams(height, width, steps, seed, 4.0, true_cfg=True, controls=controls[:1])
    first = control_latents(pipe, images[:1], seed)
    assert (run_alone(runner, one, prompt, negative, first) - got).abs().max() > 0.05


def mixed_requests(pipe, cfg: bool):
    """Rows with controlnet a, none, b with a window, a and b together, and the first request with a at another
    scale."""
    height, width, steps = 64, 64, 4
    prompts = [embeds(pipe, p) for p in ("a red cat", "a lighthouse", "a cup of tea on a wooden table", "a kite",
                                         "a red cat")]
    negative = embeds(pipe, "blurry") if cfg else None
    choices = [(Control("a"),), (), (Control("b", 1.2, 0.0, 0.5),), (Control("a", 0.8), Control("b", 0.5, 0.25)),
               (Control("a", 0.4),)]
    requests = []
    for i, controls in enumerate(choices):
        seed = 20 + i % 4  # the last row is the first one at another scale
        images = [control_image(height, width, 10 + i % 4 + k) for k in range(len(controls))]
        params = DenoiseParams(height, width, steps, seed, 4.0, true_cfg=cfg, controls=controls)
        requests.append((params, prompts[i], negative, control_latents(pipe, images, seed)))
    return requests


@pytest.mark.parametrize("cfg", [True, False], ids=["CFG", "no CFG"])
def test_a_step_batch_with_and_without_control_equals_each_row_alone(pipe, runner, cfg):
    requests = mixed_requests(pipe, cfg)
    together, _ = run_together(runner, requests)
    for i, (request, got) in enumerate(zip(requests, together)):
        assert_reordered(got, run_alone(runner, *request), i)
    # rows 0 and 4 differ only by a's scale: a row taking another's residuals would show
    assert (together[0] - together[4]).abs().max() > 0.05


def test_control_beside_an_adapter_and_a_cached_row_equals_each_alone(tiny_dir, pipe, runner, tmp_path):
    """One step batch: control with a LoRA adapter, control with a first-block cache (reusing at some steps),
    control with TeaCache, the adapter alone, the cache alone: each row equals itself alone."""
    from testing.lora_files import make_adapter

    adapter = str(make_adapter(tiny_dir, tmp_path / "A", rank=4, alpha=8, seed=1))
    runner.add_lora(("A", adapter), read_lora(adapter, runner.lora_shapes))
    try:
        lora = LoraRef("A", adapter, 1.0)
        height, width, steps = 64, 64, 6
        prompt, negative = embeds(pipe, "a red cat"), embeds(pipe, "blurry")
        fbc, tea = CacheSettings(kind="first_block", threshold=2.0), CacheSettings(kind="teacache", threshold=1.0)
        rows = [((Control("a"),), lora, None), ((Control("a", 0.9),), None, fbc), ((Control("b"),), None, tea),
                ((), lora, None), ((), None, fbc)]
        requests = []
        for i, (controls, adapter_ref, cache) in enumerate(rows):
            params = DenoiseParams(height, width, steps, 30 + i, 4.0, cache, (adapter_ref,) if adapter_ref else (),
                                   true_cfg=True, controls=controls)
            images = [control_image(height, width, 40 + i)] * len(controls)
            requests.append((params, prompt, negative, control_latents(pipe, images, 30 + i)))
        together, states = run_together(runner, requests)
        assert sum(c.reused for c in states[1].caches) > 0, "the cached control row never reused"
        assert sum(c.reused for c in states[2].caches) > 0, "the TeaCache control row never reused"
        for i, (request, got) in enumerate(zip(requests, together)):
            assert_reordered(got, run_alone(runner, *request), i)
    finally:
        runner.remove_lora(("A", adapter))


def test_bad_controls_are_refused_naming_control(pipe, runner):
    prompt = embeds(pipe, "a red cat")
    latents = control_latents(pipe, [control_image(64, 64, 1)], 0)
    wrong_size = control_latents(pipe, [control_image(64, 96, 1)], 0)
    cases = [
        (DenoiseParams(64, 64, 2, 0, controls=(Control("nope"),)), latents),
        (DenoiseParams(64, 64, 2, 0, controls=(Control("a"),)), ()),
        (DenoiseParams(64, 64, 2, 0), latents),
        (DenoiseParams(64, 64, 2, 0, controls=(Control("a"),)), wrong_size),
        (DenoiseParams(64, 64, 2, 0, controls=(Control("a", 1.0, 0.6, 0.4),)), latents),
    ]
    for params, controls in cases:
        with pytest.raises(ValueError, match="^control: "):
            runner.prepare(params, prompt, controls=controls)
    import numpy as np
    masked = DenoiseParams(64, 64, 4, 0, controls=(Control("a"),),
                           inpaint=Inpaint(np.ones((8, 8), dtype=np.uint8), 0.9))
    with pytest.raises(ValueError, match="^control: "):
        runner.prepare(masked, prompt, start=Latents(latents[0].latents, 64, 64), controls=latents)


GANGS = {  # name: (the gang, the steps' split)
    "ulysses2": (ParallelSettings(ulysses=2), "sequence"),
    "cfg2": (ParallelSettings(cfg=2), "sequence"),
    "tensor2": (ParallelSettings(tensor=2), "sequence"),
    "ring2-rows": (ParallelSettings(ring=2), "rows"),
}


@pytest.fixture(scope="module")
def one_rank(tiny_dir, controlnet_dirs):
    return denoise_controls(None, str(tiny_dir), controlnet_dirs)


@pytest.mark.parametrize("gang", GANGS)
def test_a_gang_applies_controls_as_one_rank_does(gang, tiny_dir, controlnet_dirs, one_rank):
    """Control rows on a gang of CPU processes: a sequence split adds each rank's chunk of the residuals (15 image
    tokens: one rank's chunk padded), CFG ranks each compute the residuals of the passes they run. Within the
    parallel tests' 1e-4 (test_dit_parallel: the same arithmetic grouped otherwise)."""
    settings, split = GANGS[gang]
    worst = 0.0
    for rank, latents in enumerate(run_gang(denoise_controls, settings, str(tiny_dir), controlnet_dirs, 4, split)):
        assert latents.keys() == one_rank.keys()
        for rid, expected in one_rank.items():
            worst = max(worst, (latents[rid] - expected).abs().max().item())
    print(f"{gang}: max |gang - one rank| = {worst:.2e}")
    assert worst <= 1e-4
