"""The CrossEngineCoordinator: the app's ingress. It keeps the routes; the request path does the rest.

Each route plans a request (validates it, resolves sizes, assigns seeds) and views the one event stream that
``omni_ray.request_path.run_request`` makes of it over the stage deployments (``ServeStages``): a JSON response
drains it, server-sent events forward it, handle callers get either. Stage results pass from replica to replica by
reference; only each image's final pixels come here, and they are encoded to PNG/JPEG/WebP, base64 and JSON on
threads, never on the event loop (``omni_event_loop_stall_seconds`` watches it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import pathlib
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.datastructures import UploadFile

from deployments import metrics
from deployments.process import freeze_startup_heap, watch_event_loop
from deployments.serve_stages import ServeStages
from omni_ray.config import PipelineConfig
from omni_ray.errors import NotFoundError, OmniRayError, OverloadedError, PayloadTooLargeError, RequestError
from omni_ray.protocol import (
    GenerationPlan,
    ImageGenerationRequest,
    check_route,
    completed_event,
    encode_image,
    error_body,
    image_stats,
    images_response,
    json_bytes,
    load_input_image,
    parse_request,
    partial_image_event,
    plan_request,
    progress_event,
)
from omni_ray.request_path import Failed, ImageDone, Preview, Progress, RequestEvent, collect, run_request
from omni_ray.stages.decode import Decoded, OutputMode
from omni_ray.stages.encode import PromptTokenizer, template_for

logger = logging.getLogger("ray.serve")
MAX_BODY_BYTES = 1 << 20
MAX_IMAGE_DECODES = 4  # uploads decoded and resized at once, on threads: each may take seconds and 100s of MB

api = FastAPI(title="omni-ray", description="Qwen-Image behind OpenAI's images API.")


COORDINATOR = {"stage": "coordinator"}


def _count_error(err: OmniRayError) -> None:
    metrics.errors.inc(tags={**COORDINATOR, "type": type(err).__name__})


@contextlib.contextmanager
def _counting_errors() -> Iterator[None]:
    """Counts the OmniRayError that leaves the block: a request refused before its stream starts (a failed stream
    is counted where its error event passes)."""
    try:
        yield
    except OmniRayError as err:
        _count_error(err)
        raise


async def _sse(events: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Server-sent events, one ``data:`` line of JSON each; an image's (megabytes of base64) is written on a
    thread."""
    async for event in events:
        if "b64_json" in event:
            yield await asyncio.to_thread(_sse_line, event)
        else:
            yield _sse_line(event)


def _sse_line(event: dict) -> bytes:
    return b"data: " + json_bytes(event) + b"\n\n"


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


def _deployments_without_replicas() -> list[str]:
    app = serve.status().applications[serve.get_replica_context().app_name]
    return sorted(name for name, deployment in app.deployments.items() if not deployment.replica_states.get("RUNNING"))


@api.exception_handler(OmniRayError)
async def _omni_ray_error(request: Request, err: OmniRayError) -> JSONResponse:
    headers = {"Retry-After": str(max(1, math.ceil(err.retry_after_s)))} if isinstance(err, OverloadedError) else None
    body = error_body(str(err), err.error_type, getattr(err, "param", None), getattr(err, "code", None))
    return JSONResponse(body, err.status_code, headers=headers)


async def _read_limited(request: Request, limit: int, param: str | None = None) -> bytes:
    """The body, refused as soon as it passes ``limit`` bytes (by its declared length or while it streams in)."""
    too_large = PayloadTooLargeError(f"request body exceeds {limit} bytes", param=param)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


IMAGE_FIELDS = ("image", "image[]")  # OpenAI's client names one file `image`, a list `image[]`


async def _json_object(request: Request, fields: tuple[str, ...]) -> dict:
    """A small JSON body with the string ``fields`` (no others); RequestError naming the first bad one."""
    try:
        body = json.loads(await _read_limited(request, MAX_BODY_BYTES))
    except ValueError:
        raise RequestError("request body is not valid JSON", param=None) from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", param=None)
    for field in fields:
        if not isinstance(body.get(field), str) or not body[field]:
            raise RequestError(f"{field}: required, a non-empty string", param=field)
    if extra := sorted(set(body) - set(fields)):
        raise RequestError(f"{extra[0]}: unknown parameter", param=extra[0])
    return body


