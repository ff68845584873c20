"""VAE stage: packed latents to uint8 pixels with Qwen-Image's VAE, and for edits input images to packed latents;
a batch of same-size items per call.

Decoding unpacks, denormalises with the VAE's latent statistics, decodes the single frame, and postprocesses as
diffusers' ``QwenImagePipeline`` and ``VaeImageProcessor`` do (``output_type="pil"`` rounds to uint8 the same way).
Encoding preprocesses, takes the latent distribution's mode, normalises and packs, as
``QwenImageEditPipeline.prepare_latents`` does (Edit-Plus's pipeline encodes each of its images so). The VAE itself
runs as 2-D convolutions on one frame (``vae_frame``) in channels-last layout: on the CPU the fastest layout here,
and on the tiny and full-size VAEs one whose pixels did not depend on the batch size (oneDNN does not promise it: a
VAE 16 channels wide differed by one level in 4 pixels of 16,384 between a batch of one and of two); on CUDA the
layout cuDNN's fastest convolutions take, with its autotuner on.

Qwen-Image-Layered's VAE reads and writes RGBA (``input_channels`` 4) and its latents are layered
(``Latents.layers``): ``QwenImageLayeredPipeline`` drops the first of the ``layers + 1`` frames (the composite) and
decodes each layer as a one-frame video of its own, so here each layer is one more frame of the batch, beside other
requests' frames and images of the same size (the VAE scheduler counts frames against ``max_batch_size``), and a
request's pixels are its layers ``[layers, H, W, 4]``, bottom to top. Its input image (RGBA, at its working size)
encodes as every edit's image does, to one frame. ``refuse`` turns away images of other channels than the VAE's and
layered latents that are not (or not for) an RGBA VAE's.

With ``tiling``, the decoder's up path runs on bands of ``TILE_ROWS`` latent rows one after another, each with the
rows of context its convolutions reach (``FrameDecoder.decode_rows``), and the encoder's down path the same way
(``FrameEncoder.encode_rows``): the same pixels and latents as whole frames, in a fraction of their activation
memory, for large frames on small cards. With ``tile_above_pixels`` (``vae.tiling: auto``), only a call of more
pixels than that runs in bands: a small image keeps the faster whole-frame path.

On a gang's rank (``vae.parallel``, ``mesh`` given), decoding splits the frame's latent rows over the gang's ranks
(``decode_patches``: the same pixels, each rank holding its band's activations, every rank ending with the whole
image); encoding, which has no collective, runs on rank 0 alone, whose output the engine reads.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from diffusers import AutoencoderKLQwenImage
from diffusers.image_processor import VaeImageProcessor

from omni_ray.errors import RefusedError, request_failure
from omni_ray.families.qwen_image.facts import SIZE_MULTIPLE, VAE_COMPRESSION, image_tokens
from omni_ray.families.qwen_image_layered.facts import IMAGE_CHANNELS as RGBA
from omni_ray.families.qwen_image_layered.facts import decoded_frames, dit_frames
from omni_ray.records import Decoded, ImageEncodeRequest, Latents, VaeBatch, VaeOutput, VaeRequest
from omni_ray.runners.host import to_host
from omni_ray.runners.packing import pack_latents, unpack_latents
from omni_ray.runners.parallel.mesh import Mesh
from omni_ray.runners.parallel.vae_patches import decode_patches
from omni_ray.runners.random_weights import random_model
from omni_ray.runners.vae_frame import FrameDecoder, FrameEncoder

logger = logging.getLogger(__name__)

# Latent rows per band in a tiled decode (256 pixel rows, diffusers' tile height). Each band also computes up to
# twice the decoder's halo (13 latent rows on Qwen-Image's VAE): at 1328x1328 about 1.8x the up path's work, in a
# third of its activation memory.
TILE_ROWS = 32


class BatchedVae:
    """What both VAE runners (Qwen-Image's ``VaeRunner``, Qwen-Image 2.1's ``VaeRunner21``) do around their model:
    a batch of same-key requests in one call, failures isolated. Each says how it decodes and encodes, and which
    requests it refuses before a call (``refuse``). ``comm``: the ranks of its gang (rank 0 alone encodes)."""

    comm = Mesh.single().world

    def refuse(self, request: VaeRequest) -> None:
        """Raises ValueError for a request this runner cannot run; it then fails alone, before the batch's call,
        with a 400 (``RefusedError``)."""

    def device_modules(self) -> list:
        """What it holds on its device: the VAE's halves."""
        return [self.decoder, self.encoder]

    def execute_model(self, batch: VaeBatch) -> VaeOutput:
        """Runs the batch in one VAE call; if that raises, runs each request alone so that only the failing ones
        fail (a bad latent, or one that does not fit in memory beside the others)."""
        output = VaeOutput()
        requests = []
        for request in batch.requests:
            try:
                self.refuse(request)
                requests.append(request)
            except ValueError as err:
                output.errors[request.request_id] = RefusedError(str(err))
        if not requests:
            return output
        try:
            output.finished.update(self._run(requests))
            return output
        except Exception:
            if len(requests) > 1:
                logger.exception("VAE call of %d requests failed; retrying each alone", len(requests))
        for request in requests:
            try:
                output.finished.update(self._run([request]))
            except Exception as err:
                output.errors[request.request_id] = request_failure(err)
        return output

    def _run(self, requests: list[VaeRequest]) -> dict[str, Decoded | Latents]:
        """One VAE call for same-key requests; decode requests that asked for latents only skip the VAE. A gang's
        ranks but rank 0 skip encoding (their outputs are not read)."""
        if isinstance(requests[0], ImageEncodeRequest):
            if self.comm.rank != 0:
                return {}
            encoded = self.encode([r.image for r in requests], [r.seed for r in requests], [r.draw for r in requests],
                                  [r.mask for r in requests])
            return dict(zip((r.request_id for r in requests), encoded))
        to_decode = [request for request in requests if request.output != "latents"]
        latents = [request.latents for request in to_decode]
        pixels = per_item(self.decode(latents), latents) if to_decode else []
        by_id = {request.request_id: image for request, image in zip(to_decode, pixels)}
        return {
            request.request_id: Decoded(
                pixels=by_id.get(request.request_id),
                latents=request.latents if request.output != "pixels" else None,
                dit_passes=request.latents.dit_passes,
            )
            for request in requests
        }


