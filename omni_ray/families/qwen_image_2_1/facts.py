"""Qwen-Image 2.1's facts, each stated once: what diffusers' ``QwenImage21Pipeline``,
``QwenImage21Transformer2DModel`` and ``AutoencoderKLQwenImage21`` fix, not settings.

Where they differ from Qwen-Image's (``qwen_image``): the VAE compresses 16x and the transformer takes its 64
latent channels unpatched, so one token covers 16x16 pixels and image sides are multiples of 32 (the pipeline rounds
to ``2 * 16``); the prompt and the condition images are encoded together by Qwen3-VL from a raw template, each
condition image's vision token (a 32x32 pixel tile) standing for the 2x2 latent tokens the VAE makes of it; images
are RGBA. Nothing here imports anything but the standard library.
"""

from __future__ import annotations

import math

FAMILY = "qwen-image-2.1"
PIPELINE = "QwenImage21Pipeline"
VAE_COMPRESSION = 16  # AutoencoderKLQwenImage21's spatial compression; the transformer's patch is 1
SIZE_MULTIPLE = 2 * VAE_COMPRESSION  # the pipeline rounds sides down to multiples of this
LATENT_CHANNELS = 64  # the VAE's z_dim: the transformer's in and out channels
IMAGE_CHANNELS = 4  # the VAE reads and writes RGBA
TOKENS_PER_SLOT = 4  # one Qwen3-VL vision token (after its 2x2 merge of 16-pixel patches) per 2x2 latent tokens
TEXT_HIDDEN = 4096  # Qwen3-VL-8B's hidden size: the transformer's context_in_dim
DEFAULT_STEPS = 40  # the pipeline's num_inference_steps, when the checkpoint has no sample_sigmas
OUTPUT_RESOLUTION = 1024  # the pipeline's output_resolution: default side, and the side of the area images take
MAX_IMAGES = 3  # condition images a request may bring ("Picture 1" to "Picture 3")

SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
SYSTEM_TURN = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"  # what the chat template makes of the system
# message: its tokens are dropped from the hidden states (the pipeline's _drop_idx, counted with the tokenizer)
IMAGE_SLOT = "<|vision_start|><|image_pad|><|vision_end|>"  # the processor widens <|image_pad|> to the image's tokens
TEXT_TO_IMAGE_TEMPLATE = SYSTEM_TURN + "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def template(num_images: int) -> str:
    """The pipeline's raw template for a prompt with ``num_images`` condition images ("{}" marks the prompt): each
    image's label and vision slot open the user turn, space-separated, as ``_get_qwen_prompt_embeds`` writes them."""
    if not num_images:
        return TEXT_TO_IMAGE_TEMPLATE
    pictures = " ".join(f"<image{i}>{IMAGE_SLOT}" for i in range(1, num_images + 1))
    return SYSTEM_TURN + f"<|im_start|>user\n{pictures}{{}}<|im_end|>\n<|im_start|>assistant\n"


def format_prompt(prompt: str, num_images: int = 0) -> str:
    """The templated text of ``prompt``; an empty prompt reads as one space (Qwen has no BOS token)."""
    return template(num_images).format(prompt or " ")


def working_size(height: int, width: int, area: int = OUTPUT_RESOLUTION**2) -> tuple[int, int]:
    """(height, width) an image of this aspect ratio takes at ``area`` pixels, sides rounded to multiples of 32: the
    pipeline's ``calculate_dimensions``, which sizes both a condition image and (from the last one) the output."""
    ratio = width / height
    side_w = math.sqrt(area * ratio)
    side_h = side_w / ratio
    return round(side_h / 32) * 32, round(side_w / 32) * 32


def image_tokens(height: int, width: int) -> int:
    """The transformer's tokens for an image of ``height`` x ``width`` pixels (one per 16x16 tile)."""
    return (height // VAE_COMPRESSION) * (width // VAE_COMPRESSION)


def vision_slots(height: int, width: int) -> int:
    """Qwen3-VL's vision tokens for a condition image at its working size: one per 32x32 tile."""
    return (height // SIZE_MULTIPLE) * (width // SIZE_MULTIPLE)


def check_side(name: str, side: int) -> None:
    """Raises ValueError naming ``name`` unless ``side`` (pixels) is a multiple of ``SIZE_MULTIPLE``."""
    if side % SIZE_MULTIPLE:
        raise ValueError(f"{name} {side} is not a multiple of {SIZE_MULTIPLE}")


def condition_tokens(text_tokens: int, image_sizes: tuple[tuple[int, int], ...] = ()) -> int:
    """Tokens of the condition block the transformer caches: the encoder's tokens (``text_tokens``, its image slots
    included) with each slot widened to its 2x2 latent tokens."""
    return text_tokens + sum((TOKENS_PER_SLOT - 1) * vision_slots(*size) for size in image_sizes)


def cache_bytes(condition: int, num_layers: int, inner_dim: int, dtype_bytes: int, branches: int = 1) -> int:
    """Bytes of one request's condition cache: keys and values of ``condition`` tokens in every block, for each CFG
    branch (``QwenImage21KVCache``, one per branch)."""
    return 2 * condition * num_layers * inner_dim * dtype_bytes * branches


# The published checkpoint's parameter counts: Qwen/Qwen-Image-2.1's transformer and VAE, and its text encoder
# (Qwen3-VL-8B-Instruct's architecture, vision tower included), counted from its configs/qwen-image-2.1/ by
# tests/test_full_size.py. The transformer's and the text encoder's are the hub's own counts for Qwen/Qwen-Image-2.1
# and Qwen/Qwen3-VL-8B-Instruct (omni_ray/families/CONFIGS.md).
PUBLISHED_PARAMS: dict[str, int] = {"transformer": 7_115_124_736, "vae": 337_740_404, "text_encoder": 8_767_123_696}
VISION_PARAMS = 576_388_336  # Qwen3-VL-8B's vision tower (deepstack mergers included), inside "text_encoder"
