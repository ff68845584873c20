"""The VAE stage's deployment: latents to pixels in batches, and an edit's input images to latents; with
``vae.parallel``, each replica decodes over a gang of ranks (``deployments.gang``)."""

from __future__ import annotations

import numpy as np

from deployments.stage import StageDeployment
from deployments.stages import Upstream
from omni_ray.config import PipelineConfig
from omni_ray.engine.builders import build_vae_core
from omni_ray.errors import StageCall
from omni_ray.live_settings import VAELive
from omni_ray.records import Decoded, DecodeRequest, ImageEncodeRequest, Latents, OutputMode


class VAE(StageDeployment):
    """The VAE under the batched engine: latents to pixels, and an edit's input image to latents."""

    stage = "vae"
    live_settings = VAELive

    def __init__(self, config: PipelineConfig):
        super().__init__(lambda: build_vae_core(config, self.gang_factory(config.vae), self.card), config)

    def _apply(self, live: VAELive) -> None:
        max_batch_size = live.max_batch_size or self.preset.max_batch_size
        self.engine.submit(lambda core: core.set_limits(max_batch_size=max_batch_size))

    async def decode(self, request_id: str, latents: Upstream, output: OutputMode = "pixels", preview: bool = False,
                     priority: int = 0, tenant: str = "") -> Decoded:
        """The latents decoded in the VAE's batches, taken by ``priority`` and ``tenant``'s share."""
        resolved: Latents = await latents.resolve()
        request = DecodeRequest(request_id, resolved, output, preview, priority, tenant)
        with self._lost_with_gang(StageCall.DECODE):
            return await self._run(request, "decoded", resolved.timings)

    async def encode(self, request_id: str, image: np.ndarray, seed: int | None = None, draw: int = 0,
                     mask: np.ndarray | None = None, priority: int = 0, tenant: str = "") -> Latents:
        """An edit's input image (uint8 ``[H, W, 3]`` at its working size) to the latents the DiT edits with (a
        masked edit's start image, or a control image: a sample drawn with ``seed``, the ``draw``-th of its
        generator; with ``mask``, an inpainting ControlNet's, masked and carrying the mask); taken by ``priority``
        and ``tenant``'s share."""
        request = ImageEncodeRequest(request_id, image, seed, draw, mask, priority, tenant)
        with self._lost_with_gang(StageCall.ENCODE_IMAGE):
            return await self._run(request, "encoded image")
