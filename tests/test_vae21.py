"""Qwen-Image 2.1's VAE runner (``VaeRunner21``) decodes as ``QwenImage21Pipeline`` decodes after its last step and
encodes condition images as its ``prepare_latents`` does; a batch-mate changes a pixel by one level at most (float
rounding), and a bad request fails alone."""

import functools
import json
import pathlib
import types

import numpy as np
import pytest
import torch
import yaml
from diffusers import AutoencoderKLQwenImage21, QwenImage21Pipeline
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions
from PIL import Image

from omni_ray.config import parse_config
from omni_ray.engine.builders import build_vae_runner
from omni_ray.engine.core import EngineCore
from omni_ray.engine.vae_scheduler import VaeScheduler
from omni_ray.errors import OverloadedError
from omni_ray.families.qwen_image_2_1.vae import VaeRunner21
from omni_ray.records import Decoded, DecodeRequest, ImageEncodeRequest, Latents, VaeBatch
from testing.numerics import assert_reordered

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    """The tiny 2.1 checkpoint's VAE (``tiny21.build_vae``, seed 0) beside a model index naming 2.1's pipeline: what
    the runner and a 2.1 preset read of a checkpoint."""
    from omni_ray.families.qwen_image_2_1.tiny import build_vae

    out = tmp_path_factory.mktemp("ckpt") / "tiny-2.1-vae"
    build_vae(0).save_pretrained(out / "vae")
    (out / "model_index.json").write_text(json.dumps({"_class_name": "QwenImage21Pipeline"}))
    return out


@pytest.fixture(scope="module")
def runner(vae_dir):
    return VaeRunner21.load(str(vae_dir))


@pytest.fixture(scope="module")
def reference(vae_dir):
    return AutoencoderKLQwenImage21.from_pretrained(vae_dir, subfolder="vae").eval()


def latents(seed, height=128, width=192):
    tokens = (height // 16) * (width // 16)
    return Latents(torch.randn(tokens, 64, generator=torch.Generator().manual_seed(seed)), height, width)


def image(seed, height, width, channels):
    """A smooth uint8 image with some noise (RGBA: an alpha that varies too)."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    planes = [128 + 100 * np.sin(xs / (7 + 3 * c) + ys / (11 + c) + seed) for c in range(channels)]
    pixels = np.stack(planes, axis=-1) + rng.normal(0, 12, (height, width, channels))
    return np.clip(pixels, 0, 255).astype(np.uint8)


@torch.inference_mode()
def pipeline_decode(vae, item: Latents) -> Image.Image:
    """The end of ``QwenImage21Pipeline.__call__`` on one image's packed latents (output_type "pil")."""
    processor = VaeImageProcessor(vae_scale_factor=16, vae_latent_channels=vae.config.z_dim)
    latents = QwenImage21Pipeline._unpack_latents(item.latents[None], item.height, item.width, 16)
    latents = latents.to(vae.dtype)
    latents_mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents.dtype)
    latents_std = torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(latents.dtype)
    latents = latents * latents_std + latents_mean
    decoded = vae.decode(latents, return_dict=False)[0][:, :, 0]
    return processor.postprocess(decoded, output_type="pil")[0]


@torch.inference_mode()
def pipeline_condition_latents(vae, pixels: np.ndarray) -> torch.Tensor:
    """``QwenImage21Pipeline``'s condition latents ``[tokens, 64]`` of one image given at its working size: its
    step 1 (to RGBA, preprocessed at the size ``calculate_dimensions`` gives for the image's own area) and
    ``prepare_latents``, called on a stand-in holding what they read of the pipeline."""
    height, width = pixels.shape[:2]
    img = Image.fromarray(pixels)
    if img.mode != "RGBA":
        img = img.convert("RGBA")
    input_width, input_height, _ = calculate_dimensions(height * width, width / height)
    assert (input_height, input_width) == (height, width)  # the image is at its working size
    processor = VaeImageProcessor(vae_scale_factor=16, vae_latent_channels=vae.config.z_dim)
    vae_image = processor.preprocess(img, width=input_width, height=input_height).unsqueeze(2)
    pipe = types.SimpleNamespace(vae=vae, vae_scale_factor=16, latent_channels=vae.config.z_dim,
                                 _pack_latents=QwenImage21Pipeline._pack_latents)
    pipe._encode_vae_image = functools.partial(QwenImage21Pipeline._encode_vae_image, pipe)
    _, condition = QwenImage21Pipeline.prepare_latents(pipe, [vae_image], 1, vae.config.z_dim, height, width,
                                                       torch.float32, "cpu", torch.Generator().manual_seed(0))
    return condition[0]


