"""The engine core: schedule -> execute -> update, one step at a time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from omni_ray.engine.dit_load import StepTimes
from omni_ray.engine.output import EngineCoreOutput, StepError
from omni_ray.engine.scheduler import Scheduler, SchedulerOutput
from omni_ray.engine.stats import DiTStats
from omni_ray.records import DenoiseBatch, LoraKey

SchedulerOutputT = TypeVar("SchedulerOutputT", bound=SchedulerOutput, contravariant=True)
RunnerOutputT = TypeVar("RunnerOutputT", covariant=True)


class ModelRunner(Protocol[SchedulerOutputT, RunnerOutputT]):
    def execute_model(self, scheduler_output: SchedulerOutputT) -> RunnerOutputT:
        """Runs one step's work on the model; the only place that touches it. A request that fails alone comes
        back in the output's ``errors``; an exception fails every request of the step."""


class EngineCoreProtocol(Protocol):
    """What the async driver needs of a core: ours below, and the encoder's around vLLM's."""

    def add_request(self, request) -> None: ...
    def abort_requests(self, request_ids: list[str]) -> None: ...
    def has_unfinished_requests(self) -> bool: ...
    def step(self) -> list[EngineCoreOutput]: ...
    def stats(self) -> object: ...  # the core's own figures (engine.stats), made on the engine's thread
    def shutdown(self) -> None: ...


class EngineCore(Generic[SchedulerOutputT, RunnerOutputT]):
    """Drives a stage's scheduler and model runner (the DiT's and the VAE's; the encoder's is vLLM's own)."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner[SchedulerOutputT, RunnerOutputT]):
        self.scheduler = scheduler
        self.runner = runner

    def add_request(self, request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        try:
            runner_output = self.runner.execute_model(scheduler_output)
        except Exception as err:
            raise StepError(scheduler_output.request_ids) from err
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def set_limits(self, **limits) -> None:
        """A deployment's live settings (``omni_ray.live_settings``), between two steps: its scheduler's limits."""
        self.scheduler.set_limits(**limits)

    def stats(self) -> None:
        """No figures of its own (the VAE's core)."""

    def shutdown(self) -> None:
        """Stops the ranks a gang's runner runs on (``GangRunner``); a runner in this process has nothing to
        release: its tensors go with it."""
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()


class DiTEngineCore(EngineCore):
    """The DiT's core: the engine contract, plus the LoRA adapters its runner holds (called between two steps, on
    the engine's thread, as vLLM's ``add_lora``/``remove_lora`` utility calls run on its core), and how long its
    steps take for their tokens (``step_times``, which its stats hand to the replica's load figures)."""

    def __init__(self, scheduler, runner, clock: Callable[[], float] = time.perf_counter):
        """``clock``: what step times are read from (a benchmark's virtual clock, under a simulated runner)."""
        super().__init__(scheduler, runner)
        self.step_times = StepTimes(overhead_s=getattr(runner, "step_overhead_s", 0.0))
        self.clock = clock
        self.cold = True  # no step has run: the first pays one-time costs (memory first touched, kernels picked)

    def step(self) -> list[EngineCoreOutput]:
        started = self.clock()
        outputs = super().step()
        if outputs and self.cold:  # left out of the fit: estimates from a cold step refused requests at a new
            self.cold = False  # replica (503s right after a redeploy, under load)
        elif outputs:
            self.step_times.observe(self.scheduler.last_step_tokens, self.clock() - started)
        return outputs

    def stats(self) -> DiTStats:
        scheduler = self.scheduler
        streamer = getattr(self.runner, "streamer", None)
        offload = None if streamer is None else {"kept": streamer.resident, "peak": streamer.peak,
                                                 "fetches": streamer.fetches, "bytes_per_pass": streamer.bytes_per_pass}
        return DiTStats(self.step_times.snapshot(), dict(scheduler.batch_sizes), scheduler.num_paused,
                        scheduler.num_paused_steps, getattr(self.runner, "warmup_s", None), scheduler.cache_stats(),
                        offload)

    @property
    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """The Linear layers an adapter may adapt: module name -> (in, out features)."""
        return self.runner.lora_shapes

    def add_lora(self, key: LoraKey, layers: dict) -> None:
        self.runner.add_lora(key, layers)

    def remove_lora(self, key: LoraKey) -> None:
        """Frees an adapter's slot. Requests aborted since the last step still hold their state in the runner (the
        next step's batch drops it), and so their adapter: a batch that runs nothing drops them first, so the adapter
        of a request just aborted may leave before the next step (``LoraResidency`` evicts it as soon as its last
        request lets go)."""
        freed = self.scheduler.take_freed_ids()
        if freed:
            self.runner.execute_model(DenoiseBatch(new_requests=[], request_ids=[], freed_ids=freed))
        self.runner.remove_lora(key)
