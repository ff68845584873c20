"""Pipeline presets: one validated, frozen config for the three stages, loaded from ``stage_configs/*.yaml``.

A preset names the checkpoint and, per stage, how its engine runs (dtype, device, batching limits) and how Ray Serve
places it (replicas, CPUs, GPUs). Everything is checked once here, and an invalid file fails with an error that
names the field, so nothing downstream handles a dict or a bad value.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from omni_ray.families import FAMILIES, family_of
from omni_ray.families.qwen_image.facts import (
    CONDITION_AREA,
    QWEN_IMAGE_TEACACHE,
    TEXT_TO_IMAGE,
    TOKENIZER_MAX_LENGTH,
    VAE_COMPRESSION,
    PromptTemplate,
    template_for,
)
from omni_ray.families.qwen_image_layered.facts import CAPTION_MAX_TOKENS
from omni_ray.placement import check_placement

PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
Dtype = Literal["float32", "bfloat16", "float16"]


def _int_as_float(value):
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


# A float field that also takes a JSON integer, even in strict mode (``4`` for ``4.0``).
Number = Annotated[float, BeforeValidator(_int_as_float)]

# "owner/name", as on the model hub; anything else must be a local directory.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ConfigError(ValueError):
    """A preset that does not validate. The message names the file and the field."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AutoscalingConfig(_Frozen):
    """Ray Serve autoscaling bounds for one stage."""

    min_replicas: int = Field(1, ge=0, description="Fewest replicas the stage scales down to.")
    max_replicas: PositiveInt = Field(1, description="Most replicas the stage scales up to.")
    target_ongoing_requests: float = Field(
        2.0, gt=0, description="Ongoing requests per replica that Serve aims for when it scales."
    )
    target_queued_work_s: float | None = Field(
        None, gt=0, description="DiT only: scale on the work the replicas hold instead, in cost-seconds (their "
        "requests' remaining steps at their measured step times; deployments/autoscaling.py): as many replicas "
        "as that work over this.",
    )
    look_back_period_s: float = Field(30.0, gt=0, description="Seconds of the replicas' reports Serve averages "
                                      "before each decision.")
    upscale_delay_s: float = Field(30.0, ge=0, description="How long Serve's decision to add replicas must hold "
                                   "before it acts.")
    downscale_delay_s: float = Field(600.0, ge=0, description="How long Serve's decision to remove replicas must "
                                     "hold before it acts.")

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        return self


class DeploymentConfig(_Frozen):
    """How Ray Serve places one stage's replicas."""

    num_replicas: PositiveInt | None = Field(
        None, description="Fixed replica count; leave unset when autoscaling is given (then Serve scales)."
    )
    autoscaling: AutoscalingConfig | None = Field(None, description="Autoscaling bounds instead of a fixed count.")
    max_ongoing_requests: PositiveInt = Field(
        8, description="Requests Serve sends to one replica at once; at least the engine's batch limit."
    )
    max_queued_requests: PositiveInt = Field(
        256, description="Requests that may wait for a replica; past it callers get a 503 with Retry-After."
    )
    max_surge_percent: int = Field(
        0, ge=0, le=100,
        description="Replicas Serve starts beside the old ones while it replaces them (a changed app's args, code or "
        "actor options), in percent of the count, rounded up. With some, an old replica serves until its replacement "
        "is ready; with 0 (Serve's default), Serve stops old replicas before it starts new ones, and a stage of one "
        "replica answers nothing while its replacement starts. A surge replica needs its resources free meanwhile "
        "(a GPU stage's: a spare GPU, or room for the autoscaler to add one), else the replacement waits for them.",
    )
    num_cpus: float = Field(1.0, ge=0, description="Logical CPUs each replica reserves.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs each replica reserves (1 for a GPU stage).")
    torch_threads: PositiveInt | None = Field(
        None,
        description="CPU threads for each replica's torch (OMP_NUM_THREADS); unset, Ray gives the replica's whole "
        "CPUs, at least 1. CPU presets raise it so that fractional replicas still use every core.",
    )

    resources: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict,
        description="Custom Ray resources each replica needs, e.g. {omni_dit_node: 1}: pins the stage to the nodes "
        "(or KubeRay worker groups) that declare them.",
    )
    omp_wait_policy: Literal["passive", "active"] = Field(
        "passive",
        description="What each replica's idle OpenMP threads do (OMP_WAIT_POLICY): sleep (passive), or spin for the "
        "next parallel region (active), which saves microseconds on a dedicated core and burns the cores that other "
        "replicas of a CPU machine share.",
    )

    @model_validator(mode="after")
    def _check_scaling(self) -> DeploymentConfig:
        if self.num_replicas is not None and self.autoscaling is not None:
            raise ValueError("give either num_replicas or autoscaling, not both")
        return self


class _StageConfig(_Frozen):
    runner: Literal["model", "simulated"] = Field(
        "model",
        description="model: run the checkpoint. simulated: compute nothing, wait as long as the stage would take on "
        "a GPU and return outputs of Qwen-Image's real shapes (omni_ray.runners.gpu_costs), for load tests on any "
        "machine; only the tokenizer is read from `model`.",
    )
    dtype: Dtype = Field("float32", description="Weights and activations dtype.")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="Torch device the stage runs on.")
    deployment: DeploymentConfig = Field(
        default_factory=DeploymentConfig, description="Ray Serve options for the stage's deployment."
    )


