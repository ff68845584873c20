"""Batching for the VAE: each step decodes up to ``max_batch_size`` same-size frames, oldest request first, and
streamed previews only when no final image or input image waits.

What bounds a VAE call's memory is its frames: an image is one, a Qwen-Image-Layered request one per layer
(``qwen_image_layered.decoded_frames``), an input image to encode one. A request joins the batch while the frames stay
within ``max_batch_size``; the batch's first request always runs, so one of more layers than that runs alone, all its
layers in one call.

A preview never shares a VAE call with a final image: a batch's makeup changes its float sums, so a preview in the
batch could change the final image by a level (and a user waits on the image, not on its preview)."""

from __future__ import annotations

from collections import deque

from omni_ray.engine.output import EngineCoreOutput
from omni_ray.engine.scheduler import Scheduler
from omni_ray.qwen_image_layered import decoded_frames
from omni_ray.records import DecodeRequest, VaeBatch, VaeOutput, VaeRequest


def vae_frames(request: VaeRequest) -> int:
    """Frames the request puts through the VAE: a decode's images (a layered one's layers), or the image to encode.
    A decode that asked for latents only counts too (its latents ride in the batch's result)."""
    return decoded_frames(request.latents.layers) if isinstance(request, DecodeRequest) else 1


class VaeScheduler(Scheduler[VaeRequest, VaeBatch, VaeOutput]):
    def __init__(self, max_batch_size: int):
        assert max_batch_size > 0
        self.max_batch_size = max_batch_size
        self.waiting: deque[VaeRequest] = deque()

    def add_request(self, request: VaeRequest) -> None:
        self.waiting.append(request)

    def finish_requests(self, request_ids: list[str]) -> None:
        # A decode finishes within the step that starts it, so only waiting requests can be aborted.
        ids = set(request_ids)
        self.waiting = deque(r for r in self.waiting if r.request_id not in ids)

    def schedule(self) -> VaeBatch:
        """The oldest request's kind and size decide the batch (the oldest that is not a preview, when there is
        one); later requests of that kind and size join it, in order, each that keeps the batch's frames
        (``vae_frames``) within ``max_batch_size``."""
        first = next((r for r in self.waiting if not (isinstance(r, DecodeRequest) and r.preview)), self.waiting[0])
        key = first.batch_key
        batch, kept, frames = [], deque(), 0
        for request in self.waiting:
            joins = request.batch_key == key and (not batch or frames + vae_frames(request) <= self.max_batch_size)
            (batch if joins else kept).append(request)
            frames += vae_frames(request) if joins else 0
        self.waiting = kept
        return VaeBatch(requests=batch)

    def update_from_output(self, scheduler_output: VaeBatch, runner_output: VaeOutput) -> list[EngineCoreOutput]:
        outputs = [EngineCoreOutput(rid, result, "stop") for rid, result in runner_output.finished.items()]
        outputs += [EngineCoreOutput.failed(rid, error) for rid, error in runner_output.errors.items()]
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def has_finished_requests(self) -> bool:
        return False
