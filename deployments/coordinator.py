"""The CrossEngineCoordinator: the app's ingress. It validates requests and chains the three stages.

Each image's chain is encoder -> DiT -> VAE, with each stage's ``DeploymentResponse`` passed straight into the next
stage's ``.remote(...)``: Ray moves the embeddings and latents between the stage replicas, and the coordinator awaits
only the last response. A request's prompt is encoded once, and its ``n`` images run as ``n`` concurrent chains from
there, which the DiT batches step by step. An edit's input image goes into the object store once; the encoder and
the VAE (which encodes it to latents for the DiT) read it by reference.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponse
from starlette.datastructures import UploadFile

from deployments import metrics
from deployments.chains import cancel, gather_or_cancel, stage_error
from omni_ray.config import PipelineConfig
from omni_ray.errors import (
    DeadlineExceededError,
    OmniRayError,
    OverloadedError,
    PayloadTooLargeError,
    RequestError,
)
from omni_ray.protocol import (
    GenerationPlan,
    ImageGenerationRequest,
    completed_event,
    encode_image,
    error_body,
    images_response,
    load_input_image,
    parse_request,
    plan_request,
    progress_event,
)
from omni_ray.stages.decode import Decoded, OutputMode
from omni_ray.stages.denoise import DenoiseParams
from omni_ray.stages.encode import EDIT, TEXT_TO_IMAGE, EncodeRequest, PromptTokenizer

logger = logging.getLogger("ray.serve")
MAX_BODY_BYTES = 1 << 20
MAX_IMAGE_DECODES = 4  # uploads decoded and resized at once, on threads: each may take seconds and 100s of MB

api = FastAPI(title="omni-ray", description="Qwen-Image behind OpenAI's images API.")


COORDINATOR = {"stage": "coordinator"}


def _count_error(err: OmniRayError) -> None:
    metrics.errors.inc(tags={**COORDINATOR, "type": type(err).__name__})


@contextlib.contextmanager
def _counting_errors() -> Iterator[None]:
    """Counts the OmniRayError that leaves the block (for errors raised before ``Coordinator.plan``, which counts)."""
    try:
        yield
    except OmniRayError as err:
        _count_error(err)
        raise


def _wrong_route(config: PipelineConfig) -> RequestError:
    """The error for a request sent to the route that the preset does not serve (generations or edits)."""
    if config.edit is not None:
        message = f"image: {config.name!r} edits images; send an `image` and a `prompt` to /v1/images/edits"
    else:
        message = f"image: {config.name!r} does not edit images; use /v1/images/generations"
    return RequestError(message, param="image")


async def _sse_stream(events: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Server-sent events, one ``data:`` line of JSON each."""
    async for event in events:
        yield f"data: {json.dumps(event)}\n\n".encode()


@api.exception_handler(OmniRayError)
async def _omni_ray_error(request: Request, err: OmniRayError) -> JSONResponse:
    headers = {"Retry-After": str(max(1, math.ceil(err.retry_after_s)))} if isinstance(err, OverloadedError) else None
    body = error_body(str(err), err.error_type, getattr(err, "param", None))
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