def level_diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


def test_decodes_as_the_pipeline_does_final_images_and_previews(runner, reference):
    """A batch of two (pixels, both) and a batch of previews: RGBA uint8 within one level of the pipeline's PIL
    image for each, and each image of a batch the same as decoded alone."""
    items = [latents(0), latents(1), latents(2)]
    finals = VaeBatch([DecodeRequest("a", items[0], "pixels"), DecodeRequest("b", items[1], "both")])
    previews = VaeBatch([DecodeRequest("p", items[2], preview=True), DecodeRequest("q", items[0], preview=True)])
    results = {**runner.execute_model(finals).finished, **runner.execute_model(previews).finished}
    diffs, alone = {}, {}
    for request_id, item in zip("abpq", [*items, items[0]]):
        result = results[request_id]
        assert isinstance(result, Decoded) and (result.latents is item) == (request_id == "b")
        expected = pipeline_decode(reference, item)
        assert expected.mode == "RGBA" and result.pixels.shape == (128, 192, 4) and result.pixels.dtype == np.uint8
        diffs[request_id] = level_diff(result.pixels, np.asarray(expected))
        # Batch-mates change a pixel by a level at most: oneDNN sums the decoder's conv_in (64 channels in) in
        # another order for a batch of one (diffusers' own decode differs by 7e-6 so between batch sizes).
        alone[request_id] = level_diff(result.pixels, runner.decode([item])[0])
    print("max uint8 level diff from the pipeline:", diffs, "from decoding alone:", alone)
    assert max(diffs.values()) <= 1 and max(alone.values()) <= 1
    assert results["a"].pixels.std() > 10 and level_diff(results["a"].pixels, results["b"].pixels) > 10
    assert np.array_equal(results["a"].pixels, results["q"].pixels)  # a preview decodes as a final image does


