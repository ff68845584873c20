"""HTTP plumbing of the ingress: request bodies read with a size limit, an edit's multipart form, server-sent
events, and omni-ray's errors as OpenAI's error responses."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException

from omni_ray.api.responses import error_body, json_bytes
from omni_ray.errors import OmniRayError, OverloadedError, PayloadTooLargeError, RateLimitError, RequestError

MAX_BODY_BYTES = 1 << 20


async def error_response(request: Request, err: OmniRayError) -> JSONResponse:
    """OpenAI's error response for ``err``; a 503 and a 429 say when to retry."""
    retry_after_s = err.retry_after_s if isinstance(err, (OverloadedError, RateLimitError)) else None
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if retry_after_s is not None else None
    return JSONResponse(error_body(err), err.status_code, headers=headers)


async def read_limited(request: Request, limit: int, param: str | None = None) -> bytes:
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
MAX_FILES = 8  # files a multipart body may hold at all (Edit-Plus takes three images)


async def json_object(request: Request, fields: tuple[str, ...]) -> dict:
    """A small JSON body with the string ``fields`` (no others); RequestError naming the first bad one."""
    try:
        body = json.loads(await read_limited(request, MAX_BODY_BYTES))
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


async def _read_form(request: Request, limit: int, param: str, what: str):
    """A multipart (or url-encoded) form of at most ``limit`` bytes, parsed; its too-many-files error names
    ``param``. ``what`` says what the body must hold."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        raise RequestError(f"request body must be multipart/form-data with {what}", param=None)
    body = await read_limited(request, limit, param=param)

    async def replay() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        return await Request(request.scope, replay).form(max_files=MAX_FILES, max_fields=64)
    except (HTTPException, MultiPartException) as err:  # a malformed body; anything else is the server's (500)
        detail = getattr(err, "detail", err)
        if "Too many files" in str(detail):
            raise RequestError(f"{param}: at most {MAX_FILES} files per request", param=param) from None
        raise RequestError(f"malformed multipart body: {detail}", param=None) from None


async def edit_form(request: Request, limit: int) -> tuple[dict[str, str], list[bytes], bytes | None]:
    """An edit's multipart form: its text fields, the bytes of its ``image`` files in order (``image``, or
    ``image[]`` as OpenAI's client sends a list; planning counts them against the preset), and its ``mask`` file's
    (None without one)."""
    form = await _read_form(request, limit, "image", "an `image` file and a `prompt`")
    fields, images, mask = {}, [], None
    try:
        for name, value in form.multi_items():
            if name in IMAGE_FIELDS and isinstance(value, UploadFile):
                images.append(await value.read())
            elif name == "mask" and isinstance(value, UploadFile):
                if mask is not None:
                    raise RequestError("mask: one mask per request", param="mask")
                mask = await value.read()
            elif name in (*IMAGE_FIELDS, "mask") or isinstance(value, UploadFile):
                param = name if name == "mask" else "image" if name in IMAGE_FIELDS else name
                raise RequestError(f"{param}: expected {'a file' if param in ('image', 'mask') else 'a text field'}",
                                   param=param)
            elif name in fields:
                raise RequestError(f"{name}: given more than once", param=name)
            else:
                fields[name] = value
    finally:
        await form.close()  # uploads past 1 MiB spill to temporary files
    return fields, images, mask


CONTROL_IMAGE_FIELDS = ("control_image", "control_image[]")  # a generation's control images, in `control`'s order
CONTROL_MASK_FIELDS = ("control_mask", "control_mask[]")  # its inpainting ControlNets' masks, in order


async def generation_form(request: Request, limit: int) -> tuple[dict[str, str], list[bytes], list[bytes]]:
    """A generation's multipart form (a request with ControlNets sending its control images as files): its text
    fields (``control`` among them, as JSON text without images), the bytes of its ``control_image`` files (or
    ``control_image[]``) in order, and of its ``control_mask`` files (or ``control_mask[]``: an inpainting
    ControlNet's masks, one per control naming one), in order."""
    form = await _read_form(request, limit, "control_image", "a `prompt` (and `control` with its `control_image` "
                            "files)")
    fields, images, masks = {}, [], []
    files = {**dict.fromkeys(CONTROL_IMAGE_FIELDS, ("control_image", images)),
             **dict.fromkeys(CONTROL_MASK_FIELDS, ("control_mask", masks))}
    try:
        for name, value in form.multi_items():
            if name in files and isinstance(value, UploadFile):
                files[name][1].append(await value.read())
            elif name in files or isinstance(value, UploadFile):
                param = files[name][0] if name in files else name
                expected = "a file" if name in files else "a text field (files: `control_image`, `control_mask`)"
                raise RequestError(f"{param}: expected {expected}", param=param)
            elif name in fields:
                raise RequestError(f"{name}: given more than once", param=name)
            else:
                fields[name] = value
    finally:
        await form.close()
    return fields, images, masks


async def json_body(request: Request, limit: int = MAX_BODY_BYTES) -> object:
    """A JSON request body of at most ``limit`` bytes, decoded (on a thread past ``MAX_BODY_BYTES``: a generation's
    base64 control images); RequestError when it is not JSON."""
    body = await read_limited(request, limit)
    try:
        return json.loads(body) if len(body) <= MAX_BODY_BYTES else await asyncio.to_thread(json.loads, body)
    except ValueError:
        raise RequestError("request body is not valid JSON", param=None) from None


async def sse(events: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Server-sent events, one ``data:`` line of JSON each; an image's (megabytes of base64) is written on a
    thread."""
    async for event in events:
        if "b64_json" in event:
            yield await asyncio.to_thread(_sse_line, event)
        else:
            yield _sse_line(event)


def _sse_line(event: dict) -> bytes:
    return b"data: " + json_bytes(event) + b"\n\n"