# Serve pickles the class when @serve.ingress runs, before the rest of this module exists: helpers go above.
@serve.ingress(api)
class Coordinator:
    """Validates, fans ``n`` out, chains the stages, and turns pixels into image files."""

    def __init__(self, encoder: DeploymentHandle, dit: DeploymentHandle, vae: DeploymentHandle, config: PipelineConfig):
        self.encoder, self.dit, self.vae = encoder, dit, vae
        self.config = config
        self.tokenizer = PromptTokenizer(config.model, EDIT if config.edit is not None else TEXT_TO_IMAGE)
        self.image_slots = asyncio.Semaphore(MAX_IMAGE_DECODES)

    @api.post("/v1/images/generations")
    async def generations(self, request: Request) -> Response:
        with _counting_errors():
            if self.config.edit is not None:
                raise _wrong_route(self.config)
            body = await _read_limited(request, MAX_BODY_BYTES)
            try:
                payload = json.loads(body)
            except ValueError:
                raise RequestError("request body is not valid JSON", param=None) from None
        return await self.serve(await self.plan(payload), request)

    @api.post("/v1/images/edits")
    async def edits(self, request: Request) -> Response:
        with _counting_errors():
            if self.config.edit is None:
                raise _wrong_route(self.config)
            fields, image = await _edit_form(request, self.config.edit.max_image_bytes + MAX_BODY_BYTES)
        return await self.serve(await self.plan(fields, image, form=True), request)

    async def serve(self, plan: GenerationPlan, request: Request) -> Response:
        """The response to a planned HTTP request: JSON, or server-sent events when it streams."""
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"x-request-id": request_id}
        if plan.request.stream:
            events = _sse_stream(self.events(plan, request_id))
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        return JSONResponse(await self.respond(plan, request_id), headers=headers)

    @api.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.config.name, "object": "model", "owned_by": "omni-ray"}]}

    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    async def generate(
        self, body: dict | ImageGenerationRequest, request_id: str | None = None, image: bytes | None = None
    ) -> dict:
        """The images response for an OpenAI-style body (and for an edit the input image file): what
        DeploymentHandle callers get (HTTP gets the same)."""
        return await self.respond(await self.plan(body, image), request_id)

    async def images(
        self,
        body: dict | ImageGenerationRequest,
        request_id: str | None = None,
        output: OutputMode = "pixels",
        image: bytes | None = None,
    ) -> list[Decoded]:
        """The stage results for each of the ``n`` images: pixels, latents or both, per ``output``."""
        return await self.run(await self.plan(body, image), request_id, output)

    async def plan(
        self, body: dict | ImageGenerationRequest, image: bytes | None = None, form: bool = False
    ) -> GenerationPlan:
        """Validates before any stage sees the request; an edit's image is decoded and resized off the event loop,
        a few at a time. With ``form``, ``body`` is an edit's form fields (strings)."""
        with _counting_errors():
            if self.config.edit is None:
                if image is not None:
                    raise _wrong_route(self.config)
                return plan_request(body, self.config, self.tokenizer.num_tokens)
            if form:
                body = parse_request(body, form=True)
            async with self.image_slots:
                pixels = await asyncio.to_thread(load_input_image, image, self.config)
            return plan_request(body, self.config, self.tokenizer.num_tokens, pixels)

    async def respond(self, plan: GenerationPlan, request_id: str | None) -> dict:
        results = await self.run(plan, request_id)
        request = plan.request
        files = [encode_image(result.pixels, request.output_format, request.output_compression) for result in results]
        return images_response(files, request, plan.height, plan.width, [result.timings for result in results])

    async def run(self, plan: GenerationPlan, request_id: str | None, output: OutputMode = "pixels") -> list[Decoded]:
        """Runs the ``n`` chains concurrently within the request's deadline."""
        request_id = request_id or uuid.uuid4().hex
        start = time.perf_counter()
        inputs = self.inputs(request_id, plan)
        chains = [self.chain(f"{request_id}-{i}", plan, i, inputs, output) for i in range(plan.request.n)]
        timeout_s = self.config.requests.timeout_s
        try:
            results = await asyncio.wait_for(gather_or_cancel(chains), timeout_s)
        except asyncio.TimeoutError:
            err = DeadlineExceededError(f"request {request_id} ran past its {timeout_s:g} s deadline")
            _count_error(err)
            raise err from None
        except OmniRayError as err:
            _count_error(err)
            raise
        seconds = time.perf_counter() - start
        metrics.request_latency.observe(seconds, tags=COORDINATOR)
        metrics.images_generated.inc(len(results), tags=COORDINATOR)
        logger.info("request %s: %d image(s) in %.0f ms", request_id, plan.request.n, 1000 * seconds)
        return results

    async def generate_stream(
        self, body: dict, request_id: str | None = None, image: bytes | None = None
    ) -> AsyncIterator[dict]:
        """The streamed events for DeploymentHandle callers (``handle.options(stream=True)``)."""
        async for event in self.events(await self.plan(body, image), request_id or uuid.uuid4().hex):
            yield event

    async def events(self, plan: GenerationPlan, request_id: str) -> AsyncIterator[dict]:
        """One progress event per denoising step of each image, then each image as it is done; an error event ends
        the stream early.

        The DiT streams its progress and, at the end, a reference to the latents, which goes on to the VAE.
        """
        events: asyncio.Queue[dict] = asyncio.Queue()
        start = time.perf_counter()
        inputs = self.inputs(request_id, plan)

        async def one(index: int) -> None:
            image_id = f"{request_id}-{index}"
            steps = self.dit.options(stream=True).denoise_stream.remote(image_id, self.params(plan, index), *inputs)
            calls = [*inputs, steps]
            try:
                async for event in steps:
                    if "latents" in event:
                        calls.append(self.vae.decode.remote(image_id, event["latents"], "pixels"))
                        decoded = await calls[-1]
                    else:
                        events.put_nowait(progress_event(plan, index, event["step"], event["total"]))
            except BaseException:
                for call in calls:
                    cancel(call)
                raise
            request = plan.request
            data = encode_image(decoded.pixels, request.output_format, request.output_compression)
            events.put_nowait(completed_event(plan, index, data))

        tasks = asyncio.ensure_future(asyncio.gather(*(one(i) for i in range(plan.request.n))))
        deadline = asyncio.get_running_loop().time() + self.config.requests.timeout_s
        try:
            while not tasks.done() or not events.empty():
                next_event = asyncio.ensure_future(events.get())
                remaining = deadline - asyncio.get_running_loop().time()
                await asyncio.wait({next_event, tasks}, timeout=max(remaining, 0), return_when=asyncio.FIRST_COMPLETED)
                if next_event.done():
                    yield next_event.result()
                    continue
                next_event.cancel()
                if not tasks.done():
                    raise DeadlineExceededError(f"request {request_id} ran past its deadline")
            tasks.result()
            metrics.request_latency.observe(time.perf_counter() - start, tags=COORDINATOR)
            metrics.images_generated.inc(plan.request.n, tags=COORDINATOR)
        except Exception as err:
            err = stage_error(err)
            _count_error(err)
            yield {"type": "error", **error_body(str(err), err.error_type, getattr(err, "param", None))}
        finally:
            tasks.cancel()

    def inputs(self, request_id: str, plan: GenerationPlan) -> list[DeploymentResponse]:
        """Starts the stage calls every image of the request shares: the prompt's encoding and, for an edit, the
        input image's latents. The image itself goes into the object store once and travels by reference."""
        image = ray.put(plan.image) if plan.image is not None else None
        request = EncodeRequest(request_id, plan.request.prompt, plan.negative_prompt)
        calls = [self.encoder.encode.remote(request, image)]
        if image is not None:
            calls.append(self.vae.encode.remote(request_id, image))
        return calls

    def params(self, plan: GenerationPlan, index: int) -> DenoiseParams:
        """Image ``index``'s DiT parameters: its seed is the request's plus ``index``."""
        return DenoiseParams(
            plan.height, plan.width, plan.num_inference_steps, plan.seed + index, plan.request.true_cfg_scale
        )

    def chain(
        self,
        image_id: str,
        plan: GenerationPlan,
        index: int,
        inputs: list[DeploymentResponse],
        output: OutputMode,
    ) -> list[DeploymentResponse]:
        """Starts image ``index``'s DiT and VAE calls, each taking the previous responses by reference; returns
        every call the image waits on, ``inputs`` first."""
        latents = self.dit.denoise.remote(image_id, self.params(plan, index), *inputs)
        if output == "latents":
            return [*inputs, latents]
        return [*inputs, latents, self.vae.decode.remote(image_id, latents, output)]
