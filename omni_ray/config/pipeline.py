"""``PipelineConfig``: one preset, the sections together, checked as a whole (its family's rules included)."""

from __future__ import annotations

import pathlib
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from omni_ray.config.adapters import LoraEntry, LoraSettings, lora_entry
from omni_ray.config.base import HUB_ID, Frozen, PositiveInt
from omni_ray.config.deployment import DeploymentConfig
from omni_ray.config.requests import CardConfig, EditConfig, RequestLimits
from omni_ray.config.stages import DiTConfig, EncoderConfig, VAEConfig
from omni_ray.families import FAMILIES, family_of
from omni_ray.families.qwen_image.facts import VAE_COMPRESSION, PromptTemplate, template_for
from omni_ray.placement import check_placement


class PipelineConfig(Frozen):
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
    configs: str = Field(
        "qwen-image",
        description="The published configs a `build_if_missing: dummy` checkpoint is written from, and the dry run "
        "checks: a folder's name in a family's package (omni_ray/families/<family>/configs/<configs>/).",
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
    loras: dict[Annotated[str, Field(pattern=r"^[\w.:-]+$")], Annotated[LoraEntry, BeforeValidator(lora_entry)]] = (
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

    @field_validator("configs")
    @classmethod
    def _published(cls, configs: str) -> str:
        from omni_ray.checkpoints.full_size import published_configs

        if configs not in published_configs():
            raise ValueError(f"one of {', '.join(published_configs())}, got {configs!r}")
        return configs

    @model_validator(mode="after")
    def _check_stages(self) -> PipelineConfig:
        for stage_name in ("encoder", "dit", "vae"):
            stage = getattr(self, stage_name)
            if stage.device.startswith("cuda") and stage.deployment.num_gpus == 0:
                raise ValueError(f"{stage_name}.deployment.num_gpus must be > 0 when {stage_name}.device is cuda")
        if self.dit.quantization == "int4" and self.dit.runner == "model" and (
                not self.dit.device.startswith("cuda") or self.dit.dtype != "bfloat16"):
            raise ValueError(f"dit.quantization: int4 runs on CUDA GPUs in bfloat16 (torchao's tinygemm kernel; it "
                             f"has no CPU layout here), not dit.device {self.dit.device} in {self.dit.dtype}")
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
        return not HUB_ID.match(self.model) or pathlib.Path(self.model).exists()