class EncoderConfig(_StageConfig):
    """The text (and vision) encoder stage: Qwen2.5-VL under vLLM's engine core, or transformers where vLLM has no
    build."""

    runner: Literal["model", "transformers", "simulated"] = Field(
        "model",
        description="model: Qwen2.5-VL under vLLM's engine core (continuous batching; the default). transformers: "
        "Qwen2.5-VL through transformers in omni-ray's encoder core, for platforms without a vLLM build "
        "(omni_ray/runners/transformers_encoder.py; same embeddings, slower). simulated: compute nothing, wait as "
        "long as the stage would take on a GPU (omni_ray.runners.gpu_costs).",
    )

    quantization: Literal["none", "awq", "gptq"] = Field(
        "none",
        description="The text encoder's weights as the checkpoint's text_encoder/ holds them: awq or gptq, 4-bit "
        "(Qwen/Qwen2.5-VL-7B-Instruct-AWQ, 6.9 GB against 16.6 in bf16, given by weights_dir or linked into a "
        "checkpoint by `python -m omni_ray.checkpoints.awq CHECKPOINT OUT --text-encoder AWQ_DIR`), on vLLM's AWQ or "
        "GPTQ kernels with "
        "bfloat16 or float16 activations (runner: model). Checked against the checkpoint's config.json at start; "
        "the placement check counts the quantized bytes.",
    )
    weights_dir: str | None = Field(
        None,
        description="A folder of the text encoder's weights and config in place of the checkpoint's text_encoder/ "
        "(runner: model): a download of Qwen/Qwen2.5-VL-7B-Instruct-AWQ, say, with quantization: awq. The "
        "tokenizer, processor and every other part still come from `model`.",
    )
    max_num_seqs: PositiveInt = Field(8, description="Most prompts the encoder batches in one engine step.")
    max_model_len: PositiveInt = Field(
        TOKENIZER_MAX_LENGTH + TEXT_TO_IMAGE.drop,
        description="Longest token sequence (template included) the encoder accepts.",
    )
    max_sequence_length: PositiveInt = Field(
        512, description="Prompt embeddings kept per prompt after the template is dropped (diffusers' default)."
    )
    kv_cache_memory_bytes: PositiveInt = Field(
        256 << 20, description="KV cache the encoder reserves; prompts are encoded in one pass, so it stays small."
    )
    cache_bytes: NonNegativeInt = Field(
        256 << 20,
        description="Prompt embeddings the encoder keeps, in bytes (least recently used first out; 0 keeps none): a "
        "text encoded before, with the same checkpoint, template and (for edits) input image, skips the encoder. A "
        "prompt's embeddings take tokens x 3584 x 2 bytes in bf16 (about 0.5 MB for 64 tokens).",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1,
        description="Share of its GPU's memory vLLM may claim (vLLM's own setting); at most deployment.num_gpus when "
        "the encoder shares its GPU with other stages.",
    )
    caption_max_tokens: PositiveInt = Field(
        CAPTION_MAX_TOKENS,
        description="Qwen-Image-Layered: most new tokens of the caption the encoder writes of a request's image when "
        "its prompt is empty (the pipeline's get_image_caption max_new_tokens, 512); generation is greedy and stops "
        "earlier at the end of the text.",
    )


class CacheSettings(_Frozen):
    """DiT cache acceleration for one request: which rule decides when a step reuses the residual of the blocks it
    skips, and how much change it tolerates. Both rules are decided per request (and per CFG pass) inside a step
    batch."""

    kind: Literal["first_block", "teacache"] = Field(
        ...,
        description="first_block: run the first block and skip the others while its output residual changed less "
        "than `threshold` since the last full step (diffusers' FirstBlockCacheConfig). teacache: skip every block "
        "while the rescaled change of the first block's modulated input, summed since the last full step, stays "
        "under `threshold`; the first and last steps always run.",
    )
    threshold: Number = Field(
        ..., ge=0, le=2, description="Relative change tolerated: 0 never reuses; higher reuses more and drifts more."
    )


class GangSettings(_Frozen):
    """What a stage's gang of ranks takes, whatever it splits over them: a replica above world size 1 is that many
    processes (Ray actors in the replica's placement group when served), one GPU each on GPU presets."""

    timeout_s: float = Field(
        120.0, gt=0, description="A collective that waits longer fails the step (a rank died or hangs), so the "
        "replica turns unhealthy and Serve replaces the gang.",
    )
    rank_num_cpus: float = Field(
        1.0, gt=0, description="Logical CPUs each rank's Ray actor reserves: its bundle of the replica's placement "
        "group, beside the stage's deployment.num_gpus GPUs on GPU presets (fractions for CPU tests). The replica "
        "itself keeps its deployment.num_cpus and no GPU.",
    )

    @property
    def world_size(self) -> int:
        """Ranks in the gang."""
        raise NotImplementedError


class ParallelSettings(GangSettings):
    """How one DiT replica splits a request over a gang of ranks (one process, and on GPU presets one GPU, each).
    The gang's world size is the product of the four degrees; 1 everywhere (the default) is one process."""

    cfg: Literal[1, 2] = Field(
        1, description="2: a true-CFG row's conditional and unconditional passes run on two ranks (one exchange of "
        "predictions per step); rows without true CFG are split between them.",
    )
    ulysses: PositiveInt = Field(
        1, description="Ulysses sequence parallelism: each row's image and text tokens split over this many ranks, "
        "an all-to-all on heads around attention. The heads must divide by ulysses x tensor.",
    )
    ring: PositiveInt = Field(
        1, description="Ring attention: keys and values passed round this many ranks, merged with online softmax "
        "(sequence split as with ulysses; the two compose).",
    )
    tensor: PositiveInt = Field(
        1, description="Tensor parallelism: attention heads and MLP columns sharded over this many ranks, one "
        "all-reduce per sub-block; each rank holds 1/tensor of the blocks' weights and of each adapter's.",
    )
    split: Literal["sequence", "rows", "per_step"] = Field(
        "sequence", description="How each step uses the gang when it has sequence ranks (ulysses x ring > 1). "
        "sequence: every pass's tokens split over the sequence ranks (each row at the lowest latency). rows: the "
        "step's passes dealt over the cfg x sequence ranks, each run whole (the most throughput, no all-to-alls; an "
        "urgent request alone runs at one GPU's speed), each rank within its share of max_batch_tokens. per_step: "
        "the scheduler chooses each step, rows when they load every rank evenly and slow no request of priority 0 "
        "or more urgent, sequence otherwise (omni_ray/engine/dit_split.py). A step holding a request with cache "
        "acceleration runs sequence.",
    )

    @model_validator(mode="after")
    def _check_split(self) -> ParallelSettings:
        if self.split != "sequence" and self.sequence == 1:
            raise ValueError(f"split: {self.split} needs sequence ranks to spread rows over (ulysses x ring > 1)")
        return self

    @property
    def world_size(self) -> int:
        return self.cfg * self.ulysses * self.ring * self.tensor

    @property
    def sequence(self) -> int:
        """Ranks one row's tokens are split over."""
        return self.ulysses * self.ring


