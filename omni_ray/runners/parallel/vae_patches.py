"""Patch-parallel VAE decode: a frame's latent rows split over a gang's ranks, each decoding its band with halo
rows of context, the pixel rows gathered on every rank.

Exact, not approximate: the decoder's mid block attends over the whole latent frame, so every rank runs the head
(``post_quant_conv``, ``conv_in``, the mid block; latent resolution, a small part of the decode's work and memory) on
the whole latent, and splits only the up path, whose pixels in a band of latent rows depend on ``halo`` rows either
side of it (``FrameDecoder``: 9 latent rows on the tiny VAE, 13 on Qwen-Image's). The gathered frame is the
single-process decode's, float rounding aside (on the CPU, bit for bit; see ``tests/test_vae_parallel.py``). Peers
approximate instead: vLLM-Omni's patch decode runs the whole decoder, mid block included, on each halo'd patch
(their docs: "diff < 0.5%"), and diffusers' ``tiled_decode`` blends overlapping tiles (on the tiny VAE, up to 46
uint8 levels from the untiled decode at 512x512).

Each rank computes its rows plus up to ``2 * halo`` rows of context, and holds that band's activations at the up
path's resolutions instead of the frame's: what lets a large frame decode on small cards. Bytes each rank sends, one
all-gather of its pixel rows padded to the longest band: ``(n - 1) * B * 3 * (scale * ceil(h / n)) * (scale * w) *
itemsize``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omni_ray.runners.parallel.mesh import Comm
from omni_ray.runners.vae_frame import FrameDecoder, split_rows


def decode_patches(decoder: FrameDecoder, latents: torch.Tensor, comm: Comm, band_rows: int | None = None
                   ) -> torch.Tensor:
    """The frame decoded over ``comm``'s ranks, each called with the same normalised latents ``[B, z_dim, h, w]``:
    pixels in [-1, 1] ``[B, 3, scale * h, scale * w]`` on every rank. Rank ``i`` decodes the ``i``-th of ``comm.size``
    even bands of latent rows (``split_rows``), itself in bands of ``band_rows`` if given (tiling within a rank)."""
    height = latents.shape[2]
    if comm.size == 1:
        return decoder(latents, band_rows)
    if height < comm.size:
        raise ValueError(f"a latent of {height} rows cannot be split over {comm.size} ranks")
    bands = split_rows(height, comm.size)
    start, stop = bands[comm.rank]
    pixels = decoder.decode_rows(decoder.head(latents), start, stop, band_rows)
    longest = (bands[0][1] - bands[0][0]) * decoder.scale  # all_gather takes equal shapes: pad, gather, crop
    gathered = comm.all_gather(F.pad(pixels, (0, 0, 0, longest - pixels.shape[2])), dim=2)
    return torch.cat([gathered[:, :, i * longest:i * longest + (b - a) * decoder.scale]
                      for i, (a, b) in enumerate(bands)], dim=2)

