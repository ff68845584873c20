"""One function per stage: its engine core, built from the preset's stage config."""

from __future__ import annotations

import functools
import logging

import torch

from omni_ray.config import ConfigError, DiTConfig, PipelineConfig, VAEConfig
from omni_ray.engine.caption_cache import CaptionCache
from omni_ray.engine.card import Card, TakingTurns, startup_turn
from omni_ray.engine.condition_cache import ConditionCacheSize
from omni_ray.engine.core import DiTEngineCore, EngineCore, ModelRunner
from omni_ray.engine.dit_policy import FifoPolicy, PriorityPolicy, SchedulingPolicy
from omni_ray.engine.dit_scheduler import DiTScheduler
from omni_ray.engine.dit_split import FixedSplit, PerStepSplit, SplitPolicy
from omni_ray.engine.encoder_core import EncoderEngineCore
from omni_ray.engine.executor import (
    Executor,
    ExecutorFactory,
    GangRunner,
    MultiprocExecutor,
    RunnerFactory,
    gang_backend,
)
from omni_ray.engine.prompt_cache import PromptCache
from omni_ray.engine.vae_scheduler import VaeScheduler
from omni_ray.families import family_of
from omni_ray.runners.offload import DeviceMemory, ParkedWeights
from omni_ray.runners.parallel.mesh import Mesh
from omni_ray.runners.simulated import SimulatedCaptioner, SimulatedDenoiser, SimulatedEncoder, SimulatedVae
from omni_ray.runners.transformers_encoder import TransformersCaptioner, TransformersEncoder
from omni_ray.runners.vision import VisionInputs
from omni_ray.runners.vllm_encoder import VllmEncoder
from omni_ray.tokenizer import CaptionTokenizer, tokenizer_for

logger = logging.getLogger(__name__)


def build_encoder_core(config: PipelineConfig, card: Card | None = None) -> EncoderEngineCore | TakingTurns:
    """vLLM's engine core on the text encoder (with its vision tower for edits), or transformers' Qwen2.5-VL, or the
    simulated encoder, under the encoder's core. vLLM binds threads for its whole process: give it its own.

    ``family: qwen-image-2.1``: Qwen3-VL, prompt and condition images (up to ``edit.max_images``, at their working
    size) in one sequence, the pre-norm states of its last layer; ``Qwen21Tokenizer``'s raw template, system turn
    dropped and image slots marked (``PromptEmbeds.image_slots``).

    ``family: qwen-image-layered``: the encoder also writes captions of images (``CaptionRequest``, up to
    ``encoder.caption_max_tokens`` new tokens): under vLLM a second, generating engine on the same weights, with the
    vision tower loaded for it; through transformers ``generate``; simulated, from the image's hash. They are cached
    by image beside the prompt cache (``CaptionCache``; off with it, ``encoder.cache_bytes: 0``).

    On a shared card (``card``, the preset's ``card.stages`` naming the encoder) its start and each of its batches
    are turns, its weights off the card between them (``engine.card.TakingTurns``)."""
    stage = config.encoder
    card = startup_turn(card_of(config, card, "encoder"), "encoder")
    tokenizer = tokenizer_for(config)
    captions = captions_on(config)
    captioner = None
    if stage.runner == "simulated":
        encoder = SimulatedEncoder(getattr(torch, stage.dtype), stage.max_num_seqs)
        if captions:
            captioner = SimulatedCaptioner(stage.caption_max_tokens)
    elif stage.runner == "transformers":
        encoder = TransformersEncoder(config.model, tokenizer, getattr(torch, stage.dtype), stage.device,
                                      stage.max_num_seqs, dummy=config.weights == "dummy",
                                      model_kind=family_of(config).encoder_model)
        if captions:
            captioner = TransformersCaptioner(encoder.model, VisionInputs(config.model), stage.caption_max_tokens)
    else:
        encoder = VllmEncoder(
            config.model,
            dtype=stage.dtype,
            max_num_seqs=stage.max_num_seqs,
            max_model_len=stage.max_model_len,
            kv_cache_memory_bytes=stage.kv_cache_memory_bytes,
            max_image_pixels=config.edit.max_vision_pixels if config.edit is not None else None,
            max_images=config.edit.max_images if config.edit is not None else 1,
            dummy=config.weights == "dummy",
            gpu_memory_utilization=stage.gpu_memory_utilization,
            model_kind=family_of(config).encoder_model,
            captions=captions,
            caption_max_tokens=stage.caption_max_tokens,
            caption_image_pixels=family_of(config).caption_image_pixels,
            quantization=stage.quantization,
            weights_dir=stage.weights_dir,
        )
        captioner = encoder.captioner
    cache = caption_cache = None
    checkpoint = f"{config.model}:{config.weights}:{stage.runner}"
    if stage.cache_bytes:
        cache = PromptCache(stage.cache_bytes, checkpoint, tokenizer.template.key)
        if captions:
            caption_cache = CaptionCache(checkpoint, stage.caption_max_tokens)
    caption_tokenizer = CaptionTokenizer(config.model) if captions else None
    core = EncoderEngineCore(tokenizer, encoder, stage.max_sequence_length, cache, captioner, caption_tokenizer,
                             caption_cache, stage.max_num_seqs)
    if card is None:
        return core
    modules = device_modules(encoder)
    return TakingTurns(core, card, "encoder", DeviceMemory(modules, stage.device),
                       ParkedWeights(modules, stage.device) if modules else None)


