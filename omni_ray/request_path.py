"""One request path: a planned request in, a stream of typed events out.

``run_request`` alone owns what a request means across the stages: what each stage is asked (the plan has decided
true CFG once; the encoder encodes the negative prompt and the DiT runs its pass only then), the edit branch, the
fan-out over ``n``, the deadline, cancellation when the caller goes away, retries of lost stage calls, and error
events. It reaches the stages through ``Stages``, a small Ray-free protocol with two implementations: the engines in
one process (``omni_ray.pipeline.LocalStages``) and Serve deployment handles
(``deployments.stages.ServeStages``), which pass each stage's result to the next by reference. Every caller
is a view of the stream: a JSON response drains it (``collect``), server-sent events forward it, the in-process
pipeline collects it.

Stage calls are deterministic in their inputs (each image's seed rides in its parameters), so a call lost with its
replica is issued again and gives the same image; a request fails when a stage fails it, when one image has lost
more calls than ``limits.max_retries``, or when its deadline passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from omni_ray.api.planning import GenerationPlan
from omni_ray.config import LoraEntry, RequestLimits
from omni_ray.errors import DeadlineExceededError, EngineError, OmniRayError, StageCall, StageLostError
from omni_ray.records import (
    Caption,
    CaptionRequest,
    Decoded,
    DenoiseParams,
    EncodeRequest,
    Finished,
    OutputMode,
    Preview,
    StepDone,
)

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

Handle = TypeVar("Handle")  # a started stage call's result: the record itself in process, a reference across Ray

DenoiseEvent = StepDone | Preview | Finished  # Preview and Finished carry handles to the DiT's latents


class Stages(ABC, Generic[Handle]):
    """The stage calls a request makes. ``encode_prompt`` and ``encode_image`` start their call and return at once
    with a handle that the request path only passes on; every failure surfaces as an ``OmniRayError`` where a
    handle is consumed, ``StageLostError`` (naming the lost call) when a replica or its result was lost."""

    @abstractmethod
    def put_image(self, image: np.ndarray) -> Handle:
        """One of an edit's input images (uint8 ``[H, W, 3]``), stored once for every call that reads it."""

    @abstractmethod
    def encode_prompt(self, request: EncodeRequest, images: tuple[Handle, ...]) -> Handle:
        """Starts encoding the prompt (and the negative prompt, when given), with the edit's images."""

    @abstractmethod
    async def caption(self, request: CaptionRequest, image: Handle) -> Caption:
        """Qwen-Image-Layered's caption of an input image (stored by ``put_image``; ``request.image`` is not read),
        written by the encoder for a request without a prompt."""

    @abstractmethod
    def encode_image(self, request_id: str, image: Handle, seed: int | None = None, draw: int = 0,
                     mask: Handle | None = None, *, priority: int = 0, tenant: str = "") -> Handle:
        """Starts encoding one of an edit's input images to latents the DiT edits beside (the distribution's mode),
        or with ``seed`` a masked edit's start image or a control image (a sample drawn with it: the seed's
        generator's ``draw``-th of that shape, ``ImageEncodeRequest.draw``); with ``mask`` (stored by
        ``put_image``), an inpainting ControlNet's control image and mask (``ImageEncodeRequest.mask``). The VAE
        takes it by ``priority`` and ``tenant``'s share, as every stage takes the request's work."""

    @abstractmethod
    def denoise(
        self, request_id: str, params: DenoiseParams, prompt: Handle, image_latents: tuple[Handle, ...],
        start: Handle | None = None, controls: tuple[Handle, ...] = (),
    ) -> AsyncIterator[DenoiseEvent]:
        """Denoises one image (a masked edit from its ``start`` latents; with ControlNets, ``controls`` are its
        control images' latents, one per ``params.controls``): ``StepDone`` after every step (then ``Preview`` when
        the step has one), then ``Finished``; both carry handles to latents. Closing it aborts the call."""

    @abstractmethod
    async def decode(self, request_id: str, latents: Handle, output: OutputMode, preview: bool = False, *,
                     priority: int = 0, tenant: str = "") -> Decoded:
        """The image's result per ``output``: pixels, latents or both; a ``preview``'s pixels are decoded apart from
        final images. The VAE takes it by ``priority`` and ``tenant``'s share."""

    @abstractmethod
    def cancel(self, handle: Handle) -> None:
        """Cancels a started call; a no-op on finished ones."""

    async def estimate(self, plan: GenerationPlan, request_id: str | None = None, budget_s: float | None = None
                       ) -> float | None:
        """Seconds until the DiT would be done with the plan's images, from the work that will run ahead of them
        and their own; None when these stages cannot say (then nothing is refused early). Given ``request_id`` and
        an estimate within ``budget_s``, the request is admitted: the DiT counts its work from now on, and its calls
        go where that was promised."""
        return None

    def release(self, request_id: str) -> None:
        """Gives up what ``estimate`` reserved for a request admitted under ``request_id`` that will not run, or not
        all of it (its key's quota refused it, it failed, its client left); a no-op when nothing is reserved."""

    @abstractmethod
    async def check_lora(self, path: str) -> LoraEntry:
        """A run-time adapter the DiT can take (its resolved path and the recipe beside it); RequestError (naming
        ``lora_path``) when ``path`` is outside the preset's ``lora.roots`` or not an adapter of its transformer."""


