"""Image files in and out of the API: an edit's uploads checked and resized to their working sizes, and pixels
written as PNG, JPEG or WebP. Pillow and numpy only; both run on worker threads, never on an event loop.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import re
import zlib
from collections.abc import Collection, Sequence

import numpy as np

from omni_ray.api.schema import ImageGenerationRequest, OutputFormat
from omni_ray.config import EditConfig, PipelineConfig
from omni_ray.errors import PayloadTooLargeError, RequestError
from omni_ray.families import family_of
from omni_ray.families.qwen_image.facts import EDIT_SIDE_MULTIPLE, VAE_COMPRESSION
from omni_ray.records import InputImages

INPUT_FORMATS = ("PNG", "JPEG", "MPO", "WEBP")  # what /v1/images/edits takes, as OpenAI's does (MPO: camera JPEGs)
MAX_INPUT_PIXELS = 8192 * 8192  # an input image's pixels before resizing; refused past it (decompression bombs)


def load_inputs(files: Sequence[bytes] | None, mask: bytes | None, config: PipelineConfig,
                size: tuple[int, int] | None = None, resolution: int | None = None) -> InputImages | None:
    """What a request's uploads are: a masked edit's one image and its mask (``load_masked_input``, at the size the
    request names, ``size``, when it names one), an edit's images (``load_input_images``; Qwen-Image-Layered's at
    its ``resolution`` bucket), or nothing to decode (no upload, or a text-to-image preset given an image without a
    mask: planning refuses that route)."""
    if mask is not None:
        if len(files or ()) > 1:
            raise RequestError("image: a masked edit takes one image", param="image")
        return load_masked_input(files[0] if files else b"", mask, config, size)
    if files is not None and config.edit is not None:
        return load_input_images(files, config, resolution)
    return None


def load_input_images(files: Sequence[bytes], config: PipelineConfig, resolution: int | None = None
                      ) -> InputImages:
    """An edit's uploaded image files, checked and resized as diffusers' pipelines resize them: each to its working
    size (``config.edit.image_area`` pixels at its aspect ratio) for the VAE and, for Edit-Plus, from the same
    upload to ``config.edit.condition_area`` pixels for the encoder (Qwen-Image-Edit's encoder reads the working
    size). Qwen-Image-Layered's one image is RGBA at ``resolution`` squared pixels (a bucket of
    ``config.edit.resolutions``, the first by default), and its encoder reads no image (its prompt is text alone).

    Raises RequestError (param ``image``) for no file or more than ``config.edit.max_images``, and for each file a
    missing, unreadable, corrupt or unsupported file, or one whose aspect ratio gives a working size outside the
    preset's side limits, naming which of them it is; PayloadTooLargeError past ``config.edit.max_image_bytes``.
    """
    edit = config.edit
    if len(files) > edit.max_images:
        more = "one image" if edit.max_images == 1 else f"at most {edit.max_images} images"
        raise RequestError(f"image: {config.name!r} takes {more} per request, got {len(files)}", param="image")
    if not files:
        raise RequestError("image: required: the image to edit, as a PNG, JPEG or WebP file", param="image")
    layered = edit.resolutions is not None
    area = (resolution or edit.resolutions[0]) ** 2 if layered else edit.image_area
    vae, encoder = [], []
    for number, data in enumerate(files, 1):
        which = f"image {number} of {len(files)}: " if len(files) > 1 else ""
        image = open_input_image(data, edit.max_image_bytes, which, rgba=family_of(config).rgba)
        vae.append(_resized(image, config, area, f"{which}a {image.width}x{image.height} image's working "))
        if edit.plus:
            encoder.append(_resized(image, config, edit.condition_area, ""))
    if layered:
        return InputImages(tuple(vae), ())
    return InputImages(tuple(vae), tuple(encoder) if edit.plus else tuple(vae))


def load_masked_input(image: bytes, mask: bytes, config: PipelineConfig, size: tuple[int, int] | None = None
                      ) -> InputImages:
    """A masked edit's image and OpenAI's ``mask`` (a PNG of the image's size whose fully transparent pixels mark
    what to change), as diffusers' inpaint pipelines take them at a height and width: the request's ``size``
    (height, width) when it names one, else the image's working size on an edit preset
    (``QwenImageEditInpaintPipeline``, which edits beside the image at that size too) and the preset's default size
    on a text-to-image one (``QwenImageInpaintPipeline``); the mask on that size's latent grid.

    Raises RequestError naming ``image`` as ``load_input_images`` does, or ``mask`` for a file that is not a PNG,
    not the image's size, without an alpha channel, or with no transparent pixel.
    """
    edit = config.edit
    max_bytes = edit.max_image_bytes if edit is not None else EditConfig().max_image_bytes
    if not image:
        raise RequestError("image: required: the image the mask applies to, as a PNG, JPEG or WebP file",
                           param="image")
    picture = open_input_image(image, max_bytes)
    repaint = open_mask(mask, picture.size, max_bytes)
    if edit is not None:
        start = resize_image(picture, *size) if size is not None else \
            _resized(picture, config, edit.image_area, f"a {picture.width}x{picture.height} image's working ")
        return InputImages((start,), (start,), mask_grid(repaint, *start.shape[:2]))
    height, width = size or (config.requests.default_height, config.requests.default_width)
    return InputImages((resize_image(picture, height, width),), (), mask_grid(repaint, height, width),
                       conditions=False)


def open_mask(data: bytes, size: tuple[int, int], max_bytes: int, param: str = "mask"):
    """OpenAI's mask as diffusers' mask image: an 'L' PIL image, 255 where the mask is fully transparent (what to
    change), 0 elsewhere. ``size`` is the image's (width, height); every refusal names ``param`` (``mask``, or a
    control's ``control[k].mask``)."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if not data:
        raise RequestError(f"{param}: an empty file", param=param)
    if len(data) > max_bytes:
        raise PayloadTooLargeError(f"{param}: the file is {len(data)} bytes; the limit is {max_bytes}", param=param)
    try:
        mask = Image.open(io.BytesIO(data))  # reads the header only: the checks below come before any decoding
    except (UnidentifiedImageError, Image.DecompressionBombError):
        raise RequestError(f"{param}: not a readable PNG file", param=param) from None
    except Exception as err:
        raise RequestError(f"{param}: the file is corrupt or truncated ({err})", param=param) from None
    if mask.format != "PNG":
        raise RequestError(f"{param}: {mask.format} files are not supported; send a PNG with an alpha channel",
                           param=param)
    wrong_size = RequestError(f"{param}: {mask.width}x{mask.height}, but the image is {size[0]}x{size[1]}; they must "
                              "be the same size", param=param)
    if mask.size not in (size, size[::-1]):  # before decoding: a small file can declare a huge mask
        raise wrong_size
    try:
        mask = ImageOps.exif_transpose(mask)  # decodes it, turned as the image is
    except Exception as err:
        raise RequestError(f"{param}: the file is corrupt or truncated ({err})", param=param) from None
    if mask.size != size:
        raise wrong_size
    if "A" not in mask.getbands() and "transparency" not in mask.info:
        raise RequestError(f"{param}: no alpha channel; its fully transparent pixels mark what to change",
                           param=param)
    alpha = np.asarray(mask.convert("RGBA").getchannel("A"))
    if alpha.min() > 0:
        raise RequestError(f"{param}: fully opaque, so nothing would change; make what to change fully transparent",
                           param=param)
    return Image.fromarray(np.where(alpha == 0, 255, 0).astype(np.uint8), mode="L")


