"""The request and response records of omni-ray's images API, after OpenAI's images API.

``ImageGenerationRequest`` is what ``POST /v1/images/generations`` and the Python client send, and the form fields
of ``POST /v1/images/edits`` beside its ``image`` file; it is validated once, at the coordinator, against the
preset's limits, and every error names the field it is about.
"""

from __future__ import annotations

import base64
import io
import json
import math
import random
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from omni_ray.config import SIZE_MULTIPLE, CacheSettings, LoraRef, PipelineConfig
from omni_ray.errors import NotFoundError, PayloadTooLargeError, RequestError

OutputFormat = Literal["png", "jpeg", "webp"]
MAX_SEED = 2**63 - 1
INPUT_FORMATS = ("PNG", "JPEG", "MPO", "WEBP")  # what /v1/images/edits takes, as OpenAI's does (MPO: camera JPEGs)
MAX_INPUT_PIXELS = 8192 * 8192  # an input image's pixels before resizing; refused past it (decompression bombs)


class ImageGenerationRequest(BaseModel):
    """OpenAI's image generation body, plus Qwen-Image's own knobs (negative prompt, steps, true CFG, seed)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(..., description="What to draw.")
    model: str | None = Field(
        None, description="The served model's name, or a LoRA adapter's (the base model with that adapter); "
        "optional, checked when given."
    )
    lora_scale: float = Field(1.0, ge=0.0, le=10.0, description="Strength of the `model` adapter (diffusers' "
                              "adapter weight); only with an adapter.")
    n: int = Field(1, ge=1, le=10, description="Images to draw; image i uses seed + i.")
    size: str | None = Field(None, description="'WIDTHxHEIGHT' in pixels; the preset's default when omitted.")
    response_format: Literal["b64_json"] = Field("b64_json", description="Only base64 images are served.")
    output_format: OutputFormat = Field("png", description="Image file format.")
    output_compression: int | None = Field(None, ge=0, le=100, description="JPEG/WebP quality, 0 to 100.")
    negative_prompt: str | None = Field(None, description="What to steer away from; turns true CFG on.")
    num_inference_steps: int | None = Field(None, ge=1, le=200, description="Denoising steps.")
    true_cfg_scale: float = Field(4.0, ge=1.0, le=20.0, description="True CFG scale; CFG runs when > 1 with a negative prompt.")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Seed of the first image; random when omitted.")
    stream: bool = Field(False, description="Answer with server-sent events: progress per step, then each image.")
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
    user: str | None = Field(None, description="OpenAI's end-user id; accepted and ignored.")
    safety_identifier: str | None = Field(None, description="OpenAI's successor to `user`; accepted and ignored.")

    @field_validator("true_cfg_scale", "lora_scale", mode="before")
    @classmethod
    def _int_is_a_number(cls, value):
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("cache", mode="before")
    @classmethod
    def _form_field_is_json(cls, value):
        """A multipart form (edits) carries ``cache`` as JSON text."""
        if not isinstance(value, str):
            return value
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            example = '{"kind": "first_block", "threshold": 0.1}'
            raise ValueError(f"expected a JSON object such as {example}, or null") from None

    @field_validator("prompt")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value


def parse_request(body: object, form: bool = False) -> ImageGenerationRequest:
    """Validates a decoded JSON body, or with ``form`` multipart form fields (all strings, converted as their field
    needs); raises RequestError naming the first bad field."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", param=None)
    try:
        return ImageGenerationRequest.model_validate(body, strict=not form)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        message = "unknown parameter" if first["type"] == "extra_forbidden" else first["msg"]
        raise RequestError(f"{param}: {message}" if param else message, param=param) from None


@dataclass(frozen=True, slots=True)
class GenerationPlan:
    """A validated request with the preset's defaults filled in: what the coordinator runs."""

    request: ImageGenerationRequest
    height: int
    width: int
    num_inference_steps: int
    seed: int  # image i uses seed + i
    cache: CacheSettings | None = None  # the request's, or the preset's default
    lora: LoraRef | None = None  # the LoRA adapter `model` names, at the request's scale
    quality: str = "auto"  # OpenAI's quality level the steps came from ("auto": steps given or the default)
    image: np.ndarray | None = None  # edits: the input image at its working size, uint8 [H, W, 3]

    @property
    def event_prefix(self) -> str:
        """What OpenAI's streamed events of this kind of request are called."""
        return "image_generation" if self.image is None else "image_edit"