@dataclass(slots=True)
class Progress:
    """Image ``index`` finished denoising step ``step`` of ``total`` (a retried image may repeat steps)."""

    index: int
    step: int
    total: int


@dataclass(slots=True)
class ImagePreview:
    """Image ``index``'s preview number ``partial_index`` (0-based): the VAE decode of the clean image a step
    predicted."""

    index: int
    partial_index: int
    result: Decoded


@dataclass(slots=True)
class ImageDone:
    """Image ``index`` is done."""

    index: int
    result: Decoded


@dataclass(slots=True)
class Failed:
    """The request failed; nothing follows."""

    error: OmniRayError


RequestEvent = Progress | ImagePreview | ImageDone | Failed


async def run_request(
    stages: Stages, plan: GenerationPlan, request_id: str, limits: RequestLimits, output: OutputMode = "pixels"
) -> AsyncIterator[RequestEvent]:
    """The request's events: progress per denoising step of every image, each image when it is done, or one
    ``Failed`` that ends the stream. Leaving the stream early (or the deadline) cancels every stage call."""
    events: asyncio.Queue[RequestEvent] = asyncio.Queue()
    inputs = _SharedInputs(stages, plan, request_id, limits.max_retries)
    tasks = [
        asyncio.ensure_future(_run_image(stages, plan, inputs, index, output, limits.max_retries, events.put_nowait))
        for index in range(plan.request.n)
    ]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + plan.timeout_s
    remaining = plan.request.n
    try:
        while remaining:
            try:
                # Not asyncio.wait_for: on Python 3.11 it returns what it waited for when the caller is cancelled as
                # that arrives (python/cpython#86296), and the request went on for a client that had left.
                async with asyncio.timeout(deadline - loop.time()):
                    event = await events.get()
            except TimeoutError:
                late = DeadlineExceededError(f"request {request_id} ran past its {plan.timeout_s:g} s deadline")
                event = Failed(late)
            yield event
            if isinstance(event, Failed):
                return
            remaining -= isinstance(event, ImageDone)
    finally:
        for task in tasks:
            task.cancel()
        inputs.cancel()


async def collect(events: AsyncIterator[RequestEvent]) -> list[Decoded]:
    """Every image's result in index order; raises the error the request failed with."""
    results: dict[int, Decoded] = {}
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, Failed):
                raise event.error
            if isinstance(event, ImageDone):
                results[event.index] = event.result
    return [results[index] for index in sorted(results)]


