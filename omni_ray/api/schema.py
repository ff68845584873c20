"""The request body of omni-ray's images API, after OpenAI's images API.

``ImageGenerationRequest`` is what ``POST /v1/images/generations`` and the Python client send, and the form fields
of ``POST /v1/images/edits`` beside its ``image`` file; ``parse_request`` validates it, every error naming its field.
"""

from __future__ import annotations

import json
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from omni_ray.config import CacheSettings, Number, field_errors
from omni_ray.errors import RequestError
from omni_ray.families.qwen_image_layered.facts import DEFAULT_LAYERS, MAX_LAYERS, MIN_LAYERS

OutputFormat = Literal["png", "jpeg", "webp"]
MAX_SEED = 2**63 - 1


class ControlSpec(BaseModel):
    """One ControlNet a generation applies (diffusers' ``QwenImageControlNetPipeline``): one of the preset's
    ``controlnets`` by name, with its control image at the output's size (never resized: one of another size is
    refused)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(..., description="One of the preset's `controlnets`.")
    image: str | None = Field(
        None, description="The control image: a base64 PNG, JPEG or WebP file, or a data URL of one, at the output's "
        "size (width x height). In a multipart body, absent: the images are `control_image` files, in order."
    )
    mask: str | None = Field(
        None, description="An inpainting ControlNet's mask (and only its): a base64 PNG of the control image's size "
        "whose fully transparent pixels mark what to repaint, as OpenAI's `mask`. In a multipart body, absent: the "
        "masks are `control_mask` files, one per inpainting control, in order."
    )
    scale: Number = Field(1.0, ge=0.0, le=10.0, description="diffusers' controlnet_conditioning_scale.")
    start: Number = Field(0.0, ge=0.0, le=1.0, description="diffusers' control_guidance_start: the share of the steps "
                          "before the ControlNet acts.")
    end: Number = Field(1.0, ge=0.0, le=1.0, description="diffusers' control_guidance_end: the share of the steps "
                        "after which it stops.")

    @model_validator(mode="after")
    def _start_before_end(self) -> ControlSpec:
        if self.start >= self.end:
            raise ValueError(f"start ({self.start:g}) must be below end ({self.end:g})")
        return self


class LoraSpec(BaseModel):
    """One LoRA adapter of a request's stack (``loras``): one the server knows (``GET /v1/models``), at its scale."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(..., description="An adapter's name, as `GET /v1/models` lists it.")
    scale: Number = Field(1.0, ge=0.0, le=10.0, description="Its weight (diffusers' adapter weight, "
                          "`set_adapters`' adapter_weights).")


