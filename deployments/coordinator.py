"""The CrossEngineCoordinator: the app's ingress deployment, where every request's way through the app starts.

For each request it
1. checks the caller's API key (``authorize``);
2. reads the body, and decodes and resizes an edit's images off the event loop, a few requests at a time, the most
   urgent first;
3. plans it once: the route checked, the body validated, sizes resolved, seeds assigned, true CFG decided
   (``api.planning.plan_request``);
4. admits it, or refuses it at once (503, ``Retry-After``) when it could not promise to finish it within its
   deadline (``deployments.admission``): the DiT replica it will reach counts it from then on; and charges it to its
   API key's quotas, or refuses it (429, ``Retry-After``: ``http.quotas``), giving up its DiT reservation;
5. runs it on the one request path (``request_path.run_request``, shared with the in-process pipeline): the
   stages chained by reference over ``deployments.stages.ServeStages``, ``n`` images fanned out, lost stage calls
   issued again, the deadline kept, every stage call cancelled when the caller goes away;
6. and views the request's event stream: a JSON response drains it, server-sent events forward it, handle callers
   get either (over Ray Client, which streams no handle call, the events put into a queue actor).

Image files are written, base64-encoded and serialised on threads, never on the event loop; uploads are decoded and
image files written in slots taken by the request's priority (``PrioritySlots``), so an urgent request never waits
behind bulk work of the coordinator's own. Serve builds one per
coordinator replica over the stage deployments' handles; ``CrossEngineCoordinator.over`` builds the same class over
any ``Stages`` (fakes in tests), whose routes then run under starlette's ``TestClient``. Every ``/v1/...`` route
first checks the API key; ``/``, ``/web/...`` and ``/health`` are open.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.util.queue import Queue
from starlette.background import BackgroundTask

from deployments import metrics
from deployments.admission import Admission
from deployments.health import ReplicaWatch
from deployments.http import bodies
from deployments.http.adapters import Adapters, AdapterStore, ClusterAdapters, MirroredAdapters
from deployments.http.api_keys import ApiKeys
from deployments.http.page import WEB_FILES, page_html
from deployments.http.quotas import NO_LEASE, ClusterQuotas, Lease, Quotas
from deployments.http.routes import build_api
from deployments.live import LiveDeployment
from deployments.priority_slots import PrioritySlots
from deployments.process import collect_when_idle, freeze_startup_heap, watch_event_loop
from deployments.ray_private import serve_tracing_enabled
from deployments.stages import ServeStages
from omni_ray import tracing
from omni_ray.api.images import (
    base64_limit,
    composite,
    load_control_images,
    load_control_masks,
    load_inputs,
    write_image_file,
)
from omni_ray.api.planning import (
    GenerationPlan,
    asks_for_control,
    check_control_route,
    check_controls,
    check_route,
    layered_resolution,
    max_image_bytes,
    plan_request,
    requested_size,
)
from omni_ray.api.responses import (
    completed_event,
    error_body,
    image_stats,
    images_response,
    json_bytes,
    partial_image_event,
    progress_event,
)
from omni_ray.api.schema import ImageGenerationRequest, parse_request
from omni_ray.config import EditConfig, PipelineConfig
from omni_ray.errors import NotFoundError, OmniRayError, OverloadedError
from omni_ray.live_settings import CoordinatorLive
from omni_ray.records import Decoded
from omni_ray.request_path import Failed, ImageDone, ImagePreview, Progress, RequestEvent, Stages, collect, run_request
from omni_ray.tokenizer import tokenizer_for

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger("ray.serve")
MAX_IMAGE_DECODES = 4  # uploads decoded and resized at once, on threads: each may take seconds and 100s of MB
MAX_IMAGE_WRITES = min(32, (os.cpu_count() or 1) + 4)  # image files written at once: as many threads as the event
# loop's default executor (asyncio.to_thread's) runs, so the slots, not that executor's FIFO queue, decide the order
COORDINATOR = {"stage": "coordinator"}  # the metrics' stage label
STALE_HEADER = "X-Omni-Ray-Stale-Seconds"  # on /v1/models while the adapters come from a replica's copy
ADAPTERS_EVERY_S = 10.0  # the run-time adapters listed into this replica's copy (MirroredAdapters)
STAGES_HEARD_WITHIN_S = 10.0  # at most, at start: stages still loading their models take longer


class CrossEngineCoordinator(LiveDeployment):
    """Plans requests, admits them, runs them across the stage engines and views their event streams: JSON,
    server-sent events, or records for handle callers."""

    stage = "coordinator"
    live_settings = CoordinatorLive

    def __init__(self, encoder: DeploymentHandle, dit: DeploymentHandle, vae: DeploymentHandle, config: PipelineConfig):
        """Serve builds one in each coordinator replica, over the stage deployments' handles (``app.build_app``),
        with the app's run-time adapters in the cluster's key-value store and the API keys of its process's
        ``OMNI_RAY_API_KEY``, and the keys' quotas (``OMNI_RAY_KEY_LIMITS``) counted in the app's ledger actor;
        it watches its own event loop and collects garbage when idle."""
        if serve_tracing_enabled():
            tracing.enable()  # spans for Ray Serve's exporter (omni_ray.tracing)
        app_name, api_keys = serve.get_replica_context().app_name, ApiKeys.from_env()
        quotas = Quotas.from_env(api_keys.count, lambda: ClusterQuotas(app_name))
        stages = ServeStages(encoder, dit, vae)
        adapters = MirroredAdapters(ClusterAdapters(app_name, read_timeout_s=MirroredAdapters.READ_TIMEOUT_S))
        self._setup(stages, config, adapters, api_keys, ReplicaWatch(stages.running_replicas), quotas)
        # Serve routes requests here once this returns; a replica started beside running stages (an upgrade) waits
        # until its routers have heard of their replicas, or /health would say 503 for them meanwhile.
        deadline = time.monotonic() + STAGES_HEARD_WITHIN_S
        while self.unready() and time.monotonic() < deadline:
            time.sleep(0.1)  # the routers hear from Serve's controller on a thread of their own
        # Serve runs the constructor on the event loop that serves the requests: the one to watch.
        loop = asyncio.get_running_loop()
        self.watch = loop.create_task(_watch_event_loop())
        self.collect = loop.create_task(collect_when_idle(lambda: (self.in_flight, self.served)))
        self.refresh = loop.create_task(_keep_fresh(self.unready, adapters))
        freeze_startup_heap()

    @classmethod
    def over(cls, stages: Stages, config: PipelineConfig, adapters: AdapterStore, api_keys: ApiKeys | None = None,
             unready: Callable[[], list[str]] = list, quotas: Quotas | None = None) -> CrossEngineCoordinator:
        """The same coordinator outside Serve, over any stage protocol; ``unready()`` names the deployments without
        a running replica (none: ``/health`` is ok); ``quotas``: the API keys' (none by default). An instance of the
        plain class: Serve's ingress wrapper around it has an asynchronous constructor and finaliser of Serve's own."""
        coordinator = object.__new__(_PlainCoordinator)
        coordinator._setup(stages, config, adapters, api_keys or ApiKeys(), unready, quotas or Quotas())
        return coordinator

    def _setup(self, stages: Stages, config: PipelineConfig, adapters: AdapterStore, api_keys: ApiKeys,
               unready: Callable[[], list[str]], quotas: Quotas) -> None:
        self.stages = tracing.traced(stages)  # itself unless tracing is on
        self.config = config
        self.tokenizer = tokenizer_for(config)  # counts a prompt's tokens
        self.adapters = Adapters(config, adapters, started=int(time.time()))
        self.api_keys = api_keys
        self.quotas = quotas
        self.unready = unready
        self.page_html = page_html(config, api_key=api_keys.required)
        self.image_slots = PrioritySlots(MAX_IMAGE_DECODES)  # uploads being decoded
        self.write_slots = PrioritySlots(MAX_IMAGE_WRITES)  # image files being written
        self.admission = Admission()
        self._start_live(config)
        self.in_flight = 0  # requests whose events are being produced
        self.served = 0  # requests that ended, however
        if api_keys.required:
            logger.info("API keys are on: /v1/... routes take `Authorization: Bearer <key>`")
        else:
            logger.warning("OMNI_RAY_API_KEY is not set: anyone who reaches this port can use every route")

    def _apply(self, live: CoordinatorLive) -> None:
        """The admission margins and the API keys' quotas (``key_limits``: in place of OMNI_RAY_KEY_LIMITS')."""
        quota_settings = live.quota_settings(self.api_keys.count or None)
        preset = Admission()
        self.admission.margin = preset.margin if live.admission_margin is None else live.admission_margin
        self.admission.margin_s = preset.margin_s if live.admission_margin_s is None else live.admission_margin_s
        self.quotas.set_settings(quota_settings)

    def stats(self) -> dict:
        """Its live settings (``LiveDeployment.live_stats``), for a handle caller."""
        return self.live_stats()

    # --- routes (attached by http.routes.build_api) --------------------------------------------------------------

    async def generations(self, request: Request) -> Response:
        """A JSON body (control images, and an inpainting ControlNet's masks, base64 in ``control``), or a multipart
        form whose ``control`` field is JSON text without images and whose ``control_image`` files are the control
        images in order (``control_mask`` files the masks)."""
        with self._counting_errors():
            tenant = self.authorize(request)
            controls = self.config.requests.max_controls if self.config.controlnets else 0  # room for their images
            masks = controls if self.config.inpaint_controlnets else 0  # room for their masks
            limit = bodies.MAX_BODY_BYTES + (controls + masks) * max_image_bytes(self.config)
            if request.headers.get("content-type", "").startswith("multipart/"):
                fields, files, mask_files = await bodies.generation_form(request, limit)
                body, controls, masks = parse_request(fields, form=True), files, mask_files
            else:  # base64 grows a file by a third
                body, controls, masks = await bodies.json_body(request, base64_limit(limit)), None, None
        request_id = _request_id(request)
        plan = await self.plan(body, tenant=tenant, control_images=controls, control_masks=masks, request_id=request_id)
        return await self.respond(plan, request_id, await self.charge(tenant, plan, request_id))

    async def edits(self, request: Request) -> Response:
        with self._counting_errors():
            tenant = self.authorize(request)
            if self.config.edit is None and not request.headers.get("content-type", "").startswith("multipart/"):
                check_route(self.config, has_image=True)  # no upload at all: told which route is right (planning
                # checks every other request's route)
            edit = self.config.edit or EditConfig()  # a text-to-image preset takes one image and a mask to inpaint
            limit = bodies.MAX_BODY_BYTES + (edit.max_images + 1) * edit.max_image_bytes  # the images and a mask
            fields, images, mask = await bodies.edit_form(request, limit)
            body = parse_request(fields, form=True)
        request_id = _request_id(request)  # []: "image: required"
        plan = await self.plan(body, images, tenant, mask, request_id=request_id)
        return await self.respond(plan, request_id, await self.charge(tenant, plan, request_id))

    async def page(self) -> HTMLResponse:
        """The try-it page: a form over the images API with live previews (``http/web``)."""
        return HTMLResponse(self.page_html)

    async def web_file(self, name: str) -> Response:
        if name not in WEB_FILES:
            raise NotFoundError(f"no such file: {name}", param=None, code=None)
        kind, data = WEB_FILES[name]
        return Response(data, media_type=kind, headers={"Cache-Control": "no-cache"})

    async def models(self, request: Request) -> JSONResponse:
        """OpenAI's model list; while the adapters come from this replica's copy (the GCS not answering), the
        ``X-Omni-Ray-Stale-Seconds`` header says how old it is."""
        self.authorize(request)
        return self._models_response(await self.adapters.model_list())

    async def model(self, request: Request, model: str) -> JSONResponse:
        """One model of the list (OpenAI's ``models.retrieve``); 404 naming ``model`` for any other."""
        self.authorize(request)
        return self._models_response(await self.adapters.model(model))

    def _models_response(self, body: dict) -> JSONResponse:
        stale_s = self.adapters.store.stale_s
        return JSONResponse(body, headers={STALE_HEADER: f"{stale_s:.0f}"} if stale_s is not None else None)

    async def load_lora_adapter(self, request: Request) -> JSONResponse:
        with self._counting_errors():
            self.authorize(request)
            return JSONResponse(await self.adapters.load(request, self.stages))

    async def unload_lora_adapter(self, request: Request) -> JSONResponse:
        with self._counting_errors():
            self.authorize(request)
            return JSONResponse(await self.adapters.unload(request))

    async def health(self) -> JSONResponse:
        """200 once every stage has a replica to take a call, else 503 naming those without one (still starting,
        replaced, or all lost): the ingress alone answering does not mean a request can be served. Answered from what
        this replica knows (``deployments.health``), never waiting on the cluster."""
        waiting = self.unready()
        if waiting:
            return JSONResponse({"status": "unavailable", "waiting_for": waiting}, status_code=503)
        return JSONResponse({"status": "ok"})

    # --- handle callers: the same views, by method ------------------------------------------------------------

    async def generate(
        self, body: dict | ImageGenerationRequest, request_id: str | None = None,
        image: bytes | Sequence[bytes] | None = None, mask: bytes | None = None,
    ) -> dict:
        """The images response for an OpenAI-style body (and for an edit the input image file, or a list of
        them, and a mask), as HTTP gets it."""
        request_id = request_id or uuid.uuid4().hex
        return await self.json_response(await self.plan(body, image, mask=mask, request_id=request_id), request_id)

    async def generate_stream(
        self, body: dict | ImageGenerationRequest, request_id: str | None = None,
        image: bytes | Sequence[bytes] | None = None, mask: bytes | None = None,
    ) -> AsyncIterator[dict]:
        """The streamed events, as server-sent events carry them (``handle.options(stream=True)``)."""
        request_id = request_id or uuid.uuid4().hex
        async for event in self.sse_events(await self.plan(body, image, mask=mask, request_id=request_id), request_id):
            yield event

    async def generate_into(
        self, queue: Queue, body: dict | ImageGenerationRequest, request_id: str | None = None,
        image: bytes | Sequence[bytes] | None = None, mask: bytes | None = None,
    ) -> None:
        """The streamed events put into ``queue`` as they happen, then None: the stream for a caller that cannot
        stream a handle call (Ray Client, which reads the queue). The request stops when the call is cancelled or
        the queue is gone (its caller too)."""
        try:
            async with contextlib.aclosing(self.generate_stream(body, request_id, image, mask)) as events:
                async for event in events:
                    await queue.put_async(event)
        finally:
            with contextlib.suppress(Exception):  # a queue gone takes nothing more
                await queue.put_async(None)

    # --- the one path and its views -----------------------------------------------------------------------------

    async def respond(self, plan: GenerationPlan, request_id: str, lease: Lease = NO_LEASE) -> Response:
        """JSON, or server-sent events when the request streams; ``lease`` (its key's quotas) ends with the
        response, however it ends."""
        headers = {"x-request-id": request_id}
        if plan.request.stream:  # the lease also ends after a stream that never started (its client gone)
            return StreamingResponse(lease.holding(bodies.sse(self.sse_events(plan, request_id))),
                                     media_type="text/event-stream", headers=headers,
                                     background=BackgroundTask(lease.end))
        with lease:
            body = await asyncio.to_thread(json_bytes, await self.json_response(plan, request_id))
        return Response(body, media_type="application/json", headers=headers)

    async def charge(self, tenant: str | None, plan: GenerationPlan, request_id: str | None = None) -> Lease:
        """Charges an admitted plan to its API key's quotas (``tenant``: the key's name): its lease, or
        RateLimitError (429, Retry-After) over a limit; then what its admission reserved at the DiT under
        ``request_id`` is given up."""
        with self._counting_errors():
            try:
                return await self.quotas.acquire(tenant, plan)
            except BaseException:  # refused, or its caller left: the request will not run
                if request_id is not None:
                    self.stages.release(request_id)
                raise

    async def plan(self, body: dict | ImageGenerationRequest, image: bytes | Sequence[bytes] | None = None,
                   tenant: str | None = None, mask: bytes | None = None,
                   control_images: Sequence[bytes] | None = None, control_masks: Sequence[bytes] | None = None,
                   request_id: str | None = None) -> GenerationPlan:
        """Validates before any stage sees the request, and admits it when the DiT's queue can finish it before its
        deadline; an edit's images (one file, or a list) and mask, and a generation's control images (the body's
        base64 ones, or a multipart body's ``control_image`` files: ``control_images``, and ``control_mask`` files:
        ``control_masks``), are decoded and resized off
        the event loop, a few requests at a time, after the checks that need no pixels. ``tenant`` (the caller's API
        key's name) replaces the body's ``user`` as whom the DiT shares its steps between; ``request_id`` (the id
        the request will run under) is what its admission is reserved under at the DiT."""
        with self._counting_errors():
            files = [bytes(image)] if isinstance(image, (bytes, bytearray, memoryview)) else \
                [bytes(item) for item in image] if image is not None else None
            inputs = size = controls = masks = None
            if mask is not None:  # a masked edit is prepared at the size the request names
                check_route(self.config, has_image=files is not None, has_mask=True)  # before any pixel is decoded
                body = body if isinstance(body, ImageGenerationRequest) else parse_request(body)
                size = requested_size(body, self.config)
            if control_images is not None or asks_for_control(body):
                if asks_for_control(body):
                    check_control_route(self.config, has_image=files is not None or mask is not None)
                body = body if isinstance(body, ImageGenerationRequest) else parse_request(body)
                check_controls(body, self.config)  # names and count, before any image is decoded
                async with self.image_slots.take(_priority(body)):
                    controls, masks = await asyncio.to_thread(self._load_controls, body, control_images,
                                                              control_masks)
            if files is not None or mask is not None:
                async with self.image_slots.take(_priority(body)):
                    inputs = await asyncio.to_thread(load_inputs, files, mask, self.config, size,
                                                     layered_resolution(body, self.config))
            plan = plan_request(body, self.config, self.tokenizer.num_tokens, inputs,
                                await self.adapters.for_request(body), has_image=files is not None,
                                control_images=controls, control_masks=masks)
            if tenant is not None:
                plan = dataclasses.replace(plan, tenant=tenant)
            await self._admit(plan, request_id)
            return plan

    def _load_controls(self, body: ImageGenerationRequest, images: Sequence[bytes] | None,
                       masks: Sequence[bytes] | None) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray | None, ...]]:
        """A generation's control images and masks, decoded (on a worker thread)."""
        max_bytes = max_image_bytes(self.config)
        decoded = load_control_images(body, images, max_bytes)
        files = masks if images is not None else None  # a multipart body: its mask files, maybe none
        return decoded, load_control_masks(body, files, decoded, self.config.inpaint_controlnets, max_bytes)

    async def _admit(self, plan: GenerationPlan, request_id: str | None = None) -> None:
        """Refuses at once (503, Retry-After) a request that could not be promised to finish within its deadline:
        the DiT replica it will reach estimates its share, the work that will run ahead of it included, and must fit
        the budget the deadline leaves it (``Admission``); admitted, the request is counted there from now on."""
        budget = self.admission.budget_s(plan)
        estimate = await self.stages.estimate(plan, request_id, budget)
        if estimate is None:
            return
        metrics.finish_estimate.observe(estimate, tags=COORDINATOR)
        if estimate > budget:
            raise OverloadedError(
                f"the DiT would finish this request in about {estimate:.0f} s: with its other stages, past its "
                f"{plan.timeout_s:g} s deadline (timeout)", retry_after_s=estimate - budget, stage="dit")

    async def events(self, plan: GenerationPlan, request_id: str) -> AsyncIterator[RequestEvent]:
        """The request's event stream over the stages, counted and logged. A request that fails or is left by its
        client gives up what its admission reserved at the DiT and its calls never took (a reservation otherwise
        counts in the replica's estimates until the request's deadline)."""
        start = time.perf_counter()
        self.in_flight += 1
        finished = False
        try:
            async for event in tracing.traced_request(run_request(self.stages, plan, request_id, self.config.requests),
                                                      plan, request_id):
                if isinstance(event, ImageDone):
                    self.admission.observe(plan, time.perf_counter() - start, event.result.timings.get("dit", 0.0))
                if isinstance(event, Failed):
                    _count_failure(event.error)
                    logger.warning("request %s failed: %s", request_id, event.error)
                    yield event
                    return
                yield event
            finished = True
        finally:
            self.in_flight -= 1
            self.served += 1
            if not finished:
                self.stages.release(request_id)
        seconds = time.perf_counter() - start
        metrics.request_latency.observe(seconds, tags=COORDINATOR)
        metrics.images_generated.inc(plan.request.n, tags=COORDINATOR)
        logger.info("request %s: %d image(s) in %.0f ms", request_id, plan.request.n, 1000 * seconds)

    async def json_response(self, plan: GenerationPlan, request_id: str) -> dict:
        results = await collect(self.events(plan, request_id))
        per_result = await asyncio.gather(*(self._image_files(result, plan.request) for result in results))
        files = [file for result_files in per_result for file in result_files]
        each = range(plan.images_per_result)  # a Layered image's layers share its stats and caption
        stats = [image_stats(result.timings, result.dit_passes) for result in results for _ in each]
        revised = [result.revised_prompt for result in results for _ in each]
        return await asyncio.to_thread(images_response, files, plan, stats, revised)

    async def sse_events(self, plan: GenerationPlan, request_id: str) -> AsyncIterator[dict]:
        """Each image's previews and the image as it is done, or one error event; with ``progress``, progress after
        every denoising step."""
        async for event in self.events(plan, request_id):
            if isinstance(event, Progress):
                if plan.request.progress:
                    yield progress_event(plan, event.index, event.step, event.total)
            elif isinstance(event, ImagePreview):
                data = await self._image_file(event.result, plan.request)
                yield await asyncio.to_thread(partial_image_event, plan, event.index, event.partial_index, data)
            elif isinstance(event, ImageDone):
                result = event.result
                stats = image_stats(result.timings, result.dit_passes) if plan.request.timings else None
                if not plan.layers:
                    data = await self._image_file(result, plan.request)
                    yield await asyncio.to_thread(completed_event, plan, event.index, data, stats)
                    continue
                for layer, data in enumerate(await self._image_files(result, plan.request)):  # one event per layer
                    yield await asyncio.to_thread(completed_event, plan, event.index, data, stats, layer,
                                                  result.revised_prompt)
            else:
                yield {"type": "error", **error_body(event.error)}

    async def _image_file(self, result: Decoded, request: ImageGenerationRequest) -> bytes:
        """The image file of one result, written on a thread (a large PNG takes a good part of a second) in a write
        slot taken by the request's priority; a Layered result's (a preview's) is its layers composited."""
        pixels = result.pixels if result.pixels.ndim == 3 else composite(result.pixels)
        return await self._write(pixels, request)

    async def _image_files(self, result: Decoded, request: ImageGenerationRequest) -> list[bytes]:
        """The image files of one result: its one image, or a Layered result's layers bottom to top, each written
        on a thread."""
        if result.pixels.ndim == 3:
            return [await self._image_file(result, request)]
        return list(await asyncio.gather(*(self._write(layer, request) for layer in result.pixels)))

    async def _write(self, pixels: np.ndarray, request: ImageGenerationRequest) -> bytes:
        async with self.write_slots.take(request.priority):
            return await asyncio.to_thread(write_image_file, pixels, request.output_format,
                                           request.output_compression, request.background != "opaque")

    def authorize(self, request: Request) -> str | None:
        """The name of the API key the request carries (None when the server takes none); raises
        AuthenticationError (401) unless it carries one of the server's keys."""
        return self.api_keys.check(request.headers.get("authorization"))

    @contextlib.contextmanager
    def _counting_errors(self) -> Iterator[None]:
        """Counts the OmniRayError that leaves the block: a request refused before its stream starts (a failed
        stream is counted where its error event passes)."""
        try:
            yield
        except OmniRayError as err:
            _count_failure(err)
            raise


