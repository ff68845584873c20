"""An inpainting ControlNet (diffusers' QwenImageControlNetInpaintPipeline; InstantX's Qwen-Image-ControlNet-Inpainting)
on the tiny checkpoint: the VAE's masked control latents equal the pipeline's ``prepare_image_with_mask`` (68
channels: the masked image's sample and the kept-mask channel, packed), the DiT runner's final latents equal the
pipeline's (CFG on and off), and a step batch mixing an inpainting-control row, a plain-control row and a row with
both equals each row alone.

diffusers samples the masked control image from torch's global generator (``latent_dist.sample()`` without one) and
draws the noise from the pipeline's own: omni-ray draws that sample from a fresh CPU generator seeded with the
image's seed, which is diffusers' when the caller runs ``torch.manual_seed(seed)`` before the pipeline call, as the
references here do; the noise is then the pipeline generator's first draw (no control sample precedes it)."""

import numpy as np
import pytest
import torch
from diffusers import QwenImageControlNetInpaintPipeline, QwenImageControlNetModel
from PIL import Image

from omni_ray.checkpoints.tiny import write_controlnet
from omni_ray.records import Control, DenoiseParams, PromptEmbeds
from omni_ray.runners.denoise import DenoiseRunner
from omni_ray.runners.vae import VaeRunner
from testing.numerics import assert_reordered
from testing.reference import source_image

PIPELINE_TOLERANCE = 1e-4  # as tests/test_controlnet.py: our runner against diffusers' pipeline
HEIGHT, WIDTH = 64, 96


