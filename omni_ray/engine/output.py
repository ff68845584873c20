"""What an engine step hands back per request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from omni_ray.errors import EngineError

FinishReason = Literal["stop", "error"]


@dataclass(slots=True)
class EngineCoreOutput:
    """A request's event from one step: progress, or its end with the stage's result in ``pooling_output``.

    As in vLLM's pooling path, a finished request's result rides in ``pooling_output``; ``finish_reason`` is None
    while the request runs.
    """

    request_id: str
    pooling_output: Any = None  # the stage's result record: EncodedPrompt, Latents or Decoded
    finish_reason: FinishReason | None = None
    error: EngineError | None = None  # set when finish_reason is "error"
    progress: tuple[int, int] | None = None  # (steps done, total steps), for stages that step
    preview: Any = None  # with progress: an intermediate result the request asked for (the DiT's predicted image)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def failed(cls, request_id: str, error: EngineError) -> EngineCoreOutput:
        return cls(request_id, finish_reason="error", error=error)


@dataclass(frozen=True, slots=True)
class StepDone:
    """A stepping stage's progress for one request: ``step`` of ``total`` steps are done. With ``has_preview``, the
    stream's next item is the step's preview (the DiT's latents of the clean image it predicts at this step)."""

    step: int
    total: int
    has_preview: bool = False


class StepError(Exception):
    """A step raised past the runner's own per-request isolation: it fails the requests it ran, and only them."""

    def __init__(self, request_ids: list[str]):
        super().__init__(f"step of {len(request_ids)} request(s) failed")
        self.request_ids = request_ids
