"""A Qwen-Image 2.1 request's denoising state in the DiT stage, and how it is drawn.

``prepare_state`` follows diffusers' ``QwenImage21Pipeline.__call__`` for one request: the noise drawn on the CPU
from the request's seed in the pipeline's shape ``(1, 1, 64, H/16, W/16)`` and flattened row-major (its
``prepare_latents`` and ``_pack_latents``), the flow-match schedule from the request's sigmas with the dynamic shift
of its target tokens. Each pass (the prompt's, and with true CFG the negative's) holds its text until its first step,
and from then on its condition cache (``forward21.ConditionCache``), until the request leaves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from omni_ray.families.qwen_image_2_1.facts import LATENT_CHANNELS, VAE_COMPRESSION, image_tokens, vision_slots
from omni_ray.families.qwen_image_2_1.forward import ConditionCache, Shape
from omni_ray.records import BatchKey, DenoiseParams, Latents, PromptEmbeds
from omni_ray.runners.denoise_state import calculate_shift, one_step_overrides


@dataclass(slots=True)
class Pass21:
    """One of a request's passes each step: the prompt's (conditional) or the negative's (unconditional)."""

    text: torch.Tensor | None  # [encoder_tokens, hidden] on the device, until the condition is cached
    image_slots: torch.Tensor  # bool [encoder_tokens]: the condition images' vision tokens
    cache: ConditionCache | None = None  # from the pass's first step on

    @classmethod
    def of(cls, prompt: PromptEmbeds, device: torch.device, dtype: torch.dtype) -> Pass21:
        slots = prompt.image_slots
        if slots is None:
            slots = torch.zeros(prompt.num_tokens, dtype=torch.bool)
        return cls(prompt.embeds.to(device, dtype), slots.to(device, torch.bool))


@dataclass(slots=True)
class Denoise21State:
    """One request's denoising progress; the runner advances it, the engine owns it."""

    params: DenoiseParams
    latents: torch.Tensor  # [1, target_tokens, 64] on the stage's device
    scheduler: FlowMatchEulerDiscreteScheduler  # private to this request: timesteps, sigmas
    passes: list[Pass21]  # the prompt's, then with true CFG the negative's
    shapes: list[Shape]  # the condition images' (frames, latent rows, latent cols), then the target's
    batch_key: BatchKey  # the request's: states step together only when theirs match
    condition: torch.Tensor | None = None  # [1, condition image tokens, 64] the images' latents one after another,
    # until the condition is cached
    preview: torch.Tensor | None = None  # [1, target_tokens, 64] the last step's predicted clean latents, when
    # params.previews asked for them, until the runner hands them out
    step_index: int = 0

    @property
    def num_steps(self) -> int:
        return len(self.scheduler.timesteps)

    @property
    def is_finished(self) -> bool:
        return self.step_index >= self.num_steps

    @property
    def progress(self) -> tuple[int, int]:
        """(steps done, steps in all)."""
        return self.step_index, self.num_steps

    @property
    def timestep(self) -> torch.Tensor:
        """This step's timestep ``[1]`` in the latents' dtype, scaled to [0, 1] as the pipeline hands it over."""
        return self.scheduler.timesteps[self.step_index].expand(1).to(self.latents.dtype) / 1000

    @property
    def cache_bytes(self) -> int:
        return sum(p.cache.nbytes for p in self.passes if p.cache is not None)

    def advance(self, pred: torch.Tensor, caches: list[ConditionCache]) -> None:
        """One step from the (guided) prediction ``[1, target_tokens, 64]``, with its passes' caches after it: the
        preview it asked for, the Euler update, the caches kept (what they replace, the text and the images'
        latents, let go)."""
        if self.step_index + 1 in self.params.previews:
            sigma = self.scheduler.sigmas[self.step_index]  # x_t = (1 - sigma) x_0 + sigma noise, v = noise - x_0
            self.preview = (self.latents.float() - sigma * pred.float()).to(self.latents.dtype)
        t = self.scheduler.timesteps[self.step_index]
        self.latents = self.scheduler.step(pred, t, self.latents, return_dict=False)[0]
        for one, cache in zip(self.passes, caches):
            one.cache, one.text = cache, None
        self.condition = None
        self.step_index += 1


