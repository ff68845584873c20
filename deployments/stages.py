"""The three stage deployments: shims that start an engine and turn each call into one awaited request.

Arguments arrive already resolved: the coordinator passes the previous stage's ``DeploymentResponse``, and Ray
hands its object from replica to replica, so these methods receive records, never references.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

from deployments import metrics
from omni_ray.config import PipelineConfig
from omni_ray.engine.async_engine import AsyncEngine
from omni_ray.engine.builders import build_dit_core, build_encoder_core, build_vae_core
from omni_ray.stages.decode import Decoded, DecodeRequest, OutputMode
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

    @contextmanager
    def _request(self, request_id: str, what: str):
        """Times one request in this stage, counts its failure, and logs it under its id."""
        start = time.perf_counter()
        try:
            yield
        except Exception as err:
            metrics.errors.inc(tags={**self.tags, "type": type(err).__name__})
            logger.warning("request %s: %s failed: %s", request_id, self.stage, err)
            raise
        seconds = time.perf_counter() - start
        metrics.stage_request_latency.observe(seconds, tags=self.tags)
        logger.info("request %s: %s in %.0f ms", request_id, what, 1000 * seconds)

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
    """Qwen2.5-VL under vLLM's engine core: prompts to prompt embeddings."""

    stage = "encoder"

    def __init__(self, config: PipelineConfig):
        super().__init__(lambda: build_encoder_core(config))

    async def encode(self, request: EncodeRequest) -> EncodedPrompt:
        with self._request(request.request_id, "encoded"):
            return await self.engine.generate(request)


class DiT(_EngineShim):
    """The Qwen-Image transformer under the step-batching engine: embeddings to latents."""

    stage = "dit"

    def __init__(self, config: PipelineConfig):
        super().__init__(lambda: build_dit_core(config))

    async def denoise(self, request_id: str, params: DenoiseParams, encoded: EncodedPrompt) -> Latents:
        request = DenoiseRequest(request_id, params, encoded.prompt, encoded.negative)
        with self._request(request_id, f"denoised ({params.num_inference_steps} steps)"):
            return await self.engine.generate(request)

    def stats(self) -> dict:
        """The engine's counters, and its steps by how many requests each advanced (the step-level batching)."""
        return {**super().stats(), "batch_sizes": dict(self.engine.core.scheduler.batch_sizes)}


class VAE(_EngineShim):
    """The VAE under the batched decode engine: latents to pixels."""

    stage = "vae"

    def __init__(self, config: PipelineConfig):
        super().__init__(lambda: build_vae_core(config))

    async def decode(self, request_id: str, latents: Latents, output: OutputMode = "pixels") -> Decoded:
        with self._request(request_id, "decoded"):
            return await self.engine.generate(DecodeRequest(request_id, latents, output))
