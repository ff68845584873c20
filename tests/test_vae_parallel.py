"""The VAE decode split by latent rows: in bands on one device (``vae.tiling``) and over a gang of ranks
(``decode_patches``; ``vae.parallel`` under the VAE's engine core), each band with the rows of context its
convolutions reach, against the whole-frame decode; the encode in bands the same way; ``vae.tiling: auto`` banding
only the calls past its pixels.

Measured on the CPU (float32): the banded and the gathered pixels equal the whole-frame decode's bit for bit, on the
tiny VAE and on Qwen-Image's full-size architecture with random weights. The tests allow 1e-5 (float rounding, should
another machine's kernels pick other algorithms for other shapes). The receptive field's edge weighs little: on the
tiny VAE one row less of context than the halo moves pixels by about 1e-6, two rows 1e-4, three 1e-3.
"""

import time

import numpy as np
import pytest
import torch
import yaml
from conftest import REPO
from diffusers import AutoencoderKLQwenImage

from omni_ray.config import ParallelSettings, parse_config
from omni_ray.engine.builders import build_vae_core
from omni_ray.engine.executor import GangRunner
from omni_ray.records import DecodeRequest, ImageEncodeRequest, Latents
from omni_ray.runners.packing import pack_latents
from omni_ray.runners.parallel.vae_patches import decode_patches
from omni_ray.runners.random_weights import random_model
from omni_ray.runners.vae import VaeRunner
from omni_ray.runners.vae_frame import FrameDecoder
from testing.engines import run_to_completion
from testing.gang import run_gang
from testing.numerics import assert_reordered, assert_within_a_level, reorder_tolerance

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
        assert_reordered(decoder(latents, band_rows), whole, band_rows)
    decoder.halo -= 1  # every row of the halo counts: one less changes pixels (by little: the field's edge)
    assert (decoder(latents, 8) - whole).abs().max().item() > 0
    decoder.halo -= 2
    assert (decoder(latents, 8) - whole).abs().max().item() > 10 * reorder_tolerance(whole)


@torch.inference_mode()
def test_bands_on_qwen_image_s_full_size_vae_are_exact():
    """Qwen-Image's VAE architecture (random weights): 3 residual blocks per up block, 13 latent rows of reach."""
    from omni_ray.checkpoints.full_size import CONFIG_DIR

    torch.manual_seed(0)
    config = AutoencoderKLQwenImage.load_config(CONFIG_DIR, subfolder="vae")
    decoder = _decoder(random_model(AutoencoderKLQwenImage, config, torch.float32, "cpu"))
    assert decoder.halo == 13
    latents = _latents(1, 32, 6)  # bands of 8 rows: two of the four crop context on both sides
    assert_reordered(decoder(latents, 8), decoder(latents))


@torch.inference_mode()
def test_banded_encoding_is_the_whole_frame_s_and_needs_its_halo(tiny_vae):
    """An edit's input image encoded in bands (``FrameEncoder.encode_rows``): the down path on each band's pixel rows
    and the rows of context its convolutions reach either side (48 on the tiny VAE, 80 on Qwen-Image's with its two
    residual blocks a level), the mid block on the whole latent."""
    from omni_ray.checkpoints.full_size import CONFIG_DIR
    from omni_ray.runners.vae_frame import FrameEncoder

    torch.manual_seed(0)
    full = random_model(AutoencoderKLQwenImage, AutoencoderKLQwenImage.load_config(CONFIG_DIR, subfolder="vae"),
                        torch.float32, "cpu")
    for vae, shape, halo, bands in ((full, (1, 3, 192, 32), 80, (8,)), (tiny_vae, (2, 3, 320, 96), 48, (1, 3, 8))):
        encoder = FrameEncoder(vae).eval()
        assert (encoder.halo, encoder.scale) == (halo, 8)
        pixels = torch.rand(shape, generator=torch.Generator().manual_seed(2)) * 2 - 1
        whole = encoder(pixels)
        for band_rows in bands:
            assert_reordered(encoder(pixels, band_rows), whole, band_rows)
    encoder.halo = 32  # too little context changes the latents
    assert (encoder(pixels, 3) - whole).abs().max().item() > 10 * reorder_tolerance(whole)


def test_auto_tiling_bands_the_calls_past_its_pixels_for_the_same_images(tiny_vae):
    """``vae.tiling: auto``: a call of more pixels than ``tile_above_pixels`` (its images together) decodes and
    encodes in bands, a smaller one whole; the pixels and latents are the untiled runner's either way."""
    generator = torch.Generator().manual_seed(3)
    small = [Latents(pack_latents(torch.randn(1, 1, 16, 8, 8, generator=generator))[0], 64, 64)]
    large = [Latents(pack_latents(torch.randn(1, 1, 16, 64, 48, generator=generator))[0], 512, 384)]
    untiled, auto = VaeRunner(tiny_vae), VaeRunner(tiny_vae, tile_above_pixels=256 * 256)
    assert_within_a_level(auto.decode(small), untiled.decode(small))
    assert auto.banded_calls == 0
    assert_within_a_level(auto.decode(large), untiled.decode(large))
    assert auto.banded_calls == 1
    image = (torch.rand(512, 384, 3, generator=generator) * 255).to(torch.uint8).numpy()
    (banded,), (whole,) = auto.encode([image]), untiled.encode([image])
    assert auto.banded_calls == 2
    assert_reordered(banded.latents, whole.latents)


