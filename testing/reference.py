"""References for the tests and benchmarks: the stages chained as diffusers batches them, Qwen2.5-VL run through
transformers, diffusers' QwenImageEditPipeline and QwenImageEditPlusPipeline with the preset's areas, and photo-like
test images.

``ReferencePipeline`` runs the three stage runners in one process without any engine, batching as diffusers'
``QwenImagePipeline`` batches (all prompts together, the negative prompts in a second encoder pass, CFG's two
passes separately, one decode): the same operations on the same values, so its pixels equal diffusers' exactly.

diffusers' QwenImageEditPipeline is the reference for edits, with two settings:

1. The working area. diffusers resizes the input image to 1024x1024 pixels (a constant in ``__call__``); the tiny
   preset uses 128x128, so the reference is run with ``calculate_dimensions`` given the preset's area.
2. M-RoPE. diffusers 0.42 calls the text encoder with ``input_ids``, ``attention_mask``, ``pixel_values`` and
   ``image_grid_thw`` but not the ``mm_token_type_ids`` its own processor returns; transformers 5 needs them to
   give the image tokens their 2D rotary positions and otherwise falls back to 1D positions, which Qwen2.5-VL was
   not trained with. The reference's text encoder gets them (the processor's values: 1 on image tokens), so it runs
   Qwen2.5-VL as transformers' processor and model run it together, and as vLLM runs it.
"""

from __future__ import annotations

import contextlib
import io
import math
from unittest import mock

import numpy as np
import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import (
    pipeline_qwenimage_edit,
    pipeline_qwenimage_edit_inpaint,
    pipeline_qwenimage_edit_plus,
)
from PIL import Image
from transformers import Qwen2_5_VLForConditionalGeneration

from omni_ray.config import EditConfig, PipelineConfig
from omni_ray.engine.encoder_core import to_prompt_embeds
from omni_ray.families.qwen_image.facts import TEXT_TO_IMAGE, PromptTemplate, uses_true_cfg
from omni_ray.records import DenoiseParams, PromptEmbeds
from omni_ray.runners.denoise import DenoiseRunner
from omni_ray.runners.denoise_state import DenoiseState
from omni_ray.runners.transformers_encoder import last_hidden_states
from omni_ray.runners.vae import VaeRunner
from omni_ray.runners.vision import VisionInputs
from omni_ray.tokenizer import PromptTokenizer


class UnfusedDenoiseRunner(DenoiseRunner):
    """The DiT runner with CFG's two passes run apart, as diffusers runs them. The engine's one forward pads the
    negative prompt to the prompt's length, which moves float sums by rounding; apart, the values are diffusers'."""

    def predict(self, states: list[DenoiseState], split: str = "sequence"):
        latents = torch.cat([s.latents for s in states])
        if states[0].image is not None:
            latents = torch.cat([latents, torch.cat([s.image for s in states])], dim=1)
        timesteps = torch.stack([s.scheduler.timesteps[s.step_index] for s in states])
        shapes, loras = [s.img_shapes for s in states], [s.params.loras for s in states]
        steps = [(s.step_index, s.num_steps) for s in states]

        def branch(texts, index):
            caches = [s.caches[index] if s.caches else None for s in states]
            return self._forward(latents, timesteps, texts, shapes, caches, steps, loras)

        cond, caches = branch([s.prompt for s in states], 0)
        if not states[0].params.true_cfg:
            return cond, None, caches
        uncond, uncond_caches = branch([s.negative for s in states], 1)
        return cond, uncond, caches + uncond_caches


class ReferencePipeline:
    """Loads each stage runner from a preset and runs requests through them as diffusers batches them."""

    def __init__(self, config: PipelineConfig):
        self.config = config
        self.encoder = PromptEncoder(
            config.model, getattr(torch, config.encoder.dtype), config.encoder.device,
            config.encoder.max_sequence_length, config.prompt_template,
        )
        self.denoiser = UnfusedDenoiseRunner.load(config.model, getattr(torch, config.dit.dtype), config.dit.device)
        self.decoder = VaeRunner.load(config.model, getattr(torch, config.vae.dtype), config.vae.device)

    def generate(self, prompts, *, seeds, height, width, num_inference_steps, negative_prompts=None,
                 true_cfg_scale=4.0, image=None) -> np.ndarray:
        """Images for ``prompts`` (one seed each), as uint8 ``[B, H, W, 3]``; an edit preset edits ``image``
        (uint8 ``[H, W, 3]`` at its working size)."""
        assert len(seeds) == len(prompts) and (image is not None) == (self.config.edit is not None)
        images = (image,) if image is not None else ()
        prompt_embeds = self.encoder.encode(prompts, images)
        use_cfg = uses_true_cfg(true_cfg_scale, negative_prompts is not None)
        negative_embeds = self.encoder.encode(negative_prompts, images) if use_cfg else [None] * len(prompts)
        image_latents = tuple(self.decoder.encode(list(images))) if images else ()
        states = [
            self.denoiser.prepare(
                DenoiseParams(height, width, num_inference_steps, seed, true_cfg_scale, true_cfg=use_cfg), prompt,
                negative, image_latents,
            )
            for prompt, negative, seed in zip(prompt_embeds, negative_embeds, seeds)
        ]
        for _ in range(num_inference_steps):
            self.denoiser.step(states)
        return self.decoder.decode([self.denoiser.finish(state) for state in states])