class _SharedInputs:
    """The stage calls every image of a request shares: the prompt's encoding and, for an edit, its input images'
    latents (each image stored once, and once for both stages when the encoder reads the VAE's). A lost one is
    issued again once, however many images lost it; a lost image encode issues the request's image encodes again.
    Control images are stored once too, but each image of the request samples them with its own seed
    (``encode_controls``)."""

    def __init__(self, stages: Stages, plan: GenerationPlan, request_id: str, max_retries: int = 0):
        self.stages, self.plan, self.request_id, self.max_retries = stages, plan, request_id, max_retries
        self.share = _share(plan)
        stored: dict[int, Handle] = {}

        def put(image: np.ndarray) -> Handle:
            if id(image) not in stored:
                stored[id(image)] = stages.put_image(image)
            return stored[id(image)]

        inputs = plan.inputs
        self.images = tuple(map(put, inputs.vae)) if inputs is not None else ()
        self.prompt_images = tuple(map(put, inputs.encoder)) if inputs is not None else ()
        self.control_images = tuple(map(put, plan.control_images))
        masks = plan.control_masks or (None,) * len(plan.control_images)
        self.control_masks = tuple(put(mask) if mask is not None else None for mask in masks)
        self.caption: Caption | None = None  # Layered without a prompt: the encoder's caption, once written
        self.captioning = asyncio.ensure_future(self._write_caption()) if plan.caption is not None else None
        self.prompt = self._encode_prompt() if self.captioning is None else None
        self.masked = plan.inpaint is not None  # each image starts from its own sample of the first input image
        self.image_encodes = 0  # times the image latents were asked for: a retry's calls get ids of their own
        self.image_latents = self._encode_images() if not self.masked else ()

    def _encode_prompt(self) -> Handle:
        request = self.plan.request
        negative = request.negative_prompt if self.plan.true_cfg else None
        prompt = self.caption.text if self.caption is not None else request.prompt
        return self.stages.encode_prompt(EncodeRequest(self.request_id, prompt, negative, **self.share),
                                         self.prompt_images)

    async def _write_caption(self) -> None:
        """The caption a Layered request without a prompt is encoded from (the encoder's, of its input image), then
        the prompt's encoding started; a lost call is issued again up to ``limits.max_retries`` times."""
        retries = 0
        while True:
            request = CaptionRequest(f"{self.request_id}-caption{retries or ''}", None, self.plan.caption, **self.share)
            try:
                self.caption = await self.stages.caption(request, self.images[0])
                break
            except StageLostError as lost:
                retries += 1
                if retries > self.max_retries:
                    raise
                logger.warning("request %s: %s; issuing it again (retry %d of %d)", self.request_id, lost, retries,
                               self.max_retries)
                await asyncio.sleep(0.2 * retries)
        self.prompt = self._encode_prompt()

    async def ready(self) -> None:
        """Waits until the prompt's encoding has started (at once, but for a caption to write first); raises what
        the caption failed with."""
        if self.captioning is not None:
            await asyncio.shield(self.captioning)

    def _encode_images(self) -> tuple[Handle, ...]:
        retry = f"-retry{self.image_encodes}" if self.image_encodes else ""
        self.image_encodes += 1
        return tuple(self.stages.encode_image(f"{self.request_id}-input{i}{retry}", image, **self.share)
                     for i, image in enumerate(self.images))

    def encode_start(self, image_id: str, seed: int) -> Handle:
        """A masked edit's start latents for one image: its first input image sampled with the image's seed."""
        return self.stages.encode_image(f"{image_id}-start", self.images[0], seed, **self.share)

    def encode_controls(self, image_id: str, seed: int) -> tuple[Handle, ...]:
        """An image's control images' latents, each sampled with the image's seed: a plain control's after as many
        draws as plain controls precede it, as diffusers' ControlNet pipeline samples its control images in turn
        from the image's generator; an inpainting ControlNet's (with its mask) after as many inpainting ones, as
        ``QwenImageControlNetInpaintPipeline`` samples it from torch's global generator (seeded with the seed),
        not the image's."""
        handles, drawn = [], {False: 0, True: 0}
        for k, (image, mask) in enumerate(zip(self.control_images, self.control_masks)):
            masked = mask is not None
            handles.append(self.stages.encode_image(f"{image_id}-control{k}", image, seed, draw=drawn[masked],
                                                    **({"mask": mask} if masked else {}), **self.share))
            drawn[masked] += 1
        return tuple(handles)

    def conditions(self, start: Handle | None) -> tuple[Handle, ...]:
        """The image latents an image's DiT call attends over: the shared ones, or a masked edit's start latents
        (as diffusers' edit inpainting conditions on its sample), none for text-to-image inpainting."""
        if start is None:
            return self.image_latents
        return (start,) if self.plan.inputs.conditions else ()

    def reissue(self, call: StageCall, lost: Handle | tuple[Handle, ...]) -> None:
        if call is StageCall.ENCODE_PROMPT and self.prompt is lost:
            self.prompt = self._encode_prompt()
        elif call is StageCall.ENCODE_IMAGE and not self.masked and self.image_latents is lost:
            self.cancel_images()
            self.image_latents = self._encode_images()

    def cancel_images(self) -> None:
        for handle in self.image_latents:
            self.stages.cancel(handle)

    def cancel(self) -> None:
        if self.captioning is not None:
            self.captioning.cancel()
        if self.prompt is not None:
            self.stages.cancel(self.prompt)
        self.cancel_images()