def mask_grid(repaint, height: int, width: int) -> np.ndarray:
    """diffusers' mask processing: resized to (``height``, ``width``) as its ``VaeImageProcessor`` resizes (Lanczos),
    binarised at one half, and taken to the VAE's latent grid as ``interpolate`` (nearest) does: uint8 ``[H/8, W/8]``,
    1 repaints."""
    from PIL import Image

    resized = np.asarray(repaint.resize((width, height), resample=Image.LANCZOS))
    binary = (resized.astype(np.float32) / 255 >= 0.5).astype(np.uint8)
    return np.ascontiguousarray(binary[::VAE_COMPRESSION, ::VAE_COMPRESSION])


def open_input_image(data: bytes, max_bytes: int, which: str = "", rgba: bool = False, param: str = "image"):
    """An uploaded file as an RGB PIL image (with ``rgba``, RGBA: Qwen-Image 2.1's VAE reads alpha, opaque where
    the file has none, as its pipeline converts), its EXIF orientation applied; every refusal names ``param`` (the
    ``image`` of an edit, ``control[k].image`` of a control image) and starts with ``which`` (which of several files
    it is)."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if not data:
        raise RequestError(f"{param}: {which}an empty file", param=param)
    if len(data) > max_bytes:
        raise PayloadTooLargeError(f"{param}: {which}the file is {len(data)} bytes; the limit is {max_bytes}",
                                   param=param)
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise RequestError(f"{param}: {which}more than {MAX_INPUT_PIXELS} pixels", param=param) from None
    except UnidentifiedImageError:
        raise RequestError(f"{param}: {which}not a readable image file; send PNG, JPEG or WebP", param=param) from None
    except Exception as err:  # a header Pillow cannot read: truncated, oversized chunks, ...
        raise RequestError(f"{param}: {which}the file is corrupt or truncated ({err})", param=param) from None
    if image.format not in INPUT_FORMATS:
        raise RequestError(f"{param}: {which}{image.format} files are not supported; send PNG, JPEG or WebP",
                           param=param)
    if image.width * image.height > MAX_INPUT_PIXELS:
        raise RequestError(
            f"{param}: {which}{image.width}x{image.height} is more than {MAX_INPUT_PIXELS} pixels", param=param
        )
    try:
        return ImageOps.exif_transpose(image).convert("RGBA" if rgba else "RGB")  # decodes the whole file
    except Exception as err:
        raise RequestError(f"{param}: {which}the file is corrupt or truncated ({err})", param=param) from None


_DATA_URL = re.compile(r"^data:image/[\w.+-]+;base64,", re.IGNORECASE)


def base64_limit(max_bytes: int) -> int:
    """Characters of the base64 text of a file of ``max_bytes`` bytes (a data URL's header aside)."""
    return 4 * math.ceil(max_bytes / 3)


def decode_base64_file(text: str, max_bytes: int, param: str) -> bytes:
    """A file sent in a JSON body: plain base64, or a data URL (``data:image/png;base64,...``); RequestError naming
    ``param`` for text that is neither, PayloadTooLargeError (413) for a file past ``max_bytes`` (told from the
    text's length before decoding)."""
    text = _DATA_URL.sub("", text.strip(), count=1)
    if text.startswith("data:"):
        raise RequestError(f"{param}: a data URL must be base64 (data:image/png;base64,...)", param=param)
    if len(text) > base64_limit(max_bytes) + 64:  # line breaks some encoders insert aside
        raise PayloadTooLargeError(f"{param}: the file is about {len(text) * 3 // 4} bytes; the limit is {max_bytes}",
                                   param=param)
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{param}: not base64 text; send the PNG, JPEG or WebP file base64-encoded, or as a data "
                           "URL", param=param) from None


