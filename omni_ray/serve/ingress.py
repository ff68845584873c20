"""The CrossEngineCoordinator: the app's ingress, a plain class over the stage protocol.

Each route plans a request (validates it, resolves sizes, assigns seeds, decides true CFG) and views the one event
stream that ``omni_ray.request_path.run_request`` makes of it: a JSON response drains it, server-sent events forward
it, handle callers get either. Image files are written, base64-encoded and serialised on threads, never on the event
loop.

The class knows no Ray: it takes any ``Stages`` (the Serve deployments' in the app, a fake one in tests) and any
``AdapterStore``, and its routes are attached when the app is built (``build_api``, after Ray Serve LLM's
``make_fastapi_ingress``), so the same routes run under Serve and under starlette's ``TestClient``.

Every ``/v1/...`` route first checks the API key (``api_keys``); ``/``, ``/web/...`` and ``/health`` are open.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from omni_ray.api.images import load_input_images, load_masked_input, write_image_file
from omni_ray.api.planning import GenerationPlan, check_route, plan_request, resolve_size
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
from omni_ray.config import EditConfig, LoraEntry, PipelineConfig
from omni_ray.errors import ForbiddenError, NotFoundError, OmniRayError, OverloadedError, RequestError
from omni_ray.records import Decoded, OutputMode, TokenCount
from omni_ray.request_path import Failed, ImageDone, ImagePreview, Progress, RequestEvent, Stages, collect, run_request
from omni_ray.serve import http
from omni_ray.serve.adapters import Adapter, AdapterStore, MemoryAdapters
from omni_ray.serve.api_keys import ApiKeys
from omni_ray.serve.page import WEB_FILES, page_html

logger = logging.getLogger("ray.serve")
MAX_IMAGE_DECODES = 4  # uploads decoded and resized at once, on threads: each may take seconds and 100s of MB
ADAPTER_NAME = re.compile(r"[\w.:-]+")


class Observer:
    """What the coordinator reports as it serves: Prometheus metrics in the app (``serve.app``), nothing in tests."""

    def request_failed(self, err: OmniRayError) -> None: ...
    def request_done(self, seconds: float, images: int) -> None: ...
    def estimated(self, seconds: float) -> None: ...


class Coordinator:
    """Plans requests and views their event streams: JSON, server-sent events, or records for handle callers.

    ``count_tokens(text, image_sizes)`` gives a prompt's templated length (a ``TokenCount``), checked against the
    encoder's limit and counted in ``usage``; ``unready()`` names the deployments without a running replica, for
    ``/health``. ``adapters`` holds the LoRA adapters loaded at run time (the preset's come from ``config``), and
    ``api_keys`` the keys ``/v1/...`` routes take (none: the server is open).
    """

    def __init__(
        self,
        stages: Stages,
        config: PipelineConfig,
        count_tokens: Callable[..., TokenCount],
        unready: Callable[[], list[str]] = list,
        observer: Observer | None = None,
        adapters: AdapterStore | None = None,
        api_keys: ApiKeys | None = None,
    ):
        self.stages = stages
        self.config = config
        self.count_tokens = count_tokens
        self.unready = unready
        self.observer = observer or Observer()
        self.adapters = adapters or MemoryAdapters()
        self.api_keys = api_keys or ApiKeys()
        self.started = int(time.time())  # /v1/models' `created` of the base model and the preset's adapters
        self.page_html = page_html(config, api_key=self.api_keys.required)
        self.image_slots = asyncio.Semaphore(MAX_IMAGE_DECODES)
        self.in_flight = 0  # requests whose events are being produced
        self.served = 0  # requests that ended, however
        if self.api_keys.required:
            logger.info("API keys are on: /v1/... routes take `Authorization: Bearer <key>`")
        else:
            logger.warning("OMNI_RAY_API_KEY is not set: anyone who reaches this port can use every route")

    # --- routes (attached by build_api) --------------------------------------------------------------------------

    async def generations(self, request: Request) -> Response:
        with self._counting_errors():
            tenant = self.authorize(request)
            check_route(self.config, has_image=False)  # before the body: a wrong route is told which is right
            body = await http.json_body(request)
        return await self.respond(await self.plan(body, tenant=tenant), request)

    async def edits(self, request: Request) -> Response:
        with self._counting_errors():
            tenant = self.authorize(request)
            if self.config.edit is None and not request.headers.get("content-type", "").startswith("multipart/"):
                check_route(self.config, has_image=True)  # no upload at all: told which route is right
            edit = self.config.edit or EditConfig()  # a text-to-image preset takes one image and a mask to inpaint
            limit = http.MAX_BODY_BYTES + (edit.max_images + 1) * edit.max_image_bytes  # the images and a mask
            fields, images, mask = await http.edit_form(request, limit, edit.max_images)
            body = parse_request(fields, form=True)
        return await self.respond(await self.plan(body, images, tenant, mask), request)  # []: "image: required"

    async def page(self) -> HTMLResponse:
        """The try-it page: a form over the images API with live previews (serve/web)."""
        return HTMLResponse(self.page_html)

    async def web_file(self, name: str) -> Response:
        if name not in WEB_FILES:
            raise NotFoundError(f"no such file: {name}", param=None, code=None)
        kind, data = WEB_FILES[name]
        return Response(data, media_type=kind, headers={"Cache-Control": "no-cache"})

    async def models(self, request: Request) -> dict:
        """OpenAI's model list: the base model, then each LoRA adapter (``parent``: the base it adapts, as vLLM
        lists them)."""
        self.authorize(request)
        base = {"id": self.config.name, "object": "model", "created": self.started, "owned_by": "omni-ray"}
        adapters = {name: self.started for name in self.config.loras}
        adapters.update({name: adapter.created for name, adapter in sorted((await self.adapters.all()).items())})
        return {"object": "list", "data": [base, *({"id": name, "object": "model", "created": created,
                                                    "owned_by": "omni-ray", "parent": self.config.name}
                                                   for name, created in adapters.items())]}

    async def load_lora_adapter(self, request: Request) -> JSONResponse:
        """Adds an adapter at run time (``{"lora_name", "lora_path"}``) where the preset allows it
        (``lora.allow_runtime_updates``), once a DiT replica has found the file under ``lora.roots`` and fitting the
        transformer; a path outside the roots or a broken file is a 400 naming ``lora_path`` and changes nothing.
        Every coordinator replica serves it once this returns."""
        with self._counting_errors():
            self.authorize(request)
            self._check_runtime_updates()
            body = await http.json_object(request, ("lora_name", "lora_path"))
            name, path = body["lora_name"], body["lora_path"]
            if not ADAPTER_NAME.fullmatch(name) or name == self.config.name:
                raise RequestError(f"lora_name: {name!r} must be letters, digits, '_', '.', ':' or '-', and not the "
                                   "base model's name", param="lora_name")
            taken = RequestError(f"lora_name: {name!r} is already loaded; unload it first", param="lora_name")
            if name in self.config.loras or await self.adapters.get(name) is not None:
                raise taken
            entry = await self.stages.check_lora(path)
            recipe = entry.recipe.model_dump() if entry.recipe is not None else None
            if not await self.adapters.add(name, Adapter(entry.path, int(time.time()), recipe)):
                raise taken  # another load of the name won meanwhile
            logger.info("LoRA adapter %r added from %s%s", name, entry.path, " with its recipe" if recipe else "")
        return JSONResponse({"lora_name": name, "status": "loaded"})

    async def unload_lora_adapter(self, request: Request) -> JSONResponse:
        """Removes a run-time adapter (``{"lora_name"}``): requests naming it get a 404 from now on, on every
        coordinator replica; each DiT replica frees its slot when it needs the room."""
        with self._counting_errors():
            self.authorize(request)
            self._check_runtime_updates()
            name = (await http.json_object(request, ("lora_name",)))["lora_name"]
            if name in self.config.loras:
                raise RequestError(f"lora_name: {name!r} comes from the preset (loras); remove it there",
                                   param="lora_name")
            if not await self.adapters.remove(name):
                raise NotFoundError(f"lora_name: no adapter {name!r} is loaded", param="lora_name")
            logger.info("LoRA adapter %r removed", name)
        return JSONResponse({"lora_name": name, "status": "unloaded"})

    async def health(self) -> JSONResponse:
        """200 once every deployment of the app has a running replica, else 503 naming those without one (still
        starting, or all lost): the ingress alone answering does not mean a request can be served."""
        waiting = await asyncio.to_thread(self.unready)
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
        return await self.json_response(await self.plan(body, image, mask=mask), request_id or uuid.uuid4().hex)

    async def generate_stream(
        self, body: dict | ImageGenerationRequest, request_id: str | None = None,
        image: bytes | Sequence[bytes] | None = None, mask: bytes | None = None,
    ) -> AsyncIterator[dict]:
        """The streamed events, as server-sent events carry them (``handle.options(stream=True)``)."""
        async for event in self.sse_events(await self.plan(body, image, mask=mask), request_id or uuid.uuid4().hex):
            yield event

    async def images(
        self,
        body: dict | ImageGenerationRequest,
        request_id: str | None = None,
        output: OutputMode = "pixels",
        image: bytes | Sequence[bytes] | None = None,
        mask: bytes | None = None,
    ) -> list[Decoded]:
        """The stage results for each of the ``n`` images: pixels, latents or both, per ``output``."""
        plan = await self.plan(body, image, mask=mask)
        return await collect(self.events(plan, request_id or uuid.uuid4().hex, output))

    # --- the one path and its views -----------------------------------------------------------------------------

    async def respond(self, plan: GenerationPlan, request: Request) -> Response:
        """JSON, or server-sent events when the request streams."""
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"x-request-id": request_id}
        if plan.request.stream:
            return StreamingResponse(http.sse(self.sse_events(plan, request_id)), media_type="text/event-stream",
                                     headers=headers)
        body = await asyncio.to_thread(json_bytes, await self.json_response(plan, request_id))
        return Response(body, media_type="application/json", headers=headers)

    async def plan(self, body: dict | ImageGenerationRequest, image: bytes | Sequence[bytes] | None = None,
                   tenant: str | None = None, mask: bytes | None = None) -> GenerationPlan:
        """Validates before any stage sees the request, and admits it when the DiT's queue can finish it before its
        deadline; an edit's images (one file, or a list) and mask are decoded and resized off the event loop, a few
        requests at a time. ``tenant`` (the caller's API key's name) replaces the body's ``user`` as whom the DiT
        shares its steps between."""
        with self._counting_errors():
            inputs = None
            files = [bytes(image)] if isinstance(image, (bytes, bytearray, memoryview)) else \
                [bytes(item) for item in image] if image is not None else None
            if files is not None:
                check_route(self.config, has_image=True, has_mask=mask is not None)  # before decoding anything
            if mask is not None:
                request = body if isinstance(body, ImageGenerationRequest) else parse_request(body)
                size = resolve_size(request, self.config)  # text-to-image inpainting's output size
                if len(files or ()) > 1:
                    raise RequestError("image: a masked edit takes one image", param="image")
                async with self.image_slots:
                    inputs = await asyncio.to_thread(load_masked_input, files[0] if files else b"", mask,
                                                     self.config, size)
                body = request
            elif files is not None and self.config.edit is not None:
                async with self.image_slots:
                    inputs = await asyncio.to_thread(load_input_images, files, self.config)
            plan = plan_request(body, self.config, self.count_tokens, inputs, await self._adapters_for(body),
                                has_image=image is not None)
            if tenant is not None:
                plan = dataclasses.replace(plan, tenant=tenant)
            await self._admit(plan)
            return plan

    async def _admit(self, plan: GenerationPlan) -> None:
        """Refuses at once (503, Retry-After) a request that the DiT's queue would finish past its deadline, from
        the replica's estimate of the work ahead of it (as urgent or more) and its own."""
        estimate = await self.stages.estimate(plan)
        if estimate is None:
            return
        self.observer.estimated(estimate)
        if estimate > plan.timeout_s:
            raise OverloadedError(
                f"the DiT would finish this request in about {estimate:.0f} s, past its {plan.timeout_s:g} s deadline "
                "(timeout)", retry_after_s=estimate - plan.timeout_s, stage="dit")

    async def _adapters_for(self, body: dict | ImageGenerationRequest) -> dict[str, LoraEntry]:
        """The adapter the request's ``model`` names (name -> its file and recipe), when it names one that exists;
        else every adapter, for the 404 to list."""
        if not isinstance(body, (dict, ImageGenerationRequest)):
            return {}  # not a JSON object: planning refuses it
        name = body.model if isinstance(body, ImageGenerationRequest) else body.get("model")
        if not isinstance(name, str) or name == self.config.name:
            return {}
        if name in self.config.loras:
            return {name: self.config.loras[name]}
        if (adapter := await self.adapters.get(name)) is not None:
            return {name: adapter.entry}
        return {**self.config.loras, **{name: a.entry for name, a in (await self.adapters.all()).items()}}

    def authorize(self, request: Request) -> str | None:
        """The name of the API key the request carries (None when the server takes none); raises
        AuthenticationError (401) unless it carries one of the server's keys."""
        return self.api_keys.check(request.headers.get("authorization"))

    def _check_runtime_updates(self) -> None:
        if not self.config.lora.allow_runtime_updates:
            raise ForbiddenError("loading and unloading adapters at run time is off on this server (the preset's "
                                 "lora.allow_runtime_updates)", param=None)

    async def events(self, plan: GenerationPlan, request_id: str, output: OutputMode = "pixels"
                     ) -> AsyncIterator[RequestEvent]:
        """The request's event stream over the stages, counted and logged."""
        start = time.perf_counter()
        self.in_flight += 1
        try:
            async for event in run_request(self.stages, plan, request_id, self.config.requests, output):
                if isinstance(event, Failed):
                    self.observer.request_failed(event.error)
                    logger.warning("request %s failed: %s", request_id, event.error)
                    yield event
                    return
                yield event
        finally:
            self.in_flight -= 1
            self.served += 1
        seconds = time.perf_counter() - start
        self.observer.request_done(seconds, plan.request.n)
        logger.info("request %s: %d image(s) in %.0f ms", request_id, plan.request.n, 1000 * seconds)

    async def json_response(self, plan: GenerationPlan, request_id: str) -> dict:
        results = await collect(self.events(plan, request_id))
        files = await asyncio.gather(*(_image_file(result, plan.request) for result in results))
        stats = [image_stats(result.timings, result.dit_passes) for result in results]
        return await asyncio.to_thread(images_response, files, plan, stats)

    async def sse_events(self, plan: GenerationPlan, request_id: str) -> AsyncIterator[dict]:
        """Each image's previews and the image as it is done, or one error event; with ``progress``, progress after
        every denoising step."""
        async for event in self.events(plan, request_id):
            if isinstance(event, Progress):
                if plan.request.progress:
                    yield progress_event(plan, event.index, event.step, event.total)
            elif isinstance(event, ImagePreview):
                data = await _image_file(event.result, plan.request)
                yield await asyncio.to_thread(partial_image_event, plan, event.index, event.partial_index, data)
            elif isinstance(event, ImageDone):
                data = await _image_file(event.result, plan.request)
                result = event.result
                stats = image_stats(result.timings, result.dit_passes) if plan.request.timings else None
                yield await asyncio.to_thread(completed_event, plan, event.index, data, stats)
            else:
                yield {"type": "error", **error_body(event.error)}

    @contextlib.contextmanager
    def _counting_errors(self) -> Iterator[None]:
        """Reports the OmniRayError that leaves the block: a request refused before its stream starts (a failed
        stream is reported where its error event passes)."""
        try:
            yield
        except OmniRayError as err:
            self.observer.request_failed(err)
            raise