class VaeParallelSettings(GangSettings):
    """How one VAE replica splits a decode over a gang of ranks (omni_ray/runners/parallel/vae_patches.py)."""

    patches: PositiveInt = Field(
        1, description="Ranks an image's decode is split over by latent rows: each rank decodes its band with the "
        "rows of context its convolutions reach (the mid block runs on the whole latent on every rank) and the "
        "pixel rows are gathered, so the pixels are the one-rank decode's (bit for bit on the CPU) while each rank "
        "holds a band's activations. At most requests.min_side / 8 (an image's fewest latent rows). An edit's "
        "image encoding runs on rank 0 alone. 1: one process.",
    )

    @property
    def world_size(self) -> int:
        return self.patches


class OffloadSettings(_Frozen):
    """The DiT's blocks streamed through a card that cannot hold them all (omni_ray/runners/offload.py)."""

    blocks_on_gpu: NonNegativeInt | Literal["auto"] = Field(
        description="Transformer blocks kept on the device (of Qwen-Image's 60; the first always, as cache "
        "acceleration reads it before it runs); the others' weights stay in pinned host memory and are copied in "
        "one block ahead of the block computing, then dropped: at most max(blocks_on_gpu, 1) + 2 blocks' weights on "
        "the device at once. A step copies each streamed block once whatever its rows, so deep step batches pay for "
        "it. auto: as many as the placement check fits beside the largest step batch's activations (in the DiT's "
        "share of the GPU, or on a shared card beside the other stages and the largest turn); needs "
        "gpu_memory_gib.",
    )
    host_to_device_gbps: float = Field(
        25.0, gt=0, description="GB/s the host's copies to the device run at (25: PCIe 4.0 x16 in practice): a "
        "step's transfer time, which the DiT's load counts as its steps' fixed cost until it has measured them.",
    )


class DiTConfig(_StageConfig):
    """The diffusion transformer stage: step-level continuously batched denoising."""

    max_batch_size: PositiveInt = Field(8, description="Most requests denoised together in one step.")
    max_wait_steps: PositiveInt = Field(
        8,
        description="Steps requests of another size or CFG mode (and the same priority) wait at most while the "
        "running batch's key keeps the DiT; then the DiT switches to them, so no key starves.",
    )
    scheduling: Literal["priority", "fifo"] = Field(
        "priority",
        description="priority: each step runs the most urgent requests (`priority`, aged by `priority_aging_s`), "
        "round robin over tenants, within `max_batch_tokens`; a running request that loses its row is paused at the "
        "step boundary and resumed later. fifo: oldest key first, requests in arrival order up to `max_batch_size` "
        "(the scheduling before priorities; omni_ray/engine/dit_policy.py).",
    )
    max_batch_tokens: PositiveInt | None = Field(
        None,
        description="Work one step may take: image plus text tokens of every row, doubled with true CFG (an edit's "
        "input image tokens included); a step's first row always runs. Unset, rows are bounded by max_batch_size "
        "alone. Small images then batch deeply and large ones run one or two at a time. A gang's rows step keeps each "
        "rank within its share (parallel.split).",
    )
    max_paused: NonNegativeInt = Field(
        32, description="Admitted requests that may sit paused outside a step at once (their latents stay in "
        "memory); past it new requests wait in the queue instead of being admitted.",
    )
    cache_memory_bytes: PositiveInt | None = Field(
        None,
        description="qwen-image-2.1: bytes the admitted requests' condition caches may take together (keys and "
        "values of each request's text and condition-image tokens in every block, per CFG branch, kept from its "
        "first step to its last, paused or not: omni_ray.families.qwen_image_2_1.facts.cache_bytes); a request "
        "whose cache would pass it waits in the queue until others finish, and one whose cache alone passes it "
        "fails. Unset, no bound. The stage's stats report the bytes held.",
    )
    priority_aging_s: float = Field(
        120.0, gt=0, description="A request's priority improves by one level for every this many seconds it sat out "
        "steps that ran more urgent requests, so that none starves behind a flood of more urgent work; waiting behind "
        "requests as urgent as itself does not age it.",
    )
    cache: CacheSettings | None = Field(
        None, description="Cache acceleration for requests that do not set `cache`; unset, off. A request's own "
        "`cache` (or null) wins.",
    )
    teacache_coefficients: tuple[float, ...] = Field(
        QWEN_IMAGE_TEACACHE, min_length=1,
        description="TeaCache's rescaling polynomial, highest power first; the default is published for Qwen-Image.",
    )
    compile: bool = Field(
        False,
        description="torch.compile each transformer block (regional compilation, diffusers' compile_repeated_blocks) "
        "with dynamic shapes, at start: the replica steps requests.default_* alone, with true CFG and with padded "
        "text before it is ready (tens of seconds; its stats' warmup_s), and every other size, batch size and text "
        "length runs the same compiled code; layers with a LoRA adapter loaded run their update outside the graph.",
    )
    max_loras: PositiveInt = Field(
        4, description="LoRA adapters each DiT replica holds on its device at most; the least recently used idle one "
        "leaves first when another is needed.",
    )
    parallel: ParallelSettings = Field(
        default_factory=ParallelSettings,
        description="One request on several ranks: CFG-parallel, Ulysses and ring sequence parallelism, tensor "
        "parallelism (docs/parallel.md). Above world size 1 each replica is a gang of that many Ray actors in the "
        "replica's placement group, one GPU each on GPU presets.",
    )
    quantization: Literal["none", "fp8", "int8"] = Field(
        "none",
        description="The checkpoint's weights quantized at load by torchao (omni_ray/runners/quantization.py). fp8: "
        "dynamic float8 with per-row scales on the transformer blocks' Linears (weights and activations in "
        "float8_e4m3, float32 accumulation), keeping the image MLP's output projection and the modulation Linears "
        "in bfloat16; needs a CUDA GPU of compute capability 8.9 or more (L4, L40S, H100, H200) and dtype "
        "bfloat16. int8: weight-only int8 with per-row scales on every block Linear (activations in dtype), on any "
        "device: the blocks' weights in half their bf16 bytes. Not with tensor parallelism or offload. Off by "
        "default: the effect on image quality with real weights is not measured here.",
    )
    offload: OffloadSettings | None = Field(
        None, description="Stream the transformer's blocks through the device (`blocks_on_gpu`); unset: every block "
        "stays on it. Not with `compile` or tensor parallelism.",
    )
    weights_file: str | None = Field(
        None,
        description="A GGUF file of the transformer's weights, as people download them (Q8_0, Q6_K, Q5_K_M, Q4_K_M, "
        "... of Qwen-Image and its Edit releases; `python -m omni_ray.checkpoints.gguf` writes one from a "
        "checkpoint), in place of the checkpoint's transformer/ weights (its config still comes from there): each "
        "quantized Linear dequantizes its weight in `dtype` per forward, through diffusers' GGUF support. Checked at "
        "the DiT's start: no such file, not a GGUF file, cut short, another model's, or a quant type diffusers cannot "
        "read is an error naming this field. The placement check counts the published file's size for the quant "
        "type its name carries (Q4_K_M, ...), or the file's own size. Not with `quantization: fp8`, tensor "
        "parallelism or `weights: dummy`.",
    )

    @model_validator(mode="after")
    def _check_offload(self) -> DiTConfig:
        if self.offload is not None and self.compile:
            raise ValueError("offload: streamed blocks swap their weights in hooks that compiled blocks would trace; "
                             "set compile: false")
        if self.quantization == "int8" and (self.offload is not None or self.parallel.tensor > 1):
            raise ValueError("quantization: int8 weights are not streamed (offload) or sliced (tensor parallelism) "
                             "yet; a GGUF file (weights_file) streams")
        if self.offload is not None and self.parallel.tensor > 1:
            raise ValueError("offload: not with tensor parallelism (its ranks' slices are not streamed)")
        return self

    @model_validator(mode="after")
    def _check_weights_file(self) -> DiTConfig:
        if self.weights_file is None:  # the file itself is read where the DiT starts (runners.gguf_weights.check)
            return self
        if self.quantization != "none":
            raise ValueError("weights_file: a GGUF file is quantized already; leave quantization at none")
        if self.parallel.tensor > 1:
            raise ValueError("weights_file: tensor parallelism slices full-precision weights; GGUF weights are "
                             "served whole on each rank (cfg, ulysses and ring parallelism)")
        return self

    @model_validator(mode="after")
    def _check_simulated_gang(self) -> DiTConfig:
        if self.runner == "simulated" and (self.parallel.cfg > 1 or self.parallel.tensor > 1):
            raise ValueError("parallel: the simulated runner models sequence ranks (ulysses, ring) only; cfg and "
                             "tensor must be 1")
        return self