def prepare_state(
    params: DenoiseParams,
    prompt: PromptEmbeds,
    negative: PromptEmbeds | None,
    images: tuple[Latents, ...],
    *,
    scheduler_config: dict,
    device: torch.device,
    dtype: torch.dtype,
) -> Denoise21State:
    """A request's state before its first step: its noise and schedule, its passes' texts, its condition images'
    latents in order."""
    # 1. The noise, flattened, on the stage's device.
    latents = draw_noise(params, dtype).to(device)
    # 2. The request's own schedule.
    scheduler = request_scheduler(params, scheduler_config, latents.shape[1], device)
    # 3. The passes and the condition images.
    passes = [Pass21.of(prompt, device, dtype)] + ([Pass21.of(negative, device, dtype)] if params.true_cfg else [])
    shapes = [(1, image.height // VAE_COMPRESSION, image.width // VAE_COMPRESSION) for image in images]
    shapes.append((1, params.height // VAE_COMPRESSION, params.width // VAE_COMPRESSION))
    condition = torch.cat([image.latents for image in images]).to(device, dtype)[None] if images else None
    return Denoise21State(
        params=params,
        latents=latents,
        scheduler=scheduler,
        passes=passes,
        shapes=shapes,
        batch_key=BatchKey.of(params, tuple((image.height, image.width) for image in images)),
        condition=condition,
    )


def check_inputs(params: DenoiseParams, prompts: list[PromptEmbeds], images: tuple[Latents, ...],
                 text_hidden: int) -> None:
    """Raises ValueError naming what does not fit the transformer: the prompts' width, their image slots against
    the condition images, the images' latents against their size, the sigmas against the steps."""
    slots = sum(vision_slots(image.height, image.width) for image in images)
    for name, prompt in zip(("prompt", "negative prompt"), prompts):
        if prompt.embeds.ndim != 2 or prompt.embeds.shape[1] != text_hidden:
            raise ValueError(f"{name}: embeddings {tuple(prompt.embeds.shape)}, the transformer reads "
                             f"[tokens, {text_hidden}]")
        marked = 0 if prompt.image_slots is None else int(prompt.image_slots.sum())
        if marked != slots:
            raise ValueError(f"{name}: {marked} image slots, the condition images take {slots}")
    for index, image in enumerate(images):
        expected = (image_tokens(image.height, image.width), LATENT_CHANNELS)
        if tuple(image.latents.shape) != expected:
            raise ValueError(f"images[{index}]: latents {tuple(image.latents.shape)}, a {image.width}x"
                             f"{image.height} image has {expected}")
    if params.sigmas is not None and len(params.sigmas) != params.num_inference_steps:
        raise ValueError(f"sigmas: {len(params.sigmas)} of them for {params.num_inference_steps} steps")


def draw_noise(params: DenoiseParams, dtype: torch.dtype) -> torch.Tensor:
    """The request's noise ``[1, target_tokens, 64]``: drawn on the CPU in the pipeline's shape
    ``(1, 1, 64, H/16, W/16)``, so the same seed gives the same image on any device, then flattened row-major."""
    rows, cols = params.height // VAE_COMPRESSION, params.width // VAE_COMPRESSION
    generator = torch.Generator("cpu").manual_seed(params.seed)
    noise = torch.randn((1, 1, LATENT_CHANNELS, rows, cols), generator=generator, dtype=dtype)
    return noise.view(1, LATENT_CHANNELS, rows * cols).transpose(1, 2)


def request_scheduler(params: DenoiseParams, scheduler_config: dict, target_tokens: int,
                      device: torch.device) -> FlowMatchEulerDiscreteScheduler:
    """The request's flow-match scheduler: the checkpoint's config under the request's settings, the request's
    sigmas (evenly spaced from 1 without them) shifted by ``mu`` of its target tokens, as the pipeline sets it."""
    steps = params.num_inference_steps
    sigmas = list(params.sigmas) if params.sigmas is not None else np.linspace(1.0, 1 / steps, steps)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        {**scheduler_config, **dict(params.scheduler)}, **one_step_overrides(steps))
    scheduler.set_timesteps(sigmas=sigmas, device=device, mu=calculate_shift(target_tokens, scheduler.config))
    scheduler.set_begin_index(0)
    return scheduler