async def _image_file(result: Decoded, request: ImageGenerationRequest) -> bytes:
    """The image file of one result, written on a thread (a large PNG takes a good part of a second)."""
    return await asyncio.to_thread(write_image_file, result.pixels, request.output_format, request.output_compression)


# The routes, by method name: what build_api attaches.
ROUTES = {
    "generations": ("POST", "/v1/images/generations", {}),
    "edits": ("POST", "/v1/images/edits", {}),
    "page": ("GET", "/", {"response_class": HTMLResponse}),
    "web_file": ("GET", "/web/{name}", {}),
    "models": ("GET", "/v1/models", {}),
    "load_lora_adapter": ("POST", "/v1/load_lora_adapter", {}),
    "unload_lora_adapter": ("POST", "/v1/unload_lora_adapter", {}),
    "health": ("GET", "/health", {}),
}


def build_api(target: type[Coordinator] | Coordinator) -> FastAPI:
    """The FastAPI app with every route of ``ROUTES`` attached to ``target``'s methods: a coordinator class, whose
    methods Serve's ingress binds to each replica's instance (``serve.ingress(build_api(cls))(cls)``), or an
    instance, served as it is (tests, with starlette's ``TestClient``)."""
    api = FastAPI(title="omni-ray", description="Qwen-Image behind OpenAI's images API.")
    api.add_exception_handler(OmniRayError, http.error_response)
    for name, (method, path, options) in ROUTES.items():
        api.add_api_route(path, getattr(target, name), methods=[method], **options)
    return api
