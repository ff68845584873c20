"""What the API sends back: OpenAI's images response, its streamed events, and its error body, with images as
base64 written so that an event loop is never held for long.

Each body validates against OpenAI's published OpenAPI definition (``tests/openai_images_schemas.json`` names the
version), so the official client parses it into its typed models: where that definition allows fewer values than
Qwen-Image has, a field says what the definition can (``size``), and our own fields come beside OpenAI's, never
instead of them. ``usage`` counts tokens as Qwen-Image has them: the input tokens are those the text encoder reads
(the templated prompt, the negative prompt's when true CFG runs, an edit image's vision tokens in each), the output
tokens each image's tokens in the transformer (one per 16x16 pixels).
"""

from __future__ import annotations

import base64
import json
import time

from omni_ray.api.images import keeps_alpha
from omni_ray.api.planning import GenerationPlan
from omni_ray.errors import OmniRayError
from omni_ray.families.qwen_image.facts import image_tokens

# The only sizes OpenAI's schema allows in a response (and, besides "auto", in a stream event).
OPENAI_SIZES = frozenset({"1024x1024", "1024x1536", "1536x1024"})

# Megabytes of base64 are built on worker threads, but base64 and json.dumps hold the GIL through a whole call, in
# which the event loop cannot run. Encoding in chunks and splicing the strings into the JSON (base64 needs no
# escaping) hands the GIL back every fraction of a millisecond.
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
    """A streamed event after one denoising step of image ``index``: omni-ray's own, sent only to callers that ask
    (``progress: true``), since OpenAI's client reads an event type it does not know as an empty partial image."""
    return {"type": f"{plan.event_prefix}.progress", "index": index, "step": step, "total_steps": total_steps}


def completed_event(plan: GenerationPlan, index: int, data: bytes, stats: dict | None = None,
                    layer: int | None = None, revised_prompt: str | None = None) -> dict:
    """The streamed event that carries image ``index``, after OpenAI's ``image_generation.completed`` (and
    ``image_edit.completed`` for edits); with ``stats`` (``image_stats``'), the image's times and DiT passes. Its
    ``usage`` counts the request's input and this image's output. A Layered request's image sends one per
    ``layer`` (bottom first), its ``index`` the layer's place in the response's ``data``; with the caption that
    stood for its empty prompt (``revised_prompt``)."""
    event = {
        "type": f"{plan.event_prefix}.completed",
        "index": index if layer is None else index * plan.layers + layer,
        "b64_json": b64encode(data),
        "created_at": int(time.time()),
        **output_fields(plan, event=True),
        "usage": usage(plan, images=1),
    }
    if layer is not None:
        event["layer"] = layer
    if revised_prompt is not None:
        event["revised_prompt"] = revised_prompt
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
        **output_fields(plan, event=True),
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


def images_response(files: list[bytes], plan: GenerationPlan, stats: list[dict] | None = None,
                    revised_prompts: list[str | None] | None = None) -> dict:
    """OpenAI's images response body (a Layered request's: each image's layers, bottom to top, image after image);
    with ``timings``, each file's image's ``image_stats``; each file's ``revised_prompt`` where a caption stood for
    the prompt."""
    data = [{"b64_json": b64encode(file)} for file in files]
    if plan.request.timings and stats is not None:
        for item, image in zip(data, stats):
            item.update(image)
    for item, revised in zip(data, revised_prompts or ()):
        if revised is not None:
            item["revised_prompt"] = revised
    return {"created": int(time.time()), "data": data, **output_fields(plan), "usage": usage(plan, plan.request.n)}


def output_fields(plan: GenerationPlan, event: bool = False) -> dict:
    """What OpenAI's responses and events say of the images besides the images themselves. ``size`` is one of
    OpenAI's three sizes or absent from a response (where it is optional), "auto" in an event (where it is
    required): the image itself has its size."""
    size = f"{plan.width}x{plan.height}"
    request = plan.request
    transparent = plan.rgba and keeps_alpha(request.output_format, request.background != "opaque")
    fields = {"quality": plan.quality, "background": "transparent" if transparent else "opaque",
              "output_format": request.output_format}
    if size in OPENAI_SIZES or event:
        fields["size"] = size if size in OPENAI_SIZES else "auto"
    return fields


def usage(plan: GenerationPlan, images: int) -> dict:
    """OpenAI's token usage of the request's input and ``images`` of its images (see the module's docstring; a
    Layered image's output counts each of its layers)."""
    text, image = plan.input_tokens
    output = images * plan.images_per_result * image_tokens(plan.height, plan.width)
    return {"input_tokens": text + image, "input_tokens_details": {"text_tokens": text, "image_tokens": image},
            "output_tokens": output, "total_tokens": text + image + output}


def error_body(err: OmniRayError) -> dict:
    """OpenAI's error body for ``err``: the JSON response's, and the ``error`` stream event's."""
    return {"error": {"message": str(err), "type": err.error_type, "param": getattr(err, "param", None),
                      "code": getattr(err, "code", None)}}
