"""Whether a GPU preset's stages fit the GPU share each replica reserves, before anything starts.

A preset that declares ``gpu_memory_gib`` (one GPU's memory on the target machines) is checked stage by stage: the
estimated peak memory of one replica must fit ``deployment.num_gpus`` of that GPU. The estimates are Qwen-Image's
full size (the shipped configs' parameter counts) at the stage's dtype, plus what the stage's settings add, with
the per-image activation figures measured on an H100 (benchmarks/results/gpu.json, bf16):

- DiT: 1.2 GiB per request in a step at 1328x1328 with true CFG, linear in pixels, times the requests a step holds
  at the largest size (``dit.max_batch_size``, or fewer where ``dit.max_batch_tokens`` binds);
- VAE: 4.0 GiB per megapixel decoded (7.0 GiB at 1328x1328), times ``vae.max_batch_size``; a third of it in bands
  (``vae.tiling``; with ``auto``, a call past what fits untiled, ``vae_untiled_pixels``);
- encoder: the language model's weights (and the vision tower's for edits, or always on the transformers runner; an
  AWQ or GPTQ text encoder's decoder-layer Linears at their quantized bytes, when its config.json is at hand: a local
  checkpoint or the Hugging Face cache), vLLM's KV cache (``kv_cache_memory_bytes``; none on the transformers
  runner), and 2 GiB of activations and workspace;
- every stage: 1 GiB for the CUDA context and the allocator's slack.

The largest image is ``requests.max_side`` squared. These are estimates, not guarantees: they refuse what cannot
fit and leave what may fit to a run.

A family with other sizes estimates its own (``Family.stage_memory``: Qwen-Image 2.1's is
omni_ray/families/qwen_image_2_1/placement.py).

Stages sharing one card (``card.stages``, omni_ray/engine/card.py) take turns on it: the card must hold what each
keeps between its turns (the DiT all of its estimate, the VAE its weights, the encoder its CUDA context and vLLM's KV
cache) and the largest turn on top (the encoder's weights and work, or the VAE's decode), not every stage's peak at
once.

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

from omni_ray.families import family_of
from omni_ray.families.qwen_image.facts import (
    BLOCK_LINEAR_PARAMS,
    FP8_PARAMS,
    GGUF_BYTES,
    NUM_BLOCKS,
    PUBLISHED_PARAMS,
    QUANTIZABLE_PARAMS,
    TENSOR_SHARDED_PARAMS,
    VISION_PARAMS,
    dit_work_tokens,
    image_tokens,
)

GIB = 1 << 30
BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2, "float16": 2}
# The DiT's block Linears' bytes a weight under dit.quantization int8 (a scale a row: nothing to speak of) and int4 (a
# bf16 scale and zero point a group of 128, runners.quantization.INT4_GROUP).
QUANTIZED_BYTES = {"int8": 1.0, "int4": 0.5 + 4 / 128}
CONTEXT_GIB = 1.0
DIT_GIB_PER_REQUEST_1328 = 1.2  # measured: peak at b=8 minus b=1, over 7, on an H100 (gpu.json)
VAE_GIB_PER_MEGAPIXEL = 4.0  # measured: 7.0 GiB to decode one 1328x1328 image
ENCODER_ACTIVATIONS_GIB = 2.0
VAE_TILING_SAVES = 3.0  # vae.tiling decodes in bands: about a third of the activations (its field's description)
# A request's activations per token (gpu.json's 1328x1328 true-CFG request, 64 text tokens): what other families'
# estimates scale from.
DIT_GIB_PER_TOKEN_1328 = DIT_GIB_PER_REQUEST_1328 / (2 * (image_tokens(1328, 1328) + 64))


@dataclass(frozen=True)
class StageMemory:
    stage: str
    need_gib: float  # estimated peak of one replica
    share_gib: float  # what its num_gpus reserves of one declared GPU
    detail: str
    turn_gib: float = 0.0  # of need_gib, what it holds only in its turns on a shared card (engine.card)

    @property
    def fits(self) -> bool:
        return self.need_gib <= self.share_gib


def stage_memory(config, gpu_memory_gib: float) -> list[StageMemory]:
    """The estimate for each GPU stage of ``config`` (a PipelineConfig) against its share of one GPU, as its family
    makes it."""
    return family_of(config).stage_memory(config, gpu_memory_gib)


def qwen_image_stage_memory(config, gpu_memory_gib: float) -> list[StageMemory]:
    """The estimate of a preset of Qwen-Image's architecture (Qwen-Image, its Edit releases, Layered): the module's
    docstring says how each is made."""
    side = config.requests.max_side
    pixels = side * side
    out = []
    for name in ("encoder", "dit", "vae"):
        stage = getattr(config, name)
        if stage.deployment.num_gpus == 0 or stage.runner == "simulated":
            continue
        width = BYTES_PER_PARAM[stage.dtype]
        turn = 0.0
        if name == "encoder":
            vllm = stage.runner == "model"  # transformers loads the vision tower always, and keeps no KV cache
            params = PUBLISHED_PARAMS["text_encoder"] - (VISION_PARAMS if vllm and config.edit is None else 0)
            quantization = (declared_quantization(stage.quantization) or encoder_quantization(config.model)
                            if vllm else None)
            weights, kind = encoder_weights(params, stage.dtype, quantization)
            weights /= GIB
            extra = (stage.kv_cache_memory_bytes / GIB if vllm else 0) + ENCODER_ACTIVATIONS_GIB
            detail = f"{weights:.1f} GiB of {kind} weights, {extra:.1f} GiB of KV cache and work"
            turn = weights + ENCODER_ACTIVATIONS_GIB  # on a shared card, its weights come for its turns only
        elif name == "dit":
            parallel = stage.parallel
            if stage.weights_file is not None:
                weights = gguf_bytes(stage.weights_file) / GIB
                kind = "GGUF"
            else:
                weights = dit_weight_bytes(width, parallel.tensor, stage.quantization == "fp8") / GIB
                kind = f"{stage.dtype}{' and float8' if stage.quantization == 'fp8' else ''}"
                if stage.quantization in QUANTIZED_BYTES:  # the blocks' Linears at their bytes a weight
                    per_weight = QUANTIZED_BYTES[stage.quantization]
                    weights = ((PUBLISHED_PARAMS["transformer"] - BLOCK_LINEAR_PARAMS) * width
                               + BLOCK_LINEAR_PARAMS * per_weight) / GIB
                    kind = f"{stage.quantization} and {stage.dtype}"
            streamed = ""
            if stage.offload is not None:  # the kept blocks and the two passing through
                on_card = min(NUM_BLOCKS, max(kept_blocks(config, gpu_memory_gib), 1) + 2)
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
            untiled = stage.max_batch_size * VAE_GIB_PER_MEGAPIXEL * pixels / 1e6
            banded = stage.tiling is True or (stage.tiling == "auto" and stage.max_batch_size * pixels > (
                vae_untiled_pixels(config, gpu_memory_gib)))
            extra = untiled / VAE_TILING_SAVES if banded else untiled
            detail = (f"{weights:.1f} GiB of {stage.dtype} weights, {extra:.1f} GiB to decode "
                      f"{stage.max_batch_size} images at {side}x{side}{' in bands' if banded else ''}")
            turn = extra  # on a shared card, its decode's memory goes back after each turn
        need = weights + extra + CONTEXT_GIB
        out.append(StageMemory(name, round(need, 1), round(stage.deployment.num_gpus * gpu_memory_gib, 1), detail,
                               round(turn, 1)))
    return out


def encoder_quantization(model: str) -> dict | None:
    """The AWQ or GPTQ ``quantization_config`` of ``model``'s text encoder when its config.json can be read here
    without a download (a local checkpoint, or one in the Hugging Face cache); None otherwise, which counts the
    encoder at full precision, the larger."""
    import pathlib

    from omni_ray.checkpoints.awq import read_quantization

    folder = pathlib.Path(model).expanduser() / "text_encoder"
    if not (folder / "config.json").is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model, "text_encoder/config.json")
        except ValueError:  # not a hub id either
            return None
        if not isinstance(cached, str):
            return None
        folder = pathlib.Path(cached).parent
    quantization = read_quantization(folder)
    return quantization if quantization and quantization.get("quant_method") in ("awq", "gptq") else None


def declared_quantization(method: str) -> dict | None:
    """``encoder.quantization``'s weights as the published checkpoints store them (4 bits, groups of 128)."""
    if method == "none":
        return None
    return {"quant_method": method, "bits": 4, "group_size": 128}