class ImageGenerationRequest(BaseModel):
    """OpenAI's image generation body, plus Qwen-Image's own knobs (negative prompt, steps, true CFG, seed)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(..., description="What to draw. Qwen-Image-Layered: may be empty, and the encoder then "
                        "writes a caption of the image to use instead (the response's revised_prompt).")
    model: str | None = Field(
        None, description="The served model's name, or a LoRA adapter's (the base model with that adapter); "
        "optional, checked when given."
    )
    lora_scale: Number = Field(1.0, ge=0.0, le=10.0, description="Strength of the `model` adapter (diffusers' "
                              "adapter weight); only with an adapter.")
    loras: list[LoraSpec] | None = Field(
        None, description="omni-ray's: a stack of LoRA adapters, each {name, scale}, their updates added together "
        "(diffusers' set_adapters with adapter_weights); at most the preset's lora.max_per_request, each named once, "
        "at most one with a sampling recipe (whose steps, true CFG scale and scheduler then apply). `model` then "
        "names the base model or is omitted. A multipart body sends this list as JSON text."
    )
    n: int = Field(1, ge=1, le=10, description="Images to draw; image i uses seed + i.")
    size: str | None = Field(None, description="'WIDTHxHEIGHT' in pixels; the preset's default when omitted.")
    response_format: Literal["b64_json"] = Field("b64_json", description="Only base64 images are served.")
    output_format: OutputFormat = Field("png", description="Image file format.")
    output_compression: int | None = Field(None, ge=0, le=100, description="JPEG/WebP quality, 0 to 100.")
    negative_prompt: str | None = Field(None, description="What to steer away from; turns true CFG on.")
    num_inference_steps: int | None = Field(None, ge=1, le=200, description="Denoising steps.")
    true_cfg_scale: Number = Field(
        4.0, ge=1.0, le=20.0, description="True CFG scale; CFG runs when > 1 with a negative prompt."
    )
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Seed of the first image; random when omitted.")
    stream: bool = Field(False, description="Answer with server-sent events: OpenAI's partial_image and completed "
                         "events, and an error event if the request fails.")
    progress: bool = Field(False, description="omni-ray's: while streaming, also an `image_generation.progress` (or "
                           "`image_edit.progress`) event after every denoising step of each image, which OpenAI's "
                           "API does not define (its client reads one as an empty partial image).")
    timings: bool = Field(
        False, description="Add each image's time in every stage (ms, queueing included), the part of it queued, and "
        "its DiT passes computed and reused."
    )
    cache: CacheSettings | None = Field(
        None, description="DiT cache acceleration for this request ({'kind': 'first_block' or 'teacache', "
        "'threshold': x}), or null for none; omitted, the preset's. Requests with and without it share step batches."
    )
    partial_images: int = Field(
        0, ge=0, le=3, description="Previews per image while streaming: the clean image the DiT predicts at steps "
        "spread over the run, each sent as a partial_image event before the image."
    )
    quality: Literal["low", "medium", "high", "auto"] = Field(
        "auto", description="OpenAI's quality: steps as the preset maps them (requests.quality_steps); auto takes "
        "the preset's default_steps. num_inference_steps, when given, wins."
    )
    background: Literal["auto", "opaque", "transparent"] = Field(
        "auto", description="OpenAI's background: the images are opaque; transparent is refused."
    )
    moderation: Literal["auto", "low"] = Field("auto", description="OpenAI's moderation level; accepted, no "
                                                "moderation model runs here.")
    style: str | None = Field(None, description="dall-e-3's style; refused (Qwen-Image has no style setting).")
    user: str | None = Field(None, max_length=256, description="OpenAI's end-user id: the tenant the DiT shares its "
                             "steps fairly between, when the server takes no API keys (with keys, the key is).")
    priority: int = Field(0, ge=-100, le=100, description="omni-ray's, as vLLM's: lower runs first. The DiT pauses "
                          "less urgent requests at a step boundary to run a more urgent one, and resumes them later.")
    timeout: Number | None = Field(
        None, gt=0, description="omni-ray's: seconds the request may take, its deadline; at most the preset's "
        "requests.timeout_s (the default). A request the queue cannot finish in time is refused at once (503 with "
        "Retry-After)."
    )
    safety_identifier: str | None = Field(None, description="OpenAI's successor to `user`; accepted and ignored.")
    strength: Number | None = Field(
        None, gt=0.0, le=1.0, description="Only with a `mask` (edits): diffusers' inpainting strength, the share of "
        "the denoising steps run, from the image noised to that level (1: from pure noise where the mask is "
        "transparent); diffusers' 0.6 when omitted."
    )

    control: list[ControlSpec] | None = Field(
        None, description="omni-ray's: ControlNets to apply (generations on a text-to-image preset), each "
        "{name, image, scale, start, end} (and an inpainting ControlNet's `mask`); at most the preset's "
        "requests.max_controls. A multipart body sends this list as JSON text without the images, and the images "
        "as `control_image` files in the same order (the masks as `control_mask` files)."
    )

    layers: int | None = Field(
        None, ge=MIN_LAYERS, le=MAX_LAYERS, description="omni-ray's, for Qwen-Image-Layered (/v1/images/edits on a "
        f"layered preset): the RGBA layers to decompose the image into, {MIN_LAYERS} to {MAX_LAYERS} "
        f"({DEFAULT_LAYERS} when omitted). `data` holds each image's layers bottom to top, n x layers PNGs."
    )
    resolution: int | None = Field(
        None, description="Qwen-Image-Layered's resolution bucket, one of the preset's edit.resolutions (the first "
        "when omitted; the published model's are 640 and 1024): the input image and its layers take that square's "
        "area at the image's aspect ratio."
    )
    cfg_normalize: bool | None = Field(
        None, description="Qwen-Image-Layered's: true CFG's guided prediction rescaled to the conditional one's norm "
        "(off when omitted, as diffusers' pipeline; the model card turns it on)."
    )
    caption_language: Literal["en", "zh"] | None = Field(
        None, description="Qwen-Image-Layered's: the language of the caption the encoder writes of the image when the "
        "prompt is empty (diffusers' use_en_prompt): en when omitted (diffusers' default is zh)."
    )

    @field_validator("cache", "control", "loras", mode="before")
    @classmethod
    def _form_field_is_json(cls, value, info):
        """A multipart form carries ``cache``, ``control`` and ``loras`` as JSON text."""
        if not isinstance(value, str):
            return value
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            example = {"cache": '{"kind": "first_block", "threshold": 0.1}', "control": '[{"name": "canny", "scale": '
                       '0.8}]', "loras": '[{"name": "lightning", "scale": 1.0}, {"name": "style", "scale": 0.6}]'}[
                info.field_name]
            kind = "a JSON object" if info.field_name == "cache" else "a JSON list"
            raise ValueError(f"expected {kind} such as {example}, or null") from None


def parse_request(body: object, form: bool = False) -> ImageGenerationRequest:
    """Validates a decoded JSON body, or with ``form`` multipart form fields (all strings, converted as their field
    needs); raises RequestError naming the first bad field."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", param=None)
    try:
        return ImageGenerationRequest.model_validate(body, strict=not form)
    except ValidationError as err:
        param, message = field_errors(err, unknown="unknown parameter")[0]
        param = re.sub(r"\.(\d+)", r"[\1]", param) if param else param  # control.0.scale -> control[0].scale
        raise RequestError(f"{param}: {message}" if param else message, param=param) from None
