"""Image files in and out of the API: an edit's uploads checked and resized to their working sizes, and pixels
written as PNG, JPEG or WebP. Pillow and numpy only; both run on worker threads, never on an event loop.
"""

from __future__ import annotations

import io
import math
import zlib
from collections.abc import Sequence

import numpy as np

from omni_ray.api.planning import check_sides
from omni_ray.api.schema import OutputFormat
from omni_ray.config import PipelineConfig
from omni_ray.errors import PayloadTooLargeError, RequestError
from omni_ray.qwen_image import EDIT_SIDE_MULTIPLE
from omni_ray.records import InputImages

INPUT_FORMATS = ("PNG", "JPEG", "MPO", "WEBP")  # what /v1/images/edits takes, as OpenAI's does (MPO: camera JPEGs)
MAX_INPUT_PIXELS = 8192 * 8192  # an input image's pixels before resizing; refused past it (decompression bombs)


def load_input_images(files: Sequence[bytes], config: PipelineConfig) -> InputImages:
    """An edit's uploaded image files, checked and resized as diffusers' pipelines resize them: each to its working
    size (``config.edit.image_area`` pixels at its aspect ratio) for the VAE and, for Edit-Plus, from the same
    upload to ``config.edit.condition_area`` pixels for the encoder (Qwen-Image-Edit's encoder reads the working
    size).

    Raises RequestError (param ``image``) for no file or more than ``config.edit.max_images``, and for each file as
    ``load_input_image`` does, naming which of them it is.
    """
    edit = config.edit
    if len(files) > edit.max_images:
        more = "one image" if edit.max_images == 1 else f"at most {edit.max_images} images"
        raise RequestError(f"image: {config.name!r} takes {more} per request, got {len(files)}", param="image")
    if not files:
        raise RequestError("image: required: the image to edit, as a PNG, JPEG or WebP file", param="image")
    vae, encoder = [], []
    for number, data in enumerate(files, 1):
        which = f"image {number} of {len(files)}: " if len(files) > 1 else ""
        image = open_input_image(data, config, which)
        vae.append(_resized(image, config, edit.image_area, f"{which}a {image.width}x{image.height} image's working "))
        if edit.plus:
            encoder.append(_resized(image, config, edit.condition_area, ""))
    return InputImages(tuple(vae), tuple(encoder) if edit.plus else tuple(vae))


def load_input_image(data: bytes | None, config: PipelineConfig) -> np.ndarray:
    """An edit's one uploaded image file, checked and resized to its working size (``config.edit.image_area``
    pixels at its aspect ratio, as diffusers' ``QwenImageEditPipeline`` resizes it): uint8 ``[H, W, 3]``.

    Raises RequestError (param ``image``) for a missing, unreadable, corrupt or unsupported file, or one whose
    aspect ratio gives a working size outside the preset's side limits; PayloadTooLargeError past
    ``config.edit.max_image_bytes``.
    """
    if not data:
        raise RequestError("image: required: the image to edit, as a PNG, JPEG or WebP file", param="image")
    return load_input_images([data], config).vae[0]


def open_input_image(data: bytes, config: PipelineConfig, which: str = ""):
    """An uploaded file as an RGB PIL image, its EXIF orientation applied; every refusal names ``image`` and starts
    with ``which`` (which of several files it is)."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    edit = config.edit
    if not data:
        raise RequestError(f"image: {which}an empty file", param="image")
    if len(data) > edit.max_image_bytes:
        raise PayloadTooLargeError(
            f"image: {which}the file is {len(data)} bytes; the limit is {edit.max_image_bytes}", param="image"
        )
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise RequestError(f"image: {which}more than {MAX_INPUT_PIXELS} pixels", param="image") from None
    except UnidentifiedImageError:
        raise RequestError(f"image: {which}not a readable image file; send PNG, JPEG or WebP", param="image") from None
    except Exception as err:  # a header Pillow cannot read: truncated, oversized chunks, ...
        raise RequestError(f"image: {which}the file is corrupt or truncated ({err})", param="image") from None
    if image.format not in INPUT_FORMATS:
        raise RequestError(f"image: {which}{image.format} files are not supported; send PNG, JPEG or WebP",
                           param="image")
    if image.width * image.height > MAX_INPUT_PIXELS:
        raise RequestError(
            f"image: {which}{image.width}x{image.height} is more than {MAX_INPUT_PIXELS} pixels", param="image"
        )
    try:
        return ImageOps.exif_transpose(image).convert("RGB")  # decodes the whole file
    except Exception as err:
        raise RequestError(f"image: {which}the file is corrupt or truncated ({err})", param="image") from None


def _resized(image, config: PipelineConfig, area: int, what: str) -> np.ndarray:
    """``image`` at ``area`` pixels and its aspect ratio (``working_size``); with ``what``, its sides checked
    against the preset's limits (the DiT's tokens), else only that none rounds to nothing."""
    height, width = working_size(image.width, image.height, area)
    if what:
        check_sides(width, height, config, "image", what)
    elif not (height and width):
        raise RequestError(f"image: a {image.width}x{image.height} image is too narrow for the encoder's "
                           f"{area}-pixel view", param="image")
    return resize_image(image, height, width)


def working_size(width: int, height: int, area: int) -> tuple[int, int]:
    """(height, width) of an edit's input image: ``area`` pixels at its aspect ratio, sides rounded to multiples of
    32 (twice the size multiple), as diffusers' ``calculate_dimensions`` gives."""
    ratio = width / height
    new_width = math.sqrt(area * ratio)
    new_height = new_width / ratio
    multiple = EDIT_SIDE_MULTIPLE
    return round(new_height / multiple) * multiple, round(new_width / multiple) * multiple


def resize_image(image, height: int, width: int) -> np.ndarray:
    """An RGB PIL image resized to (height, width) as diffusers' ``VaeImageProcessor.resize`` does for PIL images
    (Lanczos), as uint8 ``[H, W, 3]``."""
    from PIL import Image

    return np.asarray(image.resize((width, height), resample=Image.LANCZOS))


# PNG's deflate with zlib's run-length strategy: after PNG's row filters a photograph leaves few repeats for deflate's
# match search to find, and the search is most of Pillow's default cost (the README has the figures).
_PNG_OPTIONS = {"compress_type": zlib.Z_RLE}


def write_image_file(pixels: np.ndarray, output_format: OutputFormat, compression: int | None = None) -> bytes:
    """uint8 ``[H, W, 3]`` pixels as a PNG, JPEG or WebP file."""
    from PIL import Image

    buffer = io.BytesIO()
    if output_format == "png":
        options = _PNG_OPTIONS
    else:
        options = {} if compression is None else {"quality": compression}
    Image.fromarray(pixels).save(buffer, format=output_format.upper(), **options)
    return buffer.getvalue()