class VAEConfig(_StageConfig):
    """The VAE stage: batched latent decoding (and image encoding for edits)."""

    max_batch_size: PositiveInt = Field(4, description="Most same-size latents decoded in one VAE call.")
    tiling: bool | Literal["auto"] = Field(
        False,
        description="Decode (and encode an edit's input images) in bands of 256 pixel rows, one after another on the "
        "stage's device, for large images on small cards: the mid block still attends over the whole latent, and "
        "each band computes the rows of context either side that its convolutions reach (104 pixel rows decoding, "
        "80 encoding), so the pixels and latents are the untiled ones (bit for bit on the CPU; on a GPU, float "
        "rounding aside), unlike diffusers' enable_tiling, whose blended tiles differ. Costs up to 1.8x the up "
        "path's work (at 1328x1328) for about a third of its activation memory. true: every call; auto: a call "
        "of more pixels (its images together) than tile_above_pixels.",
    )
    tile_above_pixels: PositiveInt | None = Field(
        None,
        description="With tiling: auto, the pixels above which a call runs in bands. Unset, what fits the stage's "
        "share of a GPU untiled by the placement estimate (gpu_memory_gib must then be set and the VAE on a GPU).",
    )
    parallel: VaeParallelSettings = Field(
        default_factory=VaeParallelSettings,
        description="One decode on several ranks (`patches`): above one, each replica is a gang of that many Ray "
        "actors in the replica's placement group, one GPU each on GPU presets, as dit.parallel's.",
    )


