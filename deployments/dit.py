"""The DiT stage's deployment: the Qwen-Image transformer under the step-batching engine, embeddings to latents."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator

import ray
from ray import serve

from deployments import metrics
from deployments.gang import RayExecutor
from deployments.stage import StageDeployment, logger
from deployments.stages import Upstream, write_step_stream
from omni_ray.config import DiTConfig, LoraEntry, PipelineConfig
from omni_ray.engine.builders import build_dit_core, create_policy
from omni_ray.engine.dit_load import DiTLoad
from omni_ray.engine.executor import RunnerFactory
from omni_ray.engine.lora_residency import LoraResidency
from omni_ray.engine.stats import EngineStats
from omni_ray.errors import GangError, StageCall, StageLostError
from omni_ray.records import DenoiseParams, DenoiseRequest, Finished, Latents, StepDone, upstream_timings

GANG_END_WAIT_S = 10.0  # at most; Ray ends the process within milliseconds


class DiT(StageDeployment):
    """The Qwen-Image transformer under the step-batching engine: embeddings to latents.

    It reports the work it holds in cost-seconds (``DiTLoad``): to Serve's router (``record_routing_stats``, read
    by ``deployments.routing.LeastWorkRouter``), to Serve's autoscaler (``record_autoscaling_stats``, read by
    ``deployments.autoscaling.QueuedWorkPolicy``), and to the coordinator, which asks ``estimate`` before it admits
    a request."""

    stage = "dit"

    def __init__(self, config: PipelineConfig):
        self.gang: RayExecutor | None = None
        start_gang = functools.partial(self._start_gang, config.dit) if config.dit.parallel.world_size > 1 else None
        super().__init__(lambda: build_dit_core(config, start_gang))
        policy = create_policy(config.dit)  # what the scheduler's steps take: the load counts work the same way
        self.load = DiTLoad(lambda: self.engine.stats.core.step_fit, config.dit.max_batch_size,
                            policy.max_batch_tokens, policy.by_priority)
        self.loras = LoraResidency.from_config(
            self.engine, config, on_load=lambda name: metrics.lora_loads.inc(tags={**self.tags, "adapter": name}))

        async def route(name: str) -> str:
            return name

        # Serve's model multiplexing, for routing alone: it tells the routers which adapters this replica was last
        # asked for (as many as it holds), so requests for an adapter go preferably where it is resident.
        self._route = serve.multiplexed(max_num_models_per_replica=config.dit.max_loras)(route)

    def _start_gang(self, stage: DiTConfig, make_runner: RunnerFactory) -> RayExecutor:
        self.gang = RayExecutor(make_runner, stage, on_failure=self._end_replica)
        return self.gang

    def _end_replica(self, reason: str) -> None:
        """What a broken gang does to its replica: ends it, now.

        A rank's death fails the step it ran (the engine's ``StepError`` path, as a ``GangError``), and the gang can
        run nothing more. Failing health checks alone would leave the replica routable for three health-check periods
        (30 s by default) before Serve replaces it, and the request path's retries of the lost calls (a few, within a
        second) would all land on it again and fail. Ended, the replica is a lost replica as any other: each call it
        held raises ``RayActorError`` in its caller, which the request path issues again as a lost stage call
        (``StageLostError``); the router stops sending to it at the first such error; Serve starts a new replica
        with a new gang, whose rank actors the dead replica's took down with it (they are its children). A call
        answered before the end sees the ``GangError`` turned into ``StageLostError`` (``denoise``): retried too."""
        logger.error("DiT gang broken (%s): ending this replica so that Serve replaces it and its gang", reason)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
        time.sleep(GANG_END_WAIT_S)  # the end comes first: callers then see a dead replica, which the router drops

    def check_health(self) -> None:
        """Serve restarts the replica when this raises: the engine loop died or one step hangs, or its gang broke."""
        super().check_health()
        if self.gang is not None:
            self.gang.check_health()

    async def check_lora(self, path: str) -> LoraEntry:
        """A run-time adapter under ``lora.roots`` that this transformer can take (its resolved path, and its recipe
        when one lies beside it); RequestError naming ``lora_path`` otherwise."""
        return await self.loras.check(path)

    async def denoise(
        self, request_id: str, params: DenoiseParams, prompt: Upstream, *images: Upstream, start: Upstream | None = None
    ) -> AsyncIterator[StepDone | Latents]:
        """Denoises one image: ``StepDone`` after every step, each followed by what it announces (a preview's
        latents, or the image's): ``deployments.stages.read_step_stream`` reads it. An edit brings its input
        images' latents (the VAE's ``encode``), a masked edit its ``start`` latents. The caller reads the stream by
        reference; closing it aborts the request."""
        encoded = await prompt.resolve()
        image_latents = tuple([await image.resolve() for image in images])
        start_latents = await start.resolve() if start is not None else None
        request = DenoiseRequest(request_id, params, encoded.prompt, encoded.negative, image_latents, start_latents)
        timings = upstream_timings(encoded, *image_latents, *([start_latents] if start_latents is not None else []))
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
        except GangError as err:  # the replica is ending (``_end_replica``): the call is lost with it
            raise StageLostError("dit", StageCall.DENOISE, str(err)) from None
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

    def _set_gauges(self, stats: EngineStats) -> None:
        super()._set_gauges(stats)
        if stats.core is None or not hasattr(self, "load"):  # the gauges' thread may wake before __init__ is done
            return
        metrics.queued_work.set(self.load.seconds(), tags=self.tags)
        metrics.paused_requests.set(stats.core.paused, tags=self.tags)

    async def _count_passes(self, items: AsyncIterator) -> AsyncIterator:
        async for item in items:
            if isinstance(item, Finished):
                for outcome, passes in item.result.dit_passes.items():
                    if passes:  # Ray's counters refuse 0
                        metrics.dit_passes.inc(passes, tags={**self.tags, "outcome": outcome})
            yield item

    def stats(self) -> dict:
        """The engine's counters, its steps by how many requests each advanced (the step-level batching), the
        request-steps that admitted requests sat out, paused, the seconds compiling took at start (``compile``),
        and the adapters it holds."""
        core = self.engine.stats.core
        return {**super().stats(), "batch_sizes": core.batch_sizes, "warmup_s": core.warmup_s,
                "paused_request_steps": core.paused_request_steps,
                "loras": [name for name, _ in self.loras.resident], "lora_loads": self.loras.num_loads}
