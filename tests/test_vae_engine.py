"""The VAE engine decodes same-size latents in batches and honours each request's output mode."""

import numpy as np
import pytest
import torch

from omni_ray.engine.core import EngineCore
from omni_ray.engine.vae_scheduler import VAEScheduler
from omni_ray.stages.decode import DecodeRequest, VaeRunner
from omni_ray.stages.denoise import Latents


@pytest.fixture(scope="module")
def decoder(tiny_dir):
    return VaeRunner(str(tiny_dir))


def latents(seed, height=64, width=64):
    tokens = (height // 16) * (width // 16)
    return Latents(torch.randn(tokens, 64, generator=torch.Generator().manual_seed(seed)), height, width)


def test_batched_decode_matches_one_at_a_time(decoder):
    items = [latents(seed) for seed in range(3)] + [latents(9, 64, 96)]
    modes = ["pixels", "both", "latents", "pixels"]
    core = EngineCore(VAEScheduler(max_batch_size=4), decoder)
    for i, (item, mode) in enumerate(zip(items, modes)):
        core.add_request(DecodeRequest(f"d{i}", item, mode))
    first, second = core.step(), core.step()
    assert [o.request_id for o in first] == ["d0", "d1", "d2"]  # the square ones share a call
    assert [o.request_id for o in second] == ["d3"]
    assert not core.has_unfinished_requests()
    results = {o.request_id: o.pooling_output for o in first + second}
    for i, (item, mode) in enumerate(zip(items, modes)):
        result = results[f"d{i}"]
        assert (result.latents is not None) == (mode != "pixels")
        if mode == "latents":
            assert result.pixels is None
            continue
        alone = decoder.decode([item])[0]
        assert result.pixels.dtype == np.uint8 and result.pixels.shape == (item.height, item.width, 3)
        # A batch of three runs other conv kernels' blocking than a batch of one: rounding, at most one level.
        assert np.abs(result.pixels.astype(int) - alone.astype(int)).max() <= 1
    assert np.abs(results["d0"].pixels.astype(int) - results["d1"].pixels.astype(int)).max() > 10
