"""VAE stage for Qwen-Image 2.1: unpatched latents to RGBA uint8 pixels with ``AutoencoderKLQwenImage21``, and a
request's condition images to normalised latents; a batch of same-size items per call. ``VaeRunner``'s interface
(``runners/vae.py``), so the VAE engine core holds either.

Decoding is what ``QwenImage21Pipeline`` does after its last step: ``_unpack_latents`` (row-major tokens, one per
16x16 pixels, 64 channels each), ``latents * std + mean``, the single frame's decode, and
``VaeImageProcessor.postprocess(output_type="pil")``'s rounding, RGBA kept. Encoding is its ``prepare_latents`` on a
condition image at its working size: the image as RGBA (an RGB one takes alpha 255, as PIL's ``convert("RGBA")``
gives it), preprocessed, the latent distribution's mode, ``(mode - mean) / std``, ``_pack_latents``. Previews decode
as final images do.

The VAE runs as plain 2-D modules on its one frame, channels-last (``vae21_frame``): diffusers' arithmetic without
the video model's feature-cache copies and padding copies, within 1e-5 of its outputs. On the tiny VAE at 256x256,
two threads of the shared 2-core CPU, fastest of 40 interleaved runs: decode 21 ms against diffusers' 120 ms at
batch 1 (35 against 51 ms at batch 2), encode 9 against 49 ms (17 against 95 ms at batch 2). On the published
architecture (random weights) at 128x128 the two decode in about the same time (0.95 s against 1.04 s; the
convolutions dominate). Pixels are within one level of the pipeline's (tests/test_vae21.py; on the tiny VAE 4 or 5
of a 128x192 image's 98,304 values differ, by one), and within one level of the same latents decoded in a batch of
another size: oneDNN sums some convolutions in another order at batch 1 (on the tiny VAE, the decoder's
``conv_in``; diffusers' own decode differs between batch sizes so).

Not here (Qwen-Image's ``VaeRunner`` has them): a seeded sample of an image's latents (``ImageEncodeRequest.seed``,
Qwen-Image's masked edits; 2.1 has none, so such a request fails with a ValueError saying so), the tiled decode
(``vae.tiling``) and a gang's row-split decode (``vae.parallel`` above world size 1): ``load`` refuses both.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import AutoencoderKLQwenImage21
from diffusers.image_processor import VaeImageProcessor

from omni_ray.families.qwen_image_2_1.facts import (
    IMAGE_CHANNELS,
    LATENT_CHANNELS,
    VAE_COMPRESSION,
    check_side,
    image_tokens,
)
from omni_ray.families.qwen_image_2_1.vae_frame import FrameDecoder21, FrameEncoder21
from omni_ray.records import ImageEncodeRequest, Latents, VaeRequest
from omni_ray.runners.host import to_host
from omni_ray.runners.parallel.mesh import Mesh
from omni_ray.runners.random_weights import random_model
from omni_ray.runners.vae import BatchedVae

SEEDED_SAMPLE = ("a seeded sample of an image's latents (ImageEncodeRequest.seed: Qwen-Image's masked edit) is not "
                 "Qwen-Image 2.1's: its condition images encode to their latent distribution's mode")


class VaeRunner21(BatchedVae):
    """Holds Qwen-Image 2.1's VAE; decodes batches of same-size latents to RGBA and encodes batches of same-size
    condition images. One rank only: no tiling, no gang."""

    def __init__(self, vae: AutoencoderKLQwenImage21, tiling: bool = False, mesh: Mesh | None = None):
        if tiling:
            raise ValueError("vae.tiling: Qwen-Image 2.1's VAE runner decodes whole frames; set vae.tiling: false")
        if mesh is not None and mesh.world.size > 1:
            raise ValueError(f"vae.parallel: Qwen-Image 2.1's VAE runner runs at world size 1, not "
                             f"{mesh.world.size}; set vae.parallel's world size to 1")
        config = vae.config
        compression = 2 ** (len(config.dim_mult) - 1)
        if (compression, config.z_dim, config.in_channels, config.out_channels) != (
                VAE_COMPRESSION, LATENT_CHANNELS, IMAGE_CHANNELS, IMAGE_CHANNELS):
            raise ValueError(f"not Qwen-Image 2.1's VAE: {compression}x, {config.z_dim} latent channels, "
                             f"{config.in_channels} in and {config.out_channels} out (2.1's: {VAE_COMPRESSION}x, "
                             f"{LATENT_CHANNELS}, {IMAGE_CHANNELS} and {IMAGE_CHANNELS})")
        self.device, self.dtype = vae.device, vae.dtype
        self.decoder = FrameDecoder21(vae).eval().to(memory_format=torch.channels_last)
        self.encoder = FrameEncoder21(vae).eval().to(memory_format=torch.channels_last)
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # each image size autotunes its convolutions once
        # The pipeline's processor: its preprocess and postprocess are the arithmetic to match.
        self.image_processor = VaeImageProcessor(vae_scale_factor=VAE_COMPRESSION, vae_latent_channels=LATENT_CHANNELS)
        self.latents_mean = torch.tensor(config.latents_mean, device=self.device).view(1, LATENT_CHANNELS, 1, 1)
        self.latents_std = torch.tensor(config.latents_std, device=self.device).view(1, LATENT_CHANNELS, 1, 1)

    @classmethod
    def load(cls, model: str, dtype: torch.dtype = torch.float32, device: str = "cpu", dummy: bool = False,
             tiling: bool = False, mesh: Mesh | None = None) -> VaeRunner21:
        """The runner of a checkpoint's ``vae/``; with ``dummy``, built from its config with random weights (drawn
        from a fixed seed). ``tiling`` and a ``mesh`` of more than one rank raise ValueError."""
        if dummy:
            config = AutoencoderKLQwenImage21.load_config(model, subfolder="vae")
            return cls(random_model(AutoencoderKLQwenImage21, config, dtype, device), tiling, mesh)
        vae = AutoencoderKLQwenImage21.from_pretrained(model, subfolder="vae", torch_dtype=dtype).to(device)
        return cls(vae.eval(), tiling, mesh)

    def refuse(self, request: VaeRequest) -> None:
        check(request)

    def decode(self, batch: list[Latents]) -> np.ndarray:
        """Decodes same-size latents in one VAE call; returns RGBA uint8 pixels ``[B, H, W, 4]``."""
        return to_host(self._decode(batch)).numpy()

    @torch.inference_mode()
    def _decode(self, batch: list[Latents]) -> torch.Tensor:
        """uint8 ``[B, H, W, 4]`` on the device."""
        height, width = batch[0].height, batch[0].width
        assert all((item.height, item.width) == (height, width) for item in batch), "mixed sizes in one decode"
        for item in batch:
            check_latents(item)
        rows, cols = height // VAE_COMPRESSION, width // VAE_COMPRESSION
        tokens = torch.stack([item.latents for item in batch]).to(self.device, self.dtype)
        # The pipeline's _unpack_latents: [B, tokens, C] -> [B, C, h, w]; as a permuted view, already channels-last.
        latents = tokens.view(len(batch), rows, cols, LATENT_CHANNELS).permute(0, 3, 1, 2)
        latents = latents * self.latents_std.to(self.dtype) + self.latents_mean.to(self.dtype)
        image = self.decoder(latents.contiguous(memory_format=torch.channels_last))
        # VaeImageProcessor.postprocess(output_type="pil")'s arithmetic, on the device: denormalise in the VAE's
        # dtype, then float32, scale and round (half to even, as numpy rounds).
        image = self.image_processor.denormalize(image).permute(0, 2, 3, 1).float()
        return (image * 255).round().to(torch.uint8)

    def encode(self, images: list[np.ndarray], seeds: list[int | None] | None = None,
               draws: list[int] | None = None, masks: list[np.ndarray | None] | None = None) -> list[Latents]:
        """Encodes same-size uint8 condition images ``[H, W, 3 or 4]`` (RGB or RGBA, at their working size) in one
        VAE call; returns each one's normalised packed latents ``[tokens, 64]``. A seed (a sample, not the mode, and
        so ``draws``) raises ValueError."""
        if any(seed is not None for seed in seeds or ()):
            raise ValueError(SEEDED_SAMPLE)
        height, width = images[0].shape[:2]
        return [Latents(to_host(row), height, width) for row in self._encode(images)]

    @torch.inference_mode()
    def _encode(self, images: list[np.ndarray]) -> torch.Tensor:
        """The images' packed latents ``[B, tokens, 64]`` on the device: the latent distribution's mode, normalised
        as the pipeline's ``_encode_vae_image`` normalises it."""
        from PIL import Image

        height, width = images[0].shape[:2]
        assert all(image.shape[:2] == (height, width) for image in images), "mixed sizes in one encode"
        for image in images:
            check_image(image)
        pixels = torch.cat([self.image_processor.preprocess(Image.fromarray(image).convert("RGBA"), height, width)
                            for image in images])
        moments = self.encoder(pixels.to(self.device, self.dtype).contiguous(memory_format=torch.channels_last))
        mode = moments[:, :LATENT_CHANNELS]
        normalised = (mode - self.latents_mean.to(self.dtype)) / self.latents_std.to(self.dtype)
        # The pipeline's _pack_latents: [B, C, h, w] -> [B, h * w, C], row-major.
        return normalised.flatten(2).transpose(1, 2).contiguous()


def check(request: VaeRequest) -> None:
    """Raises ValueError, saying why, for a request the VAE cannot run: a seeded encode, an image of the wrong shape
    or type, latents that do not fit their size."""
    if isinstance(request, ImageEncodeRequest):
        if request.seed is not None:
            raise ValueError(SEEDED_SAMPLE)
        check_image(request.image)
    elif request.output != "latents":
        check_latents(request.latents)


def check_image(image: np.ndarray) -> None:
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] not in (3, 4):
        kind = f"{getattr(image, 'dtype', type(image).__name__)} {list(getattr(image, 'shape', []))}"
        raise ValueError(f"a condition image is uint8 [H, W, 3 or 4] (RGB or RGBA), not {kind}")
    check_side("condition image height", image.shape[0])
    check_side("condition image width", image.shape[1])


def check_latents(item: Latents) -> None:
    check_side("height", item.height)
    check_side("width", item.width)
    expected = (image_tokens(item.height, item.width), LATENT_CHANNELS)
    if tuple(item.latents.shape) != expected:
        raise ValueError(f"latents of shape {tuple(item.latents.shape)} do not fit a {item.width}x{item.height} image "
                         f"(Qwen-Image 2.1's: {expected})")
