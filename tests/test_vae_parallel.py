"""The VAE decode split by latent rows: in bands on one device (``vae.tiling``) and over a gang of ranks
(``decode_patches``), each band with the rows of context its convolutions reach, against the whole-frame decode.

Measured on the CPU (float32): the banded and the gathered pixels equal the whole-frame decode's bit for bit, on the
tiny VAE and on Qwen-Image's full-size architecture with random weights. The tests allow 1e-5 (float rounding, should
another machine's kernels pick other algorithms for other shapes). The receptive field's edge weighs little: on the
tiny VAE one row less of context than the halo moves pixels by about 1e-6, two rows 1e-4, three 1e-3.
"""

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLQwenImage

from omni_ray.config import ParallelSettings
from omni_ray.records import Latents
from omni_ray.runners.packing import pack_latents
from omni_ray.runners.parallel.vae_patches import decode_patches
from omni_ray.runners.random_weights import random_model
from omni_ray.runners.vae import VaeRunner
from omni_ray.runners.vae_frame import FrameDecoder
from testing.gang import run_gang

TOLERANCE = 1e-5
SHAPES = [(2, 16, 12), (1, 15, 10)]  # (batch, latent rows, latent columns): an even split, and one padded to gather


def _decoder(vae: AutoencoderKLQwenImage) -> FrameDecoder:
    return FrameDecoder(vae).eval().to(memory_format=torch.channels_last)


def _latents(batch: int, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (1.5 * torch.randn(batch, 16, rows, cols, generator=generator)).contiguous(memory_format=torch.channels_last)


@pytest.fixture(scope="module")
def tiny_vae(tiny_dir):
    return AutoencoderKLQwenImage.from_pretrained(tiny_dir, subfolder="vae").eval()


@torch.inference_mode()
def test_bands_decode_the_whole_frame_s_pixels_and_one_row_less_of_context_would_not(tiny_vae):
    decoder = _decoder(tiny_vae)
    assert (decoder.halo, decoder.scale) == (9, 8)  # 4 convolutions per up block: 9 latent rows of reach
    latents = _latents(1, 40, 12)
    whole = decoder(latents)
    for band_rows in (4, 8, 13, 40):
        assert (decoder(latents, band_rows) - whole).abs().max().item() <= TOLERANCE
    decoder.halo -= 1  # every row of the halo counts: one less changes pixels (by little: the field's edge)
    assert (decoder(latents, 8) - whole).abs().max().item() > 0
    decoder.halo -= 2
    assert (decoder(latents, 8) - whole).abs().max().item() > 10 * TOLERANCE


@torch.inference_mode()
def test_bands_on_qwen_image_s_full_size_vae_are_exact():
    """Qwen-Image's VAE architecture (random weights): 3 residual blocks per up block, 13 latent rows of reach."""
    from omni_ray.checkpoints.full_size import CONFIG_DIR

    torch.manual_seed(0)
    config = AutoencoderKLQwenImage.load_config(CONFIG_DIR, subfolder="vae")
    decoder = _decoder(random_model(AutoencoderKLQwenImage, config, torch.float32, "cpu"))
    assert decoder.halo == 13
    latents = _latents(1, 32, 6)  # bands of 8 rows: two of the four crop context on both sides
    assert (decoder(latents, 8) - decoder(latents)).abs().max().item() <= TOLERANCE


def test_a_tiled_runner_decodes_the_untiled_runner_s_pixels(tiny_vae):
    """``vae.tiling``: 512x384 pixels are two bands of 32 latent rows."""
    generator = torch.Generator().manual_seed(1)
    items = [Latents(pack_latents(torch.randn(1, 1, 16, 64, 48, generator=generator))[0], 512, 384)]
    untiled = VaeRunner(tiny_vae).decode(items)
    tiled_runner = VaeRunner(tiny_vae, tiling=True)
    assert tiled_runner.band_rows == 32
    tiled = tiled_runner.decode(items)
    assert untiled.std() > 10 and np.array_equal(tiled, untiled)


def _decode_on_rank(mesh, model_dir: str) -> list[tuple[torch.Tensor, int]]:
    """Each shape decoded over the world, whole bands and bands of 4 rows per rank: (pixels, bytes sent)."""
    decoder = _decoder(AutoencoderKLQwenImage.from_pretrained(model_dir, subfolder="vae").eval())
    results = []
    for band_rows in (None, 4):
        for seed, shape in enumerate(SHAPES):
            before = mesh.world.sent["all_gather"]
            with torch.inference_mode():
                pixels = decode_patches(decoder, _latents(*shape, seed), mesh.world, band_rows)
            results.append((pixels, mesh.world.sent["all_gather"] - before))
    return results


def test_patches_over_two_ranks_gather_the_single_process_decode(tiny_dir, tiny_vae):
    ranks = 2
    per_rank = run_gang(_decode_on_rank, ParallelSettings(ulysses=ranks), str(tiny_dir))
    decoder = _decoder(tiny_vae)
    with torch.inference_mode():
        expected = [decoder(_latents(*shape, seed)) for seed, shape in enumerate(SHAPES)] * 2
    for rank_results in per_rank:
        for ((pixels, sent), whole, (batch, rows, cols)) in zip(rank_results, expected, SHAPES * 2):
            assert pixels.shape == whole.shape == (batch, 3, 8 * rows, 8 * cols)
            assert (pixels - whole).abs().max().item() <= TOLERANCE
            # one all-gather of this rank's pixel rows, padded to the longer band: (n - 1) x [B, 3, 8 ceil(h/n), 8 w]
            assert sent == (ranks - 1) * batch * 3 * (8 * -(-rows // ranks)) * (8 * cols) * 4
