"""What a request may ask (``requests``: sizes, steps, limits), an edit preset's ``edit`` and the ``card`` the stages
share."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from omni_ray.config.base import Frozen, PositiveInt
from omni_ray.families.qwen_image.facts import CONDITION_AREA


class EditConfig(Frozen):
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


class QualitySteps(Frozen):
    """Denoising steps for OpenAI's `quality` levels (`auto` takes `default_steps`)."""

    low: PositiveInt = Field(20, description="Steps for quality=low.")
    medium: PositiveInt = Field(30, description="Steps for quality=medium.")
    high: PositiveInt = Field(50, description="Steps for quality=high: Qwen-Image's published default.")


class RequestLimits(Frozen):
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


class CardConfig(Frozen):
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
