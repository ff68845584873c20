"""The VAE stage's deployment: latents to pixels in batches, and an edit's input images to latents."""

from __future__ import annotations

import numpy as np

from deployments.stage import StageDeployment
from deployments.stages import Upstream
from omni_ray.config import PipelineConfig
from omni_ray.engine.builders import build_vae_core
from omni_ray.records import Decoded, DecodeRequest, ImageEncodeRequest, Latents, OutputMode


class VAE(StageDeployment):
    """The VAE under the batched engine: latents to pixels, and an edit's input image to latents."""

    stage = "vae"

    def __init__(self, config: PipelineConfig):
        super().__init__(lambda: build_vae_core(config))

    async def decode(self, request_id: str, latents: Upstream, output: OutputMode = "pixels", preview: bool = False
                     ) -> Decoded:
        resolved: Latents = await latents.resolve()
        return await self._run(DecodeRequest(request_id, resolved, output, preview), "decoded", resolved.timings)

    async def encode(self, request_id: str, image: np.ndarray, seed: int | None = None) -> Latents:
        """An edit's input image (uint8 ``[H, W, 3]`` at its working size) to the latents the DiT edits with (a
        masked edit's start image: a sample drawn with ``seed``)."""
        return await self._run(ImageEncodeRequest(request_id, image, seed), "encoded image")