class EditConfig(_Frozen):
    """Image editing (a Qwen-Image-Edit checkpoint): how input images are taken."""

    plus: bool = Field(
        False,
        description="A Qwen-Image-Edit-2509 or 2511 checkpoint (diffusers' QwenImageEditPlusPipeline): up to "
        "max_images input images, each read by the encoder at condition_area pixels with Edit-Plus's prompt "
        "template, and by the VAE at image_area; the output takes the last image's working size by default.",
    )
    max_images: int = Field(1, ge=1, le=3, description="Input images a request may bring (more than one: plus).")
    image_area: PositiveInt = Field(
        1024 * 1024,
        description="Pixels an input image is resized to, keeping its aspect ratio, sides rounded to multiples of "
        "32: its working size, which the VAE (and, but with plus, the encoder) sees and the output takes by default. "
        "diffusers' QwenImageEditPipeline and QwenImageEditPlusPipeline use 1024x1024.",
    )
    condition_area: PositiveInt = Field(
        CONDITION_AREA,
        description="plus only: pixels each input image is resized to for the encoder (Qwen2.5-VL), at its aspect "
        "ratio, sides rounded to multiples of 32. diffusers uses 384x384.",
    )
    max_image_bytes: PositiveInt = Field(
        20 << 20, description="Largest input image file a request may upload; a larger one gets a 413."
    )
    resolutions: tuple[PositiveInt, ...] | None = Field(
        None,
        description="Qwen-Image-Layered only (family qwen-image-layered): the resolution buckets a request's "
        "`resolution` names, the first its default. The input image (and every layer) takes the bucket's square "
        "area at the image's aspect ratio, sides rounded to multiples of 32 (image_area is not read). "
        "QwenImageLayeredPipeline's are 640 and 1024; a tiny preset's are smaller.",
    )

    @field_validator("resolutions")
    @classmethod
    def _resolutions_are_multiples(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is not None and (not value or len(set(value)) != len(value) or any(side % 32 for side in value)):
            raise ValueError("distinct sides, each a multiple of 32")
        return value

    @property
    def pipeline(self) -> str:
        """diffusers' pipeline class for the checkpoint."""
        return "QwenImageEditPlusPipeline" if self.plus else "QwenImageEditPipeline"

    @property
    def max_vision_pixels(self) -> int:
        """A bound on the pixels Qwen2.5-VL's processor sees in one image: its size for the encoder with sides
        rounded to 28 (at most (32 + 14) / 32 longer each, as sides are at least 32) stays within 4x the area."""
        if self.resolutions is not None:  # Layered's caption reads the image at its bucket's area
            return 4 * max(self.resolutions) ** 2
        return 4 * (self.condition_area if self.plus else self.image_area)


# The FlowMatchEulerDiscreteScheduler settings a recipe may change (its config keys that shape the sigmas).
RECIPE_SCHEDULER_KEYS = frozenset({
    "base_image_seq_len", "base_shift", "max_image_seq_len", "max_shift", "shift", "shift_terminal",
    "time_shift_type", "use_dynamic_shifting", "invert_sigmas", "use_karras_sigmas", "use_exponential_sigmas",
    "use_beta_sigmas", "num_train_timesteps",
})  # not stochastic_sampling: its noise would come from the process's RNG, not the request's seed
RECIPE_MAX_BYTES = 64 << 10
RECIPE_FILE = "recipe.json"  # beside an adapter: in its folder, or as <file stem>.recipe.json


class SamplingRecipe(_Frozen):
    """How an adapter's authors sample with it (a few-step distillation such as Qwen-Image-Lightning): what a request
    naming the adapter gets for each field it does not set itself."""

    num_inference_steps: int | None = Field(None, ge=1, le=200, description="Denoising steps (Lightning: 4 or 8), "
                                            "within the API's range.")
    true_cfg_scale: float | None = Field(
        None, ge=1, le=20, description="True CFG scale, within the API's range; 1 turns true CFG off (Lightning's), "
        "whatever the negative prompt.",
    )
    scheduler: dict[str, bool | int | float | str | None] = Field(
        default_factory=dict,
        description="FlowMatchEulerDiscreteScheduler settings over the checkpoint's (Lightning: base_shift and "
        "max_shift log(3), max_image_seq_len 8192, shift_terminal null); each request keeps its own sigmas, so "
        "requests of other recipes share its step batches.",
    )

    @model_validator(mode="after")
    def _check_scheduler(self) -> SamplingRecipe:
        unknown = sorted(set(self.scheduler) - RECIPE_SCHEDULER_KEYS)
        if unknown:
            raise ValueError(f"scheduler: {', '.join(unknown)} not among {', '.join(sorted(RECIPE_SCHEDULER_KEYS))}")
        return self


class LoraEntry(_Frozen):
    """An adapter the preset knows: its file and, optionally, its sampling recipe."""

    path: str = Field(..., description="diffusers' pytorch_lora_weights.safetensors, or its folder.")
    recipe: SamplingRecipe | None = Field(
        None, description=f"The adapter's sampling recipe; without one here, a {RECIPE_FILE} beside the file (in its "
        "folder, or as <file stem>.recipe.json) when the machine reading the preset has it.",
    )


def _lora_entry(value: Any) -> Any:
    return {"path": value} if isinstance(value, str) else value


class LoraSettings(_Frozen):
    """Adapters loaded at run time (POST /v1/load_lora_adapter): off unless the operator allows them, and then only
    from files under the given folders."""

    allow_runtime_updates: bool = Field(
        False, description="Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter; off, both answer 403.",
    )
    roots: tuple[str, ...] = Field(
        (), description="Folders (on the DiT's nodes) whose files run-time adapters may come from: a `lora_path` "
        "that resolves (symlinks and '..' followed, before anything is read) outside all of them is refused. A "
        "relative `lora_path` is taken under the first.",
    )

    @model_validator(mode="after")
    def _check_roots(self) -> LoraSettings:
        if self.allow_runtime_updates and not self.roots:
            raise ValueError("roots: allow_runtime_updates needs at least one folder adapters may be read from")
        if relative := [root for root in self.roots if not root.startswith(("/", "~"))]:
            raise ValueError(f"roots: {relative[0]!r} is not an absolute path")
        return self


class QualitySteps(_Frozen):
    """Denoising steps for OpenAI's `quality` levels (`auto` takes `default_steps`)."""

    low: PositiveInt = Field(20, description="Steps for quality=low.")
    medium: PositiveInt = Field(30, description="Steps for quality=medium.")
    high: PositiveInt = Field(50, description="Steps for quality=high: Qwen-Image's published default.")


class RequestLimits(_Frozen):
    """What requests may ask of this preset, and what they get when they do not say."""

    default_width: PositiveInt = Field(1328, description="Image width when a request gives no size.")
    default_height: PositiveInt = Field(1328, description="Image height when a request gives no size.")
    default_steps: PositiveInt = Field(
        50, description="Denoising steps when a request gives neither steps nor quality."
    )
    quality_steps: QualitySteps = Field(
        default_factory=QualitySteps, description="Steps for each of OpenAI's quality levels; a request's "
        "num_inference_steps wins over its quality.",
    )
    min_side: PositiveInt = Field(256, description="Smallest image side a request may ask for, in pixels.")
    max_side: PositiveInt = Field(2048, description="Largest image side a request may ask for, in pixels.")
    timeout_s: float = Field(
        600.0, gt=0, description="Deadline of one request, all images and stages included; past it the work is "
        "aborted in every stage and the caller gets a 504."
    )
    max_controls: int = Field(2, ge=0, le=4, description="ControlNets one request may apply at once (`control`).")
    max_retries: int = Field(
        2, ge=0, description="Stage calls of one request that may be issued again after their replica (or the "
        "node holding their result) was lost; stage calls are deterministic, so a retry gives the same image. Past "
        "it the caller gets a 503 naming the stage."
    )

    @model_validator(mode="after")
    def _check_sizes(self) -> RequestLimits:
        if self.min_side > self.max_side:
            raise ValueError(f"min_side ({self.min_side}) exceeds max_side ({self.max_side})")
        for name in ("default_width", "default_height"):  # each a multiple of its family's side (Family.check_preset)
            if not self.min_side <= getattr(self, name) <= self.max_side:
                raise ValueError(f"{name} is outside min_side..max_side")
        return self


class CardConfig(_Frozen):
    """Stages sharing one card and taking turns on it (omni_ray/engine/card.py)."""

    stages: tuple[Literal["encoder", "dit", "vae"], ...] = Field(
        ("encoder", "dit", "vae"), min_length=2,
        description="The stages on the card, one replica each: each step of one that runs its model (a DiT step, a "
        "VAE call, an encoder batch) is a turn, granted in the order asked, and between its turns a stage keeps only "
        "its resident memory: the DiT its weights (kept blocks) and working memory, the VAE its weights, the "
        "encoder nothing (its weights wait in pinned host memory and come back for each turn, one copy each way "
        "that the turn's batch shares). With gpu_memory_gib set, the placement check proves the residents plus the "
        "largest turn fit one card.",
    )

    @model_validator(mode="after")
    def _check_stages(self) -> CardConfig:
        if len(set(self.stages)) != len(self.stages):
            raise ValueError(f"stages: {list(self.stages)} names a stage twice")
        return self


class PipelineConfig(_Frozen):
    """One Qwen-Image preset: the checkpoint and its three stages."""

    name: str = Field(..., min_length=1, description="Served model name, as listed by /v1/models.")
    model: str = Field(
        ...,
        min_length=1,
        description="Checkpoint in diffusers' layout: a local directory, or a hub id such as 'Qwen/Qwen-Image'.",
    )
    build_if_missing: Literal["tiny", "small", "dummy"] | None = Field(
        None,
        description="Write this offline checkpoint to `model` on first start when the directory is missing: "
        "`tiny` or `small` (omni_ray.checkpoints.tiny, seed 0) for the CPU presets, `dummy` "
        "(omni_ray.checkpoints.dummy: the full-size configs `configs` names and a tokenizer, no weights) for `weights: "
        "dummy`. The app builder, the in-process pipeline and `make` write it (omni_ray.checkpoints.ensure); "
        "loading a preset never does.",
    )
    family: str = Field(
        "qwen-image",
        description="The model family the checkpoint belongs to, one of omni_ray.families.FAMILIES (each a package "
        "under omni_ray/families/). qwen-image: Qwen-Image, Edit and their releases (QwenImagePipeline and its edit "
        "pipelines; Qwen2.5-VL, the 20 B dual-stream transformer, the 8x VAE). qwen-image-2.1: Qwen-Image 2.1 "
        "(QwenImage21Pipeline; Qwen3-VL, the 7 B single-stream block-causal transformer whose condition keys and "
        "values each request keeps across its steps, the 16x RGBA VAE): it serves /v1/images/generations, and "
        "/v1/images/edits with 1 to edit.max_images condition images when `edit` is set. qwen-image-layered: "
        "Qwen-Image-Layered (QwenImageLayeredPipeline; Qwen-Image's architecture with a layer axis in its rotary "
        "embedding and an RGBA VAE): it serves /v1/images/edits with one input image, decomposed into RGBA layers; "
        "`edit` must be set.",
    )
    sample_sigmas: tuple[Annotated[float, Field(gt=0, le=1)], ...] | None = Field(
        None, min_length=1,
        description="qwen-image-2.1: the sigmas a request that sets no steps samples with (their count is its steps), "
        "as the pipeline's sample_sigmas; unset, the checkpoint's model_index.json's, read where the preset is read "
        "(none there: requests.default_steps evenly spaced, as the pipeline without them).",
    )
    configs: Literal["qwen-image", "qwen-image-edit-2511", "qwen-image-2.1", "qwen-image-layered"] = Field(
        "qwen-image",
        description="The published configs (omni_ray/model_configs/<configs>/) a `build_if_missing: dummy` checkpoint "
        "is written from, and the dry run checks.",
    )
    gpus_per_node: PositiveInt | None = Field(
        None,
        description="GPUs of one node of the machines the GPU stages run on; set, a gang (dit.parallel's or "
        "vae.parallel's world size, the stage's deployment.num_gpus each) that cannot fit one node is refused "
        "(omni_ray/placement.py).",
    )
    gpu_memory_gib: float | None = Field(
        None, gt=0,
        description="Memory of one GPU of the machines the GPU stages run on, in GiB; set, the preset is refused when "
        "a stage's estimated peak memory does not fit its share of a GPU (omni_ray/placement.py).",
    )
    weights: Literal["checkpoint", "dummy"] = Field(
        "checkpoint",
        description="`checkpoint` loads each stage's weights from `model`; `dummy` builds each stage from "
        "`model`'s configs with random weights on its device and in its dtype (vLLM's dummy load format for the "
        "encoder), for timing and capacity tests without a download.",
    )
    loras: dict[Annotated[str, Field(pattern=r"^[\w.:-]+$")], Annotated[LoraEntry, BeforeValidator(_lora_entry)]] = (
        Field(
            default_factory=dict,
            description="LoRA adapters known at start, name -> file (diffusers' pytorch_lora_weights.safetensors, or "
            "its folder), or name -> {path, recipe}, on every node that runs the DiT; a request picks one with "
            "`model`. POST /v1/load_lora_adapter adds more at run time when `lora` allows it.",
        )
    )
    lora: LoraSettings = Field(default_factory=LoraSettings, description="Adapters loaded at run time.")
    controlnets: dict[Annotated[str, Field(pattern=r"^[\w.:-]+$")], str] = Field(
        default_factory=dict,
        description="ControlNets the DiT holds, name -> folder in diffusers' layout (QwenImageControlNetModel: "
        "InstantX's Qwen-Image ControlNet Union, say), on every node that runs the DiT; a request applies up to "
        "requests.max_controls of them by name (`control`), each with its control image.",
    )
    inpaint_controlnets: list[str] = Field(
        default_factory=list,
        description="Which of `controlnets` are inpainting ControlNets (InstantX's Qwen-Image-ControlNet-Inpainting: "
        "extra_condition_channels in its config), whose controls take a `mask` beside the image. Read from each "
        "folder's config.json when the preset is read; list a ControlNet here only when its folder is not on the "
        "host that reads the preset.",
    )
    requests: RequestLimits = Field(default_factory=RequestLimits, description="Request defaults and limits.")
    coordinator: DeploymentConfig = Field(
        default_factory=lambda: DeploymentConfig(max_ongoing_requests=256),
        description="Ray Serve options for the coordinator ingress (CPU only; it holds no tensors).",
    )
    encoder: EncoderConfig = Field(default_factory=EncoderConfig, description="Encoder stage.")
    dit: DiTConfig = Field(default_factory=DiTConfig, description="Denoising stage.")
    vae: VAEConfig = Field(default_factory=VAEConfig, description="Decoding stage.")
    edit: EditConfig | None = Field(
        None,
        description="Set for a Qwen-Image-Edit checkpoint (edit.plus for Edit-2509/2511's): the app serves "
        "/v1/images/edits (input images and prompt) instead of /v1/images/generations.",
    )
    card: CardConfig | None = Field(
        None,
        description="Set when stages share one GPU and take turns on it (a one-card preset): which ones "
        "(omni_ray/engine/card.py). Unset, each stage keeps all it uses.",
    )

    @field_validator("family")
    @classmethod
    def _known_family(cls, family: str) -> str:
        if family not in FAMILIES:
            raise ValueError(f"one of {', '.join(FAMILIES)}, got {family!r}")
        return family

    @model_validator(mode="after")
    def _check_stages(self) -> PipelineConfig:
        for stage_name in ("encoder", "dit", "vae"):
            stage = getattr(self, stage_name)
            if stage.device.startswith("cuda") and stage.deployment.num_gpus == 0:
                raise ValueError(f"{stage_name}.deployment.num_gpus must be > 0 when {stage_name}.device is cuda")
        if self.dit.quantization == "fp8" and self.dit.runner == "model":
            if not self.dit.device.startswith("cuda"):
                raise ValueError(f"dit.quantization: fp8 runs on CUDA GPUs (float8 matmuls), not dit.device "
                                 f"{self.dit.device}")
            if self.dit.dtype != "bfloat16":
                raise ValueError(f"dit.quantization: fp8 keeps its other layers in bfloat16; dit.dtype is "
                                 f"{self.dit.dtype}")
        fewest_rows = self.requests.min_side // VAE_COMPRESSION
        if self.vae.parallel.patches > fewest_rows:
            raise ValueError(f"vae.parallel.patches ({self.vae.parallel.patches}) exceeds the latent rows of the "
                             f"smallest image ({fewest_rows}: requests.min_side / {VAE_COMPRESSION}); each rank "
                             "decodes one row at least")
        family_of(self).check_preset(self)
        if self.build_if_missing == "dummy" and self.weights != "dummy":
            raise ValueError("build_if_missing: dummy writes no weights; set weights: dummy")
        if self.encoder.quantization != "none" and self.encoder.runner != "model":
            raise ValueError(f"encoder.quantization: {self.encoder.quantization} weights load on vLLM's kernels "
                             "(encoder.runner: model); transformers' loader needs gptqmodel, not installed here")
        if self.encoder.weights_dir is not None and self.encoder.runner != "model":
            raise ValueError("encoder.weights_dir: read by vLLM's runner (encoder.runner: model)")
        if (self.dit.offload is not None and self.dit.offload.blocks_on_gpu == "auto"
                and (self.gpu_memory_gib is None or self.dit.deployment.num_gpus == 0)):
            raise ValueError("dit.offload.blocks_on_gpu: auto keeps as many blocks as fit the DiT's GPU memory: set "
                             "gpu_memory_gib (the DiT on a GPU), or a number")
        if self.vae.tiling == "auto" and self.vae.tile_above_pixels is None and (
                self.gpu_memory_gib is None or self.vae.deployment.num_gpus == 0):
            raise ValueError("vae.tiling: auto decodes in bands above what fits untiled: set vae.tile_above_pixels, "
                             "or gpu_memory_gib with the VAE on a GPU to have it estimated")
        if self.dit.weights_file is not None and self.weights == "dummy":
            raise ValueError("dit.weights_file: weights: dummy builds the transformer with random weights; set "
                             "weights: checkpoint to read the GGUF file")
        if self.card is not None:
            self._check_card(self.card)
        check_placement(self)
        if unknown := sorted(set(self.inpaint_controlnets) - set(self.controlnets)):
            raise ValueError(f"inpaint_controlnets: {unknown[0]!r} is not one of `controlnets`")
        if self.name in self.loras:
            raise ValueError(f"loras: {self.name!r} is the base model's name; give the adapter another")
        for stage_name in ("encoder", "vae"):
            scaling = getattr(self, stage_name).deployment.autoscaling
            if scaling is not None and scaling.target_queued_work_s is not None:
                raise ValueError(f"{stage_name}.deployment.autoscaling.target_queued_work_s: only the DiT reports its "
                                 "work; scale this stage on target_ongoing_requests")
        if self.dit.deployment.max_ongoing_requests < self.dit.max_batch_size:
            raise ValueError(
                f"dit.deployment.max_ongoing_requests ({self.dit.deployment.max_ongoing_requests}) must be at least "
                f"dit.max_batch_size ({self.dit.max_batch_size}), or batches never fill"
            )
        return self

    def _check_card(self, card: CardConfig) -> None:
        for name in card.stages:
            stage = getattr(self, name)
            if stage.deployment.num_replicas != 1:
                raise ValueError(f"card.stages: {name} takes turns on one card: {name}.deployment.num_replicas must "
                                 "be 1 (no autoscaling)")
            if name != "encoder" and stage.parallel.world_size > 1:
                raise ValueError(f"card.stages: {name}.parallel spreads the {name} over several GPUs; a stage on "
                                 "one card runs on it alone")

    @property
    def pipeline(self) -> str:
        """diffusers' pipeline class the checkpoint must be (the family's)."""
        return family_of(self).pipeline(self)

    @property
    def prompt_template(self) -> PromptTemplate:
        """The checkpoint's prompt template: the edit one for Qwen-Image-Edit checkpoints (Qwen-Image-Layered encodes
        its prompt as text to image: the image reaches the DiT alone)."""
        edit = self.edit is not None and self.edit.resolutions is None
        return template_for(edit=edit, plus=edit and self.edit.plus)

    @property
    def is_local(self) -> bool:
        """Whether ``model`` names a local directory rather than a hub id."""
        return not _HUB_ID.match(self.model) or pathlib.Path(self.model).exists()


def load_config(path: str | pathlib.Path, model: str | None = None,
                overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Reads a preset from YAML; ``model`` overrides the preset's checkpoint, and ``overrides`` (a preset fragment:
    ``{"dit": {"max_batch_tokens": 4096}}``) its fields, mappings merged key by key and anything else replaced.

    A relative local ``model`` resolves against the current directory; ``~`` expands.
    """
    path = pathlib.Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such stage config") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of fields, got {type(data).__name__}")
    if overrides:
        data = merged(data, overrides)
    if model is not None:
        data["model"] = model
    return parse_config(data, source=str(path))


def merged(base: dict[str, Any], fragment: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``fragment`` laid over it: where both hold a mapping, merged key by key; else the fragment's."""
    out = dict(base)
    for key, value in fragment.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def recipe_file(adapter_path: str) -> pathlib.Path:
    """Where an adapter's sampling recipe lies: ``recipe.json`` in its folder, or ``<file stem>.recipe.json`` beside
    its file (whether or not it is there)."""
    adapter = pathlib.Path(adapter_path).expanduser()
    return adapter / RECIPE_FILE if adapter.is_dir() else adapter.with_name(f"{adapter.stem}.{RECIPE_FILE}")


def read_recipe(path: str | pathlib.Path) -> SamplingRecipe:
    """The sampling recipe in the file at ``path`` (``recipe_file``'s); ValueError, naming neither the file nor its
    folder, for one that cannot be read or is not a valid recipe."""
    try:
        with open(path, "rb") as file:
            data = file.read(RECIPE_MAX_BYTES + 1)
        if len(data) > RECIPE_MAX_BYTES:
            raise ValueError(f"larger than {RECIPE_MAX_BYTES} bytes")
        return SamplingRecipe.model_validate(json.loads(data))
    except ValidationError as err:
        raise ValueError(f"recipe file: {describe(err)}") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"recipe file: {err.strerror if isinstance(err, OSError) else err}") from None