def load_reference(checkpoint, token_types: bool = True, pipeline=QwenImageEditPipeline) -> QwenImageEditPipeline:
    """diffusers' edit ``pipeline`` (QwenImageEditPipeline, or QwenImageEditPlusPipeline), its text encoder given
    the image tokens' types (the module's docstring says why) unless ``token_types`` is False."""
    pipe = pipeline.from_pretrained(checkpoint)
    if token_types:
        text_encoder = pipe.text_encoder
        forward = text_encoder.forward
        image_token_id = text_encoder.config.image_token_id

        def forward_with_token_types(input_ids=None, **kwargs):
            kwargs.setdefault("mm_token_type_ids", (input_ids == image_token_id).long())
            return forward(input_ids=input_ids, **kwargs)

        text_encoder.forward = forward_with_token_types
    return pipe


def reference_edit(pipe: QwenImageEditPipeline, image_area: int, image: Image.Image, seed: int, **kwargs) -> np.ndarray:
    """uint8 ``[H, W, 3]``: diffusers' edit of ``image`` with its working area set to ``image_area``."""
    calculate = pipeline_qwenimage_edit.calculate_dimensions
    with mock.patch.object(
        pipeline_qwenimage_edit, "calculate_dimensions", lambda _, ratio: calculate(image_area, ratio)
    ):
        pixels = pipe(image=image, generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **kwargs)
    return (pixels.images[0] * 255).round().astype(np.uint8)


def reference_edit_plus(pipe: QwenImageEditPlusPipeline, edit: EditConfig, images: list[Image.Image], seed: int,
                        **kwargs) -> np.ndarray:
    """uint8 ``[H, W, 3]``: diffusers' Edit-Plus edit of ``images``, with the preset's areas in place of diffusers'
    constants: ``condition_area`` for the encoder's 384x384, ``image_area`` for the VAE's and the output's
    1024x1024."""
    calculate = pipeline_qwenimage_edit_plus.calculate_dimensions
    areas = {pipeline_qwenimage_edit_plus.CONDITION_IMAGE_SIZE: edit.condition_area,
             pipeline_qwenimage_edit_plus.VAE_IMAGE_SIZE: edit.image_area}
    with mock.patch.object(
        pipeline_qwenimage_edit_plus, "calculate_dimensions", lambda area, ratio: calculate(areas[area], ratio)
    ):
        pixels = pipe(image=images, generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **kwargs)
    return (pixels.images[0] * 255).round().astype(np.uint8)


def reference_masked(pipe, image: Image.Image, repaint: Image.Image, seed: int, image_area: int | None = None,
                     dimensions: tuple[int, int] | None = None, **kwargs) -> np.ndarray:
    """uint8 ``[H, W, 3]``: diffusers' inpaint pipeline ``pipe`` (QwenImageInpaintPipeline; or
    QwenImageEditInpaintPipeline, its working area set to ``image_area``, or its dimensions, which it edits and
    draws at, to ``dimensions`` (height, width)) on ``image``, repainting where ``repaint`` (diffusers' mask image)
    is white."""
    patch = contextlib.nullcontext()
    if image_area is not None:
        calculate = pipeline_qwenimage_edit_inpaint.calculate_dimensions
        patch = mock.patch.object(pipeline_qwenimage_edit_inpaint, "calculate_dimensions",
                                  lambda _, ratio: calculate(image_area, ratio))
    if dimensions is not None:
        patch = mock.patch.object(pipeline_qwenimage_edit_inpaint, "calculate_dimensions",
                                  lambda _, ratio: (dimensions[1], dimensions[0], None))
    with patch:
        pixels = pipe(image=image, mask_image=repaint, generator=torch.Generator("cpu").manual_seed(seed),
                      output_type="np", **kwargs)
    return (pixels.images[0] * 255).round().astype(np.uint8)


