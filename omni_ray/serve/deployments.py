"""The three stage deployments: shims that start an engine and turn each call into one request in it.

A stage's input from another stage arrives as an ``Upstream`` (a reference the coordinator passed on without
reading it), which the shim resolves itself: an input lost with another replica raises ``StageLostError`` naming
that call, so the request path issues exactly that call again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator

import numpy as np
import ray
import torch  # noqa: F401  (imported before the first call: unpickling a tensor would import it on the event loop)
from ray import serve

from omni_ray.config import LoraEntry, PipelineConfig
from omni_ray.engine.async_engine import AsyncEngine
from omni_ray.engine.builders import build_dit_core, build_encoder_core, build_vae_core
from omni_ray.engine.dit_load import DiTLoad
from omni_ray.engine.lora_residency import LoraResidency
from omni_ray.records import (
    Decoded,
    DecodeRequest,
    DenoiseParams,
    DenoiseRequest,
    EncodedPrompt,
    EncodeRequest,
    Finished,
    ImageEncodeRequest,
    Latents,
    OutputMode,
    StepDone,
)
from omni_ray.request_path import write_step_stream
from omni_ray.runners.lora import AdapterFiles
from omni_ray.serve import metrics
from omni_ray.serve.process import freeze_startup_heap
from omni_ray.serve.serve_stages import Upstream

logger = logging.getLogger("ray.serve")


class _EngineShim:
    """What every stage deployment does besides its one call: start, health, shutdown."""

    stage = ""

    def __init__(self, build_core):
        self.tags = {"stage": self.stage}
        self.last_step_at = 0.0  # monotonic
        self.engine = AsyncEngine(build_core, self.stage, on_step=self._record_step).start()
        logger.info("%s engine started", self.stage)
        threading.Thread(target=self._keep_gauges_fresh, name=f"omni-ray-{self.stage}-gauges", daemon=True).start()
        freeze_startup_heap()

    def _record_step(self, seconds: float, batch: int, held: int) -> None:
        self.last_step_at = time.monotonic()
        metrics.step_latency.observe(seconds, tags=self.tags)
        metrics.running_batch_size.set(batch, tags=self.tags)
        metrics.queue_length.set(held, tags=self.tags)

    def _keep_gauges_fresh(self, period_s: float = 1.0) -> None:
        """Ray 2.60 exports a gauge for about two seconds after it was set: an idle stage would read "no data" on a
        dashboard. Once a second without a step, this sets what the stage holds and 0 for the batch."""
        while True:
            time.sleep(period_s)
            if time.monotonic() - self.last_step_at >= period_s:
                metrics.running_batch_size.set(0, tags=self.tags)
                metrics.queue_length.set(self.engine.num_running, tags=self.tags)
                self._idle_gauges()

    def _idle_gauges(self) -> None:
        """A stage's own gauges, set again while it does not step."""

    async def _run(self, request, what: str, timings: dict[str, float], timing: str = ""):
        """Runs one request in this engine: timed (into the result's ``timings``, as ``timing`` or the stage's
        name, and the part of it the request queued before its first step as ``<name>_queued``), counted, logged
        under its id."""
        result = None
        async for item in self._stream(request, what, timings, timing):
            result = item.result
        return result

    async def _stream(self, request, what: str, timings: dict[str, float], timing: str = "") -> AsyncIterator:
        """As ``_run``, yielding the engine's typed stream: ``StepDone`` and ``Preview`` items, then ``Finished``."""
        start = time.perf_counter()
        name = timing or self.stage
        queued = {}
        try:
            async for item in self.engine.stream(request, on_start=lambda s: queued.update({f"{name}_queued": s})):
                if isinstance(item, Finished):
                    seconds = time.perf_counter() - start
                    metrics.stage_request_latency.observe(seconds, tags=self.tags)
                    logger.info("request %s: %s in %.0f ms", request.request_id, what, 1000 * seconds)
                    item.result.timings = {**timings, name: seconds, **queued}
                yield item
        except Exception as err:
            metrics.errors.inc(tags={**self.tags, "type": type(err).__name__})
            logger.warning("request %s: %s failed: %s", request.request_id, self.stage, err)
            raise

    def check_health(self) -> None:
        """Serve restarts the replica when this raises: the engine loop died or one step hangs."""
        self.engine.check_health()

    def stats(self) -> dict:
        """Counters of the engine: requests it took, aborted, still running; steps it ran; and the Ray node the
        replica runs on."""
        engine = self.engine
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
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
        self._cache_counted = (0, 0)  # prompt-cache hits and misses already exported
        super().__init__(lambda: build_encoder_core(config))

    def _record_step(self, seconds: float, batch: int, held: int) -> None:
        super()._record_step(seconds, batch, held)
        cache = self.engine.core.cache
        if cache is None:
            return
        hits, misses = cache.num_hits, cache.num_misses
        for outcome, count in (("hit", hits - self._cache_counted[0]), ("miss", misses - self._cache_counted[1])):
            if count:  # Ray's counters refuse 0
                metrics.prompt_cache.inc(count, tags={**self.tags, "outcome": outcome})
        self._cache_counted = (hits, misses)
        self._idle_gauges()

    def _idle_gauges(self) -> None:
        cache = self.engine.core.cache
        if cache is not None:
            metrics.prompt_cache_bytes.set(cache.nbytes, tags=self.tags)

    def stats(self) -> dict:
        """The engine's counters, the texts it encoded, and its prompt cache's hits, misses, entries and bytes."""
        core = self.engine.core
        cache = core.cache
        return {**super().stats(), "encoded": core.num_encoded,
                "prompt_cache": {"hits": cache.num_hits, "misses": cache.num_misses, "entries": len(cache),
                                 "bytes": cache.nbytes} if cache is not None else None}

    async def encode(self, request: EncodeRequest, *images: np.ndarray) -> EncodedPrompt:
        """``images`` come apart from the request so that Ray resolves the coordinator's references to them."""
        request.images = images
        return await self._run(request, "encoded", {})