def encoder_weights(params: int, dtype: str, quantization: dict | None) -> tuple[float, str]:
    """Bytes of ``params`` of the text encoder's weights, and what they are in words: at ``dtype``, but for the
    decoder layers' Linears at what ``quantization`` stores (4-bit AWQ in groups of 128: 0.52 bytes a weight; with the
    vision tower, the 6.9 GB of ``Qwen/Qwen2.5-VL-7B-Instruct-AWQ``)."""
    if quantization is None:
        return params * BYTES_PER_PARAM[dtype], dtype
    from omni_ray.checkpoints.awq import bytes_per_weight

    quantized = QUANTIZABLE_PARAMS * bytes_per_weight(quantization)
    kind = f"{quantization['bits']}-bit {quantization['quant_method'].upper()} and {dtype}"
    return quantized + (params - QUANTIZABLE_PARAMS) * BYTES_PER_PARAM[dtype], kind


def kept_blocks(config, gpu_memory_gib: float | None) -> int:
    """``dit.offload.blocks_on_gpu``, or for ``auto`` the most blocks that fit: the DiT's estimate within its share
    of a ``gpu_memory_gib`` GPU, or on a shared card (``card.stages``) the card's need within the card (at least the
    one block always kept, which the check then refuses if even that does not fit)."""
    blocks = config.dit.offload.blocks_on_gpu
    if blocks != "auto":
        return blocks
    for kept in range(NUM_BLOCKS, 1, -1):
        offload = config.dit.offload.model_copy(update={"blocks_on_gpu": kept})
        trial = config.model_copy(update={"dit": config.dit.model_copy(update={"offload": offload})})
        estimates = stage_memory(trial, gpu_memory_gib)
        if config.card is not None and "dit" in config.card.stages:
            fits = card_need_gib([e for e in estimates if e.stage in config.card.stages])[0] <= gpu_memory_gib
        else:
            fits = next(e for e in estimates if e.stage == "dit").fits
        if fits:
            return kept
    return 1