def load_control_images(request: ImageGenerationRequest, files: Sequence[bytes] | None, max_bytes: int
                        ) -> tuple[np.ndarray, ...]:
    """The request's control images (``control``), decoded as uint8 ``[H, W, 3]`` and not resized (planning refuses
    one that is not the output's size): in a JSON body each control's ``image`` (base64 or a data URL); in a
    multipart body the ``control_image`` ``files``, one per control in order, and no control with an ``image``.
    Each refusal names ``control[k].image`` (or ``control_image`` for files that do not match the controls): an
    empty, unreadable, corrupt or unsupported file, or one of more than ``MAX_INPUT_PIXELS``; past ``max_bytes``,
    a 413."""
    controls = request.control or []
    if files is not None:
        if not controls and files:
            raise RequestError("control_image: control images without `control`; send `control` (JSON text) naming "
                               "a ControlNet for each", param="control_image")
        for k, control in enumerate(controls):
            if control.image is not None:
                raise RequestError(f"control[{k}].image: in a multipart body the control images are `control_image` "
                                   "files, in the controls' order, not base64 text", param=f"control[{k}].image")
        if len(files) != len(controls):
            raise RequestError(f"control_image: {len(files)} file(s) for {len(controls)} control(s); send one "
                               "`control_image` file per control, in order", param="control_image")
        datas = list(files)
    else:
        datas = []
        for k, control in enumerate(controls):
            if control.image is None:
                raise RequestError(f"control[{k}].image: required: the control image as a base64 PNG, JPEG or WebP "
                                   "file, or a data URL", param=f"control[{k}].image")
            datas.append(decode_base64_file(control.image, max_bytes, f"control[{k}].image"))
    return tuple(np.asarray(open_input_image(data, max_bytes, param=f"control[{k}].image"))
                 for k, data in enumerate(datas))


def check_sides(width: int, height: int, config: PipelineConfig, param: str, what: str = "") -> None:
    """Raises RequestError (naming ``param``) unless both sides are multiples of the family's (Qwen-Image's 16,
    Qwen-Image 2.1's 32) and within the preset's limits."""
    limits = config.requests
    check = family_of(config).check_side
    for name, side in (("width", width), ("height", height)):
        try:
            check(name, side)
        except ValueError as err:
            raise RequestError(f"{param}: {what}{err}", param=param) from None
        if not limits.min_side <= side <= limits.max_side:
            raise RequestError(
                f"{param}: {what}{name} {side} is outside {limits.min_side}..{limits.max_side}", param=param
            )


