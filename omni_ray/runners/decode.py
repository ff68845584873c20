"""VAE stage: packed latents to uint8 pixels with Qwen-Image's VAE, and for edits input images to packed latents;
a batch of same-size items per call.

Decoding unpacks, denormalises with the VAE's latent statistics, decodes the single frame, and postprocesses exactly
as diffusers' ``QwenImagePipeline`` and ``VaeImageProcessor`` do (``output_type="pil"`` rounds to uint8 the same
way). Encoding preprocesses, takes the latent distribution's mode, normalises and packs, as
``QwenImageEditPipeline.prepare_latents`` does.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from diffusers import AutoencoderKLQwenImage
from diffusers.image_processor import VaeImageProcessor

from omni_ray.errors import request_failure
from omni_ray.qwen_image import SIZE_MULTIPLE, VAE_COMPRESSION
from omni_ray.records import DecodeBatch, Decoded, DecodeOutput, ImageEncodeRequest, Latents, VAERequest
from omni_ray.runners.host import to_host
from omni_ray.runners.packing import pack_latents, unpack_latents
from omni_ray.runners.random_weights import random_model

logger = logging.getLogger(__name__)


class VaeRunner:
    """Holds the VAE; decodes batches of same-size latents and encodes batches of same-size images."""

    def __init__(self, vae: AutoencoderKLQwenImage):
        self.vae = vae.eval()
        self.device = vae.device
        if 2 ** len(vae.temperal_downsample) != VAE_COMPRESSION:
            raise ValueError(f"not Qwen-Image's VAE (its compression is not {VAE_COMPRESSION}x)")
        self.image_processor = VaeImageProcessor(vae_scale_factor=SIZE_MULTIPLE)
        z_dim = vae.config.z_dim
        self.latents_mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1)
        self.latents_std = torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1)

    @classmethod
    def load(cls, model: str, dtype: torch.dtype = torch.float32, device: str = "cpu", dummy: bool = False
             ) -> VaeRunner:
        """The runner of a checkpoint's ``vae/``; with ``dummy``, built from its config with random weights."""
        if dummy:
            config = AutoencoderKLQwenImage.load_config(model, subfolder="vae")
            return cls(random_model(AutoencoderKLQwenImage, config, dtype, device))
        return cls(AutoencoderKLQwenImage.from_pretrained(model, subfolder="vae", torch_dtype=dtype).to(device))

    def execute_model(self, batch: DecodeBatch) -> DecodeOutput:
        """Runs the batch in one VAE call; if that raises, runs each request alone so that only the failing ones
        fail (a bad latent, or one that does not fit in memory beside the others)."""
        output = DecodeOutput()
        try:
            output.finished.update(self._run(batch.requests))
            return output
        except Exception:
            if len(batch.requests) > 1:
                logger.exception("VAE call of %d requests failed; retrying each alone", len(batch.requests))
        for request in batch.requests:
            try:
                output.finished.update(self._run([request]))
            except Exception as err:
                output.errors[request.request_id] = request_failure(err)
        return output

    def _run(self, requests: list[VAERequest]) -> dict[str, Decoded | Latents]:
        """One VAE call for same-key requests; decode requests that asked for latents only skip the VAE."""
        if isinstance(requests[0], ImageEncodeRequest):
            return dict(zip((r.request_id for r in requests), self.encode([r.image for r in requests])))
        to_decode = [request for request in requests if request.output != "latents"]
        pixels = self.decode([request.latents for request in to_decode]) if to_decode else []
        by_id = {request.request_id: image for request, image in zip(to_decode, pixels)}
        return {
            request.request_id: Decoded(
                pixels=by_id.get(request.request_id),
                latents=request.latents if request.output != "pixels" else None,
                dit_passes=request.latents.dit_passes,
            )
            for request in requests
        }

    def decode(self, batch: list[Latents]) -> np.ndarray:
        """Decodes same-size latents in one VAE call; returns uint8 pixels ``[B, H, W, 3]``."""
        return to_host(self._decode(batch)).numpy()

    @torch.inference_mode()
    def _decode(self, batch: list[Latents]) -> torch.Tensor:
        """uint8 ``[B, H, W, 3]`` on the device: a quarter of float32's bytes to copy to the host."""
        height, width = batch[0].height, batch[0].width
        assert all((item.height, item.width) == (height, width) for item in batch), "mixed sizes in one decode"
        packed = torch.stack([item.latents for item in batch]).to(self.device)
        if len(batch) == 1 and packed.device.type == "cpu":
            # PyTorch runs a batch of one through other convolution kernels than a larger batch: slower on the CPU
            # (the tiny VAE at 256x256, 2 threads: 538 ms for one image, 460 for two) and with other float sums, so an
            # image's pixels would depend on whether it was decoded alone. Batches of two or more agree exactly.
            packed = packed.expand(2, *packed.shape[1:])
        latents = unpack_latents(packed, height, width).to(self.vae.dtype)
        mean = self.latents_mean.to(latents.device, latents.dtype)
        inverse_std = 1.0 / self.latents_std.to(latents.device, latents.dtype)
        image = self.vae.decode(latents / inverse_std + mean, return_dict=False)[0][:, :, 0]
        # VaeImageProcessor.postprocess(output_type="pil")'s arithmetic, on the device: denormalise in the VAE's
        # dtype, then float32, scale and round (half to even, as numpy rounds).
        image = self.image_processor.denormalize(image[:len(batch)]).permute(0, 2, 3, 1).float()
        return (image * 255).round().to(torch.uint8)

    def encode(self, images: list[np.ndarray]) -> list[Latents]:
        """Encodes same-size uint8 images ``[H, W, 3]`` in one VAE call; returns each one's packed latents."""
        height, width = images[0].shape[:2]
        return [Latents(to_host(row), height, width) for row in self._encode(images)]

    @torch.inference_mode()
    def _encode(self, images: list[np.ndarray]) -> torch.Tensor:
        """The images' packed latents ``[B, tokens, 64]``, on the device."""
        from PIL import Image

        height, width = images[0].shape[:2]
        assert all(image.shape[:2] == (height, width) for image in images), "mixed sizes in one encode"
        pixels = torch.cat([self.image_processor.preprocess(Image.fromarray(image), height, width) for image in images])
        pixels = pixels.unsqueeze(2).to(self.device, self.vae.dtype)  # one frame: [B, 3, 1, H, W]
        latents = self.vae.encode(pixels).latent_dist.mode()
        mean = self.latents_mean.to(latents.device, latents.dtype)
        std = self.latents_std.to(latents.device, latents.dtype)
        return pack_latents(((latents - mean) / std).transpose(1, 2))
