"""Batching for the VAE: each step decodes up to ``max_batch_size`` same-size latents, oldest request first, and
streamed previews only when no final image or input image waits.

A preview never shares a VAE call with a final image: a batch's makeup changes its float sums, so a preview in the
batch could change the final image by a level (and a user waits on the image, not on its preview)."""

from __future__ import annotations

from collections import deque

from omni_ray.engine.output import EngineCoreOutput
from omni_ray.engine.scheduler import Scheduler
from omni_ray.records import DecodeRequest, VaeBatch, VaeOutput, VaeRequest


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
        one); later requests of that kind and size join it, in order."""
        first = next((r for r in self.waiting if not (isinstance(r, DecodeRequest) and r.preview)), self.waiting[0])
        key = first.batch_key
        batch, kept = [], deque()
        for request in self.waiting:
            (batch if request.batch_key == key and len(batch) < self.max_batch_size else kept).append(request)
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