def load_control_masks(request: ImageGenerationRequest, files: Sequence[bytes] | None,
                       images: Sequence[np.ndarray], inpainting: Collection[str], max_bytes: int
                       ) -> tuple[np.ndarray | None, ...]:
    """Each control's mask, for the controls that name an inpainting ControlNet (``inpainting``; None for the
    others): OpenAI's ``mask`` convention (a PNG whose fully transparent pixels mark what to repaint, ``open_mask``)
    as diffusers' ``control_mask`` after its mask processor (white repaints, binarised at one half), uint8 ``[H, W]``
    with 1 where to repaint. In a JSON body each such control's ``mask`` (base64 or a data URL); in a multipart body
    the ``control_mask`` ``files``, one per such control in order. Each refusal names ``control[k].mask`` (or
    ``control_mask`` for files that do not match the controls): a missing mask, a mask the control's ControlNet
    does not take, one that ``open_mask`` refuses, or one not of its control image's size (``images[k]``)."""
    controls = request.control or []
    masked = [k for k, control in enumerate(controls) if control.name in inpainting]
    for k, control in enumerate(controls):
        if control.mask is not None and k not in masked:
            raise RequestError(f"control[{k}].mask: ControlNet {control.name!r} is not an inpainting ControlNet and "
                               "takes no mask", param=f"control[{k}].mask")
    datas: dict[int, bytes] = {}
    if files is not None:
        for k in masked:
            if controls[k].mask is not None:
                raise RequestError(f"control[{k}].mask: in a multipart body the control masks are `control_mask` "
                                   "files, in the controls' order, not base64 text", param=f"control[{k}].mask")
        if len(files) != len(masked):
            raise RequestError(f"control_mask: {len(files)} file(s) for {len(masked)} control(s) of an inpainting "
                               "ControlNet; send one `control_mask` file per such control, in order",
                               param="control_mask")
        datas = dict(zip(masked, files))
    else:
        for k in masked:
            if controls[k].mask is None:
                raise RequestError(f"control[{k}].mask: required: ControlNet {controls[k].name!r} inpaints; send a "
                                   "base64 PNG whose fully transparent pixels mark what to repaint",
                                   param=f"control[{k}].mask")
            datas[k] = decode_base64_file(controls[k].mask, max_bytes, f"control[{k}].mask")
    masks: list[np.ndarray | None] = [None] * len(controls)
    for k, data in datas.items():
        height, width = images[k].shape[:2]
        repaint = open_mask(data, (width, height), max_bytes, param=f"control[{k}].mask")
        masks[k] = (np.asarray(repaint) >= 128).astype(np.uint8)
    return tuple(masks)


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
    """A PIL image resized to (height, width) as diffusers' ``VaeImageProcessor.resize`` does for PIL images
    (Lanczos), as uint8 ``[H, W, 3]`` (RGBA: ``[H, W, 4]``)."""
    from PIL import Image

    return np.asarray(image.resize((width, height), resample=Image.LANCZOS))


def composite(layers: np.ndarray) -> np.ndarray:
    """RGBA layers ``[L, H, W, 4]`` (uint8, bottom first) laid over one another (Porter-Duff "over", straight
    alpha), as one RGBA image ``[H, W, 4]``: what a Layered preview shows."""
    out = np.zeros(layers.shape[1:3] + (4,), dtype=np.float32)
    for layer in layers.astype(np.float32) / 255:
        alpha = layer[..., 3:]
        out_alpha = alpha + out[..., 3:] * (1 - alpha)
        color = layer[..., :3] * alpha + out[..., :3] * out[..., 3:] * (1 - alpha)
        out[..., :3] = np.divide(color, out_alpha, out=np.zeros_like(color), where=out_alpha > 0)
        out[..., 3:] = out_alpha
    return np.round(out * 255).astype(np.uint8)


def keeps_alpha(output_format: OutputFormat, alpha: bool = True) -> bool:
    """Whether an RGBA image keeps its alpha channel in a file of this format."""
    return alpha and output_format != "jpeg"


# PNG's deflate with zlib's run-length strategy: after PNG's row filters a photograph leaves few repeats for deflate's
# match search to find, and the search is most of Pillow's default cost (docs/api.md has the figures).
_PNG_OPTIONS = {"compress_type": zlib.Z_RLE}


def write_image_file(pixels: np.ndarray, output_format: OutputFormat, compression: int | None = None,
                     alpha: bool = True) -> bytes:
    """uint8 ``[H, W, 3]`` pixels, or RGBA ``[H, W, 4]`` (Qwen-Image 2.1's), as a PNG, JPEG or WebP file; the alpha
    channel is dropped for a JPEG, which has none, or without ``alpha`` (the request's ``background: opaque``)."""
    from PIL import Image

    if pixels.shape[-1] == 4 and not keeps_alpha(output_format, alpha):
        pixels = np.ascontiguousarray(pixels[..., :3])
    buffer = io.BytesIO()
    if output_format == "png":
        options = _PNG_OPTIONS
    else:
        options = {} if compression is None else {"quality": compression}
    Image.fromarray(pixels).save(buffer, format=output_format.upper(), **options)
    return buffer.getvalue()
