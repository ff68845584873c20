"""The VAE engine decodes same-size latents in batches and honours each request's output mode."""

import numpy as np
import pytest
import torch
from PIL import Image

from omni_ray.engine.core import EngineCore
from omni_ray.engine.vae_scheduler import VaeScheduler
from omni_ray.records import DecodeRequest, Latents
from omni_ray.runners.packing import pack_latents, unpack_latents
from omni_ray.runners.vae import VaeRunner
from testing.numerics import assert_reordered, assert_within_a_level


@pytest.fixture(scope="module")
def decoder(tiny_dir):
    return VaeRunner.load(str(tiny_dir))


def latents(seed, height=64, width=64):
    tokens = (height // 16) * (width // 16)
    return Latents(torch.randn(tokens, 64, generator=torch.Generator().manual_seed(seed)), height, width)


def test_batched_decode_matches_one_at_a_time(decoder):
    items = [latents(seed) for seed in range(3)] + [latents(9, 64, 96)]
    modes = ["pixels", "both", "latents", "pixels"]
    core = EngineCore(VaeScheduler(max_batch_size=4), decoder)
    for i, (item, mode) in enumerate(zip(items, modes)):
        core.add_request(DecodeRequest(f"d{i}", item, mode))
    first, second = core.step(), core.step()
    assert [o.request_id for o in first] == ["d0", "d1", "d2"]  # the square ones share a call
    assert [o.request_id for o in second] == ["d3"]
    assert not core.has_unfinished_requests()
    results = {o.request_id: o.result for o in first + second}
    for i, (item, mode) in enumerate(zip(items, modes)):
        result = results[f"d{i}"]
        assert (result.latents is not None) == (mode != "pixels")
        if mode == "latents":
            assert result.pixels is None
            continue
        alone = decoder.decode([item])[0]
        assert result.pixels.dtype == np.uint8 and result.pixels.shape == (item.height, item.width, 3)
        # An image's pixels depend on its latents alone, not on what shared its VAE call (the convolutions may sum
        # in another order for another batch size: a level at most).
        assert_within_a_level(result.pixels, alone, i)
    assert np.abs(results["d0"].pixels.astype(int) - results["d1"].pixels.astype(int)).max() > 10


def test_a_bad_latent_in_a_batched_decode_fails_alone(decoder):
    """One request whose latents do not fit its size makes the batched call raise: the runner decodes each request
    alone, so only it fails, and its batch-mates and the request queued behind them get their images."""
    good = [latents(seed) for seed in range(2)]
    bad = Latents(torch.randn(5, 64), 64, 64)  # 5 tokens where a 64x64 image has 16
    core = EngineCore(VaeScheduler(max_batch_size=3), decoder)
    for request_id, item in (("g0", good[0]), ("bad", bad), ("g1", good[1]), ("queued", latents(7))):
        core.add_request(DecodeRequest(request_id, item))
    outputs = core.step() + core.step()
    errors = {o.request_id: o.error for o in outputs if o.finish_reason == "error"}
    assert list(errors) == ["bad"] and "RuntimeError" in str(errors["bad"])
    results = {o.request_id: o.result for o in outputs if o.finish_reason == "stop"}
    assert sorted(results) == ["g0", "g1", "queued"]
    for request_id, item in (("g0", good[0]), ("g1", good[1])):
        assert_within_a_level(results[request_id].pixels, decoder.decode([item])[0], request_id)


def test_out_of_memory_for_one_request_is_a_503_for_it_alone(decoder, monkeypatch):
    from omni_ray.errors import OverloadedError

    decode = decoder.decode

    def decode_or_run_out(batch):
        if any(item.height == 96 for item in batch):  # the large one does not fit
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return decode(batch)

    monkeypatch.setattr(decoder, "decode", decode_or_run_out)
    core = EngineCore(VaeScheduler(max_batch_size=4), decoder)
    core.add_request(DecodeRequest("large", latents(0, 96, 96)))
    core.add_request(DecodeRequest("small", latents(1)))
    outputs = {o.request_id: o for o in core.step() + core.step()}
    assert isinstance(outputs["large"].error, OverloadedError) and outputs["large"].error.status_code == 503
    assert "out of memory" in str(outputs["large"].error)
    assert outputs["small"].result.pixels.shape == (64, 64, 3)


@pytest.mark.parametrize("batch,height,width", [(1, 64, 64), (3, 64, 96), (2, 256, 256)])
def test_single_frame_vae_is_diffusers_vae_within_one_level(decoder, tiny_dir, batch, height, width):
    """The VAE runs as 2-D convolutions on one frame (runners/vae_frame.py): its pixels are diffusers'
    ``AutoencoderKLQwenImage.decode`` within one level and its latents diffusers' encode within float rounding."""
    from diffusers import AutoencoderKLQwenImage

    reference = AutoencoderKLQwenImage.from_pretrained(tiny_dir, subfolder="vae").eval()
    items = [latents(seed, height, width) for seed in range(batch)]
    packed = torch.stack([item.latents for item in items])
    unpacked = unpack_latents(packed, height, width)
    z_dim = reference.config.z_dim
    mean = torch.tensor(reference.config.latents_mean).view(1, z_dim, 1, 1, 1)
    std = torch.tensor(reference.config.latents_std).view(1, z_dim, 1, 1, 1)
    with torch.inference_mode():
        sample = reference.decode(unpacked * std + mean).sample  # [B, 3, 1, H, W] in [-1, 1]
    expected = ((sample[:, :, 0].permute(0, 2, 3, 1) / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    pixels = decoder.decode(items)
    assert pixels.shape == expected.shape and expected.std() > 10
    assert np.abs(pixels.astype(int) - expected.astype(int)).max() <= 1

    images = list(pixels)
    processed = torch.cat([decoder.image_processor.preprocess(Image.fromarray(image)) for image in images])
    with torch.inference_mode():
        moments = reference.encode(processed.unsqueeze(2)).latent_dist.mode()
    expected_latents = pack_latents(((moments - mean) / std).transpose(1, 2))
    ours = torch.stack([item.latents for item in decoder.encode(images)])
    assert (ours - expected_latents).abs().max().item() < 1e-4
    assert_reordered(decoder.encode(images[:1])[0].latents, ours[0])  # its batch-mates change nothing


def test_the_runner_leaves_the_vae_it_was_built_from_as_it_was(tiny_dir):
    """The 2-D modules are copies: their channels-last layout does not reach the diffusers VAE they came from (which a
    benchmark times beside them)."""
    from diffusers import AutoencoderKLQwenImage

    vae = AutoencoderKLQwenImage.from_pretrained(tiny_dir, subfolder="vae")
    before = {name: (p.stride(), p.data_ptr()) for name, p in vae.named_parameters()}
    VaeRunner(vae)
    assert {name: (p.stride(), p.data_ptr()) for name, p in vae.named_parameters()} == before
