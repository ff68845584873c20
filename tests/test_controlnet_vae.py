"""A ControlNet's control images as the VAE encodes them (issue 39): the k-th control image of a request is the k-th
sample its seed's generator draws, as diffusers' QwenImageControlNetPipeline samples its control images in turn
from one generator (``retrieve_latents``) before it draws the noise."""

import numpy as np
import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.qwenimage.pipeline_qwenimage_controlnet import QwenImageControlNetPipeline, retrieve_latents
from PIL import Image

from omni_ray.checkpoints.tiny import build_vae
from omni_ray.records import ImageEncodeRequest, VaeBatch
from omni_ray.runners.vae import VaeRunner

HEIGHT, WIDTH = 64, 96


def picture(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    planes = [128 + 100 * np.sin(x / (5 + 2 * c) + y / (9 + c) + seed) for c in range(3)]
    return (np.stack(planes, -1) + rng.normal(0, 6, (HEIGHT, WIDTH, 3))).clip(0, 255).astype(np.uint8)


def diffusers_control_latents(vae, images: list[np.ndarray], seed: int) -> list[torch.Tensor]:
    """QwenImageControlNetPipeline's step 3 for a QwenImageMultiControlNetModel: each control image preprocessed at
    (height, width), encoded, sampled with the pipeline's one generator in turn, normalised and packed."""
    processor = VaeImageProcessor(vae_scale_factor=8 * 2)
    generator = torch.Generator("cpu").manual_seed(seed)
    mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
    packed = []
    with torch.no_grad():
        for image in images:
            pixels = processor.preprocess(Image.fromarray(image), height=HEIGHT, width=WIDTH).unsqueeze(2)
            latents = (retrieve_latents(vae.encode(pixels), generator=generator) - mean) * inverse_std
            latents = latents.permute(0, 2, 1, 3, 4)
            packed.append(QwenImageControlNetPipeline._pack_latents(latents, 1, latents.shape[2], latents.shape[3],
                                                                    latents.shape[4])[0])
    return packed


def test_the_kth_control_image_is_the_kth_sample_of_the_seeds_generator_as_diffusers_draws_them():
    vae = build_vae(seed=0).eval()
    runner = VaeRunner(vae)
    images = [picture(1), picture(2)]
    expected = diffusers_control_latents(vae, images, seed=7)
    # One batch, as the engine forms it: both controls of image 0 (seed 7) and the second control of image 1 (seed 8)
    # beside an edit's mode encode of the same size; seeds and draws never split a batch.
    batch = VaeBatch([ImageEncodeRequest("c0", images[0], 7, draw=0), ImageEncodeRequest("c1", images[1], 7, draw=1),
                      ImageEncodeRequest("mode", images[1]), ImageEncodeRequest("other", images[1], 8, draw=1)])
    output = runner.execute_model(batch)
    assert not output.errors
    for request_id, want in zip(("c0", "c1"), expected):
        got = output.finished[request_id].latents
        assert got.shape == want.shape == ((HEIGHT // 16) * (WIDTH // 16), 64)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # the draw matters: the second control's sample is not the first draw of its seed, nor the mode
    first_draw = runner.encode([images[1]], [7])[0].latents
    assert (first_draw - expected[1]).abs().max() > 1e-2
    assert (output.finished["mode"].latents - expected[1]).abs().max() > 1e-2
    assert (output.finished["other"].latents - expected[1]).abs().max() > 1e-2  # another image's seed


def test_the_reference_helper_runs_diffusers_controlnet_pipeline_with_two_control_images(tiny_dir):
    """``testing.reference.reference_controlnet``, which the end-to-end parity test reads, runs diffusers' pipeline
    over the tiny checkpoint with two control images on one ControlNet-Union (built from its transformer here:
    diffusers' multi-model holds one net): images of the control images' size, one seed giving one image, and the
    second control image mattering."""
    from diffusers import QwenImageControlNetModel, QwenImageMultiControlNetModel, QwenImagePipeline

    from testing.reference import reference_controlnet

    base = QwenImagePipeline.from_pretrained(tiny_dir)
    config = base.transformer.config
    torch.manual_seed(0)
    union = QwenImageControlNetModel.from_transformer(base.transformer, num_layers=1,
                                                      attention_head_dim=config.attention_head_dim,
                                                      num_attention_heads=config.num_attention_heads)
    with torch.no_grad():  # from_transformer zero-initialises the residual projections: nothing would change
        for block in union.controlnet_blocks:
            block.weight.normal_(0, 0.2)
        union.controlnet_x_embedder.weight.normal_(0, 0.2)
    pipe = QwenImageControlNetPipeline(**base.components, controlnet=QwenImageMultiControlNetModel([union]))
    options = {"prompt": "a house", "num_inference_steps": 2, "controlnet_conditioning_scale": [0.5, 1.0],
               "control_guidance_start": [0.0, 0.5], "control_guidance_end": [1.0, 1.0]}
    images = [picture(1), picture(2)]
    first = reference_controlnet(pipe, images, seed=3, **options)
    assert first.shape == (HEIGHT, WIDTH, 3) and first.dtype == np.uint8
    assert np.array_equal(first, reference_controlnet(pipe, images, seed=3, **options))
    other = reference_controlnet(pipe, [images[0], picture(5)], seed=3, **options)
    assert np.abs(other.astype(int) - first.astype(int)).max() > 0
