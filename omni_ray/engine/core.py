"""The engine core: schedule -> execute -> update, one step at a time."""

from __future__ import annotations

from typing import Any, Protocol

from omni_ray.engine.output import EngineCoreOutput
from omni_ray.engine.scheduler import Scheduler


class ModelRunner(Protocol):
    def execute_model(self, scheduler_output: Any) -> Any:
        """Runs one step's work on the model; the only place that touches it."""


class EngineCore:
    """Drives a stage's scheduler and model runner (the DiT's and the VAE's; the encoder's is vLLM's own)."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner):
        self.scheduler = scheduler
        self.runner = runner

    def add_request(self, request: Any) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def shutdown(self) -> None:
        """Nothing to release: the runner's tensors go with it."""