def vae_untiled_pixels(config, gpu_memory_gib: float | None) -> int:
    """``vae.tiling: auto``: the pixels of a call (its images together) above which it runs in bands, as
    ``vae.tile_above_pixels`` sets it, or as many as fit the VAE's share of a GPU untiled beside its weights and
    context (at least one 256x256 image)."""
    stage = config.vae
    if stage.tile_above_pixels is not None:
        return stage.tile_above_pixels
    free_gib = (stage.deployment.num_gpus * gpu_memory_gib - PUBLISHED_PARAMS["vae"] * BYTES_PER_PARAM[stage.dtype]
                / GIB - CONTEXT_GIB)
    return max(int(free_gib / VAE_GIB_PER_MEGAPIXEL * 1e6), 256 * 256)


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
    estimates = stage_memory(config, config.gpu_memory_gib)
    on_card = [e for e in estimates if config.card is not None and e.stage in config.card.stages]
    if on_card:
        check_card(config, on_card)
    for estimate in estimates:
        if estimate in on_card:
            continue
        if not estimate.fits:
            raise ValueError(
                f"{estimate.stage}.deployment.num_gpus: the {estimate.stage} needs about {estimate.need_gib} GiB "
                f"({estimate.detail}), more than its {estimate.share_gib} GiB share of a {config.gpu_memory_gib} "
                "GiB GPU (gpu_memory_gib)"
            )


def card_need_gib(on_card: list[StageMemory]) -> tuple[float, StageMemory]:
    """The most a shared card holds (engine.card): every stage's resident memory, plus the largest turn; and the
    stage whose turn that is."""
    largest = max(on_card, key=lambda e: e.turn_gib)
    return round(sum(e.need_gib - e.turn_gib for e in on_card) + largest.turn_gib, 1), largest


def check_card(config, on_card: list[StageMemory]) -> None:
    """The stages sharing the card fit it taking turns (``card_need_gib``); a vLLM encoder among them, which refuses
    to start unless ``gpu_memory_utilization`` of the card is free, asks no more than the others leave it."""
    gpu_memory_gib = config.gpu_memory_gib
    need, largest = card_need_gib(on_card)
    if need > gpu_memory_gib:
        held = ", ".join(f"{e.stage} {e.need_gib - e.turn_gib:.1f}" for e in on_card)
        raise ValueError(f"card.stages: the stages sharing the card need about {need} GiB, more than the "
                         f"{gpu_memory_gib} GiB card (gpu_memory_gib): they hold {held} GiB between turns, and the "
                         f"{largest.stage}'s turn {largest.turn_gib:.1f} GiB more ({largest.detail})")
    encoder = config.encoder
    if any(e.stage == "encoder" for e in on_card) and encoder.runner == "model":
        free = gpu_memory_gib - sum(e.need_gib - e.turn_gib for e in on_card if e.stage != "encoder")
        if encoder.gpu_memory_utilization * gpu_memory_gib > free:
            raise ValueError(
                f"encoder.gpu_memory_utilization: vLLM starts only with {encoder.gpu_memory_utilization} of the "
                f"card ({encoder.gpu_memory_utilization * gpu_memory_gib:.1f} GiB) free, but the stages sharing it "
                f"hold about {gpu_memory_gib - free:.1f} GiB between turns, leaving {free:.1f}")


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