def per_item(frames: np.ndarray, items: list[Latents]) -> list[np.ndarray]:
    """Each item's pixels from a decode's frames ``[frames, H, W, C]``, the items' frames in order
    (``qwen_image_layered.decoded_frames`` each): a plain item's image ``[H, W, C]``, a layered item's layers
    ``[layers, H, W, C]``."""
    pixels, start = [], 0
    for item in items:
        count = decoded_frames(item.layers)
        pixels.append(frames[start:start + count] if item.layers else frames[start])
        start += count
    assert start == len(frames), f"{len(frames)} frames decoded for {start}"
    return pixels


class VaeRunner(BatchedVae):
    """Holds the VAE; decodes batches of same-size latents and encodes batches of same-size images (on one rank of
    a gang: ``mesh``). Its images are RGB, or RGBA with Qwen-Image-Layered's VAE (``input_channels`` 4), which
    also decodes layered latents (``Latents.layers``): each layer a one-frame image, the composite dropped."""

    def __init__(self, vae: AutoencoderKLQwenImage, tiling: bool = False, mesh: Mesh | None = None,
                 tile_above_pixels: int | None = None):
        if 2 ** len(vae.temperal_downsample) != VAE_COMPRESSION:
            raise ValueError(f"not Qwen-Image's VAE (its compression is not {VAE_COMPRESSION}x)")
        self.channels = vae.config.input_channels  # 3, or Qwen-Image-Layered's RGBA 4
        if self.channels not in (3, RGBA):
            raise ValueError(f"not Qwen-Image's VAE (it reads {self.channels} image channels, not 3 or {RGBA})")
        self.device, self.dtype = vae.device, vae.dtype
        self.band_rows = TILE_ROWS if tiling else None
        self.tile_above_pixels = tile_above_pixels  # bands for a call of more pixels than this (its frames together)
        self.banded_calls = 0  # calls run in bands
        self.comm = (mesh or Mesh.single()).world  # the ranks a decode's rows are split over
        self.decoder = FrameDecoder(vae).eval().to(memory_format=torch.channels_last)
        self.encoder = FrameEncoder(vae).eval().to(memory_format=torch.channels_last)
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # each image size autotunes its convolutions once
        self.image_processor = VaeImageProcessor(vae_scale_factor=SIZE_MULTIPLE)
        z_dim = vae.config.z_dim
        self.latents_mean = torch.tensor(vae.config.latents_mean, device=self.device).view(1, z_dim, 1, 1)
        self.latents_std = torch.tensor(vae.config.latents_std, device=self.device).view(1, z_dim, 1, 1)

    @classmethod
    def load(cls, model: str, dtype: torch.dtype = torch.float32, device: str = "cpu", dummy: bool = False,
             tiling: bool = False, mesh: Mesh | None = None, tile_above_pixels: int | None = None) -> VaeRunner:
        """The runner of a checkpoint's ``vae/``; with ``dummy``, built from its config with random weights (drawn
        from a fixed seed: every rank of a gang holds the same). ``tiling``: every call in bands of ``TILE_ROWS``
        latent rows; ``tile_above_pixels``: a call of more pixels than that (its frames' together)."""
        if dummy:
            config = AutoencoderKLQwenImage.load_config(model, subfolder="vae")
            vae = random_model(AutoencoderKLQwenImage, config, dtype, device)
        else:
            vae = AutoencoderKLQwenImage.from_pretrained(model, subfolder="vae", torch_dtype=dtype).to(device)
        return cls(vae, tiling, mesh, tile_above_pixels)

    def _bands(self, frames: int, height: int, width: int) -> int | None:
        """The band height for a call of ``frames`` images of this size: ``TILE_ROWS`` with ``tiling`` or past
        ``tile_above_pixels``, else None (whole frames)."""
        banded = self.band_rows is not None or (
            self.tile_above_pixels is not None and frames * height * width > self.tile_above_pixels)
        self.banded_calls += banded
        return TILE_ROWS if banded else None

    def refuse(self, request: VaeRequest) -> None:
        """An image of other channels than the VAE's; layered latents to an RGB VAE, or whose rows are not their
        frames' tokens."""
        if isinstance(request, ImageEncodeRequest):
            image = request.image
            if image.ndim != 3 or image.shape[2] != self.channels:
                kind = "RGBA" if self.channels == RGBA else "RGB"
                raise ValueError(f"image: this model's VAE encodes {kind} images, uint8 [H, W, {self.channels}], not "
                                 f"{image.dtype} {list(image.shape)}")
            return
        latents = request.latents
        if latents.layers < 0:
            raise ValueError(f"latents: layers is {latents.layers}, not 0 or more")
        if latents.layers and self.channels != RGBA:
            raise ValueError(f"latents: {latents.layers} layers (Qwen-Image-Layered's), but this model's VAE decodes "
                             "RGB images, not RGBA layers")
        tokens = image_tokens(latents.height, latents.width)
        if latents.layers and latents.latents.shape[0] != dit_frames(latents.layers) * tokens:
            raise ValueError(f"latents: {latents.latents.shape[0]} rows are not {dit_frames(latents.layers)} frames "
                             f"(the composite and {latents.layers} layers) of {tokens} tokens, a "
                             f"{latents.width}x{latents.height} image's")

    def decode(self, batch: list[Latents]) -> np.ndarray:
        """Decodes same-size latents in one VAE call; returns uint8 pixels ``[frames, H, W, C]`` (C: 3, or 4 for
        RGBA): each item's frames in order, one per plain item and a layered item's layers, bottom to top
        (``per_item`` splits them)."""
        return to_host(self._decode(batch)).numpy()

    @staticmethod
    def _frames(item: Latents) -> torch.Tensor:
        """The packed frames an item decodes to, ``[frames, tokens, 64]``: its image, or a layered item's layers
        (its frames lie one after another, the composite first, which the pipeline drops)."""
        frames = item.latents.reshape(dit_frames(item.layers), -1, item.latents.shape[-1])
        return frames[1:] if item.layers else frames

    @torch.inference_mode()
    def _decode(self, batch: list[Latents]) -> torch.Tensor:
        """uint8 ``[frames, H, W, C]`` on the device: a quarter of float32's bytes to copy to the host. Every frame
        decodes as a one-frame video, as ``QwenImageLayeredPipeline`` decodes each layer, so a batch's frames are
        one batch of the 2-D decoder whether they are images or layers."""
        height, width = batch[0].height, batch[0].width
        assert all((item.height, item.width) == (height, width) for item in batch), "mixed sizes in one decode"
        packed = torch.cat([self._frames(item) for item in batch]).to(self.device)
        latents = unpack_latents(packed, height, width)[:, :, 0].to(self.dtype)  # one frame: [frames, z_dim, h, w]
        mean, inverse_std = self.latents_mean.to(self.dtype), 1.0 / self.latents_std.to(self.dtype)
        latents = (latents / inverse_std + mean).contiguous(memory_format=torch.channels_last)
        image = decode_patches(self.decoder, latents, self.comm, self._bands(len(latents), height, width))
        # VaeImageProcessor.postprocess(output_type="pil")'s arithmetic, on the device: denormalise in the VAE's
        # dtype, then float32, scale and round (half to even, as numpy rounds).
        image = self.image_processor.denormalize(image).permute(0, 2, 3, 1).float()
        return (image * 255).round().to(torch.uint8)

    def encode(self, images: list[np.ndarray], seeds: list[int | None] | None = None,
               draws: list[int] | None = None, masks: list[np.ndarray | None] | None = None) -> list[Latents]:
        """Encodes same-size uint8 images ``[H, W, C]`` (the VAE's channels: RGB, or Qwen-Image-Layered's RGBA) in
        one VAE call; returns each one's packed latents (one frame): the latent distribution's mode, or where
        ``seeds`` gives one, a sample drawn with it (with ``draws``, the seed's generator's ``draws[i]``-th sample of
        that shape: a request's k-th control image). Where ``masks`` gives one (an inpainting ControlNet's control
        mask, uint8 ``[H, W]``, 1 repaints; with a seed), the image is masked first and the latents carry the mask:
        ``[tokens, 68]``."""
        height, width = images[0].shape[:2]
        seeds = seeds or [None] * len(images)
        masks = masks or [None] * len(images)
        if any(mask is not None and seed is None for seed, mask in zip(seeds, masks)):
            raise ValueError("a control mask's image is sampled: it needs a seed")
        rows = self._encode(images, seeds, draws or [0] * len(images), masks)
        return [Latents(to_host(row), height, width) for row in rows]

    @torch.inference_mode()
    def _encode(self, images: list[np.ndarray], seeds: list[int | None], draws: list[int],
                masks: list[np.ndarray | None] | None = None) -> list[torch.Tensor]:
        """Each image's packed latents ``[tokens, 64]`` (``[tokens, 68]`` with a mask), on the device. A mode is
        normalised as diffusers' edit pipelines normalise it; a sample is drawn on the CPU from
        ``torch.Generator().manual_seed(seed)`` in the distribution's shape and normalised as diffusers' inpaint
        pipelines do (``_encode_vae_image`` with a generator). A row's ``draw`` skips that many draws of the same
        shape first: diffusers' controlnet pipelines sample each control image in turn from the one generator
        (``retrieve_latents``, whose ``latent_dist.sample`` is ``randn_tensor`` of the distribution's shape), so the
        k-th control image's sample is the generator's (k+1)-th. Samples are per row: seeds, draws and masks never
        split a batch.

        A row with a mask is ``QwenImageControlNetInpaintPipeline.prepare_image_with_mask``: its pixels where the
        mask repaints set to -1 (black) before encoding, the sample normalised, and ``1 - mask`` on the latent grid
        (``interpolate``'s nearest: every 8th pixel) appended as a 17th channel before packing, which packs to the
        64 latent columns followed by the mask's 4. diffusers draws that sample from torch's global generator
        (``latent_dist.sample()`` without one); here it is the seed's own generator's ``draw``-th, which is
        diffusers' when the caller seeds the global generator with the seed before the pipeline call."""
        from PIL import Image

        height, width = images[0].shape[:2]
        assert all(image.shape[:2] == (height, width) for image in images), "mixed sizes in one encode"
        masks = masks or [None] * len(images)
        pixels = torch.cat([self.image_processor.preprocess(Image.fromarray(image), height, width) for image in images])
        for row, mask in enumerate(masks):
            if mask is not None:  # prepare_image_with_mask: masked_image[mask > 0.5] = -1
                pixels[row, :, torch.from_numpy(mask > 0)] = -1.0
        moments = self.encoder(pixels.to(self.device, self.dtype).contiguous(memory_format=torch.channels_last),
                               self._bands(len(images), height, width))
        mean, logvar = moments.chunk(2, dim=1)
        latents_mean, latents_std = self.latents_mean.to(self.dtype), self.latents_std.to(self.dtype)
        normalised = (mean - latents_mean) / latents_std
        shape = (1, *mean.shape[1:2], 1, *mean.shape[2:])  # the distribution's: [1, z_dim, frames=1, h, w]
        for row, (seed, draw) in enumerate(zip(seeds, draws)):
            if seed is None:
                continue
            std = torch.exp(0.5 * torch.clamp(logvar[row], -30.0, 20.0))
            generator = torch.Generator("cpu").manual_seed(seed)
            for _ in range(draw):  # the earlier control images' samples
                torch.randn(shape, generator=generator, dtype=mean.dtype)
            eps = torch.randn(shape, generator=generator, dtype=mean.dtype)
            sample = mean[row] + std * eps[0, :, 0].to(self.device)
            normalised[row] = (sample - latents_mean[0]) * (1.0 / latents_std[0])
        packed = pack_latents(normalised.contiguous().unsqueeze(1))  # [B, frames=1, z_dim, h, w] -> [B, tokens, 64]
        rows = list(packed)
        for row, mask in enumerate(masks):
            if mask is not None:
                step = VAE_COMPRESSION
                keep = 1.0 - torch.from_numpy(mask[::step, ::step] > 0).to(self.device, self.dtype)
                rows[row] = torch.cat([rows[row], pack_latents(keep[None, None, None])[0]], dim=-1)
        return rows
