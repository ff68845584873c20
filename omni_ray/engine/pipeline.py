"""The three stage engines chained in one process: what the Serve app does across replicas, without Ray.

For tests and benchmarks. Each engine runs on its own thread; requests flow encoder -> DiT -> VAE as asyncio
tasks, so concurrent requests batch in every stage. vLLM binds threads for its whole process, so a process that
holds the encoder engine runs the other stages single-threaded too; the served app gives each stage its own.
"""

from __future__ import annotations

import asyncio

import numpy as np

from omni_ray.config import PipelineConfig
from omni_ray.engine.async_engine import AsyncEngine, ProgressCallback
from omni_ray.engine.builders import build_dit_core, build_encoder_core, build_vae_core
from omni_ray.stages.decode import Decoded, DecodeRequest, ImageEncodeRequest, OutputMode
from omni_ray.stages.denoise import DenoiseParams, DenoiseRequest
from omni_ray.stages.encode import EncodeRequest


class EnginePipeline:
    def __init__(self, encoder: AsyncEngine, dit: AsyncEngine, vae: AsyncEngine):
        self.encoder, self.dit, self.vae = encoder, dit, vae

    @classmethod
    def from_config(cls, config: PipelineConfig) -> EnginePipeline:
        return cls(
            AsyncEngine(lambda: build_encoder_core(config), "encoder").start(),
            AsyncEngine(lambda: build_dit_core(config), "dit").start(),
            AsyncEngine(lambda: build_vae_core(config), "vae").start(),
        )

    async def generate(
        self,
        request_id: str,
        prompt: str,
        params: DenoiseParams,
        negative_prompt: str | None = None,
        output: OutputMode = "pixels",
        on_progress: ProgressCallback | None = None,
        image: np.ndarray | None = None,
    ) -> Decoded:
        """One image; an edit passes its input ``image`` (uint8 ``[H, W, 3]`` at its working size)."""
        use_cfg = params.true_cfg_scale > 1 and negative_prompt is not None
        encode = EncodeRequest(request_id, prompt, negative_prompt if use_cfg else None, image)
        if image is None:
            encoded, image_latents = await self.encoder.generate(encode), None
        else:
            encoded, image_latents = await asyncio.gather(
                self.encoder.generate(encode), self.vae.generate(ImageEncodeRequest(request_id, image))
            )
        latents = await self.dit.generate(
            DenoiseRequest(request_id, params, encoded.prompt, encoded.negative, image_latents), on_progress
        )
        return await self.vae.generate(DecodeRequest(request_id, latents, output))

    def shutdown(self) -> None:
        for engine in (self.encoder, self.dit, self.vae):
            engine.shutdown()