_PlainCoordinator = CrossEngineCoordinator
# Wrapped where it is defined, under its own name, so that Serve pickles the deployment by reference (a few bytes)
# rather than the class and its FastAPI app by value (tens of KB, past Ray's inline limit into the object store).
CrossEngineCoordinator = serve.ingress(build_api(CrossEngineCoordinator))(CrossEngineCoordinator)


def _priority(body: dict | ImageGenerationRequest) -> int:
    """The request's priority for the coordinator's own queues, read before the body is validated (planning refuses
    a bad one; meanwhile it counts as 0)."""
    value = body.priority if isinstance(body, ImageGenerationRequest) else body.get("priority", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _request_id(request: Request) -> str:
    return request.headers.get("x-request-id") or uuid.uuid4().hex


def _count_failure(err: OmniRayError) -> None:
    metrics.errors.inc(tags={**COORDINATOR, "type": type(err).__name__})


async def _keep_fresh(watch: ReplicaWatch, adapters: MirroredAdapters) -> None:
    """Looks at the stages' replicas twice a second, so that ``/health`` knows how long one has been without any;
    lists the adapters into their copy every ``ADAPTERS_EVERY_S`` (so that it is recent when the GCS goes away), and
    every second while the copy stands in for the store (so that the store takes over again as soon as it answers)."""
    listed_at = -math.inf
    while True:
        watch()
        every_s = 1.0 if adapters.stale_s is not None else ADAPTERS_EVERY_S
        if time.monotonic() - listed_at >= every_s:
            listed_at = time.monotonic()
            await adapters.refresh()
        await asyncio.sleep(0.5)


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
