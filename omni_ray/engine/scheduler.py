"""The scheduler contract every omni-ray engine core drives."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from omni_ray.engine.output import EngineCoreOutput


class Scheduler(ABC):
    """Decides what each engine step runs. Called from the engine's thread only, so it needs no locks."""

    @abstractmethod
    def add_request(self, request: Any) -> None:
        """Queues a new request. It runs from the first ``schedule()`` that admits it."""

    @abstractmethod
    def finish_requests(self, request_ids: list[str]) -> None:
        """Removes requests wherever they are (aborts); unknown ids are ignored.

        Requests the runner already holds are handed to it in the next ``schedule()`` output, to drop their state.
        """

    @abstractmethod
    def schedule(self) -> Any:
        """Picks one step's work: the runner's input record."""

    @abstractmethod
    def update_from_output(self, scheduler_output: Any, runner_output: Any) -> list[EngineCoreOutput]:
        """Applies one step's results: finished and failed requests leave and come back as outputs."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""

    @abstractmethod
    def has_finished_requests(self) -> bool:
        """Whether removed requests still wait to be handed to the runner."""

    def has_requests(self) -> bool:
        """Whether a step has anything to do."""
        return self.has_unfinished_requests() or self.has_finished_requests()
