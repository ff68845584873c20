"""The three GPU stages' settings: the encoder, the DiT (batching, scheduling, caches, gangs, offloading,
quantization) and the VAE."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from omni_ray.config.base import Frozen, NonNegativeInt, Number, PositiveInt
from omni_ray.config.deployment import StageConfig
from omni_ray.families.qwen_image.facts import QWEN_IMAGE_TEACACHE, TEXT_TO_IMAGE, TOKENIZER_MAX_LENGTH
from omni_ray.families.qwen_image_layered.facts import CAPTION_MAX_TOKENS


class EncoderConfig(StageConfig):
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


class CacheSettings(Frozen):
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


class GangSettings(Frozen):
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


class OffloadSettings(Frozen):
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


class DiTConfig(StageConfig):
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
    quantization: Literal["none", "fp8", "int8", "int4"] = Field(
        "none",
        description="The checkpoint's weights quantized at load by torchao (omni_ray/runners/quantization.py). fp8: "
        "dynamic float8 with per-row scales on the transformer blocks' Linears (weights and activations in "
        "float8_e4m3, float32 accumulation), keeping the image MLP's output projection and the modulation Linears "
        "in bfloat16; needs a CUDA GPU of compute capability 8.9 or more (L4, L40S, H100, H200) and dtype "
        "bfloat16. int8: weight-only int8 with per-row scales on every block Linear (activations in dtype), on any "
        "device: the blocks' weights in half their bf16 bytes. int4: weight-only int4 on the same Linears, groups of "
        "128 with a scale and zero point each (tinygemm's packing): CUDA GPUs and dtype bfloat16 only, a little over a "
        "quarter of the bf16 bytes. int8 and int4: not with tensor parallelism or offload. Off by "
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
        if self.quantization in ("int8", "int4") and (self.offload is not None or self.parallel.tensor > 1):
            raise ValueError(f"quantization: {self.quantization} weights are not streamed (offload) or sliced (tensor "
                             "parallelism) yet; a GGUF file (weights_file) streams")
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


class VAEConfig(StageConfig):
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
