"""``Family``: what a model family supports and the parts only it has, after vLLM's model interfaces.

A family says what it supports as class attributes (``rgba``, ``controlnets``, ``captions``, ...), which the shared
code reads where it used to ask which family a preset names, and does its own part through the methods below: the
preset's checks, the checkpoint it must be, the request rules only it has, its tokenizer, its runners, its memory
estimate and its checkpoint writer. The defaults are what the Qwen-Image architecture's families share (Qwen2.5-VL's
template, the shared ``DenoiseRunner`` and ``VaeRunner``, the placement estimate of Qwen-Image's published sizes);
a family overrides what differs. Nothing here imports torch: the runners are imported when a stage builds them.
"""

from __future__ import annotations

import pathlib
from typing import ClassVar

from omni_ray.errors import RequestError


class Family:
    """One model family (the preset's ``family``). Subclasses set ``name``, ``title`` and ``pipeline_class`` and
    override what is theirs; one instance serves every preset of the family (it holds no state)."""

    name: ClassVar[str]  # the preset's `family`
    title: ClassVar[str]  # how a message names it ("Qwen-Image 2.1")
    pipeline_class: ClassVar[str]  # diffusers' pipeline class of its checkpoints (``pipeline`` may refine it)
    pipelines: ClassVar[tuple[str, ...]] = ()  # every pipeline class of its checkpoints (unset: pipeline_class)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not cls.pipelines and hasattr(cls, "pipeline_class"):
            cls.pipelines = (cls.pipeline_class,)

    # What it supports, read by the shared code (vLLM's SupportsX).
    side_multiple: ClassVar[int] = 16  # image sides are multiples of this (pixels per token side, after patching)
    rgba: ClassVar[bool] = False  # reads and writes RGBA images (else RGB, opaque)
    controlnets: ClassVar[bool] = False  # runs the preset's `controlnets` on its generations
    dit_cache: ClassVar[bool] = True  # a request's `cache` (TeaCache, first-block cache) applies
    layers: ClassVar[bool] = False  # decomposes an image into layers (the request's layers, resolution, ...)
    captions: ClassVar[bool] = False  # its encoder captions an input image that comes with an empty prompt
    caption_image_pixels: ClassVar[int] = 0  # with captions: the most pixels the captioner reads an image at
    condition_cache: ClassVar[bool] = False  # keeps a request's condition keys and values across its steps
    vision_in_every_prompt: ClassVar[bool] = False  # its template reads vision tokens in a generation's prompt too
    encoder_model: ClassVar[str] = "qwen2.5-vl"  # the text encoder's architecture (the encoder runners build it)
    default_true_cfg_scale: ClassVar[float | None] = None  # the request's default when it sets none (None: the API's)

    # The preset.

    def pipeline(self, config) -> str:
        """diffusers' pipeline class the preset's checkpoint must be."""
        return self.pipeline_class

    def check_preset(self, config) -> None:
        """Raises ValueError naming the field when the preset asks for what this family does not have. Subclasses
        add their own rules and call this."""
        for name in ("default_width", "default_height", "min_side", "max_side"):
            self.check_side(f"requests.{name}", getattr(config.requests, name))
        if not self.condition_cache and (config.sample_sigmas is not None
                                         or config.dit.cache_memory_bytes is not None):
            raise ValueError(f"sample_sigmas and dit.cache_memory_bytes: {self.title} keeps no condition cache; they "
                             f"are for a family that does (family: {families_with('condition_cache')})")
        if not self.layers and config.edit is not None and config.edit.resolutions is not None:
            raise ValueError(f"edit.resolutions: resolution buckets are for a family that decomposes images into "
                             f"layers (family: {families_with('layers')})")

    def with_checkpoint_settings(self, config):
        """The preset with what its local checkpoint fixes and the preset left out filled in (none by default)."""
        return config

    def check_checkpoint(self, config, source: str) -> None:
        """Raises ConfigError when the checkpoint, of the right pipeline, cannot serve the preset (nothing by
        default)."""

    def write_checkpoint(self, model_dir: pathlib.Path, config) -> None:
        """Writes the checkpoint ``config.build_if_missing`` names (a tiny size, or ``dummy``) to ``model_dir``."""
        edit = config.edit is not None
        plus = edit and config.edit.plus
        if config.build_if_missing == "dummy":
            from omni_ray.checkpoints.dummy import write_dummy_checkpoint

            write_dummy_checkpoint(model_dir, edit=edit, plus=plus, configs=config.configs)
        else:
            from omni_ray.checkpoints.tiny import write_checkpoint

            write_checkpoint(model_dir, seed=0, size=config.build_if_missing, edit=edit, plus=plus)

    # A request.

    def check_side(self, name: str, side: int) -> None:
        """Raises ValueError naming ``name`` unless ``side`` (pixels) is a multiple of ``side_multiple``."""
        if side % self.side_multiple:
            raise ValueError(f"{name} {side} is not a multiple of {self.side_multiple}")

    def check_route(self, config, has_image: bool, has_mask: bool) -> None:
        """RequestError (param ``image`` or ``mask``) when a request's modality is not the preset's: an edit preset
        serves /v1/images/edits (images and a prompt, a mask but on Edit-Plus), any other /v1/images/generations (a
        prompt) and, with a mask, /v1/images/edits (diffusers' text-to-image inpainting)."""
        if has_mask and config.edit is not None and config.edit.plus:
            raise RequestError(f"mask: {config.name!r} edits several images, which diffusers defines no masked edit "
                               "for; masks work on Qwen-Image and Qwen-Image-Edit presets", param="mask")
        if has_image and config.edit is None and not has_mask:
            raise RequestError(f"image: {config.name!r} does not edit images; use /v1/images/generations, or send a "
                               "`mask` with the image to repaint part of it", param="image")
        if not has_image and config.edit is not None:
            raise RequestError(f"image: {config.name!r} edits images; send an `image` and a `prompt` to "
                               "/v1/images/edits", param="image")

    def check_image_tokens(self, image_tokens: int, image_sizes: tuple[tuple[int, int], ...]) -> None:
        """RequestError when the encoder reads the input images (at ``image_sizes``) as ``image_tokens`` vision tokens
        that the DiT cannot line up with their latents (nothing by default: Qwen2.5-VL's read is its own)."""

    # The stages.

    def tokenizer(self, config):
        """The encoder's text side (``omni_ray.tokenizer``): the preset's Qwen-Image prompt template."""
        from omni_ray.tokenizer import PromptTokenizer

        return PromptTokenizer(config.model, config.prompt_template)

    def build_dit_runner(self, config, mesh=None):
        """One rank's DiT runner for a ``dit.runner: model`` preset (``mesh`` None: the replica's only one): the
        shared ``DenoiseRunner`` (offloaded, quantized, with ControlNets as the preset says), compiled and warmed up
        when ``dit.compile`` says so."""
        import logging

        import torch

        from omni_ray.placement import kept_blocks
        from omni_ray.runners.denoise import DenoiseRunner

        stage = config.dit
        offload = stage.offload
        runner = DenoiseRunner.load(config.model, getattr(torch, stage.dtype), stage.device,
                                    stage.teacache_coefficients, dummy=config.weights == "dummy",
                                    max_loras=stage.max_loras, compile=stage.compile,
                                    quantization=stage.quantization, mesh=mesh, controlnets=dict(config.controlnets),
                                    weights_file=stage.weights_file,
                                    offload_resident=(kept_blocks(config, config.gpu_memory_gib)
                                                      if offload is not None else None),
                                    offload_gbps=offload.host_to_device_gbps if offload is not None else 25.0)
        if stage.compile:  # compile now, while the replica is not yet ready, not on a user's first request
            height, width = config.requests.default_height, config.requests.default_width
            seconds = runner.warm_up(height, width)
            logging.getLogger(__name__).info("DiT blocks compiled for %dx%d in %.1f s", width, height, seconds)
        return runner

    def build_vae_runner(self, config, mesh=None):
        """One rank's VAE runner for a ``vae.runner: model`` preset: the shared ``VaeRunner`` (banded past what fits
        untiled with ``vae.tiling: auto``)."""
        import torch

        from omni_ray.placement import vae_untiled_pixels
        from omni_ray.runners.vae import VaeRunner

        stage = config.vae
        auto = stage.tiling == "auto"
        return VaeRunner.load(config.model, getattr(torch, stage.dtype), stage.device,
                              dummy=config.weights == "dummy", tiling=stage.tiling is True, mesh=mesh,
                              tile_above_pixels=vae_untiled_pixels(config, config.gpu_memory_gib) if auto else None)

    def stage_memory(self, config, gpu_memory_gib: float) -> list:
        """Each GPU stage's estimated peak memory against its share (``placement.StageMemory``)."""
        from omni_ray.placement import qwen_image_stage_memory

        return qwen_image_stage_memory(config, gpu_memory_gib)

    def page_settings(self, config) -> dict:
        """What the web page's family-specific fields offer (``layered``: the Layers fields, None when absent)."""
        return {"layered": None}


def families_with(capability: str) -> str:
    """The registered families that have ``capability`` (a ``Family`` attribute), for a message."""
    from omni_ray.families import FAMILIES, family_of

    return " or ".join(name for name in FAMILIES if getattr(family_of(name), capability))


def read_image_processor(model: str) -> dict | None:
    """A local checkpoint's image processor settings: ``processor/preprocessor_config.json`` as the published
    checkpoints have it, or the ``image_processor`` of ``processor_config.json`` as transformers 5 writes one; None
    when it has neither."""
    import json

    folder = pathlib.Path(model) / "processor"
    if (folder / "preprocessor_config.json").is_file():
        return json.loads((folder / "preprocessor_config.json").read_text())
    if (folder / "processor_config.json").is_file():
        return json.loads((folder / "processor_config.json").read_text()).get("image_processor", {})
    return None
