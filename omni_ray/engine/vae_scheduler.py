"""Batching for the VAE: each step decodes up to ``max_batch_size`` same-size frames, the most urgent request first,
and streamed previews only when no final image or input image waits.

Requests are taken in the order every stage takes work (``FairShare``, omni_ray/engine/fair_share.py): by priority,
then each turn to the tenant that used the VAE least lately (its requests' pixels over recent batches), then by
arrival. The first request in that order (the first that is not a preview, when there is one) picks the batch's
kind and size; that key's requests join it in the same order.

What bounds a VAE call's memory is its frames: an image is one, a Qwen-Image-Layered request one per layer
(``qwen_image_layered.decoded_frames``), an input image to encode one. A request joins the batch while the frames stay
within ``max_batch_size``; the batch's first request always runs, so one of more layers than that runs alone, all its
layers in one call.

A preview never shares a VAE call with a final image: a batch's makeup changes its float sums, so a preview in the
batch could change the final image by a level (and a user waits on the image, not on its preview)."""

from __future__ import annotations

from omni_ray.engine.fair_share import FairShare
from omni_ray.engine.output import EngineCoreOutput
from omni_ray.engine.scheduler import Scheduler
from omni_ray.families.qwen_image_layered.facts import decoded_frames
from omni_ray.records import DecodeRequest, VaeBatch, VaeOutput, VaeRequest


def vae_frames(request: VaeRequest) -> int:
    """Frames the request puts through the VAE: a decode's images (a layered one's layers), or the image to encode.
    A decode that asked for latents only counts too (its latents ride in the batch's result)."""
    return decoded_frames(request.latents.layers) if isinstance(request, DecodeRequest) else 1


def vae_work(request: VaeRequest) -> int:
    """What the request spends of its tenant's share of the VAE: its frames' pixels, in 16x16 patches."""
    height, width = request.batch_key[1:]
    return vae_frames(request) * max(1, height * width // 256)


class VaeScheduler(Scheduler[VaeRequest, VaeBatch, VaeOutput]):
    def __init__(self, max_batch_size: int):
        assert max_batch_size > 0
        self.max_batch_size = max_batch_size
        self.waiting: list[VaeRequest] = []  # in arrival order
        self.shares = FairShare()  # tenants' recent use of the VAE

    def set_limits(self, max_batch_size: int) -> None:
        """Frames a call may decode from the next step on (a live change)."""
        assert max_batch_size > 0
        self.max_batch_size = max_batch_size

    def add_request(self, request: VaeRequest) -> None:
        self.waiting.append(request)

    def finish_requests(self, request_ids: list[str]) -> None:
        # A decode finishes within the step that starts it, so only waiting requests can be aborted.
        ids = set(request_ids)
        self.waiting = [r for r in self.waiting if r.request_id not in ids]

    def schedule(self) -> VaeBatch:
        """The most urgent request's kind and size decide the batch (the most urgent that is not a preview, when
        there is one); that key's requests join it in turn order, each that keeps the batch's frames
        (``vae_frames``) within ``max_batch_size``."""
        finals = [r for r in self.waiting if not (isinstance(r, DecodeRequest) and r.preview)]
        (first,) = self.shares.in_turn(finals or self.waiting, vae_work, limit=1)
        batch, frames = [], 0
        for request in self.shares.in_turn([r for r in self.waiting if r.batch_key == first.batch_key], vae_work):
            if not batch or frames + vae_frames(request) <= self.max_batch_size:
                batch.append(request)
                frames += vae_frames(request)
        taken = {id(request) for request in batch}
        self.waiting = [r for r in self.waiting if id(r) not in taken]
        self.shares.charge(batch, vae_work)
        self.shares.forget({r.tenant for r in self.waiting})
        return VaeBatch(requests=batch)

    def update_from_output(self, scheduler_output: VaeBatch, runner_output: VaeOutput) -> list[EngineCoreOutput]:
        outputs = [EngineCoreOutput(rid, result, "stop") for rid, result in runner_output.finished.items()]
        outputs += [EngineCoreOutput.failed(rid, error) for rid, error in runner_output.errors.items()]
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def has_finished_requests(self) -> bool:
        return False
