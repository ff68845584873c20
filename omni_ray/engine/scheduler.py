"""The scheduler contract every omni-ray engine core drives."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generic, Protocol, TypeVar

from omni_ray.engine.output import EngineCoreOutput


class SchedulerOutput(Protocol):
    """One step's work, as a scheduler hands it to the runner."""

    @property
    def request_ids(self) -> list[str]:
        """Every request the step runs."""


RequestT = TypeVar("RequestT")
OutputT = TypeVar("OutputT", bound=SchedulerOutput)
RunnerOutputT = TypeVar("RunnerOutputT")


class Scheduler(ABC, Generic[RequestT, OutputT, RunnerOutputT]):
    """Decides what each engine step runs. Called from the engine's thread only, so it needs no locks."""

    @abstractmethod
    def add_request(self, request: RequestT) -> None:
        """Queues a new request. It runs from the first ``schedule()`` that admits it."""

    @abstractmethod
    def finish_requests(self, request_ids: list[str]) -> None:
        """Removes requests wherever they are (aborts, failed steps); unknown ids are ignored.

        Requests the runner already holds are handed to it in the next ``schedule()`` output, to drop their state.
        """

    @abstractmethod
    def schedule(self) -> OutputT:
        """Picks one step's work: the runner's input record."""

    @abstractmethod
    def update_from_output(self, scheduler_output: OutputT, runner_output: RunnerOutputT) -> list[EngineCoreOutput]:
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
