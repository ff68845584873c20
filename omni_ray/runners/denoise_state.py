"""A request's denoising state in the DiT stage: what the runner steps, and how a request's is drawn.

``prepare_state`` follows diffusers' ``QwenImagePipeline.__call__`` for one request: the noise drawn on the CPU from
the request's seed in the unpacked shape, the dynamic-shift flow-match schedule, and for a masked edit
(``QwenImageInpaintPipeline``, ``QwenImageEditInpaintPipeline``) the start image's latents noised to the first step's
level; with ControlNets (``QwenImageControlNetPipeline``), the control images' latents, whose samples the pipeline's
generator drew before the noise. ``DenoiseState.advance`` is the loop body after the transformer: the Euler update,
a masked edit's blend, the step's preview.

Qwen-Image-Layered (``QwenImageLayeredPipeline``, ``params.layers`` > 0) denoises ``layers + 1`` frames at the
output's size, drawn together and packed frame after frame; its input image's latents ride behind them as an edit's
do, numbered -1 on the rotary layer axis (the frames 0 to ``layers``); its schedule's sigmas run
``linspace(1, 0, steps + 1)[:-1]`` with its own ``mu`` (``qwen_image_layered.schedule_mu`` of the input image's
tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from omni_ray.families.qwen_image.facts import SIZE_MULTIPLE, latent_grid
from omni_ray.families.qwen_image_layered.facts import dit_frames, schedule_mu
from omni_ray.records import BatchKey, DenoiseParams, Latents, PromptEmbeds
from omni_ray.runners.dit_cache import BranchCache
from omni_ray.runners.packing import pack_latents


@dataclass(slots=True)
class InpaintState:
    """A masked edit's fixed tensors, packed like the latents ``[1, image_seq_len, in_channels]``."""

    start: torch.Tensor  # the start image's latents (sampled)
    noise: torch.Tensor  # the request's noise: noised to each level, the start image is what the mask keeps
    mask: torch.Tensor  # 1 where the step's latents stay, 0 where the start image's come back

    @classmethod
    def of(
        cls, params: DenoiseParams, start: Latents, noise: torch.Tensor, channels: int, device: torch.device,
        dtype: torch.dtype,
    ) -> InpaintState:
        """A masked edit's start latents, noise and mask packed as diffusers packs them (the mask repeated over the
        latent channels)."""
        if (start.height, start.width) != (params.height, params.width):
            raise ValueError(f"a masked edit's start image is {start.width}x{start.height}, its output "
                             f"{params.width}x{params.height}")
        rows, cols = latent_grid(params.height, params.width)
        grid = torch.from_numpy(params.inpaint.mask).to(dtype)
        if grid.shape != (rows, cols):
            raise ValueError(f"the mask is {grid.shape[1]}x{grid.shape[0]} on the latent grid, not {cols}x{rows}")
        mask = pack_latents(grid.expand(1, 1, channels, rows, cols)).to(device)
        return cls(start.latents.to(device, dtype).unsqueeze(0), noise, mask)

    def blend(self, latents: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """diffusers' ``(1 - mask) * init_latents_proper + mask * latents``."""
        return (1 - self.mask) * kept + self.mask * latents


@dataclass(slots=True)
class DenoiseState:
    """One request's denoising progress; the runner advances it, the engine owns it."""

    params: DenoiseParams
    latents: torch.Tensor  # [1, image_seq_len, in_channels], on the stage's device (Qwen-Image-Layered: its frames'
    # tokens one after another)
    scheduler: FlowMatchEulerDiscreteScheduler  # private to this request: timesteps, sigmas
    prompt: torch.Tensor  # [num_tokens, hidden], on the stage's device
    negative: torch.Tensor | None  # [num_neg_tokens, hidden], set when true CFG runs
    img_shapes: list[tuple[int, int, int]]  # (frames, latent rows, latent cols) after packing; the edit images' next
    batch_key: BatchKey  # the request's: states step together only when theirs match
    image: torch.Tensor | None = None  # edits: the input images' packed latents one after another [1, tokens, C]
    caches: list[BranchCache] | None = None  # with cache acceleration: the conditional pass's, the unconditional's
    preview: torch.Tensor | None = None  # [1, image_seq_len, in_channels] the last step's predicted clean latents,
    # when params.previews asked for them, until the runner hands them out
    step_index: int = 0  # into the whole schedule: a masked edit starts at params.first_step
    inpaint: InpaintState | None = None  # a masked edit's start image, noise and mask
    home: int | None = None  # with CFG ranks and a cache: the rank that holds its caches (``parallel.split``)
    controls: tuple[torch.Tensor, ...] = ()  # params.controls' control images' packed latents [1, image_seq_len, C]

    @property
    def num_steps(self) -> int:
        return len(self.scheduler.timesteps)

    @property
    def is_finished(self) -> bool:
        return self.step_index >= self.num_steps

    @property
    def progress(self) -> tuple[int, int]:
        """(steps done, steps run): what the request sees, a masked edit's skipped steps left out."""
        first = self.params.first_step
        return self.step_index - first, self.num_steps - first

    def advance(self, pred: torch.Tensor, caches: list[BranchCache | None]) -> None:
        """One step from the transformer's (guided) prediction ``[1, image_seq_len, in_channels]``, with this
        request's passes' caches after it: the preview it asked for, the scheduler's Euler update, a masked edit's
        blend, the caches kept with the step (so a step retried alone decides from the same caches)."""
        if self.step_index + 1 in self.params.previews:
            self.preview = self._predicted_clean(pred)
        t = self.scheduler.timesteps[self.step_index]
        self.latents = self.scheduler.step(pred, t, self.latents, return_dict=False)[0]
        if self.inpaint is not None:
            self.latents = self._keep_unmasked()
        if self.caches:
            self.caches = caches
        self.step_index += 1

    def _predicted_clean(self, pred: torch.Tensor) -> torch.Tensor:
        """The clean latents the step predicts: flow matching's ``x_t = (1 - sigma) x_0 + sigma * noise`` with
        velocity ``noise - x_0``, so ``x_0 = x_t - sigma * v`` (in float32, as the scheduler computes its update); a
        masked edit's keeps its start image where the mask says."""
        sigma = self.scheduler.sigmas[self.step_index]
        clean = (self.latents.float() - sigma * pred.float()).to(self.latents.dtype)
        return self.inpaint.blend(clean, self.inpaint.start) if self.inpaint is not None else clean

    def _keep_unmasked(self) -> torch.Tensor:
        """After a masked edit's step (the scheduler's index already on the next): the start image noised to the
        next step's level where the mask is 0 (the clean start image after the last step), as diffusers' inpaint
        loop."""
        inpaint, scheduler = self.inpaint, self.scheduler
        kept = inpaint.start
        if self.step_index + 1 < self.num_steps:
            next_t = scheduler.timesteps[self.step_index + 1 : self.step_index + 2]
            kept = scheduler.scale_noise(inpaint.start, next_t, inpaint.noise)
        return inpaint.blend(self.latents, kept)


def prepare_state(
    params: DenoiseParams,
    prompt: PromptEmbeds,
    negative: PromptEmbeds | None,
    images: tuple[Latents, ...],
    start: Latents | None,
    controls: tuple[Latents, ...] = (),
    *,
    scheduler_config: dict,
    channels: int,  # the transformer's latent channels before packing (in_channels // 4)
    device: torch.device,
    dtype: torch.dtype,
) -> DenoiseState:
    """A request's state before its first step: its noise and schedule; an edit's image latents come along, in
    order. A masked edit (``params.inpaint``) starts from ``start``, its start image's latents noised to its first
    step's level. ``controls`` are ``params.controls``' control images' latents, in order (checked by the runner)."""
    # 1. The noise, packed, on the stage's device.
    latents = pack_latents(draw_noise(params, channels, dtype)).to(device)
    # 2. The request's own schedule, started at its first step (Qwen-Image-Layered's shift reads its input image).
    shift_tokens = images[0].latents.shape[0] if params.layers else latents.shape[1]
    scheduler = request_scheduler(params, scheduler_config, shift_tokens, device)
    # 3. A masked edit: its start image noised to the first step's level.
    inpaint = None
    if params.inpaint is not None:
        inpaint = InpaintState.of(params, start, latents, channels, device, dtype)
        first = params.first_step
        latents = scheduler.scale_noise(inpaint.start, scheduler.timesteps[first : first + 1], latents)
    # 4. What rides beside the latents in every forward: the prompts, an edit's images and their rotary shapes.
    do_true_cfg = params.true_cfg
    rows, cols = latent_grid(params.height, params.width)
    img_shapes = [(1, rows // 2, cols // 2)] * frames(params)
    img_shapes += [(1, image.height // SIZE_MULTIPLE, image.width // SIZE_MULTIPLE) for image in images]
    image = torch.cat([image.latents for image in images]).to(device, dtype) if images else None
    return DenoiseState(
        params=params,
        latents=latents,
        scheduler=scheduler,
        prompt=prompt.embeds.to(device, dtype),
        negative=negative.embeds.to(device, dtype) if do_true_cfg else None,
        img_shapes=img_shapes,
        batch_key=BatchKey.of(params, tuple((image.height, image.width) for image in images)),
        image=image.unsqueeze(0) if image is not None else None,
        caches=[BranchCache(params.cache)] * (2 if do_true_cfg else 1) if params.cache is not None else None,
        step_index=params.first_step,
        inpaint=inpaint,
        controls=tuple(control.latents.to(device, dtype).unsqueeze(0) for control in controls),
    )


def frames(params: DenoiseParams) -> int:
    """The frames a request denoises: one image, or Qwen-Image-Layered's composite and layers."""
    return dit_frames(params.layers) if params.layers else 1


def draw_noise(params: DenoiseParams, channels: int, dtype: torch.dtype) -> torch.Tensor:
    """The request's noise ``[1, frames, channels, rows, cols]`` (``frames``), drawn on the CPU in diffusers'
    unpacked shape, so the same seed gives the same image on any device. Draws the pipelines make from the same
    generator before the noise are skipped: a masked edit's start image's sample, and each control image's
    (``QwenImageControlNetPipeline`` encodes them in order, ``retrieve_latents`` drawing ``mean + std * randn`` of the
    latents' shape ``[1, channels, 1, rows, cols]`` from its generator, before ``prepare_latents``). An inpainting
    ControlNet's control image is not among them: ``QwenImageControlNetInpaintPipeline`` samples it from torch's
    global generator, leaving the pipeline's own to the noise (``Control.mask``)."""
    rows, cols = latent_grid(params.height, params.width)
    generator = torch.Generator("cpu").manual_seed(params.seed)
    earlier = sum(not control.mask for control in params.controls) + (params.inpaint is not None)
    for _ in range(earlier):  # the VAE drew these samples from this seed's generator first
        torch.randn((1, channels, 1, rows, cols), generator=generator, dtype=dtype)
    return torch.randn((1, frames(params), channels, rows, cols), generator=generator, dtype=dtype)


def request_scheduler(
    params: DenoiseParams, scheduler_config: dict, image_seq_len: int, device: torch.device
) -> FlowMatchEulerDiscreteScheduler:
    """The request's flow-match scheduler: the checkpoint's config under the request's settings, diffusers' sigmas
    and dynamic shift, begun at ``params.first_step``. ``image_seq_len`` is the tokens the shift reads: the output's
    (Qwen-Image-Layered: its input image's, under its own rule)."""
    steps = params.num_inference_steps
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        {**scheduler_config, **dict(params.scheduler)}, **one_step_overrides(steps))
    if params.layers:  # QwenImageLayeredPipeline's own sigmas and mu
        sigmas, mu = np.linspace(1.0, 0, steps + 1)[:-1], schedule_mu(image_seq_len)
    else:
        sigmas, mu = np.linspace(1.0, 1 / steps, steps), calculate_shift(image_seq_len, scheduler.config)
    scheduler.set_timesteps(sigmas=sigmas, device=device, mu=mu)
    scheduler.set_begin_index(params.first_step)
    return scheduler


def calculate_shift(image_seq_len: int, config) -> float:
    """diffusers' dynamic-shift ``mu``: linear in the number of image tokens."""
    base_len, max_len = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    base_shift, max_shift = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
    m = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * m + (base_shift - m * base_len)


def one_step_overrides(num_inference_steps: int) -> dict:
    """Scheduler config changes that a one-step schedule needs.

    Qwen-Image's config stretches the schedule so that its last sigma lands on ``shift_terminal``. With one step the
    only sigma is 1.0 and the stretch divides 0 by 0, so diffusers' pipeline returns NaN latents (a black image).
    One step without the stretch is the plain Euler step from pure noise to sigma 0.
    """
    return {"shift_terminal": None} if num_inference_steps == 1 else {}