def reference_controlnet(pipe, control_images, seed: int, **kwargs) -> np.ndarray:
    """uint8 ``[H, W, 3]``: diffusers' ``QwenImageControlNetPipeline`` ``pipe`` with ``control_images`` (PIL images
    or uint8 ``[H, W, 3]`` arrays, in the request's order, each at the output's size: the pipeline would resize
    them, and omni-ray refuses any other size), the seed's CPU generator, and ``kwargs`` (prompt,
    ``controlnet_conditioning_scale``, ``control_guidance_start`` / ``_end`` as lists for several, ...). Several
    control images need a ``QwenImageMultiControlNetModel``, which in diffusers 0.42 holds exactly one net (a
    ControlNet-Union, run once per control image with that image's scale; more nets raise): the parity of several
    controls is that of one preset ControlNet named by every control. One image takes a single
    ``QwenImageControlNetModel`` too. The output's size is the control images' unless ``height`` / ``width`` are
    given.

    The pipeline draws from the one generator, in order: each control image's latent sample (``retrieve_latents``),
    then the noise; omni-ray's VAE gives the k-th control image's sample with ``ImageEncodeRequest.draw`` k, and its
    DiT draws the noise after as many samples of the control latents' shape."""
    from diffusers import QwenImageMultiControlNetModel

    images = [Image.fromarray(image) if isinstance(image, np.ndarray) else image for image in control_images]
    if not images or any(image.size != images[0].size for image in images):
        raise ValueError("control images: at least one, all of one size")
    multi = isinstance(pipe.controlnet, QwenImageMultiControlNetModel)
    if not multi and len(images) != 1:
        raise ValueError("several control images need a QwenImageMultiControlNetModel")
    kwargs.setdefault("width", images[0].width)
    kwargs.setdefault("height", images[0].height)
    pixels = pipe(control_image=images if multi else images[0], generator=torch.Generator("cpu").manual_seed(seed),
                  output_type="np", **kwargs)
    return (pixels.images[0] * 255).round().astype(np.uint8)


def reference_controlnet_inpaint(pipe, control_image, repaint: np.ndarray, seed: int, **kwargs) -> np.ndarray:
    """uint8 ``[H, W, 3]``: diffusers' ``QwenImageControlNetInpaintPipeline`` ``pipe`` with ``control_image`` (PIL or
    uint8 ``[H, W, 3]``, at the output's size) and ``repaint`` (boolean ``[H, W]``: the pipeline's ``control_mask``,
    white where set), the seed's CPU generator, and ``kwargs`` (prompt, ``controlnet_conditioning_scale``, ...).

    The pipeline samples the masked control image's latents from torch's global generator and the noise from its
    own: torch's global generator is seeded with ``seed`` first, as omni-ray draws that sample from a fresh
    generator seeded with the image's seed."""
    image = Image.fromarray(control_image) if isinstance(control_image, np.ndarray) else control_image
    kwargs.setdefault("width", image.width)
    kwargs.setdefault("height", image.height)
    torch.manual_seed(seed)
    pixels = pipe(control_image=image, control_mask=Image.fromarray(repaint.astype(np.uint8) * 255, mode="L"),
                  generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **kwargs)
    return (pixels.images[0] * 255).round().astype(np.uint8)


def openai_mask(repaint: np.ndarray) -> bytes:
    """OpenAI's mask for a boolean ``[H, W]`` array: an RGBA PNG, fully transparent where ``repaint`` is set."""
    pixels = np.zeros((*repaint.shape, 4), np.uint8)
    pixels[..., 3] = np.where(repaint, 0, 255)
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="RGBA").save(buffer, format="PNG")
    return buffer.getvalue()


def source_image(width: int, height: int, seed: int) -> Image.Image:
    """A photo-like input for tests and benchmarks: smooth colour gradients, a bright disc, and some noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    cx, cy = rng.uniform(0.2, 0.8, 2) * (width / max(width, height), height / max(width, height))
    disc = ((x - cx) ** 2 + (y - cy) ** 2 < 0.04)[..., None]
    base = np.stack([x, y, 1 - x * y], axis=-1) * rng.uniform(120, 255, 3)
    pixels = np.where(disc, rng.uniform(0, 255, 3), base) + rng.normal(0, 8, (height, width, 3))
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


class TransformersTextEncoder:
    """Token ids (and for edits an image) to last hidden states with transformers' Qwen2.5-VL: the reference.

    Text sequences run as one right-padded batch with an attention mask, exactly as diffusers runs them; a sequence
    with an image runs alone, as diffusers' edit pipeline runs each prompt with its image.
    """

    def __init__(self, model: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        self.device = torch.device(device)
        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model, subfolder="text_encoder", dtype=dtype)
        self.model.to(self.device).eval()

    def __call__(
        self, token_ids: list[list[int]], pad_token_id: int, vision: dict[str, torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """Returns each sequence's last hidden state, ``[num_tokens_i, hidden]``: the encoder stage's own forward
        (``runners.transformers_encoder.last_hidden_states``). With ``vision`` (one image's ``pixel_values`` and
        ``image_grid_thw``), the one sequence holds that image's tokens already expanded."""
        return last_hidden_states(self.model, token_ids, pad_token_id, vision)