def parse_config(data: dict[str, Any], source: str = "<config>") -> PipelineConfig:
    """Validates a preset given as a mapping; raises ConfigError naming the field. Reads the checkpoint's
    ``model_index.json`` when it exists; writes nothing (a checkpoint that ``build_if_missing`` names and that is not
    there yet is written by ``omni_ray.checkpoints.ensure``)."""
    try:
        config = PipelineConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source}: {describe(err)}") from None
    loras = dict(config.loras)
    for name, entry in config.loras.items():
        beside = recipe_file(entry.path)
        if entry.recipe is None and beside.is_file():  # the operator's own files: read where the preset is read
            try:
                loras[name] = entry.model_copy(update={"recipe": read_recipe(beside)})
            except ValueError as err:
                raise ConfigError(f"{source}: loras.{name}.recipe: {err}") from None
    config = config.model_copy(update={"loras": loras, "inpaint_controlnets": inpaint_controlnets(config)})
    if not config.is_local:
        return config
    model_dir = pathlib.Path(config.model).expanduser()
    config = config.model_copy(update={"model": str(model_dir.resolve())})
    if config.build_if_missing and not model_dir.exists():
        return config
    check_checkpoint(config, source)
    return with_checkpoint_settings(config)


def inpaint_controlnets(config: PipelineConfig) -> list[str]:
    """The preset's ``inpaint_controlnets``, and each of its ``controlnets`` whose folder's ``config.json`` gives it
    extra condition channels (an inpainting ControlNet: the control mask rides beside the control image's
    latents), in ``controlnets``' order."""
    found = []
    for name, path in config.controlnets.items():
        settings = pathlib.Path(path).expanduser() / "config.json"
        try:
            extra = json.loads(settings.read_text()).get("extra_condition_channels") if settings.is_file() else 0
        except (OSError, ValueError):
            extra = 0  # the DiT reads it again when it loads the ControlNet, and says what is wrong
        if extra or name in config.inpaint_controlnets:
            found.append(name)
    return found


