"""What an engine step hands back per request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from omni_ray.errors import EngineError
from omni_ray.records import Latents

FinishReason = Literal["stop", "error"]


@dataclass(slots=True)
class EngineCoreOutput:
    """A request's event from one step: progress, or its end with the stage's result (vLLM's pooling path carries
    it in ``pooling_output``; ours is any stage's record, so ``result``); ``finish_reason`` is None while the request
    runs."""

    request_id: str
    result: Any = None  # the stage's result record: EncodedPrompt, Latents (the DiT's, or an image's encode) or Decoded
    finish_reason: FinishReason | None = None
    error: EngineError | None = None  # set when finish_reason is "error"
    progress: tuple[int, int] | None = None  # (steps done, total steps), for stages that step
    preview: Latents | None = None  # with progress: the clean latents the DiT's step predicted, when asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def failed(cls, request_id: str, error: EngineError) -> EngineCoreOutput:
        return cls(request_id, finish_reason="error", error=error)


class StepError(Exception):
    """A step raised past the runner's own per-request isolation: it fails the requests it ran, and only them."""

    def __init__(self, request_ids: list[str]):
        super().__init__(f"step of {len(request_ids)} request(s) failed")
        self.request_ids = request_ids
