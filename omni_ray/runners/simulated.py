"""Model runners that compute nothing: each waits as long as its stage would take on a GPU (``gpu_costs``) and
returns outputs of the real shapes and dtypes, so that the deployments, engines and schedulers run at Qwen-Image's
real sizes on any machine (``runner: simulated`` in a preset; ``stage_configs/qwen_image_sim.yaml``).

Each stands exactly where its real runner stands: ``SimulatedEncoder`` under the encoder's engine core (vLLM's
``EngineCore`` interface: add, abort, step), ``SimulatedDenoiser`` and ``SimulatedVae`` under ``EngineCore`` with
the DiT's and the VAE's schedulers; ``SimulatedCaptioner`` where Qwen-Image-Layered's captioner stands. The VAE's
pixels are photo-like (smooth colour fields, texture and noise), so that a PNG of them costs what a generated image's
costs (docs/benchmarks.md, load tests).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import numpy as np
import torch

from omni_ray.errors import request_failure
from omni_ray.families.qwen_image.facts import LATENT_CHANNELS, TEXT_HIDDEN, VISION_PATCH, check_side, image_tokens
from omni_ray.families.qwen_image_layered.facts import decoded_frames
from omni_ray.records import (
    Decoded,
    DenoiseBatch,
    DenoiseOutput,
    DenoiseParams,
    ImageEncodeRequest,
    Latents,
    VaeBatch,
    VaeOutput,
)
from omni_ray.runners.gpu_costs import GpuCosts


class Clock(Protocol):
    """What a simulated runner waits on: the ``time`` module, or a benchmark's virtual clock."""

    def monotonic(self) -> float: ...
    def sleep(self, seconds: float) -> None: ...


def _wait_until(deadline: float, clock: Clock = time) -> None:
    remaining = deadline - clock.monotonic()
    if remaining > 0:
        clock.sleep(remaining)