def test_a_tiled_runner_decodes_the_untiled_runner_s_pixels(tiny_vae):
    """``vae.tiling``: 512x384 pixels are two bands of 32 latent rows."""
    generator = torch.Generator().manual_seed(1)
    items = [Latents(pack_latents(torch.randn(1, 1, 16, 64, 48, generator=generator))[0], 512, 384)]
    untiled = VaeRunner(tiny_vae).decode(items)
    tiled_runner = VaeRunner(tiny_vae, tiling=True)
    assert tiled_runner.band_rows == 32
    tiled = tiled_runner.decode(items)
    assert untiled.std() > 10
    assert_within_a_level(tiled, untiled)


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
            assert_reordered(pixels, whole)
            # one all-gather of this rank's pixel rows, padded to the longer band: (n - 1) x [B, 3, 8 ceil(h/n), 8 w]
            assert sent == (ranks - 1) * batch * 3 * (8 * -(-rows // ranks)) * (8 * cols) * 4


def _requests() -> list:
    """Two 64x64 decodes sharing a VAE call (one asking for its latents too), a 48x80 one, and an edit's image."""
    generator = torch.Generator().manual_seed(3)
    latents = [Latents(pack_latents(torch.randn(1, 1, 16, h // 8, w // 8, generator=generator))[0], h, w)
               for h, w in ((64, 64), (64, 64), (48, 80))]
    image = np.random.default_rng(4).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    return [DecodeRequest("a", latents[0]), DecodeRequest("b", latents[1], "both"), DecodeRequest("wide", latents[2]),
            ImageEncodeRequest("image", image)]


def _comm_of(runner: VaeRunner) -> tuple[int, int, int]:
    return runner.comm.rank, runner.comm.size, runner.comm.sent["all_gather"]


def test_the_vae_core_on_a_gang_of_two_decodes_one_rank_s_pixels(tiny_dir):
    """``vae.parallel.patches: 2`` on spawned gloo ranks (``MultiprocExecutor``): the engine core's uint8 pixels are
    world size 1's, and an edit's image (encoded on rank 0 alone) the same latents."""
    preset = yaml.safe_load((REPO / "stage_configs" / "qwen_image_tiny.yaml").read_text())
    preset["model"] = str(tiny_dir)
    results = {}
    for patches in (1, 2):
        preset["vae"]["parallel"] = {"patches": patches, "timeout_s": 60}
        started = time.monotonic()
        core = build_vae_core(parse_config(preset))
        assert isinstance(core.runner, GangRunner) == (patches > 1)
        try:
            for request in _requests():
                core.add_request(request)
            results[patches], _ = run_to_completion(core)
            if patches > 1:  # every rank decoded its band and gathered the others'
                ranks = core.runner.executor.collective_rpc(_comm_of)
                assert [(rank, size) for rank, size, _ in ranks] == [(0, 2), (1, 2)]
                assert all(sent > 0 for _, _, sent in ranks)
        finally:
            core.shutdown()
        print(f"patches {patches}: {time.monotonic() - started:.1f} s")
    alone, gang = results[1], results[2]
    assert sorted(gang) == sorted(alone) == ["a", "b", "image", "wide"]
    for request_id in ("a", "b", "wide"):
        pixels = alone[request_id].pixels
        assert pixels.dtype == np.uint8 and pixels.std() > 10
        assert_within_a_level(gang[request_id].pixels, pixels, request_id)
    assert gang["wide"].pixels.shape == (48, 80, 3)
    assert torch.equal(gang["b"].latents.latents, alone["b"].latents.latents)  # handed back, not computed
    assert_reordered(gang["image"].latents, alone["image"].latents)


def test_auto_tiling_takes_its_pixels_from_the_preset_or_the_vae_s_share_of_its_gpu(tiny_dir):
    """``vae.tiling: auto`` on the CPU needs ``tile_above_pixels``; on a GPU preset it is what the placement estimate
    fits untiled in the VAE's share (the 16 GB card's 0.32 of 16 GiB, less weights and context: 3.9 GiB at 4 GiB a
    megapixel), so a 1664x1664 decode runs in bands there and the check counts it so."""
    from omni_ray.config import ConfigError, load_config
    from omni_ray.placement import stage_memory, vae_untiled_pixels

    tiny = REPO / "stage_configs/qwen_image_tiny.yaml"
    with pytest.raises(ConfigError, match="vae.tiling: auto decodes in bands above what fits untiled"):
        load_config(tiny, model=str(tiny_dir), overrides={"vae": {"tiling": "auto"}})
    config = load_config(tiny, model=str(tiny_dir), overrides={"vae": {"tiling": "auto", "tile_above_pixels": 4096}})
    runner = build_vae_core(config).runner
    assert (runner.band_rows, runner.tile_above_pixels) == (None, 4096)
    card = load_config(REPO / "stage_configs/qwen_image_16gb_card.yaml", overrides={"vae": {"tiling": "auto"}})
    assert 0.9e6 < vae_untiled_pixels(card, 16) < 1.0e6 < 1024 * 1024
    vae = next(e for e in stage_memory(card, 16) if e.stage == "vae")
    assert "in bands" in vae.detail and vae.fits
