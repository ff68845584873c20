"""The coordinator as a Serve replica: the plain ingress (``ingress.Coordinator``) over the stage deployments'
handles, counting into Prometheus and watching its own event loop.

Its own module, so that a coordinator replica imports what it runs and no model code: the stage shims (and the
runners they load) live in ``deployments``.
"""

from __future__ import annotations

import asyncio
import time

from ray import serve
from ray.serve.handle import DeploymentHandle

from omni_ray.config import PipelineConfig
from omni_ray.errors import OmniRayError
from omni_ray.runners.tokenizer import PromptTokenizer
from omni_ray.serve import metrics, ray_private
from omni_ray.serve.adapters import Adapter, AdapterStore
from omni_ray.serve.api_keys import ApiKeys
from omni_ray.serve.ingress import Coordinator, Observer, build_api
from omni_ray.serve.process import collect_when_idle, freeze_startup_heap, watch_event_loop
from omni_ray.serve.serve_stages import ServeStages

COORDINATOR = {"stage": "coordinator"}


class _Metrics(Observer):
    def request_failed(self, err: OmniRayError) -> None:
        metrics.errors.inc(tags={**COORDINATOR, "type": type(err).__name__})

    def request_done(self, seconds: float, images: int) -> None:
        metrics.request_latency.observe(seconds, tags=COORDINATOR)
        metrics.images_generated.inc(images, tags=COORDINATOR)

    def estimated(self, seconds: float) -> None:
        metrics.finish_estimate.observe(seconds, tags=COORDINATOR)


class ClusterAdapters(AdapterStore):
    """The app's run-time adapters in the GCS's key-value store, which every replica reads and which outlives them
    (as long as the cluster lives; with GCS fault tolerance, its restarts too)."""

    NAMESPACE = "omni_ray_adapters"

    def __init__(self, app_name: str):
        self.prefix = f"{app_name}/"

    async def get(self, name: str) -> Adapter | None:
        data = await ray_private.kv_get(self.prefix + name, self.NAMESPACE)
        return Adapter.from_json(data) if data is not None else None

    async def all(self) -> dict[str, Adapter]:
        items = await ray_private.kv_items(self.prefix, self.NAMESPACE)
        return {key.removeprefix(self.prefix): Adapter.from_json(value) for key, value in items.items()}

    async def add(self, name: str, adapter: Adapter) -> bool:
        return await ray_private.kv_add(self.prefix + name, adapter.to_json(), self.NAMESPACE)

    async def remove(self, name: str) -> bool:
        return await ray_private.kv_delete(self.prefix + name, self.NAMESPACE)


class ServeCoordinator(Coordinator):
    """The coordinator as a Serve replica: over the stage deployments' handles, with the app's adapters in the
    cluster's key-value store and the API keys of its process's ``OMNI_RAY_API_KEY``, counting into Prometheus,
    watching its own event loop, collecting garbage when idle (``collect_when_idle``)."""

    def __init__(self, encoder: DeploymentHandle, dit: DeploymentHandle, vae: DeploymentHandle, config: PipelineConfig):
        tokenizer = PromptTokenizer(config.model, config.prompt_template)
        super().__init__(ServeStages(encoder, dit, vae), config, tokenizer.num_tokens, _deployments_without_replicas,
                         _Metrics(), ClusterAdapters(serve.get_replica_context().app_name), ApiKeys.from_env())
        # Serve runs the constructor on the event loop that serves the requests: the one to watch.
        self.watch = asyncio.get_running_loop().create_task(_watch_event_loop())
        self.collect = asyncio.get_running_loop().create_task(collect_when_idle(lambda: (self.in_flight, self.served)))
        freeze_startup_heap()


# Wrapped where it is defined, under its own name, so that Serve pickles the deployment by reference (a few bytes)
# rather than the class and its FastAPI app by value (tens of KB, past Ray's inline limit into the object store).
ServeCoordinator = serve.ingress(build_api(ServeCoordinator))(ServeCoordinator)


def _deployments_without_replicas() -> list[str]:
    app = serve.status().applications[serve.get_replica_context().app_name]
    return sorted(name for name, deployment in app.deployments.items() if not deployment.replica_states.get("RUNNING"))


async def _watch_event_loop() -> None:
    """The event loop's stalls and its thread's waits for a CPU (``watch_event_loop``), and the replica process's
    CPU time, into Prometheus."""
    cpu = time.process_time()

    def observe(stall_s: float, cpu_wait_s: float) -> None:
        nonlocal cpu
        metrics.event_loop_stall.observe(stall_s, tags=COORDINATOR)
        metrics.event_loop_cpu_wait.observe(cpu_wait_s, tags=COORDINATOR)
        now = time.process_time()
        if now > cpu:  # Ray's counters refuse 0
            metrics.process_cpu.inc(now - cpu, tags=COORDINATOR)
            cpu = now

    await watch_event_loop(observe)
