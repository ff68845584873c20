"""The records that cross layers: what a stage takes and returns, what its scheduler hands its runner, and what its
engine streams back. The request path, the engines, the runners and the Serve layer all read them; none of them
owns them (as vLLM keeps ``SchedulerOutput`` and ``ModelRunnerOutput`` apart from the code that makes them).

Inside a process they are slotted dataclasses; what crosses a Ray boundary holds CPU, contiguous tensors, numpy
arrays or plain values. torch is named for typing only, so the request path imports this module without it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Generic, Literal, NamedTuple, TypeVar

from omni_ray.config import CacheSettings
from omni_ray.families.qwen_image.facts import dit_work_tokens, inpaint_start

if TYPE_CHECKING:
    import numpy as np
    import torch

    from omni_ray.errors import EngineError

OutputMode = Literal["pixels", "latents", "both"]  # what the VAE stage hands back for a request
LoraKey = tuple[str, str]  # (name, path): a name loaded again from another file is another adapter


@dataclass(frozen=True, slots=True)
class LoraRef:
    """A request's LoRA adapter: its name, where its file is, and the request's scale (diffusers' adapter weight)."""

    name: str
    path: str
    scale: float = 1.0

    @property
    def key(self) -> LoraKey:
        return (self.name, self.path)


def stack_id(loras: tuple[LoraRef, ...]) -> str:
    """A stack of adapters as Serve's multiplexed model id: "" for none, the adapter's name for one, the names
    joined by ',' (which no adapter name holds) for more (``deployments.routing`` prefers replicas holding most)."""
    return ",".join(lora.name for lora in loras)


@dataclass(frozen=True, slots=True)
class InputImages:
    """An edit's input images, decoded and resized once by the API: what the VAE encodes (each at its working size,
    sides multiples of 32) and what the encoder reads (the same arrays for Qwen-Image-Edit, Edit-Plus's smaller
    condition images otherwise). uint8 ``[H, W, 3]`` each, in the request's order."""

    vae: tuple[np.ndarray, ...]
    encoder: tuple[np.ndarray, ...]
    mask: np.ndarray | None = None  # a masked edit's mask on the output's latent grid (uint8 [H/8, W/8], 1 repaints):
    # the DiT starts from vae[0], noised, and keeps it where the mask is 0
    conditions: bool = True  # the DiT attends over the vae images (edits); False: text-to-image inpainting, where
    # vae[0] (at the output size) is only where denoising starts

    @classmethod
    def of(cls, image: np.ndarray | InputImages) -> InputImages:
        """``image`` as the inputs: one Qwen-Image-Edit image at its working size stands for both."""
        return image if isinstance(image, InputImages) else cls((image,), (image,))

    @property
    def sizes(self) -> tuple[tuple[int, int], ...]:
        """(height, width) of each image as the VAE and the DiT take it."""
        return tuple(image.shape[:2] for image in self.vae)

    @property
    def condition_sizes(self) -> tuple[tuple[int, int], ...]:
        """(height, width) of each image the DiT attends over."""
        return self.sizes if self.conditions else ()


@dataclass(frozen=True, slots=True)
class Inpaint:
    """What a masked edit asks of the DiT, as diffusers' inpaint pipelines run it: start ``qwen_image.inpaint_start``
    steps into the schedule from the start image's latents noised to that level, and after every step put back the
    start image (noised to the next level) where ``mask`` is 0."""

    mask: np.ndarray  # uint8 [H/8, W/8], the output's latent grid: 1 repaints, 0 keeps
    strength: float


@dataclass(frozen=True, slots=True)
class Control:
    """One ControlNet a request applies (diffusers' ``QwenImageControlNetPipeline``): the preset's controlnet
    ``name``, its residuals' ``scale`` (``controlnet_conditioning_scale``), and the share of the steps it acts on
    (``control_guidance_start`` to ``control_guidance_end``). Its control image's latents travel beside it in
    ``DenoiseRequest.controls``. ``mask``: an inpainting ControlNet (``QwenImageControlNetInpaintPipeline``), whose
    control latents carry the control mask as a 17th channel (68 packed) and whose sample is drawn apart from the
    noise's generator (``ImageEncodeRequest.mask``)."""

    name: str
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0
    mask: bool = False


# --- encoder -------------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class PromptEmbeds:
    """One prompt's embeddings, as they travel to the DiT stage (CPU, contiguous)."""

    embeds: torch.Tensor  # [num_tokens, hidden]
    image_slots: torch.Tensor | None = None  # Qwen-Image 2.1: bool [num_tokens], True at the condition images'
    # vision tokens (<|image_pad|>), each of which the DiT widens to the 2x2 latent tokens of its tile

    @property
    def num_tokens(self) -> int:
        return self.embeds.shape[0]


@dataclass(slots=True)
class EncodeRequest:
    """A request as the encoder engine receives it."""

    timing: ClassVar[str] = "encoder"  # its stage's name in a result's timings
    request_id: str
    prompt: str
    negative_prompt: str | None = None  # given only when the request runs true CFG
    images: tuple[np.ndarray, ...] = ()  # edits: the input images as the encoder reads them, uint8 [H, W, 3] each
    # (Qwen-Image 2.1: [H, W, 3] or RGBA [H, W, 4], at their working size; the encoder reads alpha over white)
    priority: int = 0  # the request's (DenoiseParams.priority): lower runs first, in the encoder's queue too
    tenant: str = ""  # whose share of the encoder it spends (DenoiseParams.tenant)


@dataclass(slots=True)
class CaptionRequest:
    """Qwen-Image-Layered's caption of its input image, for a request without a prompt: the encoder generates it
    greedily (``qwen_image_layered.CAPTION_TEMPLATES[language]``, up to the preset's bound of new tokens)."""

    timing: ClassVar[str] = "caption"
    request_id: str
    image: np.ndarray | None  # uint8 [H, W, 4] (or [H, W, 3]) at its working size, as the pipeline hands it to
    # Qwen2.5-VL's processor (which drops alpha: ``convert("RGB")``); None while it travels apart (``Stages.caption``)
    language: Literal["en", "zh"] = "en"
    priority: int = 0  # as EncodeRequest's
    tenant: str = ""


@dataclass(slots=True)
class Caption:
    """The caption's text (special tokens skipped, stripped, as the pipeline decodes it), the tokens generated, and
    whether it came from the encoder's cache (an image captioned before, by its bytes)."""

    text: str
    token_ids: tuple[int, ...]
    cached: bool = False
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds (the engine's result contract)


@dataclass(slots=True)
class EncodedPrompt:
    """The encoder's result for one request; travels to the DiT stage."""

    prompt: PromptEmbeds
    negative: PromptEmbeds | None
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds this request spent there


# --- DiT -----------------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class DenoiseParams:
    """What one image asks of the DiT. ``true_cfg`` is the planner's decision (diffusers' rule,
    ``qwen_image.uses_true_cfg``); the DiT reads it and never decides again."""

    height: int
    width: int
    num_inference_steps: int
    seed: int
    true_cfg_scale: float = 1.0
    cache: CacheSettings | None = None  # DiT cache acceleration; never splits a batch
    loras: tuple[LoraRef, ...] = ()  # LoRA adapters resident in the runner, each at its scale, their updates
    # summed (a stack; one for `model`'s adapter); never split a batch either
    previews: tuple[int, ...] = ()  # steps after which to hand back the clean image the step predicts
    true_cfg: bool = False  # runs the unconditional pass beside the conditional one
    priority: int = 0  # lower runs first; the DiT pauses lower-priority requests at a step boundary for it
    tenant: str = ""  # who sent it (an API key's name, or OpenAI's `user`): the DiT shares steps fairly between them
    scheduler: tuple[tuple[str, object], ...] = ()  # scheduler settings over the checkpoint's (an adapter's recipe):
    # the request's own sigmas; never splits a batch
    inpaint: Inpaint | None = None  # a masked edit: its mask and strength; never splits a batch
    controls: tuple[Control, ...] = ()  # ControlNets in the request's order; never split a batch
    sigmas: tuple[float, ...] | None = None  # Qwen-Image 2.1: the sigmas to sample with (the checkpoint's
    # sample_sigmas, num_inference_steps of them); None: evenly spaced from 1, as diffusers' pipelines
    layers: int = 0  # Qwen-Image-Layered: the RGBA layers the input image is decomposed into (the DiT denoises
    # layers + 1 frames, the composite first); 0 for every other model
    cfg_normalize: bool = True  # true CFG rescales the guided prediction to the conditional one's norm (Qwen-Image's
    # pipelines always; Layered's ``cfg_normalize``, off by default)

    def __post_init__(self) -> None:
        if any(not self.first_step < step < self.num_inference_steps for step in self.previews):
            raise ValueError(f"previews: steps within {self.first_step + 1}..{self.num_inference_steps - 1} (the last "
                             "step's image is the result)")

    @property
    def first_step(self) -> int:
        """The step of the schedule denoising starts at: 0, or a masked edit's (``qwen_image.inpaint_start``)."""
        return inpaint_start(self.num_inference_steps, self.inpaint.strength) if self.inpaint is not None else 0

    @property
    def steps_run(self) -> int:
        """Denoising steps the image runs (what its progress counts)."""
        return self.num_inference_steps - self.first_step


class BatchKey(NamedTuple):
    """What requests must share to share a forward pass: size, CFG mode and an edit's input image sizes (the cache,
    the adapter, the scheduler settings and a mask never split a batch). The engine's requests and the runner's
    states both take theirs from ``of``."""

    height: int
    width: int
    true_cfg: bool
    image_sizes: tuple[tuple[int, int], ...]  # (height, width) of each input image, none for text to image
    layers: int = 0  # Qwen-Image-Layered's layer count (its frames: layers + 1)

    @classmethod
    def of(cls, params: DenoiseParams, image_sizes: tuple[tuple[int, int], ...]) -> BatchKey:
        return cls(params.height, params.width, params.true_cfg, image_sizes, params.layers)


@dataclass(slots=True)
class DenoiseRequest:
    """A request as the DiT engine receives it: the prompt's embeddings (and the negative's, for true CFG), and for
    an edit its input images' latents, in order."""

    timing: ClassVar[str] = "dit"
    request_id: str
    params: DenoiseParams
    prompt: PromptEmbeds
    negative: PromptEmbeds | None = None
    images: tuple[Latents, ...] = ()
    start: Latents | None = None  # a masked edit's start image's latents, sampled with the request's seed
    controls: tuple[Latents, ...] = ()  # params.controls' control images' latents, in order: each a sample drawn
    # with the image's seed, the k-th control's after k others, as diffusers' controlnet pipelines draw them before
    # the noise

    def __post_init__(self) -> None:
        if self.params.true_cfg and self.negative is None:
            raise ValueError(f"request {self.request_id}: true CFG needs the negative prompt's embeddings")
        if (self.params.inpaint is None) != (self.start is None):
            raise ValueError(f"request {self.request_id}: a masked edit needs its mask and its start image's latents")
        if len(self.controls) != len(self.params.controls):
            raise ValueError(f"request {self.request_id}: {len(self.params.controls)} ControlNet(s) but "
                             f"{len(self.controls)} control image latents")

    @property
    def batch_key(self) -> BatchKey:
        return BatchKey.of(self.params, self.image_sizes)

    @property
    def image_sizes(self) -> tuple[tuple[int, int], ...]:
        """(height, width) of each input image (none for text to image)."""
        return tuple((image.height, image.width) for image in self.images)

    @property
    def work_tokens(self) -> int:
        """Tokens each of its steps pushes through the transformer (``qwen_image.dit_work_tokens``)."""
        texts = [self.prompt] + ([self.negative] if self.params.true_cfg else [])
        return dit_work_tokens(self.params.height, self.params.width, max(t.num_tokens for t in texts),
                               self.params.true_cfg, self.image_sizes, self.params.layers)


@dataclass(slots=True)
class DenoiseBatch:
    """One engine step's work for the runner (the DiT scheduler's output)."""

    new_requests: list[DenoiseRequest]  # admitted this step: the runner draws their noise and schedule
    request_ids: list[str]  # every request stepped this step (new ones included); one batch key
    freed_ids: list[str]  # requests that left since the last step (aborted): the runner drops their state
    # sequence: every row's tokens split over the gang's sequence ranks; rows: the rows spread over them, each run whole
    split: Literal["sequence", "rows"] = "sequence"


@dataclass(slots=True)
class DenoiseOutput:
    """What one engine step produced (the runner's output)."""

    finished: dict[str, Latents] = field(default_factory=dict)  # request id -> final latents
    errors: dict[str, EngineError] = field(default_factory=dict)  # request id -> why, for requests that failed alone
    progress: dict[str, tuple[int, int]] = field(default_factory=dict)  # request id -> (steps done, total steps)
    previews: dict[str, Latents] = field(default_factory=dict)  # request id -> the clean latents its step predicted


@dataclass(slots=True)
class Latents:
    """Packed latents, as they travel from the DiT (or an edit's image encode) to the VAE (CPU, contiguous)."""

    latents: torch.Tensor  # [image_tokens, 64]: 2x2-packed 16-channel latents (Qwen-Image 2.1: its 64 channels
    # unpatched, one token per 16x16 pixels, row-major)
    height: int
    width: int
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds, the stages so far
    layers: int = 0  # Qwen-Image-Layered's: ``latents`` holds layers + 1 frames one after another, the composite
    # first (which the VAE drops), each [image_tokens, 64]; 0: one image
    dit_passes: dict[str, int] = field(default_factory=dict)  # "computed"/"reused" -> transformer passes (true CFG
    # runs two per step, each decided apart)


def upstream_timings(*results: EncodedPrompt | Latents) -> dict[str, float]:
    """The timings a stage call's inputs bring (each stage before it, in seconds), for the result it makes: where
    several inputs come from one stage run side by side (an edit's image encodes), the longest."""
    timings: dict[str, float] = {}
    for result in results:
        for stage, seconds in result.timings.items():
            timings[stage] = max(seconds, timings.get(stage, 0.0))
    return timings


# --- the API's accounting ----------------------------------------------------------------------------------------


class TokenCount(NamedTuple):
    """Tokens the text encoder reads for one templated prompt: its text, and an edit's input images' vision tokens."""

    text: int
    image: int = 0

    @property
    def total(self) -> int:
        return self.text + self.image

    def __add__(self, other: TokenCount) -> TokenCount:  # type: ignore[override]
        return TokenCount(self.text + other.text, self.image + other.image)


# --- VAE -----------------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class DecodeRequest:
    """Latents to decode, as the VAE engine receives them."""

    timing: ClassVar[str] = "vae"
    request_id: str
    latents: Latents
    output: OutputMode = "pixels"
    preview: bool = False  # a streamed preview: decoded in batches of previews only, after waiting final images
    priority: int = 0  # the request's (DenoiseParams.priority): lower runs first, in the VAE's queue too
    tenant: str = ""  # whose share of the VAE it spends (DenoiseParams.tenant)

    @property
    def batch_key(self) -> tuple[str, int, int]:
        return ("preview" if self.preview else "decode", self.latents.height, self.latents.width)


@dataclass(slots=True)
class ImageEncodeRequest:
    """One of an edit's input images, to become latents the DiT denoises beside (the latent distribution's mode), or
    a masked edit's start image (a sample of it, drawn with ``seed`` as diffusers' inpaint pipelines draw it), or a
    control image (a sample, the ``draw``-th; with ``mask``, an inpainting ControlNet's masked control image)."""

    timing: ClassVar[str] = "vae_encode"
    request_id: str
    image: np.ndarray  # uint8 [H, W, 3], at its working size (sides multiples of 32)
    seed: int | None = None
    draw: int = 0  # with seed: the sample is the generator's draw-th of this shape (a request's k-th control image)
    mask: np.ndarray | None = None  # an inpainting ControlNet's control mask, uint8 [H, W], 1 repaints: the image is
    # blacked out there before encoding, and the mask on the latent grid (kept: 1) rides as a 17th channel
    priority: int = 0  # as DecodeRequest's
    tenant: str = ""

    def __post_init__(self) -> None:
        if self.mask is not None and (self.seed is None or self.mask.shape != self.image.shape[:2]):
            raise ValueError(f"request {self.request_id}: a control mask needs a seed and its image's size")

    @property
    def batch_key(self) -> tuple[str, int, int]:
        return ("encode", *self.image.shape[:2])


VaeRequest = DecodeRequest | ImageEncodeRequest


@dataclass(slots=True)
class VaeBatch:
    """One engine step's work: same-key requests run in one VAE call (the VAE scheduler's output)."""

    requests: list[VaeRequest]  # one batch key: all decodes of one size, or all image encodes of one size

    @property
    def request_ids(self) -> list[str]:
        return [request.request_id for request in self.requests]


@dataclass(slots=True)
class Decoded:
    """A request's result, per its output mode; crosses to the coordinator (plain numpy and CPU tensors)."""

    pixels: np.ndarray | None  # [H, W, 3] uint8 (Qwen-Image 2.1: RGBA, [H, W, 4]; Layered: its layers bottom to
    # top, RGBA, [layers, H, W, 4])
    latents: Latents | None
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds, every stage
    dit_passes: dict[str, int] = field(default_factory=dict)  # the DiT's passes computed and reused (Latents')
    revised_prompt: str | None = None  # the request path's: Layered's caption, where it stood for an empty prompt


@dataclass(slots=True)
class VaeOutput:
    """What one engine step produced (the runner's output)."""

    finished: dict[str, Decoded | Latents] = field(default_factory=dict)  # request id -> result (Latents for an
    # ImageEncodeRequest)
    errors: dict[str, EngineError] = field(default_factory=dict)  # request id -> why, for requests that failed alone


# --- a stepping engine's stream --------------------------------------------------------------------------------------

T = TypeVar("T")


class Follows(enum.Enum):
    """What a stream sends right after a ``StepDone``: nothing, the step's preview, or the request's result. Over Ray
    the next item is read by reference without being fetched, so the step that precedes it says what it is."""

    NOTHING = "nothing"
    PREVIEW = "preview"
    RESULT = "result"


@dataclass(frozen=True, slots=True)
class StepDone:
    """A stepping stage's progress for one request: ``step`` of ``total`` steps are done."""

    step: int
    total: int
    follows: Follows = Follows.NOTHING


@dataclass(frozen=True, slots=True)
class Preview(Generic[T]):
    """An intermediate result the request asked for: the DiT's latents of the clean image a step predicts (or, in the
    request path, a handle to them)."""

    result: T


@dataclass(frozen=True, slots=True)
class Finished(Generic[T]):
    """The request's stage result (or a handle to it); nothing follows."""

    result: T


StreamItem = StepDone | Preview | Finished
