"""What every stage deployment is: a shim that starts its engine and turns each call into one request in it.

A stage's input from another stage arrives as an ``Upstream`` (a reference the coordinator passed on without
reading it), which the shim resolves itself: an input lost with another replica raises ``StageLostError`` naming
that call, so the request path issues exactly that call again. The shim reads its engine only through what the
engine hands out (each result with its timings, and ``engine.stats``), never the core's attributes. One module per
stage: ``encoder``, ``dit``, ``vae``. The DiT's and the VAE's replicas may run their runner on a gang of ranks
(``deployments.gang``); a broken gang ends its replica (``_end_replica``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator

import ray
import torch  # noqa: F401  (imported before the first call: unpickling a tensor would import it on the event loop)
from ray import serve

from deployments import metrics
from deployments.card import RayCard
from deployments.gang import RayExecutor
from deployments.live import LiveDeployment
from deployments.process import freeze_startup_heap
from deployments.ray_private import serve_tracing_enabled
from omni_ray import tracing
from omni_ray.config import DiTConfig, PipelineConfig, VAEConfig
from omni_ray.engine.async_engine import AsyncEngine
from omni_ray.engine.executor import ExecutorFactory, RunnerFactory
from omni_ray.engine.stats import EngineStats
from omni_ray.errors import GangError, StageCall, StageLostError
from omni_ray.records import Finished

logger = logging.getLogger("ray.serve")

GANG_END_WAIT_S = 10.0  # at most; Ray ends the process within milliseconds


class StageDeployment(LiveDeployment):
    """What every stage deployment does besides its one call: start, live settings, metrics, health, stats,
    shutdown."""

    stage = ""

    def __init__(self, build_core, config: PipelineConfig):
        """``config``: the app's, whose stage section its live settings lie over."""
        self._start_live(config)
        if serve_tracing_enabled():
            tracing.enable()  # a span per engine request, for Ray Serve's exporter (omni_ray.tracing)
        self.gang: RayExecutor | None = None  # set while ``build_core`` starts one (``gang_factory``)
        # the app's shared card, when this stage takes turns on one (``card.stages``), for ``build_core`` to use
        self.card = (RayCard(serve.get_replica_context().app_name)
                     if config.card is not None and self.stage in config.card.stages else None)
        if self.card is not None:
            self.card.register(self.stage)
        self.tags = {"stage": self.stage}
        self.last_step_at = 0.0  # monotonic
        self.engine = AsyncEngine(build_core, self.stage, on_step=self._record_step).start()
        logger.info("%s engine started", self.stage)
        threading.Thread(target=self._keep_gauges_fresh, name=f"omni-ray-{self.stage}-gauges", daemon=True).start()
        freeze_startup_heap()

    def _record_step(self, seconds: float, batch: int) -> None:
        """Called on the engine's thread after every step that produced outputs, its stats just made."""
        self.last_step_at = time.monotonic()
        metrics.step_latency.observe(seconds, tags=self.tags)
        metrics.running_batch_size.set(batch, tags=self.tags)
        self._set_gauges(self.engine.stats)

    def _keep_gauges_fresh(self, period_s: float = 1.0) -> None:
        """Ray 2.60 exports a gauge for about two seconds after it was set: an idle stage would read "no data" on a
        dashboard. Once a second without a step, this sets what the stage holds and 0 for the batch."""
        while True:
            time.sleep(period_s)
            if time.monotonic() - self.last_step_at < period_s:
                continue
            try:
                metrics.running_batch_size.set(0, tags=self.tags)
                self._set_gauges(self.engine.stats)
            except Exception:  # a gauge's bug must show, and must not stop the others being kept fresh
                logger.exception("%s: setting the idle gauges failed", self.stage)

    def _set_gauges(self, stats: EngineStats) -> None:
        """The gauges of what the stage holds, from its engine's latest stats."""
        metrics.queue_length.set(stats.running, tags=self.tags)

    async def _run(self, request, what: str, upstream: dict[str, float] | None = None):
        """Runs one request in this engine (timed into its result's ``timings``, after ``upstream``'s), counted,
        logged under its id."""
        result = None
        async for item in self._stream(request, what, upstream):
            result = item.result
        return result

    async def _stream(self, request, what: str, upstream: dict[str, float] | None = None) -> AsyncIterator:
        """As ``_run``, yielding the engine's typed stream: ``StepDone`` and ``Preview`` items, then ``Finished``."""
        try:
            async for item in tracing.traced_stream(self.stage, request, self.engine.stream(request, upstream)):
                if isinstance(item, Finished):
                    seconds = item.result.timings[request.timing]
                    metrics.stage_request_latency.observe(seconds, tags=self.tags)
                    logger.info("request %s: %s in %.0f ms", request.request_id, what, 1000 * seconds)
                yield item
        except Exception as err:
            metrics.errors.inc(tags={**self.tags, "type": type(err).__name__})
            logger.warning("request %s: %s failed: %s", request.request_id, self.stage, err)
            raise

    def gang_factory(self, stage: DiTConfig | VAEConfig) -> ExecutorFactory | None:
        """How the stage's builder starts its gang here (``stage.parallel`` above world size 1): as rank actors in
        this replica's placement group, a broken gang ending the replica; None at world size 1."""
        return functools.partial(self._start_gang, stage) if stage.parallel.world_size > 1 else None

    def _start_gang(self, stage: DiTConfig | VAEConfig, make_runner: RunnerFactory) -> RayExecutor:
        self.gang = RayExecutor(make_runner, stage, self.stage, on_failure=self._end_replica)
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
        answered before the end sees the ``GangError`` turned into ``StageLostError`` (``_lost_with_gang``): retried
        too."""
        logger.error("%s gang broken (%s): ending this replica so that Serve replaces it and its gang", self.stage,
                     reason)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
        time.sleep(GANG_END_WAIT_S)  # the end comes first: callers then see a dead replica, which the router drops

    @contextlib.contextmanager
    def _lost_with_gang(self, call: StageCall) -> Iterator[None]:
        """A call that failed with its replica's gang (the replica is ending) is lost with it: the caller issues
        ``call`` again."""
        try:
            yield
        except GangError as err:
            raise StageLostError(self.stage, call, str(err)) from None

    def check_health(self) -> None:
        """Serve restarts the replica when this raises: the engine loop died or one step hangs, or its gang broke."""
        self.engine.check_health()
        if self.gang is not None:
            self.gang.check_health()

    def stats(self) -> dict:
        """Counters of the engine: requests it took, aborted, still running; steps it ran; the Ray node the replica
        runs on; its turns on a shared card (``RayCard.figures``; None off one); and its live settings
        (``live_stats``)."""
        stats = self.engine.stats
        return {"node_id": ray.get_runtime_context().get_node_id(), "requests": stats.requests,
                "aborted": stats.aborted, "running": stats.running, "steps": stats.steps,
                "card": self.card.figures() if self.card is not None else None, **self.live_stats()}

    def __del__(self) -> None:
        # Serve calls this on graceful shutdown; it stops the loop and shuts the core down (vLLM's included, which
        # otherwise leaves a /tmp/vllm_dist_* file behind per replica).
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
