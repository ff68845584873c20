"""Qwen-Image 2.1's memory estimate, which ``omni_ray.placement`` checks: its GPU stages are estimated from 2.1's
published parameter counts (``facts.PUBLISHED_PARAMS``) and figures **scaled from Qwen-Image's measured ones, not
measured on 2.1**:

- DiT: the weights; a step's activations at 1.5x Qwen-Image's per token (1.2 GiB over a 1328x1328 true-CFG
  request's 2 x (6,889 + 64) tokens, 90 KiB a token; 2.1's SwiGLU MLP holds three 12,288-wide tensors a token where
  Qwen-Image's GELU MLP holds two, and its width is 4,096 against 3,072), for the tokens a step holds: each row's two
  passes of its image at the largest size and its condition block (``encoder.max_model_len`` tokens, with an edit's
  ``edit.max_images`` images at ``edit.image_area`` widened from one vision slot to four latent tokens each), times
  ``dit.max_batch_size`` rows, or ``dit.max_batch_tokens`` where it binds; and on top, the condition caches'
  budget ``dit.cache_memory_bytes`` (unset: the caches of the rows a step holds, each at the largest condition with
  true CFG: ``facts.cache_bytes``). A gang is estimated whole on every rank (an upper bound);
- VAE: its weights, and 6.0 GiB per megapixel (Qwen-Image's 4.0 times 1.5: the decoder's full- and half-resolution
  stages are 144 and 288 channels wide against 96 and 192) times ``vae.max_batch_size``, at the larger of the
  largest output and an edit's condition image;
- encoder: Qwen3-VL-8B's weights (the vision tower's for edits, or always on the transformers runner), vLLM's KV cache,
  and 2.3 GiB of activations and workspace (Qwen-Image's 2 GiB times the hidden widths' 4,096 / 3,584).
"""

from __future__ import annotations

from omni_ray.families.qwen_image_2_1 import facts
from omni_ray.placement import (
    BYTES_PER_PARAM,
    CONTEXT_GIB,
    DIT_GIB_PER_TOKEN_1328,
    ENCODER_ACTIVATIONS_GIB,
    GIB,
    VAE_GIB_PER_MEGAPIXEL,
    StageMemory,
)

# Scaled from Qwen-Image's measured figures (the module's docstring says how), not measured.
DIT_GIB_PER_TOKEN = 1.5 * DIT_GIB_PER_TOKEN_1328
DIT_LAYERS, DIT_INNER_DIM = 32, 4096  # the published transformer's blocks and width (its configs/)
VAE_GIB_PER_MEGAPIXEL_21 = VAE_GIB_PER_MEGAPIXEL * 144 / 96
ENCODER_ACTIVATIONS_GIB_21 = ENCODER_ACTIVATIONS_GIB * 4096 / 3584


def stage_memory(config, gpu_memory_gib: float) -> list[StageMemory]:
    """The estimate for each GPU stage of a Qwen-Image 2.1 preset against its share of one GPU (the module's
    docstring says how each is made)."""
    side = config.requests.max_side
    out = []
    for name in ("encoder", "dit", "vae"):
        stage = getattr(config, name)
        if stage.deployment.num_gpus == 0 or stage.runner not in ("model", "transformers"):
            continue
        width = BYTES_PER_PARAM[stage.dtype]
        if name == "encoder":
            vllm = stage.runner == "model"  # transformers loads the vision tower always, and keeps no KV cache
            params = facts.PUBLISHED_PARAMS["text_encoder"] - (
                facts.VISION_PARAMS if vllm and config.edit is None else 0)
            weights = params * width / GIB
            extra = (stage.kv_cache_memory_bytes / GIB if vllm else 0) + ENCODER_ACTIVATIONS_GIB_21
            detail = f"{weights:.1f} GiB of {stage.dtype} weights, {extra:.1f} GiB of KV cache and work"
        elif name == "dit":
            weights = facts.PUBLISHED_PARAMS["transformer"] * width / GIB
            row, rows = dit_row_tokens(config), dit_rows(config)
            activations = dit_step_tokens(config) * DIT_GIB_PER_TOKEN
            budget = stage.cache_memory_bytes
            caches = (budget if budget is not None else rows * dit_request_cache_bytes(config, width)) / GIB
            extra = activations + caches
            held = "dit.cache_memory_bytes" if budget is not None else f"{rows} rows' caches"
            detail = (f"{weights:.1f} GiB of {stage.dtype} weights, {activations:.1f} GiB for a step of up to {rows} "
                      f"request{'s' if rows != 1 else ''} of {row} tokens at {side}x{side} (scaled from "
                      f"Qwen-Image's), {caches:.1f} GiB of condition caches ({held})")
        else:
            weights = facts.PUBLISHED_PARAMS["vae"] * width / GIB
            pixels = max(side * side, config.edit.image_area if config.edit is not None else 0)
            extra = stage.max_batch_size * VAE_GIB_PER_MEGAPIXEL_21 * pixels / 1e6
            count = stage.max_batch_size
            detail = (f"{weights:.1f} GiB of {stage.dtype} weights, {extra:.1f} GiB to decode {count} "
                      f"image{'s' if count != 1 else ''} at {side}x{side} (scaled from Qwen-Image's)")
        need = weights + extra + CONTEXT_GIB
        out.append(StageMemory(name, round(need, 1), round(stage.deployment.num_gpus * gpu_memory_gib, 1), detail))
    return out


def dit_condition_tokens(config) -> int:
    """The largest condition block a Qwen-Image 2.1 request brings: ``encoder.max_model_len`` tokens (the template,
    prompt and image slots the encoder accepts), an edit's ``edit.max_images`` images at ``edit.image_area`` each
    widened from its vision slots to four latent tokens a slot."""
    images = ()
    if config.edit is not None:
        side = facts.working_size(1, 1, config.edit.image_area)
        images = (side,) * config.edit.max_images
    return facts.condition_tokens(config.encoder.max_model_len, images)


def dit_row_tokens(config) -> int:
    """Tokens one true-CFG row of the largest Qwen-Image 2.1 request pushes through the transformer in its first step
    (its later steps take the condition from its cache): two passes of its image at ``requests.max_side`` squared and
    its condition block."""
    side = config.requests.max_side
    return 2 * (facts.image_tokens(side, side) + dit_condition_tokens(config))


def dit_rows(config) -> int:
    """The largest Qwen-Image 2.1 rows one DiT step may hold: ``max_batch_size``, fewer where ``max_batch_tokens``
    binds (the first row always runs)."""
    dit = config.dit
    if dit.max_batch_tokens is None:
        return dit.max_batch_size
    return max(1, min(dit.max_batch_size, dit.max_batch_tokens // dit_row_tokens(config)))


def dit_step_tokens(config) -> int:
    """Tokens one Qwen-Image 2.1 DiT step may push through the transformer: ``max_batch_size`` of the largest rows,
    or ``max_batch_tokens`` (the first row's, if more) where it binds."""
    dit, row = config.dit, dit_row_tokens(config)
    if dit.max_batch_tokens is None:
        return dit.max_batch_size * row
    return min(dit.max_batch_size * row, max(dit.max_batch_tokens, row))


def dit_request_cache_bytes(config, dtype_bytes: int = 2) -> int:
    """Bytes of the largest Qwen-Image 2.1 request's condition cache: its condition block's keys and values in every
    block, for both CFG branches."""
    return facts.cache_bytes(dit_condition_tokens(config), DIT_LAYERS, DIT_INNER_DIM, dtype_bytes,
                                    branches=2)