class DiT(_EngineShim):
    """The Qwen-Image transformer under the step-batching engine: embeddings to latents.

    It reports the work it holds in cost-seconds (``DiTLoad``): to Serve's router (``record_routing_stats``, read
    by ``serve.routing.LeastWorkRouter``), to Serve's autoscaler (``record_autoscaling_stats``, read by
    ``serve.autoscaling.QueuedWorkPolicy``), and to the coordinator, which asks ``estimate`` before it admits a
    request."""

    stage = "dit"

    def __init__(self, config: PipelineConfig):
        super().__init__(lambda: build_dit_core(config))
        scheduler = self.engine.core.scheduler
        self.load = DiTLoad(self.engine.core.step_times, scheduler.max_batch_size, scheduler.max_batch_tokens,
                            by_priority=scheduler.policy != "fifo")
        self.files = AdapterFiles([entry.path for entry in config.loras.values()], config.lora.roots)
        self.loras = LoraResidency(
            self.engine, config.dit.max_loras, self.files.read,
            on_load=lambda name: metrics.lora_loads.inc(tags={**self.tags, "adapter": name}),
        )

        async def route(name: str) -> str:
            return name

        # Serve's model multiplexing, for routing alone: it tells the routers which adapters this replica was last
        # asked for (as many as it holds), so requests for an adapter go preferably where it is resident.
        self._route = serve.multiplexed(max_num_models_per_replica=config.dit.max_loras)(route)

    async def check_lora(self, path: str) -> LoraEntry:
        """A run-time adapter under ``lora.roots`` that this transformer can take (its resolved path, and its recipe
        when one lies beside it); RequestError naming ``lora_path`` otherwise."""
        return await asyncio.to_thread(self.files.check, path, self.loras.shapes)

    async def denoise(
        self, request_id: str, params: DenoiseParams, prompt: Upstream, *images: Upstream, start: Upstream | None = None
    ) -> AsyncIterator[StepDone | Latents]:
        """Denoises one image: ``StepDone`` after every step, each followed by what it announces (a preview's
        latents, or the image's): ``request_path.read_step_stream`` reads it. An edit brings its input images'
        latents (the VAE's ``encode``), a masked edit its ``start`` latents. The caller reads the stream by
        reference; closing it aborts the request."""
        encoded: EncodedPrompt = await prompt.resolve()
        image_latents: list[Latents] = [await image.resolve() for image in images]
        start_latents: Latents | None = await start.resolve() if start is not None else None
        request = DenoiseRequest(request_id, params, encoded.prompt, encoded.negative, tuple(image_latents),
                                 start_latents)
        timings = dict(encoded.timings)
        encodes = image_latents + ([start_latents] if start_latents is not None else [])
        for latents in encodes:  # encoded side by side: the longest is the time they took
            for stage, seconds in latents.timings.items():
                timings[stage] = max(seconds, timings.get(stage, 0.0))
        if params.lora is not None:
            await self._route(params.lora.name)
        self.load.add(request_id, params.priority, request.work_tokens, params.steps_run)
        try:
            async with self.loras.use(params.lora):
                items = self._stream(request, f"denoised ({params.steps_run} steps)", timings)
                async for item in write_step_stream(self._count_passes(items)):
                    if isinstance(item, StepDone):
                        self.load.progress(request_id, item.step, item.total)
                    yield item
        finally:
            self.load.remove(request_id)

    async def estimate(self, priority: int, tokens: int, steps: int, images: int) -> float:
        """Seconds until ``images`` new images of ``tokens`` work tokens and ``steps`` steps at ``priority`` would
        be done on this replica (``DiTLoad.estimate``)."""
        return self.load.estimate(priority, tokens, steps, images)

    def record_routing_stats(self) -> dict:
        """Serve's router reads it (``serve.routing.LeastWorkRouter``): the replica's work in cost-seconds, a
        request's mean cost, and when it was said."""
        return {"queued_work_s": self.load.seconds(), "request_s": self.load.request_s, "at": time.time()}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaler reads it (``serve.autoscaling.QueuedWorkPolicy``)."""
        return {"queued_work_s": self.load.seconds()}

    def _record_step(self, seconds: float, batch: int, held: int) -> None:
        super()._record_step(seconds, batch, held)
        self._idle_gauges()

    def _idle_gauges(self) -> None:
        if not hasattr(self, "load"):  # the gauges' thread may wake before __init__ is done
            return
        metrics.queued_work.set(self.load.seconds(), tags=self.tags)
        metrics.paused_requests.set(self.engine.core.scheduler.num_paused, tags=self.tags)

    async def _count_passes(self, items: AsyncIterator) -> AsyncIterator:
        async for item in items:
            if isinstance(item, Finished):
                for outcome, passes in item.result.dit_passes.items():
                    if passes:  # Ray's counters refuse 0
                        metrics.dit_passes.inc(passes, tags={**self.tags, "outcome": outcome})
            yield item

    def stats(self) -> dict:
        """The engine's counters, its steps by how many requests each advanced (the step-level batching), the
        request-steps that admitted requests sat out, paused, and the seconds compiling took at start (``compile``)."""
        return {**super().stats(), "batch_sizes": self.engine.core.batch_sizes,
                "warmup_s": getattr(self.engine.core.runner, "warmup_s", None),
                "paused_request_steps": self.engine.core.scheduler.num_paused_steps,
                "loras": [name for name, _ in self.loras.resident], "lora_loads": self.loras.num_loads}


class VAE(_EngineShim):
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
        return await self._run(ImageEncodeRequest(request_id, image, seed), "encoded image", {}, timing="vae_encode")
