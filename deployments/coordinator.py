"""The CrossEngineCoordinator: the app's ingress. It validates requests and chains the three stages.

Each image's chain is encoder -> DiT -> VAE, with each stage's ``DeploymentResponse`` passed straight into the next
stage's ``.remote(...)``: Ray moves the embeddings and latents between the stage replicas, and the coordinator awaits
only the last response. ``n`` images run as ``n`` concurrent chains, which the DiT batches step by step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from deployments import metrics
from deployments.chains import gather_or_cancel
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
    encode_image,
    error_body,
    images_response,
    plan_request,
)
from omni_ray.stages.decode import Decoded, OutputMode
from omni_ray.stages.denoise import DenoiseParams
from omni_ray.stages.encode import EncodeRequest, PromptTokenizer

logger = logging.getLogger("ray.serve")
MAX_BODY_BYTES = 1 << 20

api = FastAPI(title="omni-ray", description="Qwen-Image behind OpenAI's images API.")


@api.exception_handler(OmniRayError)
async def _omni_ray_error(request: Request, err: OmniRayError) -> JSONResponse:
    headers = {"Retry-After": str(max(1, math.ceil(err.retry_after_s)))} if isinstance(err, OverloadedError) else None
    body = error_body(str(err), err.error_type, getattr(err, "param", None))
    return JSONResponse(body, err.status_code, headers=headers)


async def _read_limited(request: Request, limit: int) -> bytes:
    """The body, refused as soon as it passes ``limit`` bytes (by its declared length or while it streams in)."""
    too_large = PayloadTooLargeError(f"request body exceeds {limit} bytes", param=None)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


# Serve pickles the class when @serve.ingress runs, before the rest of this module exists: helpers go above.
@serve.ingress(api)
class Coordinator:
    """Validates, fans ``n`` out, chains the stages, and turns pixels into image files."""

    def __init__(self, encoder: DeploymentHandle, dit: DeploymentHandle, vae: DeploymentHandle, config: PipelineConfig):
        self.encoder, self.dit, self.vae = encoder, dit, vae
        self.config = config
        self.tokenizer = PromptTokenizer(config.model)

    @api.post("/v1/images/generations")
    async def generations(self, request: Request) -> JSONResponse:
        body = await _read_limited(request, MAX_BODY_BYTES)
        try:
            payload = json.loads(body)
        except ValueError:
            raise RequestError("request body is not valid JSON", param=None) from None
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        response = await self.generate(payload, request_id=request_id)
        return JSONResponse(response, headers={"x-request-id": request_id})

    @api.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.config.name, "object": "model", "owned_by": "omni-ray"}]}

    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    async def generate(self, body: dict | ImageGenerationRequest, request_id: str | None = None) -> dict:
        """The images response for an OpenAI-style body; what HTTP and DeploymentHandle callers both get."""
        plan, results = await self._serve(body, request_id, "pixels")
        request = plan.request
        files = [encode_image(result.pixels, request.output_format, request.output_compression) for result in results]
        return images_response(files, request, plan.height, plan.width)

    async def images(
        self, body: dict | ImageGenerationRequest, request_id: str | None = None, output: OutputMode = "pixels"
    ) -> list[Decoded]:
        """The stage results for each of the ``n`` images: pixels, latents or both, per ``output``."""
        return (await self._serve(body, request_id, output))[1]

    async def _serve(self, body, request_id: str | None, output: OutputMode) -> tuple[GenerationPlan, list[Decoded]]:
        start = time.perf_counter()
        try:
            plan = self.plan(body)
            results = await self.run(plan, request_id, output)
        except OmniRayError as err:
            metrics.errors.inc(tags={"stage": "coordinator", "type": type(err).__name__})
            raise
        metrics.request_latency.observe(time.perf_counter() - start, tags={"stage": "coordinator"})
        metrics.images_generated.inc(len(results), tags={"stage": "coordinator"})
        return plan, results

    def plan(self, body: dict | ImageGenerationRequest) -> GenerationPlan:
        """Validates before any stage sees the request."""
        return plan_request(body, self.config, self.tokenizer.num_tokens)

    async def run(self, plan: GenerationPlan, request_id: str | None, output: OutputMode = "pixels") -> list[Decoded]:
        request_id = request_id or uuid.uuid4().hex
        start = time.perf_counter()
        chains = [
            self.chain(
                f"{request_id}-{i}",
                plan,
                DenoiseParams(plan.height, plan.width, plan.num_inference_steps, plan.seed + i,
                              plan.request.true_cfg_scale),
                output,
            )
            for i in range(plan.request.n)
        ]
        timeout_s = self.config.requests.timeout_s
        try:
            results = await asyncio.wait_for(gather_or_cancel(chains), timeout_s)
        except asyncio.TimeoutError:
            raise DeadlineExceededError(f"request {request_id} ran past its {timeout_s:g} s deadline") from None
        logger.info("request %s: %d image(s) in %.0f ms", request_id, plan.request.n, 1000 * (time.perf_counter() - start))
        return results

    def chain(
        self, request_id: str, plan: GenerationPlan, params: DenoiseParams, output: OutputMode
    ) -> list[DeploymentResponse]:
        """Starts one image's three stage calls, each taking the previous one's response by reference."""
        encoded = self.encoder.encode.remote(EncodeRequest(request_id, plan.request.prompt, plan.negative_prompt))
        latents = self.dit.denoise.remote(request_id, params, encoded)
        if output == "latents":
            return [encoded, latents]
        return [encoded, latents, self.vae.decode.remote(request_id, latents, output)]