async def _run_image(
    stages: Stages, plan: GenerationPlan, inputs: _SharedInputs, index: int, output: OutputMode, max_retries: int,
    emit,
) -> None:
    """Image ``index`` through the DiT and the VAE, issuing a lost call again (and what depends on it) up to
    ``max_retries`` times; emits its progress and its result, or ``Failed``."""
    image_id = f"{inputs.request_id}-{index}"
    latents: Handle | None = None
    retries = 0
    previews = start = None
    controls: tuple[Handle, ...] = ()
    try:
        params = plan.denoise_params(index)
        previews = _Previews(stages, index, emit, len(params.previews), inputs.share)
        start = inputs.encode_start(image_id, params.seed) if inputs.masked else None
        controls = inputs.encode_controls(image_id, params.seed)
        await inputs.ready()
        while True:
            call_id = image_id if not retries else f"{image_id}-retry{retries}"
            prompt, image_latents = inputs.prompt, inputs.conditions(start)
            try:
                if latents is None:
                    async for event in stages.denoise(call_id, params, prompt, image_latents, start, controls):
                        if isinstance(event, StepDone):
                            emit(Progress(index, event.step, event.total))
                        elif isinstance(event, Preview):
                            previews.decode(call_id, event.result)
                        else:
                            latents = event.result
                result = await stages.decode(call_id, latents, output, **inputs.share)
                if inputs.caption is not None:
                    result.revised_prompt = inputs.caption.text
                await previews.finish()  # previews come before the image
                emit(ImageDone(index, result))
                return
            except StageLostError as lost:
                retries += 1
                if retries > max_retries:
                    raise
                logger.warning("request %s: %s; issuing it again (retry %d of %d)", image_id, lost, retries,
                               max_retries)
                if lost.call is not StageCall.DECODE:  # the latents are gone or were never made: denoise again
                    latents = None
                if lost.call is StageCall.ENCODE_IMAGE and start is not None:
                    stages.cancel(start)
                    start = inputs.encode_start(f"{image_id}-retry{retries}", params.seed)
                if lost.call is StageCall.ENCODE_IMAGE and controls:  # which one was lost is not said: all again
                    for handle in controls:
                        stages.cancel(handle)
                    controls = inputs.encode_controls(f"{image_id}-retry{retries}", params.seed)
                inputs.reissue(lost.call, prompt if lost.call is StageCall.ENCODE_PROMPT else image_latents)
                await asyncio.sleep(0.2 * retries)  # let Serve notice the dead replica before the retry is routed
    except OmniRayError as err:
        emit(Failed(err))
    except Exception as err:  # a bug: still one error event, never a hang
        logger.exception("request %s failed", image_id)
        emit(Failed(EngineError(f"{type(err).__name__}: {err}")))
    finally:
        if previews is not None:
            previews.cancel()
        if start is not None:
            stages.cancel(start)
        for handle in controls:
            stages.cancel(handle)


class _Previews:
    """An image's previews: each decoded in the VAE's batches as soon as the DiT hands it over, while the DiT goes
    on, and emitted in order as they are done. A preview is best effort: one that fails (its VAE replica lost, say)
    is skipped, and the image goes on."""

    def __init__(self, stages: Stages, index: int, emit, count: int, share: dict):
        self.stages, self.index, self.emit, self.count, self.share = stages, index, emit, count, share
        self.decodes: list[asyncio.Future] = []
        self.emitted: list[asyncio.Future] = []

    def decode(self, call_id: str, latents: Handle) -> None:
        number = len(self.decodes)
        if number >= self.count:  # a denoise issued again after a lost replica previews its steps again
            return
        self.decodes.append(asyncio.ensure_future(self.stages.decode(f"{call_id}-preview{number}", latents, "pixels",
                                                                 preview=True, **self.share)))
        before = self.emitted[-1] if self.emitted else None
        self.emitted.append(asyncio.ensure_future(self._emit(number, before)))

    async def _emit(self, number: int, before: asyncio.Future | None) -> None:
        try:
            result = await self.decodes[number]
        except OmniRayError as err:
            logger.warning("image %d: preview %d skipped: %s", self.index, number, err)
            result = None
        if before is not None:
            await before
        if result is not None:
            self.emit(ImagePreview(self.index, number, result))

    async def finish(self) -> None:
        """Waits until every preview so far is out (or skipped)."""
        await asyncio.gather(*self.emitted)

    def cancel(self) -> None:
        for task in self.decodes + self.emitted:
            task.cancel()


def _share(plan: GenerationPlan) -> dict:
    """The keywords every stage call of the request carries, so that each stage's queue takes it by its priority and
    its tenant's share, as the DiT does (``DenoiseParams.priority``, ``.tenant``)."""
    return {"priority": plan.request.priority, "tenant": plan.tenant}