@pytest.fixture(scope="module")
def controlnet_dirs(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("controlnets")
    return {"inpaint": str(write_controlnet(root / "inpaint", tiny_dir, seed=3, inpaint=True)),
            "union": str(write_controlnet(root / "union", tiny_dir, seed=1))}


@pytest.fixture(scope="module")
def pipe(tiny_dir, controlnet_dirs):
    pipe = QwenImageControlNetInpaintPipeline.from_pretrained(
        tiny_dir, controlnet=QwenImageControlNetModel.from_pretrained(controlnet_dirs["inpaint"]))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def runner(tiny_dir, controlnet_dirs):
    return DenoiseRunner.load(str(tiny_dir), controlnets=controlnet_dirs)


@pytest.fixture(scope="module")
def vae(pipe):
    return VaeRunner(pipe.vae)


def repaint_mask(seed: int, height: int = HEIGHT, width: int = WIDTH) -> np.ndarray:
    """uint8 ``[H, W]``, 1 repaints: a rectangle (off the 8-pixel grid on one side) and a few scattered pixels."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((height, width), np.uint8)
    top, left = rng.integers(4, height // 3), rng.integers(4, width // 3)
    mask[top : top + height // 2 + 3, left : left + width // 2] = 1
    mask[rng.integers(0, height, 20), rng.integers(0, width, 20)] = 1
    return mask


def white_is_repaint(mask: np.ndarray) -> Image.Image:
    """diffusers' control_mask: white repaints."""
    return Image.fromarray(mask * 255, mode="L")


def embeds(pipe, prompt: str) -> PromptEmbeds:
    with torch.no_grad():
        values, mask = pipe.encode_prompt(prompt, device="cpu")
    assert mask is None
    return PromptEmbeds(values[0])


def test_the_masked_control_latents_equal_prepare_image_with_mask(pipe, vae):
    image, mask = np.asarray(source_image(WIDTH, HEIGHT, seed=4)), repaint_mask(1)
    torch.manual_seed(7)  # diffusers samples from the global generator
    with torch.no_grad():
        expected = pipe.prepare_image_with_mask(Image.fromarray(image), white_is_repaint(mask), WIDTH, HEIGHT, 1, 1,
                                                "cpu", pipe.vae.dtype)[0]
    got = vae.encode([image], [7], [0], [mask])[0].latents
    assert got.shape == expected.shape == ((HEIGHT // 16) * (WIDTH // 16), 68)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    # the mask matters twice: as the 17th channel and through the blacked-out pixels
    plain = vae.encode([image], [7], [0])[0].latents
    assert (plain - got[:, :64]).abs().max() > 1e-2
    assert set(got[:, 64:].unique().tolist()) == {0.0, 1.0}


def test_masked_and_plain_encodes_share_a_batch(vae):
    """Seeds, draws and masks never split a VAE batch: each row equals itself encoded alone."""
    from omni_ray.records import ImageEncodeRequest, VaeBatch

    images = [np.asarray(source_image(WIDTH, HEIGHT, seed=s)) for s in (1, 2)]
    requests = [ImageEncodeRequest("masked", images[0], 3, 0, repaint_mask(2)),
                ImageEncodeRequest("plain", images[1], 3, 0), ImageEncodeRequest("mode", images[0]),
                ImageEncodeRequest("masked-2", images[1], 4, 1, repaint_mask(3))]
    output = VaeRunner.execute_model(vae, VaeBatch(requests))
    assert not output.errors
    for request in requests:
        alone = vae.encode([request.image], [request.seed], [request.draw], [request.mask])[0].latents
        assert_reordered(output.finished[request.request_id].latents, alone, request.request_id)


def control_latents(vae, image: np.ndarray, mask: np.ndarray | None, seed: int, draw: int = 0):
    return vae.encode([image], [seed], [draw], [mask])[0]


CASES = {"CFG": True, "no CFG": False}


@pytest.mark.parametrize("case", list(CASES))
def test_the_runner_equals_the_inpaint_pipeline(pipe, runner, vae, case):
    cfg = CASES[case]
    steps, seed, scale = 4, 5, 0.9
    image, mask = np.asarray(source_image(WIDTH, HEIGHT, seed=6)), repaint_mask(4)
    prompt, negative = embeds(pipe, "a green taxi on the road"), embeds(pipe, "blurry")
    torch.manual_seed(seed)
    expected = pipe(
        prompt_embeds=prompt.embeds[None], negative_prompt_embeds=negative.embeds[None] if cfg else None,
        true_cfg_scale=4.0 if cfg else 1.0, height=HEIGHT, width=WIDTH, num_inference_steps=steps,
        control_image=Image.fromarray(image), control_mask=white_is_repaint(mask),
        controlnet_conditioning_scale=scale, generator=torch.Generator("cpu").manual_seed(seed),
        output_type="latent",
    ).images[0]
    params = DenoiseParams(HEIGHT, WIDTH, steps, seed, 4.0, true_cfg=cfg,
                           controls=(Control("inpaint", scale, mask=True),))
    state = runner.prepare(params, prompt, negative if cfg else None,
                           controls=(control_latents(vae, image, mask, seed),))
    while not state.is_finished:
        runner.step([state])
    got = runner.finish(state).latents
    diff = (got - expected).abs().max().item()
    print(f"inpainting ControlNet, {case}: max |ours - diffusers| = {diff:.2e}")
    assert diff <= PIPELINE_TOLERANCE
    plain = DenoiseParams(HEIGHT, WIDTH, steps, seed, 4.0, true_cfg=cfg)
    state = runner.prepare(plain, prompt, negative if cfg else None)
    while not state.is_finished:
        runner.step([state])
    assert (runner.finish(state).latents - got).abs().max() > 0.05  # the control moved the image


def run_together(runner, requests):
    states = [runner.prepare(params, prompt, negative, controls=controls)
              for params, prompt, negative, controls in requests]
    while not states[0].is_finished:
        runner.step(states)
    return [runner.finish(state).latents for state in states]


@pytest.mark.parametrize("cfg", [True, False], ids=["CFG", "no CFG"])
def test_a_step_batch_with_inpainting_and_plain_control_rows_equals_each_alone(pipe, runner, vae, cfg):
    """Rows: the inpainting ControlNet alone; the union alone; both in one request (the plain control's sample
    drawn from the image's generator before the noise, the inpainting one's apart); none; the first at another
    scale."""
    prompts = [embeds(pipe, p) for p in ("a red cat", "a lighthouse", "a kite over a beach", "a cup", "a red cat")]
    negative = embeds(pipe, "dark") if cfg else None
    image, other = np.asarray(source_image(WIDTH, HEIGHT, seed=8)), np.asarray(source_image(WIDTH, HEIGHT, seed=9))
    mask = repaint_mask(5)
    choices = [
        ((Control("inpaint", mask=True),), lambda seed: (control_latents(vae, image, mask, seed),)),
        ((Control("union", 0.8),), lambda seed: (control_latents(vae, other, None, seed),)),
        ((Control("union", 0.7), Control("inpaint", 1.1, 0.0, 0.5, mask=True)),
         lambda seed: (control_latents(vae, other, None, seed), control_latents(vae, image, mask, seed))),
        ((), lambda seed: ()),
        ((Control("inpaint", 0.4, mask=True),), lambda seed: (control_latents(vae, image, mask, seed),)),
    ]
    requests = []
    for i, (controls, latents) in enumerate(choices):
        seed = 40 + i % 4
        params = DenoiseParams(HEIGHT, WIDTH, 4, seed, 4.0, true_cfg=cfg, controls=controls)
        requests.append((params, prompts[i], negative, latents(seed)))
    together = run_together(runner, requests)
    for i, (request, got) in enumerate(zip(requests, together)):
        assert_reordered(got, run_together(runner, [request])[0], i)
    assert (together[0] - together[4]).abs().max() > 0.05  # rows 0 and 4 differ by the inpainting scale only


def test_a_mask_must_match_its_controlnet(pipe, runner, vae):
    image, mask = np.asarray(source_image(WIDTH, HEIGHT, seed=1)), repaint_mask(1)
    prompt = embeds(pipe, "a red cat")
    masked, plain = control_latents(vae, image, mask, 0), control_latents(vae, image, None, 0)
    cases = [
        (Control("inpaint"), plain),  # an inpainting ControlNet without a mask
        (Control("inpaint", mask=True), plain),  # said masked, but 64 channels
        (Control("union", mask=True), masked),  # a mask on a plain ControlNet
        (Control("union"), masked),  # 68 channels for a plain one
    ]
    for control, latents in cases:
        with pytest.raises(ValueError, match="^control: "):
            runner.prepare(DenoiseParams(HEIGHT, WIDTH, 2, 0, controls=(control,)), prompt, controls=(latents,))


def test_the_runner_refuses_other_extra_condition_channels(tiny_dir, tmp_path):
    from omni_ray.runners.denoise import check_controlnets

    net = QwenImageControlNetModel.from_pretrained(write_controlnet(tmp_path / "c", tiny_dir, num_layers=1))
    runner_transformer = DenoiseRunner.load(str(tiny_dir)).transformer
    check_controlnets(runner_transformer, {"ok": net})
    odd = QwenImageControlNetModel.from_config({**net.config, "extra_condition_channels": 1})
    with pytest.raises(ValueError, match="^controlnets: 'odd' takes 1 extra condition channels"):
        check_controlnets(runner_transformer, {"odd": odd})