class PromptEncoder:
    """Prompts to ``PromptEmbeds`` with the transformers forward pass; the encoder engine swaps in vLLM's."""

    def __init__(
        self,
        model: str,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        max_sequence_length: int = 512,
        template: PromptTemplate = TEXT_TO_IMAGE,
    ):
        self.tokenizer = PromptTokenizer(model, template)
        self.vision = VisionInputs(model) if template.has_image else None
        self.text_encoder = TransformersTextEncoder(model, dtype, device)
        self.max_sequence_length = max_sequence_length

    def encode(self, prompts: list[str], images: tuple[np.ndarray, ...] = ()) -> list[PromptEmbeds]:
        """Every prompt's embeddings; for edits each prompt is encoded with ``images``."""
        token_ids = [self.tokenizer.tokenize(prompt, len(images)) for prompt in prompts]
        if not images:
            hidden = self.text_encoder(token_ids, self.tokenizer.pad_token_id)
        else:
            vision = self.vision(images)
            counts = self.vision.tokens(vision)
            hidden = [
                self.text_encoder([self.tokenizer.expand_images(ids, counts)], self.tokenizer.pad_token_id, vision)[0]
                for ids in token_ids
            ]
        return [to_prompt_embeds(h, self.tokenizer.template, self.max_sequence_length) for h in hidden]


def reference21(pipe, seed: int, images: list[Image.Image] | None = None, image_area: int = 64 * 64,
                **kwargs) -> np.ndarray:
    """uint8 ``[H, W, 4]`` (RGBA): diffusers' ``QwenImage21Pipeline`` with the preset's condition area
    (``edit.image_area``) as its ``output_resolution`` squared, the seed's CPU generator, and ``kwargs``."""
    side = math.isqrt(image_area)
    assert side * side == image_area, "the pipeline takes a square area"
    pixels = pipe(image=images, output_resolution=side, generator=torch.Generator("cpu").manual_seed(seed),
                  output_type="np", **kwargs)
    return (pixels.images[0] * 255).round().astype(np.uint8)


def rgba_source(width: int, height: int, seed: int) -> Image.Image:
    """A photo-like RGBA image whose alpha falls from opaque to a sixth across it, with a transparent corner."""
    rgb = np.asarray(source_image(width, height, seed))
    alpha = np.linspace(255, 40, width)[None, :].repeat(height, 0)
    alpha[: height // 4, : width // 4] = 0
    return Image.fromarray(np.dstack([rgb, alpha.astype(np.uint8)]), "RGBA")


def reference_layers(pipe, image: Image.Image, bucket: int, seed: int, caption_tokens: int, **kwargs):
    """diffusers' layers (uint8 RGBA arrays, bottom first) and its caption, with the pipeline's resolution bucket
    standing for the tiny preset's (its calculate_dimensions given the bucket's area) and its caption bounded as
    the preset bounds ours (get_image_caption's generate given ``caption_tokens`` new tokens at most)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_layered as module

    captions = []
    original_dimensions, original_caption = module.calculate_dimensions, pipe.get_image_caption
    generate = pipe.text_encoder.generate

    def bounded_generate(*args, **generate_kwargs):
        return generate(*args, **{**generate_kwargs, "max_new_tokens": caption_tokens})

    def caption(*args, **caption_kwargs):
        captions.append(original_caption(*args, **caption_kwargs))
        return captions[-1]

    module.calculate_dimensions = lambda area, ratio: original_dimensions(bucket * bucket, ratio)
    pipe.get_image_caption, pipe.text_encoder.generate = caption, bounded_generate
    try:
        output = pipe(image=image, generator=torch.Generator().manual_seed(seed), resolution=640, **kwargs)
    finally:
        module.calculate_dimensions = original_dimensions
        pipe.get_image_caption, pipe.text_encoder.generate = original_caption, generate
    return [np.asarray(layer.convert("RGBA")) for layer in output.images[0]], (captions[0] if captions else None)
