"""What an engine hands out about itself: a snapshot its thread makes after every step (and every command it takes),
as vLLM's engine core ships ``SchedulerStats`` with its outputs. Whoever reads an engine's figures (the stage
deployments' metrics and ``stats`` calls, the DiT's load) reads these, never the core's attributes: the core is
touched only by its own thread."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omni_ray.engine.dit_load import StepFit


@dataclass(frozen=True, slots=True)
class PromptCacheStats:
    """The encoder's prompt-embedding cache."""

    hits: int
    misses: int
    entries: int
    bytes: int


@dataclass(frozen=True, slots=True)
class EncoderStats:
    """The encoder core's figures."""

    encoded: int  # sequences the encoder ran (texts not served from the cache)
    prompt_cache: PromptCacheStats | None  # None when the cache is off
    captioned: int = 0  # Qwen-Image-Layered: captions the captioner wrote (not served from the cache)
    caption_hits: int = 0  # captions served from the caption cache


@dataclass(frozen=True, slots=True)
class ConditionCacheStats:
    """Qwen-Image 2.1's condition caches in the DiT: keys and values of each admitted request's text and
    condition-image tokens in every block, per CFG branch, held from its first step to its end."""

    bytes: int  # held by the admitted requests (unfinished, not aborted)
    budget: int | None  # what they may take together (dit.cache_memory_bytes); None: no bound
    waiting: int  # requests the last step left in the queue because their cache did not fit the room left


@dataclass(frozen=True, slots=True)
class DiTStats:
    """The DiT core's figures."""

    step_fit: StepFit  # how long its steps take for their tokens, learned from the steps it ran
    batch_sizes: dict[int, int]  # requests per step -> steps run with that many (the step-level batching)
    paused: int  # admitted requests the last step did not run
    paused_request_steps: int  # request-steps admitted requests sat out
    warmup_s: float | None  # seconds compiling took at start (dit.compile), None without
    condition_cache: ConditionCacheStats | None = None  # Qwen-Image 2.1's; None when not counted (Qwen-Image)
    offload: dict | None = None  # dit.offload's streamer: blocks kept, peak on the device, fetches; None without


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One engine's snapshot: the driver's counters and its core's own figures (``EncoderStats``, ``DiTStats``;
    None for the VAE's)."""

    steps: int = 0  # steps run
    requests: int = 0  # requests added to the core
    aborted: int = 0  # requests their callers cancelled before they finished
    running: int = 0  # requests added and not yet finished or aborted
    core: EncoderStats | DiTStats | None = field(default=None)
