"""Qwen-Image-Layered on the VAE runner (``VaeRunner`` over an RGBA ``AutoencoderKLQwenImage``): layered latents
decode as ``QwenImageLayeredPipeline`` decodes them after its last step (the composite dropped, each layer a
one-frame video, RGBA PIL images bottom to top), the input image encodes as its ``prepare_latents`` encodes it, a
layered request's layers share a VAE call with other requests' frames without changing a pixel, and what the
runner cannot run fails alone with a 400."""

import functools
import types

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLQwenImage, QwenImageLayeredPipeline
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from omni_ray.checkpoints.parts import randomised
from omni_ray.checkpoints.tiny import build_vae
from omni_ray.engine.core import EngineCore
from omni_ray.engine.vae_scheduler import VaeScheduler
from omni_ray.errors import RefusedError
from omni_ray.records import DecodeRequest, ImageEncodeRequest, Latents, VaeBatch
from omni_ray.runners.simulated import SimulatedVae
from omni_ray.runners.vae import VaeRunner

HEIGHT, WIDTH = 64, 96
Z_DIM = 16


def write_vae(out, channels: int, seed: int):
    """The tiny checkpoint's VAE config (``tiny.build_vae``) reading ``channels`` image channels, with seeded random
    weights, saved under ``out/vae`` as a checkpoint's."""
    config = {key: value for key, value in build_vae(0).config.items() if not key.startswith("_")}
    torch.manual_seed(seed)
    vae = randomised(AutoencoderKLQwenImage(**{**config, "input_channels": channels}), seed)
    vae.save_pretrained(out / "vae")
    return out


@pytest.fixture(scope="module")
def rgba_dir(tmp_path_factory):
    return write_vae(tmp_path_factory.mktemp("ckpt") / "tiny-rgba-vae", 4, seed=7)


@pytest.fixture(scope="module")
def runner(rgba_dir):
    return VaeRunner.load(str(rgba_dir))


@pytest.fixture(scope="module")
def reference(rgba_dir):
    return AutoencoderKLQwenImage.from_pretrained(rgba_dir, subfolder="vae").eval()


@pytest.fixture(scope="module")
def rgb_runner(tmp_path_factory):
    return VaeRunner.load(str(write_vae(tmp_path_factory.mktemp("ckpt") / "tiny-rgb-vae", 3, seed=7)))


def layered(seed: int, layers: int, height: int = HEIGHT, width: int = WIDTH) -> Latents:
    """A DiT's layered latents: ``layers + 1`` random frames packed as the pipeline packs them (one frame after
    another, the composite first)."""
    h, w = height // 8, width // 8
    frames = torch.randn(1, layers + 1, Z_DIM, h, w, generator=torch.Generator().manual_seed(seed))
    packed = QwenImageLayeredPipeline._pack_latents(frames, 1, Z_DIM, h, w, layers + 1)
    return Latents(packed[0].contiguous(), height, width, layers=layers)


