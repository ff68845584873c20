"""The CrossEngineCoordinator: the app's ingress. It validates requests and chains the three stages.

Each image's chain is encoder -> DiT -> VAE, with each stage's ``DeploymentResponse`` passed straight into the next
stage's ``.remote(...)``: Ray moves the embeddings and latents between the stage replicas, and the coordinator awaits
only the last response. ``n`` images run as ``n`` concurrent chains, which the DiT batches step by step.
"""

from __future__ import annotations

import json
import logging
import random
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from deployments.chains import gather_or_cancel
from omni_ray.config import PipelineConfig
from omni_ray.errors import OmniRayError, RequestError
from omni_ray.protocol import (
    MAX_SEED,
    ImageGenerationRequest,
    encode_image,
    error_body,
    images_response,
    parse_request,
    resolve_size,
)
from omni_ray.stages.decode import Decoded, OutputMode
from omni_ray.stages.denoise import DenoiseParams
from omni_ray.stages.encode import EncodeRequest

logger = logging.getLogger("ray.serve")
MAX_BODY_BYTES = 1 << 20

api = FastAPI(title="omni-ray", description="Qwen-Image behind OpenAI's images API.")


@api.exception_handler(OmniRayError)
async def _omni_ray_error(request: Request, err: OmniRayError) -> JSONResponse:
    return JSONResponse(error_body(str(err), err.error_type, getattr(err, "param", None)), err.status_code)


@serve.ingress(api)
class Coordinator:
    """Validates, fans ``n`` out, chains the stages, and turns pixels into image files."""

    def __init__(self, encoder: DeploymentHandle, dit: DeploymentHandle, vae: DeploymentHandle, config: PipelineConfig):
        self.encoder, self.dit, self.vae = encoder, dit, vae
        self.config = config

    @api.post("/v1/images/generations")
    async def generations(self, request: Request) -> JSONResponse:
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            raise RequestError(f"request body exceeds {MAX_BODY_BYTES} bytes", param=None)
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
        request = body if isinstance(body, ImageGenerationRequest) else parse_request(body)
        height, width = resolve_size(request, self.config)
        results = await self.images(request, request_id=request_id)
        files = [encode_image(result.pixels, request.output_format, request.output_compression) for result in results]
        return images_response(files, request, height, width)

    async def images(
        self, body: dict | ImageGenerationRequest, request_id: str | None = None, output: OutputMode = "pixels"
    ) -> list[Decoded]:
        """The stage results for each of the ``n`` images: pixels, latents or both, per ``output``."""
        request = body if isinstance(body, ImageGenerationRequest) else parse_request(body)
        if request.model is not None and request.model != self.config.name:
            raise RequestError(f"model: this app serves {self.config.name!r}, not {request.model!r}", param="model")
        height, width = resolve_size(request, self.config)
        steps = request.num_inference_steps or self.config.requests.default_steps
        seed = request.seed if request.seed is not None else random.randint(0, MAX_SEED - request.n)
        request_id = request_id or uuid.uuid4().hex
        start = time.perf_counter()
        chains = [
            self.chain(
                f"{request_id}-{i}",
                request,
                DenoiseParams(height, width, steps, seed + i, request.true_cfg_scale),
                output,
            )
            for i in range(request.n)
        ]
        results = await gather_or_cancel(chains)
        logger.info("request %s: %d image(s) in %.0f ms", request_id, request.n, 1000 * (time.perf_counter() - start))
        return results

    def chain(
        self, request_id: str, request: ImageGenerationRequest, params: DenoiseParams, output: OutputMode
    ) -> list[DeploymentResponse]:
        """Starts one image's three stage calls, each taking the previous one's response by reference."""
        use_cfg = request.true_cfg_scale > 1 and request.negative_prompt is not None
        encoded = self.encoder.encode.remote(
            EncodeRequest(request_id, request.prompt, request.negative_prompt if use_cfg else None)
        )
        latents = self.dit.denoise.remote(request_id, params, encoded)
        if output == "latents":
            return [encoded, latents]
        return [encoded, latents, self.vae.decode.remote(request_id, latents, output)]