async def _edit_form(request: Request, limit: int) -> tuple[dict[str, str], bytes | None]:
    """An edit's multipart form: its text fields, and the bytes of its one ``image`` file (None when missing)."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        raise RequestError("request body must be multipart/form-data with an `image` file and a `prompt`", param=None)
    body = await _read_limited(request, limit, param="image")

    async def replay() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        form = await Request(request.scope, replay).form(max_files=4, max_fields=64)
    except Exception as err:  # Starlette's parser raises HTTPException or MultiPartException
        raise RequestError(f"malformed multipart body: {getattr(err, 'detail', err)}", param=None) from None
    fields, images = {}, []
    try:
        for name, value in form.multi_items():
            if name in IMAGE_FIELDS and isinstance(value, UploadFile):
                images.append(await value.read())
            elif name == "mask":
                raise RequestError("mask: masks are not supported; the prompt says what to change", param="mask")
            elif name in IMAGE_FIELDS or isinstance(value, UploadFile):
                param = "image" if name in IMAGE_FIELDS else name
                raise RequestError(f"{param}: expected {'a file' if param == 'image' else 'a text field'}",
                                   param=param)
            elif name in fields:
                raise RequestError(f"{name}: given more than once", param=name)
            else:
                fields[name] = value
    finally:
        await form.close()  # uploads past 1 MiB spill to temporary files
    if len(images) > 1:
        raise RequestError(f"image: one input image per request, got {len(images)}", param="image")
    return fields, images[0] if images else None


WEB = pathlib.Path(__file__).resolve().parent / "web"
WEB_FILES = {name: (kind, (WEB / name).read_bytes())
             for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css"))}


def page_html(config: PipelineConfig) -> str:
    """index.html with what the page needs of the preset: its name, mode, default size and steps, and sizes to offer."""
    limits = config.requests
    default = f"{limits.default_width}x{limits.default_height}"
    squares = [f"{side}x{side}" for side in (64, 128, 256, 512, 1024, 1328)
               if limits.min_side <= side <= limits.max_side]
    settings = {"model": config.name, "edit": config.edit is not None, "default_size": default,
                "default_steps": limits.default_steps, "sizes": list(dict.fromkeys([default, *squares]))}
    # "</" cannot end the script element early: JSON allows "<\/" for "</".
    return (WEB / "index.html").read_text().replace("__SETTINGS__", json.dumps(settings).replace("</", "<\\/"))


async def _encode_file(result: Decoded, request: ImageGenerationRequest) -> bytes:
    """The image file of one result, encoded on a thread (a 1328x1328 PNG takes 120-250 ms)."""
    return await asyncio.to_thread(encode_image, result.pixels, request.output_format, request.output_compression)


# Serve pickles the class when @serve.ingress runs, before the rest of this module exists: helpers go above.
@serve.ingress(api)
class Coordinator:
    """Plans requests and views their event streams: JSON, server-sent events, or records for handle callers."""

    def __init__(self, encoder: DeploymentHandle, dit: DeploymentHandle, vae: DeploymentHandle, config: PipelineConfig):
        self.stages = ServeStages(encoder, dit, vae)
        self.config = config
        self.adapters = dict(config.loras)  # LoRA adapter name -> file: the preset's, then those loaded at run time
        self.page_html = page_html(config)
        self.tokenizer = PromptTokenizer(config.model, template_for(config))
        self.image_slots = asyncio.Semaphore(MAX_IMAGE_DECODES)
        try:  # Serve runs the constructor on the event loop that serves the requests: the one to watch
            self.watch = asyncio.get_running_loop().create_task(_watch_event_loop())
        except RuntimeError:  # built outside an event loop, as in unit tests: nothing to watch
            self.watch = None
        freeze_startup_heap()

    @api.post("/v1/images/generations")
    async def generations(self, request: Request) -> Response:
        with _counting_errors():
            check_route(self.config, has_image=False)
            body = await _read_limited(request, MAX_BODY_BYTES)
            try:
                payload = json.loads(body)
            except ValueError:
                raise RequestError("request body is not valid JSON", param=None) from None
        return await self.respond(await self.plan(payload), request)

    @api.post("/v1/images/edits")
    async def edits(self, request: Request) -> Response:
        with _counting_errors():
            check_route(self.config, has_image=True)
            fields, image = await _edit_form(request, self.config.edit.max_image_bytes + MAX_BODY_BYTES)
            body = parse_request(fields, form=True)
        return await self.respond(await self.plan(body, image or b""), request)  # b"": "image: required"

    async def respond(self, plan: GenerationPlan, request: Request) -> Response:
        """JSON, or server-sent events when the request streams."""
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"x-request-id": request_id}
        if plan.request.stream:
            return StreamingResponse(_sse(self.sse_events(plan, request_id)), media_type="text/event-stream",
                                     headers=headers)
        body = await asyncio.to_thread(json_bytes, await self.json_response(plan, request_id))
        return Response(body, media_type="application/json", headers=headers)

    @api.get("/", response_class=HTMLResponse)
    async def page(self) -> HTMLResponse:
        """The try-it page: a form over the images API with live previews (deployments/web)."""
        return HTMLResponse(self.page_html)

    @api.get("/web/{name}")
    async def web_file(self, name: str) -> Response:
        if name not in WEB_FILES:
            raise NotFoundError(f"no such file: {name}", param=None, code=None)
        return Response(WEB_FILES[name][1], media_type=WEB_FILES[name][0], headers={"Cache-Control": "no-cache"})

    @api.get("/v1/models")
    async def models(self) -> dict:
        """The base model, then each LoRA adapter (``parent``: the base it adapts), as vLLM lists them."""
        base = {"id": self.config.name, "object": "model", "owned_by": "omni-ray"}
        adapters = [{"id": name, "object": "model", "owned_by": "omni-ray", "parent": self.config.name, "root": path}
                    for name, path in self.adapters.items()]
        return {"object": "list", "data": [base, *adapters]}

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> JSONResponse:
        """Adds an adapter at run time (``{"lora_name", "lora_path"}``), once a DiT replica has read the file and
        found it fits the transformer; a broken file is a 400 naming ``lora_path`` and changes nothing."""
        with _counting_errors():
            body = await _json_object(request, ("lora_name", "lora_path"))
            name, path = body["lora_name"], body["lora_path"]
            if not re.fullmatch(r"[\w.:-]+", name) or name == self.config.name:
                raise RequestError(f"lora_name: {name!r} must be letters, digits, '_', '.', ':' or '-', and not the "
                                   "base model's name", param="lora_name")
            if name in self.adapters:
                raise RequestError(f"lora_name: {name!r} is already loaded; unload it first", param="lora_name")
            await self.stages.check_lora(path)
            self.adapters[name] = path
            logger.info("LoRA adapter %r added from %s", name, path)
        return JSONResponse({"lora_name": name, "lora_path": path, "status": "loaded"})

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> JSONResponse:
        """Removes an adapter (``{"lora_name"}``): requests naming it get a 404 from now on; each DiT replica frees
        its slot when it needs the room."""
        with _counting_errors():
            name = (await _json_object(request, ("lora_name",)))["lora_name"]
            if self.adapters.pop(name, None) is None:
                raise NotFoundError(f"lora_name: no adapter {name!r} is loaded", param="lora_name")
            logger.info("LoRA adapter %r removed", name)
        return JSONResponse({"lora_name": name, "status": "unloaded"})

    @api.get("/health")
    async def health(self) -> JSONResponse:
        """200 once every deployment of the app has a running replica, else 503 naming those without one (still
        starting, or all lost): the ingress alone answering does not mean a request can be served."""
        waiting = await asyncio.to_thread(_deployments_without_replicas)
        if waiting:
            return JSONResponse({"status": "unavailable", "waiting_for": waiting}, status_code=503)
        return JSONResponse({"status": "ok"})

    # --- handle callers: the same views, by method ------------------------------------------------------------

    async def generate(
        self, body: dict | ImageGenerationRequest, request_id: str | None = None, image: bytes | None = None
    ) -> dict:
        """The images response for an OpenAI-style body (and for an edit the input image file), as HTTP gets it."""
        return await self.json_response(await self.plan(body, image), request_id or uuid.uuid4().hex)

    async def generate_stream(
        self, body: dict | ImageGenerationRequest, request_id: str | None = None, image: bytes | None = None
    ) -> AsyncIterator[dict]:
        """The streamed events, as server-sent events carry them (``handle.options(stream=True)``)."""
        async for event in self.sse_events(await self.plan(body, image), request_id or uuid.uuid4().hex):
            yield event

    async def images(
        self,
        body: dict | ImageGenerationRequest,
        request_id: str | None = None,
        output: OutputMode = "pixels",
        image: bytes | None = None,
    ) -> list[Decoded]:
        """The stage results for each of the ``n`` images: pixels, latents or both, per ``output``."""
        return await collect(self.events(await self.plan(body, image), request_id or uuid.uuid4().hex, output))

    # --- the one path and its views -----------------------------------------------------------------------------

    async def plan(self, body: dict | ImageGenerationRequest, image: bytes | None = None) -> GenerationPlan:
        """Validates before any stage sees the request; an edit's image is decoded and resized off the event loop,
        a few at a time."""
        with _counting_errors():
            check_route(self.config, has_image=image is not None)
            pixels = None
            if image is not None:
                async with self.image_slots:
                    pixels = await asyncio.to_thread(load_input_image, image, self.config)
            return plan_request(body, self.config, self.tokenizer.num_tokens, pixels, self.adapters)

    async def events(self, plan: GenerationPlan, request_id: str, output: OutputMode = "pixels"
                     ) -> AsyncIterator[RequestEvent]:
        """The request's event stream over the stage deployments, counted and logged."""
        start = time.perf_counter()
        async for event in run_request(self.stages, plan, request_id, self.config.requests, output):
            if isinstance(event, Failed):
                _count_error(event.error)
                logger.warning("request %s failed: %s", request_id, event.error)
                yield event
                return
            yield event
        seconds = time.perf_counter() - start
        metrics.request_latency.observe(seconds, tags=COORDINATOR)
        metrics.images_generated.inc(plan.request.n, tags=COORDINATOR)
        logger.info("request %s: %d image(s) in %.0f ms", request_id, plan.request.n, 1000 * seconds)

    async def json_response(self, plan: GenerationPlan, request_id: str) -> dict:
        results = await collect(self.events(plan, request_id))
        request = plan.request
        files = await asyncio.gather(*(_encode_file(result, request) for result in results))
        stats = [image_stats(result.timings, result.dit_passes) for result in results]
        return await asyncio.to_thread(images_response, files, plan, stats)

    async def sse_events(self, plan: GenerationPlan, request_id: str) -> AsyncIterator[dict]:
        """Progress after every denoising step of each image, its previews, each image as it is done, or one error
        event."""
        async for event in self.events(plan, request_id):
            if isinstance(event, Progress):
                yield progress_event(plan, event.index, event.step, event.total)
            elif isinstance(event, Preview):
                data = await _encode_file(event.result, plan.request)
                yield await asyncio.to_thread(partial_image_event, plan, event.index, event.partial_index, data)
            elif isinstance(event, ImageDone):
                data = await _encode_file(event.result, plan.request)
                result = event.result
                stats = image_stats(result.timings, result.dit_passes) if plan.request.timings else None
                yield await asyncio.to_thread(completed_event, plan, event.index, data, stats)
            else:
                error = event.error
                yield {"type": "error", **error_body(str(error), error.error_type, getattr(error, "param", None))}