def with_checkpoint_settings(config: PipelineConfig) -> PipelineConfig:
    """The preset with what its local checkpoint fixes and the preset left out (Qwen-Image 2.1's ``sample_sigmas``),
    as its family reads them."""
    return family_of(config).with_checkpoint_settings(config)


def check_checkpoint(config: PipelineConfig, source: str = "<config>") -> None:
    """Raises ConfigError unless a local ``model`` holds a checkpoint of the preset's kind (reads
    ``model_index.json``)."""
    index = pathlib.Path(config.model) / "model_index.json"
    if not index.is_file():
        raise ConfigError(
            f"{source}: model: {config.model!r} is not a checkpoint directory (no model_index.json); "
            "build the tiny one with `python -m omni_ray.checkpoints.tiny DIR` (`--edit` or `--edit-plus` for an edit "
            "checkpoint)"
        )
    pipeline = json.loads(index.read_text()).get("_class_name")
    expected = config.pipeline
    family = family_of(config)
    owner = next((family_of(name) for name in FAMILIES if pipeline in family_of(name).pipelines), None)
    if pipeline != expected and owner is not None and owner is not family:  # another family's checkpoint
        raise ConfigError(
            f"{source}: family: {config.family!r}, but model: {config.model!r} is a {pipeline} checkpoint (a "
            f"{expected} one is needed; family {family.name} is for {', '.join(family.pipelines)} checkpoints, "
            f"family {owner.name} for {pipeline})"
        )
    family.check_checkpoint(config, source)
    if pipeline != expected:
        raise ConfigError(
            f"{source}: model: {config.model!r} is a {pipeline} checkpoint, but this preset "
            f"{'edits' if config.edit is not None else 'generates'} images and needs a {expected} one "
            f"(`edit:` is set for Qwen-Image-Edit checkpoints only, `edit.plus` for Edit-2509/2511's)"
        )


def field_errors(err: ValidationError, unknown: str = "unknown field") -> list[tuple[str | None, str]]:
    """Each problem of a pydantic error as (the field's dotted name or None for the whole, the message); a field the
    schema does not have is called ``unknown``."""
    problems = []
    for error in err.errors():
        field = ".".join(str(part) for part in error["loc"]) or None
        if error["type"] == "extra_forbidden":
            message = unknown
        elif error["type"] == "value_error":  # our validators' own words, without pydantic's "Value error, "
            message = str(error["ctx"]["error"])
        else:
            message = error["msg"]
        problems.append((field, message))
    return problems


def describe(err: ValidationError) -> str:
    """A pydantic error as one line, each problem led by its field's name."""
    return "; ".join(f"{field}: {message}" if field else message for field, message in field_errors(err))
