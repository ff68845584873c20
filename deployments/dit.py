"""The DiT stage's deployment: the Qwen-Image transformer under the step-batching engine, embeddings to latents."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from ray import serve

from deployments import metrics
from deployments.stage import StageDeployment
from deployments.stages import Upstream, write_step_stream
from omni_ray.config import LoraEntry, PipelineConfig
from omni_ray.engine.builders import build_dit_core
from omni_ray.engine.dit_load import DiTLoad
from omni_ray.engine.lora_residency import LoraResidency
from omni_ray.records import DenoiseParams, DenoiseRequest, EncodedPrompt, Finished, Latents, StepDone
from omni_ray.runners.lora import AdapterFiles


class DiT(StageDeployment):
    """The Qwen-Image transformer under the step-batching engine: embeddings to latents.

    It reports the work it holds in cost-seconds (``DiTLoad``): to Serve's router (``record_routing_stats``, read
    by ``deployments.routing.LeastWorkRouter``), to Serve's autoscaler (``record_autoscaling_stats``, read by
    ``deployments.autoscaling.QueuedWorkPolicy``), and to the coordinator, which asks ``estimate`` before it admits a
    request."""

    stage = "dit"

    def __init__(self, config: PipelineConfig):
        super().__init__(lambda: build_dit_core(config))
        scheduler = self.engine.core.scheduler
        self.load = DiTLoad(self.engine.core.step_times, scheduler.max_batch_size, scheduler.max_batch_tokens,
                            by_priority=scheduler.policy.by_priority)
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
        """Serve's router reads it (``deployments.routing.LeastWorkRouter``): the replica's work in cost-seconds, a
        request's mean cost, and when it was said."""
        return {"queued_work_s": self.load.seconds(), "request_s": self.load.request_s, "at": time.time()}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaler reads it (``deployments.autoscaling.QueuedWorkPolicy``)."""
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