def plain(seed: int, height: int = HEIGHT, width: int = WIDTH) -> Latents:
    tokens = (height // 16) * (width // 16)
    return Latents(torch.randn(tokens, 64, generator=torch.Generator().manual_seed(seed)), height, width)


def rgba_image(seed: int, height: int = HEIGHT, width: int = WIDTH, channels: int = 4) -> np.ndarray:
    """A smooth uint8 image with noise, its alpha varying too."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    planes = [128 + 100 * np.sin(xs / (7 + 3 * c) + ys / (11 + c) + seed) for c in range(channels)]
    return np.clip(np.stack(planes, axis=-1) + rng.normal(0, 12, (height, width, channels)), 0, 255).astype(np.uint8)


@torch.inference_mode()
def pipeline_decode(vae, item: Latents) -> np.ndarray:
    """The end of ``QwenImageLayeredPipeline.__call__`` (output_type "pil") on one request's packed latents: unpack the
    ``layers + 1`` frames, denormalise, drop the first, decode each frame as a one-frame video, postprocess; the PIL
    images as uint8 ``[layers, H, W, 4]``."""
    processor = VaeImageProcessor(vae_scale_factor=16)
    latents = QwenImageLayeredPipeline._unpack_latents(item.latents[None], item.height, item.width, item.layers, 8)
    latents = latents.to(vae.dtype)
    mean = torch.tensor(vae.config.latents_mean).view(1, Z_DIM, 1, 1, 1).to(latents.dtype)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, Z_DIM, 1, 1, 1).to(latents.dtype)
    latents = latents / inverse_std + mean
    _, c, _, h, w = latents.shape
    latents = latents[:, :, 1:].permute(0, 2, 1, 3, 4).reshape(-1, c, 1, h, w)
    image = vae.decode(latents, return_dict=False)[0].squeeze(2)
    images = processor.postprocess(image, output_type="pil")
    assert all(image.mode == "RGBA" for image in images)
    return np.stack([np.array(image) for image in images])


@torch.inference_mode()
def pipeline_image_latents(vae, pixels: np.ndarray, layers: int = 2) -> torch.Tensor:
    """``QwenImageLayeredPipeline``'s image latents ``[tokens, 64]`` of an RGBA image given at its working size: its
    step 2 (resize, which keeps a working-size image, and preprocess, then ``unsqueeze(2)``) and ``prepare_latents``,
    called on a stand-in holding what they read of the pipeline."""
    height, width = pixels.shape[:2]
    processor = VaeImageProcessor(vae_scale_factor=16)
    image = processor.resize(Image.fromarray(pixels), height, width)
    image = processor.preprocess(image, height, width)
    assert image.shape == (1, 4, height, width) and -1.0 <= image.min() and image.max() <= 1.0  # RGBA kept
    pipe = types.SimpleNamespace(vae=vae, vae_scale_factor=8, latent_channels=Z_DIM,
                                 _pack_latents=QwenImageLayeredPipeline._pack_latents)
    pipe._encode_vae_image = functools.partial(QwenImageLayeredPipeline._encode_vae_image, pipe)
    _, image_latents = QwenImageLayeredPipeline.prepare_latents(
        pipe, image.unsqueeze(2), 1, Z_DIM, height, width, layers, torch.float32, "cpu",
        torch.Generator().manual_seed(0))
    return image_latents[0]


def level_diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


@pytest.mark.parametrize("layers", [2, 4])
def test_layered_latents_decode_as_the_pipeline_does(runner, reference, layers):
    """Each layer within one level of the pipeline's RGBA image, the composite dropped; previews decode alike."""
    item = layered(layers, layers)
    expected = pipeline_decode(reference, item)
    assert expected.shape == (layers, HEIGHT, WIDTH, 4)
    output = runner.execute_model(VaeBatch([DecodeRequest("r", item)]))
    assert not output.errors
    pixels = output.finished["r"].pixels
    assert pixels.dtype == np.uint8 and pixels.shape == (layers, HEIGHT, WIDTH, 4)
    assert level_diff(pixels, expected) <= 1
    assert np.abs(pixels[..., 3].astype(int) - pixels[..., 0]).max() > 10  # alpha is a channel of its own
    preview = runner.execute_model(VaeBatch([DecodeRequest("p", item, preview=True)])).finished["p"].pixels
    assert np.array_equal(preview, pixels)


def test_output_modes_keep_the_layered_latents(runner):
    item = layered(0, 2)
    output = runner.execute_model(VaeBatch([DecodeRequest("l", item, "latents"), DecodeRequest("b", item, "both")]))
    assert output.finished["l"].pixels is None and output.finished["l"].latents is item
    both = output.finished["b"]
    assert both.latents.layers == 2 and both.pixels.shape == (2, HEIGHT, WIDTH, 4)


def test_a_batch_of_layered_and_plain_decodes_equals_each_alone(runner):
    """Two layered requests of 2 and 3 layers and a plain one share one VAE call (6 frames); the frames split back to
    their requests, each request's pixels the same as decoded alone."""
    items = {"two": layered(10, 2), "plain": plain(11), "three": layered(12, 3)}
    core = EngineCore(VaeScheduler(max_batch_size=6), runner)
    for request_id, item in items.items():
        core.add_request(DecodeRequest(request_id, item))
    outputs = core.step()
    assert [o.request_id for o in outputs] == ["two", "plain", "three"] and not core.has_unfinished_requests()
    results = {o.request_id: o.result.pixels for o in outputs}
    assert results["plain"].shape == (HEIGHT, WIDTH, 4)
    assert results["two"].shape == (2, HEIGHT, WIDTH, 4) and results["three"].shape == (3, HEIGHT, WIDTH, 4)
    for request_id, item in items.items():
        alone = runner.execute_model(VaeBatch([DecodeRequest(request_id, item)])).finished[request_id].pixels
        assert level_diff(results[request_id], alone) <= 1, request_id
    assert level_diff(results["two"][0], results["two"][1]) > 10  # each layer its own frame


def test_the_scheduler_counts_a_layered_requests_frames():
    """``max_batch_size`` bounds the frames of a call: a request joins while they fit, and one of more layers than
    the bound runs alone."""
    scheduler = VaeScheduler(max_batch_size=4)
    for request_id, item in (("three", layered(0, 3)), ("two", layered(1, 2)), ("one", plain(2)),
                             ("eight", layered(3, 8)), ("after", plain(4))):
        scheduler.add_request(DecodeRequest(request_id, item))
    batches = []
    while scheduler.has_unfinished_requests():
        batches.append(scheduler.schedule().request_ids)
    assert batches == [["three", "one"], ["two", "after"], ["eight"]]


def test_an_rgba_image_encodes_as_the_pipeline_encodes_it(runner, reference):
    """Two images of one size in one call: each the pipeline's mode, normalised and packed (one frame)."""
    images = [rgba_image(0), rgba_image(1)]
    output = runner.execute_model(VaeBatch([ImageEncodeRequest(f"i{k}", image) for k, image in enumerate(images)]))
    assert not output.errors
    for k, image in enumerate(images):
        ours = output.finished[f"i{k}"]
        expected = pipeline_image_latents(reference, image)
        assert ours.layers == 0 and (ours.height, ours.width) == (HEIGHT, WIDTH)
        assert ours.latents.shape == expected.shape == ((HEIGHT // 16) * (WIDTH // 16), 64)
        torch.testing.assert_close(ours.latents, expected, rtol=1e-4, atol=1e-4)
    assert (output.finished["i0"].latents - output.finished["i1"].latents).abs().max() > 0.1


def test_what_the_runner_cannot_run_fails_alone_with_a_400(runner, rgb_runner):
    good = layered(0, 2)
    short = Latents(good.latents[:-1].clone(), HEIGHT, WIDTH, layers=2)  # rows that are not 3 frames' tokens
    wrong_count = Latents(good.latents, HEIGHT, WIDTH, layers=3)  # 3 frames' rows, said to be 4
    batch = VaeBatch([DecodeRequest("good", good), DecodeRequest("short", short),
                      DecodeRequest("wrong-count", wrong_count)])
    output = runner.execute_model(batch)
    assert list(output.finished) == ["good"] and sorted(output.errors) == ["short", "wrong-count"]
    for error in output.errors.values():
        assert isinstance(error, RefusedError) and error.status_code == 400 and "frames" in str(error)

    rgb, rgba = rgba_image(0, channels=3), rgba_image(0)
    encodes = VaeBatch([ImageEncodeRequest("rgb", rgb), ImageEncodeRequest("rgba", rgba)])
    output = runner.execute_model(encodes)
    assert list(output.finished) == ["rgba"] and "RGBA" in str(output.errors["rgb"])
    assert output.errors["rgb"].status_code == 400
    output = rgb_runner.execute_model(encodes)
    assert list(output.finished) == ["rgb"] and "RGB images" in str(output.errors["rgba"])
    assert output.errors["rgba"].status_code == 400

    output = rgb_runner.execute_model(VaeBatch([DecodeRequest("layered", good), DecodeRequest("plain", plain(0))]))
    assert list(output.finished) == ["plain"] and output.finished["plain"].pixels.shape == (HEIGHT, WIDTH, 3)
    assert isinstance(output.errors["layered"], RefusedError) and "RGBA layers" in str(output.errors["layered"])


def test_the_simulated_vae_answers_layered_latents_with_rgba_layers():
    vae = SimulatedVae(torch.float32)
    output = vae.execute_model(VaeBatch([DecodeRequest("l", layered(0, 3)), DecodeRequest("p", plain(1))]))
    layers = output.finished["l"].pixels
    assert layers.dtype == np.uint8 and layers.shape == (3, HEIGHT, WIDTH, 4) and (layers[..., 3] == 255).all()
    assert output.finished["p"].pixels.shape == (HEIGHT, WIDTH, 3)
