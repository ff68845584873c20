"""What an engine step hands back per request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

FinishReason = Literal["stop", "error"]


@dataclass(slots=True)
class EngineCoreOutput:
    """A request's event from one step: progress, or its end with the stage's result in ``pooling_output``.

    As in vLLM's pooling path, a finished request's result rides in ``pooling_output``; ``finish_reason`` is None
    while the request runs.
    """

    request_id: str
    pooling_output: Any = None
    finish_reason: FinishReason | None = None
    error: str | None = None  # set when finish_reason is "error"
    progress: tuple[int, int] | None = None  # (steps done, total steps), for stages that step

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