def plan_request(
    body: object,
    config: PipelineConfig,
    count_tokens: Callable[..., int] | None = None,
    image: np.ndarray | None = None,
    adapters: Mapping[str, str] | None = None,
) -> GenerationPlan:
    """Validates ``body`` against the API and the preset; raises RequestError naming the field.

    An edit brings its ``image`` (``load_input_image``'s); its working size is the default output size.
    ``count_tokens(text, image_size)`` gives a prompt's templated length (the image's tokens included), checked
    against the encoder's limit. ``adapters`` (name -> file) are the LoRA adapters ``model`` may name.
    """
    check_route(config, has_image=image is not None)
    request = body if isinstance(body, ImageGenerationRequest) else parse_request(body)
    lora = resolve_model(request, config, adapters or {})
    height, width = resolve_size(request, config, image.shape[:2] if image is not None else None)
    if count_tokens is not None:
        image_size = image.shape[:2] if image is not None else None
        for field in ("prompt", "negative_prompt"):
            text = getattr(request, field)
            if text is not None and (tokens := count_tokens(text, image_size)) > config.encoder.max_model_len:
                raise RequestError(
                    f"{field}: {tokens} tokens with the prompt template; the limit is "
                    f"{config.encoder.max_model_len}",
                    param=field,
                )
    if request.background == "transparent":
        raise RequestError("background: Qwen-Image draws opaque images; use auto or opaque", param="background")
    if request.style is not None:
        raise RequestError("style: a dall-e-3 setting that Qwen-Image does not have; describe the style in the "
                           "prompt", param="style")
    if request.seed is not None and request.seed + request.n - 1 > MAX_SEED:
        raise RequestError(f"seed: seed + n - 1 must be at most {MAX_SEED}", param="seed")
    return GenerationPlan(
        request=request,
        height=height,
        width=width,
        num_inference_steps=request.num_inference_steps or quality_steps(request.quality, config),
        seed=request.seed if request.seed is not None else random.randint(0, MAX_SEED - request.n + 1),
        cache=request.cache if "cache" in request.model_fields_set else config.dit.cache,
        lora=lora,
        quality=request.quality if request.num_inference_steps is None else "auto",
        image=image,
    )


def quality_steps(quality: str, config: PipelineConfig) -> int:
    """The steps of an OpenAI quality level: the preset's mapping, or its default steps for ``auto``."""
    if quality == "auto":
        return config.requests.default_steps
    return getattr(config.requests.quality_steps, quality)


def resolve_model(request: ImageGenerationRequest, config: PipelineConfig, adapters: Mapping[str, str]
                  ) -> LoraRef | None:
    """The LoRA adapter ``model`` names (None for the base model); NotFoundError (404, ``model_not_found``) for a name
    that is neither, as OpenAI answers."""
    if request.model in (None, config.name):
        if "lora_scale" in request.model_fields_set:
            raise RequestError(f"lora_scale: {config.name!r} is the base model; set `model` to an adapter",
                               param="lora_scale")
        return None
    if request.model not in adapters:
        known = ", ".join([config.name, *sorted(adapters)])
        raise NotFoundError(f"model: {request.model!r} does not exist here; the models are {known}", param="model")
    return LoraRef(request.model, adapters[request.model], request.lora_scale)


def check_route(config: PipelineConfig, has_image: bool) -> None:
    """Raises RequestError (param ``image``) when a request's modality is not the preset's: an edit preset serves
    /v1/images/edits (an image and a prompt), any other /v1/images/generations (a prompt)."""
    if has_image and config.edit is None:
        raise RequestError(f"image: {config.name!r} does not edit images; use /v1/images/generations", param="image")
    if not has_image and config.edit is not None:
        raise RequestError(
            f"image: {config.name!r} edits images; send an `image` and a `prompt` to /v1/images/edits", param="image"
        )


def resolve_size(
    request: ImageGenerationRequest, config: PipelineConfig, default: tuple[int, int] | None = None
) -> tuple[int, int]:
    """(height, width) for the request, checked against the preset's limits; ``default`` (an edit's working size)
    replaces the preset's default size."""
    limits = config.requests
    if request.size in (None, "auto"):
        return default or (limits.default_height, limits.default_width)
    try:
        width, height = (int(side) for side in request.size.lower().split("x"))
    except ValueError:
        raise RequestError(f"size: expected 'WIDTHxHEIGHT', got {request.size!r}", param="size") from None
    check_sides(width, height, config, "size")
    return height, width