def card_of(config: PipelineConfig, card: Card | None, stage: str) -> Card | None:
    """``card`` if the preset's ``card.stages`` names ``stage``: it takes turns there (``engine.card``)."""
    return card if config.card is not None and stage in config.card.stages else None


def captions_on(config: PipelineConfig) -> bool:
    """Whether the preset's encoder writes captions (its family's: an empty prompt is the image's caption)."""
    return family_of(config).captions


def create_policy(stage: DiTConfig) -> SchedulingPolicy:
    """The policy ``dit.scheduling`` names, with the stage's token budget, pause bound and aging."""
    if stage.scheduling == "fifo":
        return FifoPolicy()
    return PriorityPolicy(stage.max_batch_tokens, stage.max_paused, stage.priority_aging_s)


def create_split(stage: DiTConfig) -> SplitPolicy:
    """How the steps use the gang, as ``dit.parallel.split`` says: over its cfg x sequence ranks."""
    ranks = stage.parallel.cfg * stage.parallel.sequence
    if stage.parallel.split == "per_step":
        return PerStepSplit(ranks)
    return FixedSplit(stage.parallel.split, ranks)


def condition_cache_size(config: PipelineConfig) -> ConditionCacheSize | None:
    """What a request's condition cache takes (Qwen-Image 2.1's; None for Qwen-Image's, which keeps none), from the
    checkpoint's ``transformer/config.json`` in ``dit.dtype``. A checkpoint whose config cannot be had here (a hub id
    neither in the Hugging Face cache nor downloadable) raises ConfigError when ``dit.cache_memory_bytes`` bounds the
    caches (a bound that cannot be counted is not kept silently); without a bound, the DiT runs uncounted (its stats'
    ``condition_cache`` None), with a warning."""
    if not family_of(config).condition_cache:
        return None
    size = ConditionCacheSize.from_checkpoint(config.model, getattr(torch, config.dit.dtype).itemsize,
                                              local=config.is_local)
    if size is not None:
        return size
    where = "directory" if config.is_local else "hub checkpoint (neither in the Hugging Face cache nor downloadable)"
    if config.dit.cache_memory_bytes is not None:
        raise ConfigError(f"dit.cache_memory_bytes: the condition caches cannot be counted without the checkpoint's "
                          f"transformer/config.json, which model: {config.model!r} ({where}) does not have here")
    logger.warning("model %r (%s) has no transformer/config.json here: the DiT's condition caches go uncounted",
                   config.model, where)
    return None


