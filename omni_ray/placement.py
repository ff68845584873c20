"""Whether a GPU preset's stages fit the GPU share each replica reserves, before anything starts.

A preset that declares ``gpu_memory_gib`` (one GPU's memory on the target machines) is checked stage by stage: the
estimated peak memory of one replica must fit ``deployment.num_gpus`` of that GPU. The estimates are Qwen-Image's
full size (the shipped configs' parameter counts) at the stage's dtype, plus what the stage's settings add, with
the per-image activation figures measured on an H100 (benchmarks/results/gpu.json, bf16):

- DiT: 1.2 GiB per request in a step at 1328x1328 with true CFG, linear in pixels, times the requests a step holds
  at the largest size (``dit.max_batch_size``, or fewer where ``dit.max_batch_tokens`` binds);
- VAE: 4.0 GiB per megapixel decoded (7.0 GiB at 1328x1328), times ``vae.max_batch_size``;
- encoder: the language model's weights (and the vision tower's for edits, or always on the transformers runner),
  vLLM's KV cache (``kv_cache_memory_bytes``; none on the transformers runner), and 2 GiB of activations and
  workspace;
- every stage: 1 GiB for the CUDA context and the allocator's slack.

The largest image is ``requests.max_side`` squared. These are estimates, not guarantees: they refuse what cannot
fit and leave what may fit to a run.

A Qwen-Image 2.1 preset (``family: qwen-image-2.1``) is estimated from 2.1's published parameter counts
(``qwen_image21.PUBLISHED_PARAMS``) and figures **scaled from Qwen-Image's measured ones, not measured on 2.1**:

- DiT: the weights; a step's activations at 1.5x Qwen-Image's per token (1.2 GiB over a 1328x1328 true-CFG
  request's 2 x (6,889 + 64) tokens, 90 KiB a token; 2.1's SwiGLU MLP holds three 12,288-wide tensors a token where
  Qwen-Image's GELU MLP holds two, and its width is 4,096 against 3,072), for the tokens a step holds: each row's two
  passes of its image at the largest size and its condition block (``encoder.max_model_len`` tokens, with an edit's
  ``edit.max_images`` images at ``edit.image_area`` widened from one vision slot to four latent tokens each), times
  ``dit.max_batch_size`` rows, or ``dit.max_batch_tokens`` where it binds; and on top, the condition caches'
  budget ``dit.cache_memory_bytes`` (unset: the caches of the rows a step holds, each at the largest condition with
  true CFG: ``qwen_image21.cache_bytes``). A gang is estimated whole on every rank (an upper bound);
- VAE: its weights, and 6.0 GiB per megapixel (Qwen-Image's 4.0 times 1.5: the decoder's full- and half-resolution
  stages are 144 and 288 channels wide against 96 and 192) times ``vae.max_batch_size``, at the larger of the
  largest output and an edit's condition image;
- encoder: Qwen3-VL-8B's weights (the vision tower's for edits, or always on the transformers runner), vLLM's KV cache,
  and 2.3 GiB of activations and workspace (Qwen-Image's 2 GiB times the hidden widths' 4,096 / 3,584).

A DiT gang (``dit.parallel``) is estimated per rank: the weights diffusers' ``_tp_plan`` shards divided by ``tensor``
(the modulation Linears, a third of the model, whole on every rank), float8 bytes for the Linears ``dit.quantization:
fp8`` quantizes, and a step's activations divided over its CFG and sequence ranks (each holds half the passes, or a
chunk of every row's tokens), or, where ``dit.parallel.split`` lets steps run rows, the whole passes a rank then holds
(its share of ``max_batch_tokens``, one pass at least), if more. A VAE gang's rank (``vae.parallel``) is estimated as a
whole decode, an upper bound (it holds one band's activations).

A gang (``dit.parallel`` or ``vae.parallel`` above world size 1) is placed as one Ray placement group per replica,
packed on one node (``STRICT_PACK``): the replica's own bundle, then one per rank (``gang_bundles``). With
``gpus_per_node`` declared, a gang that cannot fit one node is refused here; ``deployments.app`` checks the same
bundles against the cluster's nodes before it deploys.
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_ray import qwen_image21
from omni_ray.qwen_image import (
    FP8_PARAMS,
    GGUF_BYTES,
    NUM_BLOCKS,
    PUBLISHED_PARAMS,
    TENSOR_SHARDED_PARAMS,
    VISION_PARAMS,
    dit_work_tokens,
    image_tokens,
)

GIB = 1 << 30
BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2, "float16": 2}
CONTEXT_GIB = 1.0
DIT_GIB_PER_REQUEST_1328 = 1.2  # measured: peak at b=8 minus b=1, over 7, on an H100 (gpu.json)
VAE_GIB_PER_MEGAPIXEL = 4.0  # measured: 7.0 GiB to decode one 1328x1328 image
ENCODER_ACTIVATIONS_GIB = 2.0
VAE_TILING_SAVES = 3.0  # vae.tiling decodes in bands: about a third of the activations (its field's description)
# Qwen-Image 2.1's, scaled from the measured figures above (the module's docstring says how), not measured.
DIT_GIB_PER_TOKEN_1328 = DIT_GIB_PER_REQUEST_1328 / (2 * (image_tokens(1328, 1328) + 64))  # gpu.json: 64 text tokens
DIT21_GIB_PER_TOKEN = 1.5 * DIT_GIB_PER_TOKEN_1328
DIT21_LAYERS, DIT21_INNER_DIM = 32, 4096  # the published transformer's blocks and width (model_configs/qwen-image-2.1)
VAE21_GIB_PER_MEGAPIXEL = VAE_GIB_PER_MEGAPIXEL * 144 / 96
ENCODER21_ACTIVATIONS_GIB = ENCODER_ACTIVATIONS_GIB * 4096 / 3584


@dataclass(frozen=True)
class StageMemory:
    stage: str
    need_gib: float  # estimated peak of one replica
    share_gib: float  # what its num_gpus reserves of one declared GPU
    detail: str

    @property
    def fits(self) -> bool:
        return self.need_gib <= self.share_gib


def stage_memory(config, gpu_memory_gib: float) -> list[StageMemory]:
    """The estimate for each GPU stage of ``config`` (a PipelineConfig) against its share of one GPU."""
    if config.family == qwen_image21.FAMILY:
        return stage_memory_21(config, gpu_memory_gib)
    side = config.requests.max_side
    pixels = side * side
    out = []
    for name in ("encoder", "dit", "vae"):
        stage = getattr(config, name)
        if stage.deployment.num_gpus == 0 or stage.runner != "model":
            continue
        width = BYTES_PER_PARAM[stage.dtype]
        if name == "encoder":
            vllm = stage.runner == "model"  # transformers loads the vision tower always, and keeps no KV cache
            params = PUBLISHED_PARAMS["text_encoder"] - (VISION_PARAMS if vllm and config.edit is None else 0)
            weights = params * width / GIB
            extra = (stage.kv_cache_memory_bytes / GIB if vllm else 0) + ENCODER_ACTIVATIONS_GIB
            detail = f"{weights:.1f} GiB of {stage.dtype} weights, {extra:.1f} GiB of KV cache and work"
        elif name == "dit":
            parallel = stage.parallel
            if stage.weights_file is not None:
                weights = gguf_bytes(stage.weights_file) / GIB
                kind = "GGUF"
            else:
                weights = dit_weight_bytes(width, parallel.tensor, stage.quantization == "fp8") / GIB
                kind = f"{stage.dtype}{' and float8' if stage.quantization == 'fp8' else ''}"
            streamed = ""
            if stage.offload is not None:  # the kept blocks and the two passing through
                on_card = min(NUM_BLOCKS, max(stage.offload.blocks_on_gpu, 1) + 2)
                streamed = (f" ({on_card} of {NUM_BLOCKS} blocks on the card at once, {weights:.1f} GiB in all, the "
                            "rest streamed from pinned host memory)")
                weights *= on_card / NUM_BLOCKS
            rows = dit_rows_at(config, side)
            extra = rows * DIT_GIB_PER_REQUEST_1328 * pixels / 1328**2 / (parallel.cfg * parallel.sequence)
            if parallel.split != "sequence":  # whole passes, half a true-CFG request's activations each
                extra = max(extra, dit_rank_passes_at(config, side) * DIT_GIB_PER_REQUEST_1328 * pixels / 1328**2 / 2)
            gang = f", per rank of a gang of {parallel.world_size}" if parallel.world_size > 1 else ""
            detail = (f"{weights:.1f} GiB of {kind} weights{streamed}, {extra:.1f} GiB for "
                      f"{rows} request{'s' if rows != 1 else ''} at {side}x{side}{gang}")
        else:
            weights = PUBLISHED_PARAMS["vae"] * width / GIB
            extra = stage.max_batch_size * VAE_GIB_PER_MEGAPIXEL * pixels / 1e6 / (VAE_TILING_SAVES if stage.tiling
                                                                                     else 1)
            detail = (f"{weights:.1f} GiB of {stage.dtype} weights, {extra:.1f} GiB to decode "
                      f"{stage.max_batch_size} images at {side}x{side}{' in bands' if stage.tiling else ''}")
        need = weights + extra + CONTEXT_GIB
        out.append(StageMemory(name, round(need, 1), round(stage.deployment.num_gpus * gpu_memory_gib, 1), detail))
    return out


def stage_memory_21(config, gpu_memory_gib: float) -> list[StageMemory]:
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
            params = qwen_image21.PUBLISHED_PARAMS["text_encoder"] - (
                qwen_image21.VISION_PARAMS if vllm and config.edit is None else 0)
            weights = params * width / GIB
            extra = (stage.kv_cache_memory_bytes / GIB if vllm else 0) + ENCODER21_ACTIVATIONS_GIB
            detail = f"{weights:.1f} GiB of {stage.dtype} weights, {extra:.1f} GiB of KV cache and work"
        elif name == "dit":
            weights = qwen_image21.PUBLISHED_PARAMS["transformer"] * width / GIB
            row, rows = dit21_row_tokens(config), dit21_rows(config)
            activations = dit21_step_tokens(config) * DIT21_GIB_PER_TOKEN
            budget = stage.cache_memory_bytes
            caches = (budget if budget is not None else rows * dit21_request_cache_bytes(config, width)) / GIB
            extra = activations + caches
            held = "dit.cache_memory_bytes" if budget is not None else f"{rows} rows' caches"
            detail = (f"{weights:.1f} GiB of {stage.dtype} weights, {activations:.1f} GiB for a step of up to {rows} "
                      f"request{'s' if rows != 1 else ''} of {row} tokens at {side}x{side} (scaled from "
                      f"Qwen-Image's), {caches:.1f} GiB of condition caches ({held})")
        else:
            weights = qwen_image21.PUBLISHED_PARAMS["vae"] * width / GIB
            pixels = max(side * side, config.edit.image_area if config.edit is not None else 0)
            extra = stage.max_batch_size * VAE21_GIB_PER_MEGAPIXEL * pixels / 1e6
            count = stage.max_batch_size
            detail = (f"{weights:.1f} GiB of {stage.dtype} weights, {extra:.1f} GiB to decode {count} "
                      f"image{'s' if count != 1 else ''} at {side}x{side} (scaled from Qwen-Image's)")
        need = weights + extra + CONTEXT_GIB
        out.append(StageMemory(name, round(need, 1), round(stage.deployment.num_gpus * gpu_memory_gib, 1), detail))
    return out


def dit21_condition_tokens(config) -> int:
    """The largest condition block a Qwen-Image 2.1 request brings: ``encoder.max_model_len`` tokens (the template,
    prompt and image slots the encoder accepts), an edit's ``edit.max_images`` images at ``edit.image_area`` each
    widened from its vision slots to four latent tokens a slot."""
    images = ()
    if config.edit is not None:
        side = qwen_image21.working_size(1, 1, config.edit.image_area)
        images = (side,) * config.edit.max_images
    return qwen_image21.condition_tokens(config.encoder.max_model_len, images)


def dit21_row_tokens(config) -> int:
    """Tokens one true-CFG row of the largest Qwen-Image 2.1 request pushes through the transformer in its first step
    (its later steps take the condition from its cache): two passes of its image at ``requests.max_side`` squared and
    its condition block."""
    side = config.requests.max_side
    return 2 * (qwen_image21.image_tokens(side, side) + dit21_condition_tokens(config))


def dit21_rows(config) -> int:
    """The largest Qwen-Image 2.1 rows one DiT step may hold: ``max_batch_size``, fewer where ``max_batch_tokens``
    binds (the first row always runs)."""
    dit = config.dit
    if dit.max_batch_tokens is None:
        return dit.max_batch_size
    return max(1, min(dit.max_batch_size, dit.max_batch_tokens // dit21_row_tokens(config)))


def dit21_step_tokens(config) -> int:
    """Tokens one Qwen-Image 2.1 DiT step may push through the transformer: ``max_batch_size`` of the largest rows,
    or ``max_batch_tokens`` (the first row's, if more) where it binds."""
    dit, row = config.dit, dit21_row_tokens(config)
    if dit.max_batch_tokens is None:
        return dit.max_batch_size * row
    return min(dit.max_batch_size * row, max(dit.max_batch_tokens, row))


def dit21_request_cache_bytes(config, dtype_bytes: int = 2) -> int:
    """Bytes of the largest Qwen-Image 2.1 request's condition cache: its condition block's keys and values in every
    block, for both CFG branches."""
    return qwen_image21.cache_bytes(dit21_condition_tokens(config), DIT21_LAYERS, DIT21_INNER_DIM, dtype_bytes,
                                    branches=2)


def gguf_bytes(weights_file: str) -> float:
    """The bytes of ``dit.weights_file``: the published file's for the quant type its name carries, else the file's
    own size; ValueError naming the field when neither can be had."""
    import pathlib
    import re

    name = pathlib.Path(weights_file).name.upper()
    for kind in sorted(GGUF_BYTES, key=len, reverse=True):
        if re.search(rf"(^|[^A-Z0-9]){kind}([^A-Z0-9]|$)", name):
            return GGUF_BYTES[kind]
    path = pathlib.Path(weights_file).expanduser()
    if path.is_file():
        return float(path.stat().st_size)
    raise ValueError(f"dit.weights_file: {weights_file} is not here and its name carries no published quant type "
                     f"({', '.join(GGUF_BYTES)}): the placement check cannot tell its size")


def dit_weight_bytes(width: int, tensor: int = 1, fp8: bool = False) -> float:
    """The bytes of Qwen-Image's transformer on one rank: the Linears ``_tp_plan`` shards, 1/``tensor`` of them
    (float8 for those fp8 quantizes), and the rest whole."""
    whole = PUBLISHED_PARAMS["transformer"] - TENSOR_SHARDED_PARAMS
    quantized = FP8_PARAMS if fp8 else 0
    return whole * width + ((TENSOR_SHARDED_PARAMS - quantized) * width + quantized) / tensor


def dit_rows_at(config, side: int) -> int:
    """Requests of ``side`` x ``side`` with true CFG one DiT step may hold: ``max_batch_size``, fewer where
    ``max_batch_tokens`` binds (the first row always runs)."""
    dit = config.dit
    if dit.max_batch_tokens is None:
        return dit.max_batch_size
    tokens = dit_work_tokens(side, side, config.encoder.max_sequence_length, true_cfg=True)
    return max(1, min(dit.max_batch_size, dit.max_batch_tokens // tokens))


def dit_rank_passes_at(config, side: int) -> int:
    """Passes of ``side`` x ``side`` one rank of a gang holds in a step that runs rows whole: its share of
    ``max_batch_tokens`` (one pass at least), or its share of ``max_batch_size`` rows' passes."""
    dit = config.dit
    ranks = dit.parallel.cfg * dit.parallel.sequence
    if dit.max_batch_tokens is None:
        return -(-2 * dit.max_batch_size // ranks)
    pass_tokens = dit_work_tokens(side, side, config.encoder.max_sequence_length, true_cfg=True) // 2
    return max(1, min(-(-2 * dit.max_batch_size // ranks), dit.max_batch_tokens // ranks // pass_tokens))


def check_placement(config) -> None:
    """Raises ValueError naming the field when a stage cannot fit its GPU share (with ``gpu_memory_gib`` set), or
    when a vLLM encoder on part of a GPU would claim more of it than its share."""
    encoder = config.encoder
    if (encoder.runner == "model" and encoder.device.startswith("cuda")
            and encoder.gpu_memory_utilization > encoder.deployment.num_gpus):
        raise ValueError(
            f"encoder.gpu_memory_utilization ({encoder.gpu_memory_utilization}) exceeds the encoder's share of its "
            f"GPU (encoder.deployment.num_gpus: {encoder.deployment.num_gpus}): vLLM would claim memory the stages "
            "sharing the GPU hold"
        )
    check_gang(config)
    if config.gpu_memory_gib is None:
        return
    for estimate in stage_memory(config, config.gpu_memory_gib):
        if not estimate.fits:
            raise ValueError(
                f"{estimate.stage}.deployment.num_gpus: the {estimate.stage} needs about {estimate.need_gib} GiB "
                f"({estimate.detail}), more than its {estimate.share_gib} GiB share of a {config.gpu_memory_gib} "
                "GiB GPU (gpu_memory_gib)"
            )


GANG_STAGES = ("dit", "vae")  # the stages whose replicas may be gangs (their config's ``parallel``)


def gang_bundles(stage) -> list[dict[str, float]]:
    """The placement group of one replica with a gang (``stage``: a DiTConfig or VAEConfig): the replica's own
    bundle (its CPUs and custom resources, no GPU), then one per rank (``parallel.rank_num_cpus`` CPUs and
    ``deployment.num_gpus`` GPUs)."""
    deployment = stage.deployment
    replica = {"CPU": deployment.num_cpus, **deployment.resources}
    rank = {"CPU": stage.parallel.rank_num_cpus, "GPU": deployment.num_gpus}
    return [_nonzero(replica)] + [_nonzero(rank) for _ in range(stage.parallel.world_size)]


def _nonzero(bundle: dict[str, float]) -> dict[str, float]:
    return {name: amount for name, amount in bundle.items() if amount > 0}


def largest_shortfall(bundles: list[dict[str, float]], nodes: list[dict[str, float]]) -> dict[str, float] | None:
    """None when some node's resources hold every bundle together (``STRICT_PACK``); otherwise what the bundles
    need in all, for the message."""
    need: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            need[name] = need.get(name, 0.0) + amount
    if any(all(node.get(name, 0.0) >= amount for name, amount in need.items()) for node in nodes):
        return None
    return need


def check_gang(config) -> None:
    """Raises ValueError naming the field when a stage's gang (``dit.parallel`` or ``vae.parallel`` above world size
    1) cannot be placed: the replica's bundle would be empty, ranks on CUDA would share a GPU (NCCL needs one each:
    more than half of one, the rest left to other stages, or whole GPUs), or the gang needs more GPUs than
    ``gpus_per_node``."""
    for name in GANG_STAGES:
        stage = getattr(config, name)
        world = stage.parallel.world_size
        if world == 1:
            continue
        if stage.deployment.num_cpus == 0 and not stage.deployment.resources:
            raise ValueError(f"{name}.deployment.num_cpus: a replica with a gang ({name}.parallel) takes a bundle of "
                             "its own in its placement group, which needs a CPU share (> 0)")
        gpus = stage.deployment.num_gpus
        if stage.device.startswith("cuda") and not (0.5 < gpus <= 1 or gpus == int(gpus)):
            raise ValueError(f"{name}.deployment.num_gpus ({gpus}): each rank of a gang ({name}.parallel) needs a GPU "
                             "of its own (NCCL runs one rank per GPU): more than half of one, or whole GPUs")
        if config.gpus_per_node is not None and world * max(gpus, 1) > config.gpus_per_node:
            raise ValueError(
                f"{name}.parallel: a gang of {world} ranks with {gpus:g} GPU(s) each ({name}.deployment.num_gpus) "
                f"needs {world * max(gpus, 1):g} GPUs on one node, more than gpus_per_node ({config.gpus_per_node})"
            )