class SimulatedEncoder:
    """Stands for ``VllmEncoder``: each step takes up to ``max_num_seqs`` queued sequences, as vLLM's scheduler
    batches prompts, and returns each one's last hidden states ``[tokens, 3584]`` after the step's simulated time."""

    def __init__(self, dtype: torch.dtype, max_num_seqs: int, costs: GpuCosts | None = None):
        self.dtype = dtype
        self.max_num_seqs = max_num_seqs
        self.costs = costs or GpuCosts.h200()
        self.waiting: dict[str, int] = {}  # sequence id -> tokens, in arrival order

    def add(self, request_id: str, token_ids: list[int], images: tuple[np.ndarray, ...] = ()) -> None:
        tokens = len(token_ids)
        for image in images:  # each placeholder token becomes its image's tokens
            tokens += (image.shape[0] // VISION_PATCH) * (image.shape[1] // VISION_PATCH) - 1
        self.waiting[request_id] = tokens

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.waiting.pop(request_id, None)

    def step(self) -> dict[str, torch.Tensor]:
        started = time.monotonic()
        batch = dict(list(self.waiting.items())[: self.max_num_seqs])
        for sequence_id in batch:
            del self.waiting[sequence_id]
        hidden = {sequence_id: torch.zeros(tokens, TEXT_HIDDEN, dtype=self.dtype)
                  for sequence_id, tokens in batch.items()}
        _wait_until(started + self.costs.encoder_step(sum(batch.values())))
        return hidden

    def shutdown(self) -> None:
        self.waiting.clear()


class SimulatedCaptioner:
    """Stands for ``VllmCaptioner``: each step writes every queued caption at once, after the simulated time of
    reading its template and image (the decoding is not simulated). A caption's tokens are a function of the image
    (its SHA-256's bytes), ``max_tokens`` at most, so a repeated image gets the same caption."""

    def __init__(self, max_tokens: int, costs: GpuCosts | None = None, num_tokens: int = 16):
        self.num_tokens = min(num_tokens, max_tokens)
        self.costs = costs or GpuCosts.h200()
        self.waiting: dict[str, tuple[int, bytes]] = {}  # sequence id -> (prompt tokens, image digest)

    def add(self, sequence_id: str, token_ids: list[int], image: np.ndarray) -> None:
        tokens = len(token_ids) - 1 + (image.shape[0] // VISION_PATCH) * (image.shape[1] // VISION_PATCH)
        digest = hashlib.sha256(repr(image.shape).encode() + np.ascontiguousarray(image).tobytes()).digest()
        self.waiting[sequence_id] = (tokens, digest)

    def abort(self, sequence_ids: list[str]) -> None:
        for sequence_id in sequence_ids:
            self.waiting.pop(sequence_id, None)

    def step(self) -> dict[str, list[int]]:
        started = time.monotonic()
        batch, self.waiting = self.waiting, {}
        # Ids from 256 up: ordinary tokens of Qwen2.5-VL's vocabulary, never its special ones (from 151643).
        captions = {sequence_id: [256 + byte for byte in digest[: self.num_tokens]]
                    for sequence_id, (_, digest) in batch.items()}
        _wait_until(started + self.costs.encoder_step(sum(tokens for tokens, _ in batch.values())))
        return captions

    def shutdown(self) -> None:
        self.waiting.clear()


@dataclass(slots=True)
class _Denoising:
    params: DenoiseParams
    text_tokens: int  # the longer of the prompt's and (with true CFG) the negative prompt's
    true_cfg: bool
    image_tokens: int  # an edit's input image tokens, riding in every pass
    step_index: int = 0

    @property
    def passes(self) -> int:
        return self.params.steps_run * (2 if self.true_cfg else 1)


class SimulatedDenoiser:
    """Stands for ``DenoiseRunner`` under the DiT's scheduler: a step of the batch the scheduler formed takes the
    simulated time of that batch (fixed overhead plus every pass's FLOPs), and a finished request's latents are
    ``[tokens, 64]`` noise of the stage's dtype, drawn from its seed. Cache acceleration is not simulated: every
    pass counts as computed. It takes no LoRA adapters (no layer to adapt).

    With ``ranks`` > 1 it stands for a gang of that many sequence ranks: a ``sequence`` step takes the batch's time
    with every pass split over the ranks (``GpuCosts.dit_step``'s all-to-alls included), a ``rows`` step as long as
    its busiest rank's passes take on one GPU, dealt over the ranks in turn as ``DenoiseRunner.predict`` deals them.
    Every rank of a gang of simulated ranks sleeps the whole gang's step."""

    lora_shapes: dict[str, tuple[int, int]] = {}

    def __init__(self, dtype: torch.dtype, costs: GpuCosts | None = None, ranks: int = 1, clock: Clock = time):
        self.dtype = dtype
        self.costs = costs or GpuCosts.h200()
        self.ranks = ranks
        self.clock = clock
        self.states: dict[str, _Denoising] = {}

    def execute_model(self, batch: DenoiseBatch) -> DenoiseOutput:
        started = self.clock.monotonic()
        for request_id in batch.freed_ids:
            self.states.pop(request_id, None)
        output = DenoiseOutput()
        for request in batch.new_requests:
            params = request.params
            try:
                check_side("height", params.height)
                check_side("width", params.width)
            except ValueError as error:
                output.errors[request.request_id] = request_failure(error)
                continue
            true_cfg = params.true_cfg
            texts = [request.prompt] + ([request.negative] if true_cfg else [])
            extra = sum(image_tokens(*size) for size in request.image_sizes)
            self.states[request.request_id] = _Denoising(params, max(t.num_tokens for t in texts), true_cfg, extra)
        stepped = {rid: self.states[rid] for rid in batch.request_ids if rid in self.states}
        if not stepped:
            return output
        seconds = self._step_seconds(list(stepped.values()), batch.split)
        for request_id, state in stepped.items():
            state.step_index += 1
            output.progress[request_id] = (state.step_index, state.params.steps_run)
            if state.step_index >= state.params.steps_run:
                output.finished[request_id] = self._latents(self.states.pop(request_id))
        _wait_until(started + seconds, self.clock)
        return output

    def _step_seconds(self, rows: list[_Denoising], split: str) -> float:
        """A step's simulated time: every pass split over the ranks, or the busiest rank's passes whole (every row's
        first pass, then the unconditional ones, dealt in turn), text padded to the longest in the forward."""
        first = rows[0]
        image = image_tokens(first.params.height, first.params.width) + first.image_tokens
        if split == "sequence" or self.ranks == 1:
            passes = len(rows) * (2 if first.true_cfg else 1)
            return self.costs.dit_forward(passes, image + max(s.text_tokens for s in rows), self.ranks)
        passes = rows + [row for row in rows if row.true_cfg]
        shares = [passes[rank :: self.ranks] for rank in range(min(self.ranks, len(passes)))]
        return max(self.costs.dit_forward(len(share), image + max(s.text_tokens for s in share)) for share in shares)

    def _latents(self, state: _Denoising) -> Latents:
        params = state.params
        generator = torch.Generator().manual_seed(params.seed)
        latents = torch.randn(image_tokens(params.height, params.width), LATENT_CHANNELS, generator=generator)
        return Latents(latents.to(self.dtype), params.height, params.width,
                       dit_passes={"computed": state.passes, "reused": 0})


class SimulatedVae:
    """Stands for ``VaeRunner`` under the VAE's scheduler: a batch takes the simulated time of its pixels; decoding
    gives photo-like uint8 ``[H, W, 3]`` pixels (Qwen-Image-Layered's layered latents: ``[layers, H, W, 4]``, each
    layer opaque), encoding an edit's image gives zero latents ``[tokens, 64]``."""

    def __init__(self, dtype: torch.dtype, costs: GpuCosts | None = None):
        self.dtype = dtype
        self.costs = costs or GpuCosts.h200()

    def execute_model(self, batch: VaeBatch) -> VaeOutput:
        started = time.monotonic()
        output = VaeOutput()
        pixels = 0
        for request in batch.requests:
            try:
                if isinstance(request, ImageEncodeRequest):
                    height, width = request.image.shape[:2]
                    channels = LATENT_CHANNELS + (4 if request.mask is not None else 0)  # a control mask's
                    latents = torch.zeros(image_tokens(height, width), channels, dtype=self.dtype)
                    output.finished[request.request_id] = Latents(latents, height, width)
                    pixels += height * width
                    continue
                latents = request.latents
                image = None
                if request.output != "latents":
                    image = _pixels(latents)
                    pixels += decoded_frames(latents.layers) * latents.height * latents.width
                output.finished[request.request_id] = Decoded(
                    pixels=image, latents=latents if request.output != "pixels" else None,
                    dit_passes=latents.dit_passes,
                )
            except Exception as err:
                output.errors[request.request_id] = request_failure(err)
        _wait_until(started + self.costs.vae_step(pixels))
        return output


def _pixels(latents: Latents) -> np.ndarray:
    """A decode's pixels: a photo-like image, or for layered latents that many photo-like RGBA layers."""
    variant = _variant(latents)
    if not latents.layers:
        return photo_like(latents.height, latents.width, variant).copy()
    layers = [photo_like(latents.height, latents.width, (variant + layer) % 4) for layer in range(latents.layers)]
    alpha = np.full((latents.layers, latents.height, latents.width, 1), 255, np.uint8)
    return np.concatenate([np.stack(layers), alpha], axis=-1)


def _variant(latents: Latents, variants: int = 4) -> int:
    """One of a few images per size, picked by the latents (so by the request's seed)."""
    return int(abs(float(latents.latents[0, 0])) * 1e4) % variants


@lru_cache(maxsize=16)
def photo_like(height: int, width: int, variant: int = 0) -> np.ndarray:
    """A deterministic image that compresses like a photograph: smooth colour fields, mid-scale texture and a little
    sensor noise (a 1328x1328 PNG of it is about 3 MB and takes as long to encode as a generated image's). Read-only:
    callers copy."""
    rng = np.random.default_rng(variant)
    from PIL import Image

    def field(cells_h: int, cells_w: int, resample) -> np.ndarray:
        cells = rng.integers(0, 256, (max(cells_h, 2), max(cells_w, 2), 3), dtype=np.uint8)
        return np.asarray(Image.fromarray(cells).resize((width, height), resample), np.float32)

    image = 0.7 * field(6, 6, Image.BICUBIC) + 0.3 * field(height // 8, width // 8, Image.BILINEAR)
    image += rng.normal(0, 3, image.shape).astype(np.float32)
    image = np.clip(image, 0, 255).astype(np.uint8)
    image.flags.writeable = False
    return image