def check_sides(width: int, height: int, config: PipelineConfig, param: str, what: str = "") -> None:
    """Raises RequestError (naming ``param``) unless both sides are multiples of the preset's and within its
    limits."""
    limits = config.requests
    for name, side in (("width", width), ("height", height)):
        if side % SIZE_MULTIPLE:
            raise RequestError(f"{param}: {what}{name} {side} is not a multiple of {SIZE_MULTIPLE}", param=param)
        if not limits.min_side <= side <= limits.max_side:
            raise RequestError(
                f"{param}: {what}{name} {side} is outside {limits.min_side}..{limits.max_side}", param=param
            )


def load_input_image(data: bytes | None, config: PipelineConfig) -> np.ndarray:
    """An edit's uploaded image file, checked and resized to its working size (``config.edit.image_area`` pixels at
    its aspect ratio, as diffusers' ``QwenImageEditPipeline`` resizes it): uint8 ``[H, W, 3]``.

    Raises RequestError (param ``image``) for a missing, unreadable, corrupt or unsupported file, or one whose
    aspect ratio gives a working size outside the preset's side limits; PayloadTooLargeError past
    ``config.edit.max_image_bytes``.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    edit = config.edit
    if not data:
        raise RequestError("image: required: the image to edit, as a PNG, JPEG or WebP file", param="image")
    if len(data) > edit.max_image_bytes:
        raise PayloadTooLargeError(
            f"image: the file is {len(data)} bytes; the limit is {edit.max_image_bytes}", param="image"
        )
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise RequestError(f"image: more than {MAX_INPUT_PIXELS} pixels", param="image") from None
    except UnidentifiedImageError:
        raise RequestError("image: not a readable image file; send PNG, JPEG or WebP", param="image") from None
    except Exception as err:  # a header Pillow cannot read: truncated, oversized chunks, ...
        raise RequestError(f"image: the file is corrupt or truncated ({err})", param="image") from None
    if image.format not in INPUT_FORMATS:
        raise RequestError(f"image: {image.format} files are not supported; send PNG, JPEG or WebP", param="image")
    if image.width * image.height > MAX_INPUT_PIXELS:
        raise RequestError(
            f"image: {image.width}x{image.height} is more than {MAX_INPUT_PIXELS} pixels", param="image"
        )
    try:
        image = ImageOps.exif_transpose(image).convert("RGB")  # decodes the whole file
    except Exception as err:
        raise RequestError(f"image: the file is corrupt or truncated ({err})", param="image") from None
    height, width = working_size(image.width, image.height, edit.image_area)
    check_sides(width, height, config, "image", f"a {image.width}x{image.height} image's working ")
    return resize_image(image, height, width)


def working_size(width: int, height: int, area: int) -> tuple[int, int]:
    """(height, width) of an edit's input image: ``area`` pixels at its aspect ratio, sides rounded to multiples of
    32 (twice the size multiple), as diffusers' ``calculate_dimensions`` gives."""
    ratio = width / height
    new_width = math.sqrt(area * ratio)
    new_height = new_width / ratio
    multiple = 2 * SIZE_MULTIPLE
    return round(new_height / multiple) * multiple, round(new_width / multiple) * multiple


def resize_image(image, height: int, width: int) -> np.ndarray:
    """An RGB PIL image resized to (height, width) as diffusers' ``VaeImageProcessor.resize`` does (Lanczos), as
    uint8 ``[H, W, 3]``."""
    from diffusers.image_processor import VaeImageProcessor

    return np.asarray(VaeImageProcessor(vae_scale_factor=SIZE_MULTIPLE).resize(image, height, width))


# PNG's deflate with zlib's run-length strategy: after PNG's row filters a photograph leaves few repeats for deflate's
# match search to find, and the search is most of Pillow's default cost. Measured on a 2-core Xeon, Pillow 13 (zlib-ng),
# two photographs resized to 1328x1328: 121 and 188 ms instead of 689 and 824, files 6% and 0.4% larger.
_PNG_OPTIONS = {"compress_type": zlib.Z_RLE}


def encode_image(pixels: np.ndarray, output_format: OutputFormat, compression: int | None = None) -> bytes:
    """uint8 ``[H, W, 3]`` pixels as a PNG, JPEG or WebP file."""
    from PIL import Image

    buffer = io.BytesIO()
    if output_format == "png":
        options = _PNG_OPTIONS
    else:
        options = {} if compression is None else {"quality": compression}
    Image.fromarray(pixels).save(buffer, format=output_format.upper(), **options)
    return buffer.getvalue()


