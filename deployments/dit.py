"""The DiT stage's deployment: the Qwen-Image transformer under the step-batching engine, embeddings to latents."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator

from ray import serve

from deployments import metrics
from deployments.stage import StageDeployment
from deployments.stages import Upstream, write_step_stream
from omni_ray.config import LoraEntry, PipelineConfig
from omni_ray.engine.builders import build_dit_core, create_policy, create_split
from omni_ray.engine.dit_load import DiTLoad, size_key
from omni_ray.engine.lora_residency import LoraResidency
from omni_ray.engine.stats import EngineStats
from omni_ray.errors import StageCall
from omni_ray.live_settings import DiTLive
from omni_ray.records import DenoiseParams, DenoiseRequest, Finished, Latents, StepDone, upstream_timings


class DiT(StageDeployment):
    """The Qwen-Image transformer under the step-batching engine: embeddings to latents.

    It reports the work it holds in cost-seconds (``DiTLoad``): to Serve's router (``record_routing_stats``, read
    by ``deployments.routing.LeastWorkRouter``), to Serve's autoscaler (``record_autoscaling_stats``, read by
    ``deployments.autoscaling.QueuedWorkPolicy``), and to the coordinator, which asks ``estimate`` before it admits
    a request."""

    stage = "dit"
    live_settings = DiTLive

    def __init__(self, config: PipelineConfig):
        super().__init__(lambda: build_dit_core(config, self.gang_factory(config.dit), self.card), config)
        policy = create_policy(config.dit)  # what the scheduler's steps take: the load counts work the same way
        self.load = DiTLoad(lambda: self.engine.stats.core.step_fit, config.dit.max_batch_size,
                            policy.max_batch_tokens, policy.by_priority, create_split(config.dit),
                            config.dit.priority_aging_s if policy.by_priority else None)
        self.max_batch_tokens = policy.max_batch_tokens  # the budget its steps take (None: max_batch_size alone)
        self.loras = LoraResidency.from_config(
            self.engine, config, on_load=lambda name: metrics.lora_loads.inc(tags={**self.tags, "adapter": name}))

        async def route(name: str) -> str:
            return name

        # Serve's model multiplexing, for routing alone: it tells the routers which adapters this replica was last
        # asked for (as many as it holds), so requests for an adapter go preferably where it is resident.
        self._route = serve.multiplexed(max_num_models_per_replica=config.dit.max_loras)(route)

    def _apply(self, live: DiTLive) -> None:
        """The step limits and scheduling knobs: the scheduler's from its next step, the load's at once."""
        dit = live.applied_to(self.preset)
        policy = create_policy(dit)
        self.engine.submit(lambda core: core.set_limits(max_batch_size=dit.max_batch_size,
                                                        max_wait_steps=dit.max_wait_steps, policy=policy))
        self.load.set_limits(dit.max_batch_size, policy.max_batch_tokens,
                             dit.priority_aging_s if policy.by_priority else None)
        self.max_batch_tokens = policy.max_batch_tokens

    async def check_lora(self, path: str) -> LoraEntry:
        """A run-time adapter under ``lora.roots`` that this transformer can take (its resolved path, and its recipe
        when one lies beside it); RequestError naming ``lora_path`` otherwise."""
        return await self.loras.check(path)

    async def denoise(
        self, request_id: str, params: DenoiseParams, prompt: Upstream, *images: Upstream,
        start: Upstream | None = None, controls: tuple[Upstream, ...] = (),
    ) -> AsyncIterator[StepDone | Latents]:
        """Denoises one image: ``StepDone`` after every step, each followed by what it announces (a preview's
        latents, or the image's): ``deployments.stages.read_step_stream`` reads it. An edit brings its input
        images' latents (the VAE's ``encode``), a masked edit its ``start`` latents, a request with ControlNets its
        control images' latents (``controls``, one per ``params.controls``). The caller reads the stream by
        reference; closing it aborts the request."""
        encoded = await prompt.resolve()
        image_latents = tuple([await image.resolve() for image in images])
        start_latents = await start.resolve() if start is not None else None
        control_latents = tuple([await control.resolve() for control in controls])
        request = DenoiseRequest(request_id, params, encoded.prompt, encoded.negative, image_latents, start_latents,
                                 control_latents)
        timings = upstream_timings(encoded, *image_latents, *([start_latents] if start_latents is not None else []),
                                   *control_latents)
        for lora in params.loras:
            await self._route(lora.name)
        self.load.add(request_id, params.priority, request.work_tokens, params.steps_run, 2 if params.true_cfg else 1,
                      params.tenant, size_key(params.height, params.width, params.true_cfg))
        try:
            with self._lost_with_gang(StageCall.DENOISE):
                async with self.loras.use(params.loras):
                    items = self._stream(request, f"denoised ({params.steps_run} steps)", timings)
                    async for item in write_step_stream(self._count_passes(items)):
                        if isinstance(item, StepDone):
                            self.load.progress(request_id, item.step, item.total)
                        yield item
        finally:
            self.load.remove(request_id)

    async def estimate(self, priority: int, tokens: int, steps: int, images: int, passes: int = 1, tenant: str = "",
                       deadline_s: float | None = None, budget_s: float | None = None,
                       reservation: str | None = None, key: tuple | None = None) -> float:
        """Seconds until ``images`` new images of ``tokens`` work tokens in ``passes`` passes (2 with true CFG) and
        ``steps`` steps at ``priority`` for ``tenant`` (``key``: their ``size_key``) would be done on this replica,
        the work that will go ahead of them included (``DiTLoad.estimate``). Given a ``reservation`` (the request's
        id) and an estimate within ``budget_s``, the request is admitted: its work counts here until its calls
        arrive (``DiTLoad.admit``), and the router sends them here (``deployments.routing``)."""
        if reservation is None or budget_s is None:
            return self.load.estimate(priority, tokens, steps, images, passes, tenant, deadline_s, key)
        return self.load.admit(reservation, budget_s, priority, tokens, steps, images, passes, tenant, deadline_s, key)

    def release(self, reservation: str) -> None:
        """A request admitted here under ``reservation`` will not come (refused after its admission): the router
        sends this call to the replica that admitted it."""
        self.load.release(reservation)

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
        cache = stats.core.condition_cache
        if cache is not None:
            metrics.condition_cache_bytes.set(cache.bytes, tags=self.tags)
            metrics.condition_cache_waiting.set(cache.waiting, tags=self.tags)
            if cache.budget is not None:
                metrics.condition_cache_budget_bytes.set(cache.budget, tags=self.tags)

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
        the adapters it holds, the work a step may take (``max_batch_tokens``), the requests admitted here whose
        calls have not arrived (``reservations``), Qwen-Image 2.1's condition caches (``condition_cache``: the
        bytes held, the budget, the requests waiting for room; None for Qwen-Image), and a streamed DiT's blocks
        (``offload``: kept, the most on the device at once, copies in, bytes a forward copies; None unstreamed)."""
        core = self.engine.stats.core
        cache = core.condition_cache
        return {**super().stats(), "batch_sizes": core.batch_sizes, "warmup_s": core.warmup_s,
                "paused_request_steps": core.paused_request_steps,
                "loras": [name for name, _ in self.loras.resident], "lora_loads": self.loras.num_loads,
                "max_batch_tokens": self.max_batch_tokens, "reservations": len(self.load.reserved),
                "condition_cache": dataclasses.asdict(cache) if cache is not None else None,
                "offload": core.offload}
