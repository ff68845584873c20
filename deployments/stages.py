"""The three stage deployments: shims that start an engine and turn each call into one awaited request.

Arguments arrive already resolved: the coordinator passes the previous stage's ``DeploymentResponse``, and Ray
hands its object from replica to replica, so these methods receive records, never references.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import numpy as np
import ray

from deployments import metrics
from omni_ray.config import PipelineConfig
from omni_ray.engine.async_engine import AsyncEngine
from omni_ray.engine.builders import build_dit_core, build_encoder_core, build_vae_core
from omni_ray.stages.decode import Decoded, DecodeRequest, ImageEncodeRequest, OutputMode
from omni_ray.stages.denoise import DenoiseParams, DenoiseRequest, Latents
from omni_ray.stages.encode import EncodedPrompt, EncodeRequest

logger = logging.getLogger("ray.serve")


class _EngineShim:
    """What every stage deployment does besides its one call: start, health, shutdown."""

    stage = ""

    def __init__(self, build_core):
        self.tags = {"stage": self.stage}
        self.engine = AsyncEngine(build_core, self.stage, on_step=self._record_step).start()
        logger.info("%s engine started", self.stage)

    def _record_step(self, seconds: float, batch: int, held: int) -> None:
        metrics.step_latency.observe(seconds, tags=self.tags)
        metrics.running_batch_size.set(batch, tags=self.tags)
        metrics.queue_length.set(held, tags=self.tags)

    async def _run(self, request, what: str, timings: dict[str, float], on_progress=None, timing: str = ""):
        """Runs one request in this engine: timed (into the result's ``timings``, as ``timing`` or the stage's
        name), counted, logged under its id."""
        start = time.perf_counter()
        try:
            result = await self.engine.generate(request, on_progress)
        except Exception as err:
            metrics.errors.inc(tags={**self.tags, "type": type(err).__name__})
            logger.warning("request %s: %s failed: %s", request.request_id, self.stage, err)
            raise
        seconds = time.perf_counter() - start
        metrics.stage_request_latency.observe(seconds, tags=self.tags)
        logger.info("request %s: %s in %.0f ms", request.request_id, what, 1000 * seconds)
        result.timings = {**timings, timing or self.stage: seconds}
        return result

    def check_health(self) -> None:
        """Serve restarts the replica when this raises: the engine loop died or one step hangs."""
        self.engine.check_health()

    def stats(self) -> dict:
        """Counters of the engine: requests it took, aborted, still running; steps it ran."""
        engine = self.engine
        return {
            "requests": engine.num_requests,
            "aborted": engine.num_aborted,
            "running": engine.num_running,
            "steps": engine.num_steps,
        }

    def __del__(self) -> None:
        # Serve calls this on graceful shutdown; it stops the loop and shuts the core down (vLLM's included, which
        # otherwise leaves a /tmp/vllm_dist_* file behind per replica).
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


class Encoder(_EngineShim):
    """Qwen2.5-VL under vLLM's engine core: prompts (and an edit's input image) to prompt embeddings."""

    stage = "encoder"

    def __init__(self, config: PipelineConfig):
        super().__init__(lambda: build_encoder_core(config))

    async def encode(self, request: EncodeRequest, image: np.ndarray | None = None) -> EncodedPrompt:
        """``image`` comes apart from the request so that Ray resolves the coordinator's reference to it."""
        request.image = image
        return await self._run(request, "encoded", {})


class DiT(_EngineShim):
    """The Qwen-Image transformer under the step-batching engine: embeddings to latents."""

    stage = "dit"

    def __init__(self, config: PipelineConfig):
        super().__init__(lambda: build_dit_core(config))

    async def denoise(
        self,
        request_id: str,
        params: DenoiseParams,
        encoded: EncodedPrompt,
        image: Latents | None = None,
        on_progress=None,
    ) -> Latents:
        """Denoises one image; an edit brings its input image's latents (the VAE's ``encode``)."""
        request = DenoiseRequest(request_id, params, encoded.prompt, encoded.negative, image)
        timings = {**encoded.timings, **(image.timings if image is not None else {})}
        return await self._run(request, f"denoised ({params.num_inference_steps} steps)", timings, on_progress)

    async def denoise_stream(
        self, request_id: str, params: DenoiseParams, encoded: EncodedPrompt, image: Latents | None = None
    ) -> AsyncIterator[dict]:
        """Streams ``{"step", "total"}`` after every denoising step, then ``{"latents": ObjectRef}``.

        The latents go into this replica's object store and only their reference travels, so the caller can hand
        them to the VAE without ever holding the tensor. Closing the stream aborts the request.
        """
        progress: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        result = asyncio.ensure_future(
            self.denoise(request_id, params, encoded, image, lambda done, total: progress.put_nowait((done, total)))
        )
        try:
            while not result.done() or not progress.empty():
                step = asyncio.ensure_future(progress.get())
                await asyncio.wait({step, result}, return_when=asyncio.FIRST_COMPLETED)
                if step.done():
                    done, total = step.result()
                    yield {"step": done, "total": total}
                else:
                    step.cancel()
            yield {"latents": ray.put(result.result())}
        finally:
            result.cancel()

    def stats(self) -> dict:
        """The engine's counters, and its steps by how many requests each advanced (the step-level batching)."""
        return {**super().stats(), "batch_sizes": dict(self.engine.core.scheduler.batch_sizes)}


class VAE(_EngineShim):
    """The VAE under the batched engine: latents to pixels, and an edit's input image to latents."""

    stage = "vae"

    def __init__(self, config: PipelineConfig):
        super().__init__(lambda: build_vae_core(config))

    async def decode(self, request_id: str, latents: Latents, output: OutputMode = "pixels") -> Decoded:
        return await self._run(DecodeRequest(request_id, latents, output), "decoded", latents.timings)

    async def encode(self, request_id: str, image: np.ndarray) -> Latents:
        """An edit's input image (uint8 ``[H, W, 3]`` at its working size) to the latents the DiT edits with."""
        return await self._run(ImageEncodeRequest(request_id, image), "encoded image", {}, timing="vae_encode")