# Megabytes of base64 are built on worker threads, but base64 and json.dumps hold the GIL through a whole call: a
# 2.9 MB PNG (1328x1328) takes 6 ms to encode and its JSON 12 ms, in which the event loop cannot run. Encoding in
# chunks and splicing the strings into the JSON (base64 needs no escaping) hands the GIL back every fraction of a ms.
B64_CHUNK = 3 << 16  # bytes per base64 call: a multiple of 3, so the chunks' encodings concatenate
_B64_SLOT = "\x00b64\x00"  # where an image's base64 goes in the JSON text; json.dumps writes it escaped


def b64encode(data: bytes) -> str:
    """``base64.b64encode(data).decode()``, a chunk at a time so that other threads run in between."""
    view = memoryview(data)
    return "".join(base64.b64encode(view[i:i + B64_CHUNK]).decode() for i in range(0, len(view), B64_CHUNK))


def json_bytes(body: dict) -> bytes:
    """``json.dumps(body).encode()`` for an images response or event: its ``b64_json`` strings (in ``body`` or in
    the items of ``body["data"]``) are spliced in rather than scanned."""
    images: list[str] = []

    def hollow(item: dict) -> dict:
        if isinstance(item.get("b64_json"), str):
            images.append(item["b64_json"])
            return {**item, "b64_json": _B64_SLOT}
        return item

    small = hollow(body)
    if isinstance(small.get("data"), list):
        small = {**small, "data": [hollow(item) if isinstance(item, dict) else item for item in small["data"]]}
    first, *rest = json.dumps(small).encode().split(json.dumps(_B64_SLOT).encode())
    out = bytearray(first)
    for image, tail in zip(images, rest, strict=True):
        out += b'"'
        out += image.encode("ascii")
        out += b'"'
        out += tail
    return bytes(out)


def progress_event(plan: GenerationPlan, index: int, step: int, total_steps: int) -> dict:
    """A streamed event after one denoising step of image ``index``."""
    return {"type": f"{plan.event_prefix}.progress", "index": index, "step": step, "total_steps": total_steps}


def completed_event(plan: GenerationPlan, index: int, data: bytes, stats: dict | None = None) -> dict:
    """The streamed event that carries image ``index``, after OpenAI's ``image_generation.completed`` (and
    ``image_edit.completed`` for edits); with ``stats`` (``image_stats``'), the image's times and DiT passes."""
    event = {
        "type": f"{plan.event_prefix}.completed",
        "index": index,
        "b64_json": b64encode(data),
        "created_at": int(time.time()),
        **output_fields(plan),
    }
    return {**event, **(stats or {})}


def partial_image_event(plan: GenerationPlan, index: int, partial_index: int, data: bytes) -> dict:
    """A streamed preview of image ``index``, after OpenAI's ``image_generation.partial_image`` (and
    ``image_edit.partial_image`` for edits)."""
    return {
        "type": f"{plan.event_prefix}.partial_image",
        "index": index,
        "partial_image_index": partial_index,
        "b64_json": b64encode(data),
        "created_at": int(time.time()),
        **output_fields(plan),
    }


QUEUED = "_queued"  # a timing's suffix: the part of a stage's time the request waited before its first step


def image_stats(timings: dict[str, float], dit_passes: dict[str, int]) -> dict:
    """What ``timings: true`` adds to an image: its milliseconds per stage (queueing included), the part of each it
    queued before the stage's first step that ran it, and its DiT passes computed and reused (true CFG runs two per
    step; cache acceleration reuses some)."""
    ms = {stage: round(1000 * seconds, 1) for stage, seconds in timings.items()}
    return {"timings_ms": {stage: v for stage, v in ms.items() if not stage.endswith(QUEUED)},
            "queued_ms": {stage.removesuffix(QUEUED): v for stage, v in ms.items() if stage.endswith(QUEUED)},
            "dit_passes": dit_passes}


def images_response(files: list[bytes], plan: GenerationPlan, stats: list[dict] | None = None) -> dict:
    """OpenAI's images response body; with ``timings``, each image's ``image_stats``."""
    data = [{"b64_json": b64encode(file)} for file in files]
    if plan.request.timings and stats is not None:
        for item, image in zip(data, stats):
            item.update(image)
    return {"created": int(time.time()), "data": data, **output_fields(plan)}


def output_fields(plan: GenerationPlan) -> dict:
    """What OpenAI's responses and completed events say of the images besides the images themselves."""
    return {"size": f"{plan.width}x{plan.height}", "quality": plan.quality, "background": "opaque",
            "output_format": plan.request.output_format}


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