def build_dit_core(config: PipelineConfig, executor_factory: ExecutorFactory | None = None,
                   card: Card | None = None) -> DiTEngineCore | TakingTurns:
    """The DiT's core, its runner on ``dit.parallel``'s ranks (``stage_runner``); for Qwen-Image 2.1, its scheduler
    admits requests within ``dit.cache_memory_bytes`` of condition caches (``condition_cache_size``); on a shared
    card (``card``), its start and each step are turns."""
    stage = config.dit
    card = startup_turn(card_of(config, card, "dit"), "dit")
    scheduler = DiTScheduler(stage.max_batch_size, stage.max_wait_steps, create_policy(stage),
                             split=create_split(stage), cache_bytes=condition_cache_size(config),
                             cache_memory_bytes=stage.cache_memory_bytes)
    runner = stage_runner(stage, functools.partial(build_dit_runner, config), executor_factory)
    core = DiTEngineCore(scheduler, runner)
    if card is None:
        return core  # on a card, it keeps its working memory between its turns: each step needs the same again
    return TakingTurns(core, card, "dit", DeviceMemory(device_modules(runner), stage.device), keeps_work=True)


def stage_runner(stage: DiTConfig | VAEConfig, make_runner: RunnerFactory,
                 executor_factory: ExecutorFactory | None = None) -> ModelRunner:
    """A stage's runner. At world size 1 (``stage.parallel``) built in this process; above it, on every rank of a
    gang through ``executor_factory`` (the Serve deployment hands in its Ray executor; unset, a
    ``MultiprocExecutor`` of processes on this machine), behind a ``GangRunner``."""
    if stage.parallel.world_size == 1:
        return make_runner(None)
    start_gang = executor_factory or functools.partial(local_gang, stage)
    return GangRunner(start_gang(make_runner))


def local_gang(stage: DiTConfig | VAEConfig, make_runner: RunnerFactory) -> Executor:
    """A gang of processes on this machine, one per rank."""
    return MultiprocExecutor(make_runner, stage.parallel, gang_backend(stage.device))


def build_dit_runner(config: PipelineConfig, mesh: Mesh | None = None) -> ModelRunner:
    """One rank's DiT runner (``mesh`` None: the replica's only one), as the preset's family builds it. Picklable
    with its config (``functools.partial``), for a gang's ranks to call. A simulated rank sleeps the whole gang's step
    (``SimulatedDenoiser``'s ranks), so a gang of them steps as the gang would."""
    stage = config.dit
    if stage.runner == "simulated":
        return SimulatedDenoiser(getattr(torch, stage.dtype), ranks=stage.parallel.sequence)
    return family_of(config).build_dit_runner(config, mesh)


def build_vae_core(config: PipelineConfig, executor_factory: ExecutorFactory | None = None,
                   card: Card | None = None) -> EngineCore | TakingTurns:
    """The VAE's core, its runner on ``vae.parallel``'s ranks (``stage_runner``); on a shared card (``card``), its
    start and each call are turns, its decode's memory handed back after each."""
    stage = config.vae
    card = startup_turn(card_of(config, card, "vae"), "vae")
    runner = stage_runner(stage, functools.partial(build_vae_runner, config), executor_factory)
    core = EngineCore(VaeScheduler(stage.max_batch_size), runner)
    if card is None:
        return core
    return TakingTurns(core, card, "vae", DeviceMemory(device_modules(runner), stage.device))


def device_modules(runner) -> list:
    """The modules a runner in this process holds on its device (none for a simulated or a gang's runner)."""
    modules = getattr(runner, "device_modules", None)
    return modules() if modules is not None else []


def build_vae_runner(config: PipelineConfig, mesh: Mesh | None = None) -> ModelRunner:
    """One rank's VAE runner (``mesh`` None: the replica's only one), as the preset's family builds it; picklable
    with its config."""
    stage = config.vae
    if stage.runner == "simulated":
        return SimulatedVae(getattr(torch, stage.dtype))
    return family_of(config).build_vae_runner(config, mesh)
