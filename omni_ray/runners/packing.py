"""Qwen-Image's latent packing: the VAE's ``[B, C, 1, H/8, W/8]`` latents as the transformer's tokens of 2x2
patches, ``[B, (H/16)*(W/16), C*4]``, and back. The DiT draws noise unpacked and packs it; the VAE unpacks to
decode and packs what it encodes."""

from __future__ import annotations

import torch

from omni_ray.families.qwen_image.facts import latent_grid


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """``[B, F, C, H, W]`` -> ``[B, F*(H/2)*(W/2), C*4]``: 2x2 patches as tokens, frame after frame (one frame but
    for Qwen-Image-Layered's ``layers + 1``, as its pipeline's ``_pack_latents`` packs them)."""
    b, f, c, h, w = latents.shape
    latents = latents.view(b, f, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4, 6)
    return latents.reshape(b, f * (h // 2) * (w // 2), c * 4)


def unpack_latents(latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``[B, image_seq_len, C*4]`` -> ``[B, C, 1, H/8, W/8]``, the inverse of ``pack_latents``."""
    batch, _, channels = latents.shape
    rows, cols = latent_grid(height, width)
    latents = latents.view(batch, rows // 2, cols // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(batch, channels // 4, 1, rows, cols)