@pytest.mark.parametrize("channels,height,width", [(3, 64, 96), (4, 96, 64)])
def test_encodes_condition_images_as_the_pipeline_does(runner, reference, channels, height, width):
    """Two condition images (RGB, then RGBA at another size) in one VAE call: each one's latents the pipeline's
    condition latents within 1e-5, and the same as encoded alone."""
    images = [image(seed, height, width, channels) for seed in (0, 1)]
    batch = VaeBatch([ImageEncodeRequest(f"i{n}", pixels) for n, pixels in enumerate(images)])
    output = runner.execute_model(batch)
    assert not output.errors
    diffs = []
    for n, pixels in enumerate(images):
        result = output.finished[f"i{n}"]
        assert (result.height, result.width) == (height, width)
        assert result.latents.shape == ((height // 16) * (width // 16), 64)
        expected = pipeline_condition_latents(reference, pixels)
        diffs.append((result.latents - expected).abs().max().item())
        alone = runner.encode([pixels])[0].latents  # batch-mates change nothing (float rounding aside)
        assert_reordered(result.latents, alone, n)
    print(f"{channels} channels: max latent diff from the pipeline {max(diffs):.2e}")
    assert max(diffs) < 1e-5
    assert (output.finished["i0"].latents - output.finished["i1"].latents).abs().max() > 0.1
    if channels == 3:  # RGB reads as RGBA with alpha 255
        opaque = np.concatenate([images[0], np.full((height, width, 1), 255, np.uint8)], axis=-1)
        assert_reordered(runner.encode([opaque])[0].latents, output.finished["i0"].latents)


def test_a_bad_request_fails_alone(runner):
    """Latents that do not fit their size, a seeded encode (Qwen-Image's masked edit) and an image of two channels
    fail with errors saying why; their batch-mates get their results."""
    good = [latents(0, 64, 64), latents(1, 64, 64)]
    decodes = [DecodeRequest("g0", good[0]), DecodeRequest("bad", Latents(torch.randn(5, 64), 64, 64)),
               DecodeRequest("g1", good[1])]
    output = runner.execute_model(VaeBatch(decodes))
    assert list(output.errors) == ["bad"] and "(5, 64)" in str(output.errors["bad"])
    for request_id, item in zip(("g0", "g1"), good):
        assert level_diff(output.finished[request_id].pixels, runner.decode([item])[0]) <= 1

    pixels = image(0, 64, 64, 3)
    encodes = [ImageEncodeRequest("seeded", pixels, seed=3), ImageEncodeRequest("ok", pixels),
               ImageEncodeRequest("two-channel", pixels[:, :, :2].copy())]
    output = runner.execute_model(VaeBatch(encodes))
    assert sorted(output.errors) == ["seeded", "two-channel"] and list(output.finished) == ["ok"]
    assert "masked edit" in str(output.errors["seeded"]) and "not Qwen-Image 2.1's" in str(output.errors["seeded"])
    assert "RGB or RGBA" in str(output.errors["two-channel"])
    assert torch.equal(output.finished["ok"].latents, runner.encode([pixels])[0].latents)
    with pytest.raises(ValueError, match="masked edit"):
        runner.encode([pixels], seeds=[0])


def test_out_of_memory_in_a_batched_call_fails_only_the_request_that_does_not_fit(runner, monkeypatch):
    """The batched call raises: the engine core's runner retries each request alone, and only the one that does not
    fit fails (a 503)."""
    decode = runner.decode

    def decode_or_run_out(batch):
        if any(item.latents[0, 0] == 100.0 for item in batch):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return decode(batch)

    monkeypatch.setattr(runner, "decode", decode_or_run_out)
    large = latents(0, 64, 64)
    large.latents[0, 0] = 100.0
    core = EngineCore(VaeScheduler(max_batch_size=4), runner)
    core.add_request(DecodeRequest("large", large))
    core.add_request(DecodeRequest("small", latents(1, 64, 64)))
    outputs = {o.request_id: o for o in core.step()}
    assert isinstance(outputs["large"].error, OverloadedError) and outputs["large"].error.status_code == 503
    assert outputs["small"].result.pixels.shape == (64, 64, 4)


def test_tiling_and_a_gang_are_refused_and_the_vae_given_is_left_as_it_was(reference):
    before = {name: (p.stride(), p.data_ptr()) for name, p in reference.named_parameters()}
    VaeRunner21(reference)
    assert {name: (p.stride(), p.data_ptr()) for name, p in reference.named_parameters()} == before
    with pytest.raises(ValueError, match="vae.tiling"):
        VaeRunner21(reference, tiling=True)
    gang = types.SimpleNamespace(world=types.SimpleNamespace(size=2, rank=0))
    with pytest.raises(ValueError, match="vae.parallel"):
        VaeRunner21(reference, mesh=gang)


def test_a_2_1_preset_builds_this_runner(vae_dir):
    preset = yaml.safe_load((REPO / "stage_configs" / "qwen_image_2_1_tiny.yaml").read_text())
    preset["model"] = str(vae_dir)
    runner = build_vae_runner(parse_config(preset))
    assert isinstance(runner, VaeRunner21)
    out = runner.execute_model(VaeBatch([DecodeRequest("d", latents(0, 64, 64))]))
    assert out.finished["d"].pixels.shape == (64, 64, 4)
    preset["weights"] = "dummy"  # built from the checkpoint's VAE config with random weights
    assert isinstance(build_vae_runner(parse_config(preset)), VaeRunner21)
