"""Runs an engine core's step loop in one background thread and gives each caller an awaitable result.

Every call to the core happens on that thread, so cores and schedulers need no locks. Callers' adds and aborts
reach the loop through a queue and take effect at the next step boundary. Cancelling the awaiting task aborts the
request in the engine. What others read of the engine is what its thread hands out: each request's result with its
timings, and ``stats``, a snapshot made after every step and every command.

The thread also builds the core, so the model is loaded and run on one thread: torch's OpenMP thread pools belong to
the thread that first ran a parallel region.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from omni_ray.engine.core import EngineCoreProtocol
from omni_ray.engine.output import EngineCoreOutput, StepError
from omni_ray.engine.stats import EngineStats
from omni_ray.errors import EngineError, request_failure
from omni_ray.records import Finished, Follows, Preview, StepDone, StreamItem

logger = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int, Any], None]  # (steps done, total steps, the step's preview or None)
StepCallback = Callable[[float, int], None]  # (seconds, requests the step touched), after ``stats`` is new


class Command(enum.Enum):
    """What a caller asks of the engine's thread; each takes effect at the next step boundary."""

    ADD = "add"  # payload: (request, _Caller)
    CALL = "call"  # payload: (method of the core, _Caller or None: nobody waits)
    ABORT = "abort"  # payload: request id
    WAKE = "wake"  # payload: None; unblocks a waiting loop (shutdown)


@dataclass(slots=True)
class _Caller:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    on_progress: ProgressCallback | None
    added_at: float = 0.0  # monotonic, when the caller asked
    queued_s: float | None = None  # seconds it waited before the first step that ran it, once one has


class AsyncEngine:
    """One engine core, one thread, many concurrent callers."""

    def __init__(
        self,
        build_core: Callable[[], EngineCoreProtocol],
        name: str,
        stall_timeout_s: float = 300.0,
        on_step: StepCallback | None = None,
    ):
        self.build_core = build_core
        self.on_step = on_step  # called on the engine thread after every step, for metrics
        self.core: EngineCoreProtocol | None = None  # touched by the engine's thread only
        self.name = name
        self.stall_timeout_s = stall_timeout_s
        self._commands: queue.SimpleQueue[tuple[Command, Any]] = queue.SimpleQueue()
        self._callers: dict[str, _Caller] = {}  # request id -> who awaits it; touched on the loop thread only
        self._thread = threading.Thread(target=self._run, name=f"omni-ray-{name}-engine", daemon=True)
        self._stopping = False
        self._busy_since: float | None = None  # when the step now running began
        self._ready = threading.Event()
        self._build_error: BaseException | None = None
        self.num_steps = 0
        self.num_requests = 0  # added to the core
        self.num_aborted = 0  # aborted by their callers (cancelled) before they finished
        self.stats = EngineStats()  # the engine thread's latest snapshot, replaced whole

    def start(self) -> AsyncEngine:
        """Starts the thread, which builds the core; returns once it is built (or raises what building raised)."""
        self._thread.start()
        self._ready.wait()
        if self._build_error is not None:
            raise EngineError(f"engine failed to start: {self._build_error}", self.name) from self._build_error
        return self

    async def generate(self, request, on_progress: ProgressCallback | None = None,
                       upstream: dict[str, float] | None = None) -> Any:
        """Adds ``request`` (its ``request_id`` must be unique) and returns its stage result (the core's
        ``EngineCoreOutput.result``); raises the EngineError it failed with. The result's ``timings`` are ``upstream``'s
        (the stages before this one) and this engine's: the seconds from this call to the result, as
        ``request.timing``, and the part of them it queued before its first step, as ``<request.timing>_queued``.
        ``on_progress`` gets each step's progress."""
        if not self._thread.is_alive():
            raise EngineError("engine loop is not running", self.name)
        loop = asyncio.get_running_loop()
        caller = _Caller(loop, loop.create_future(), on_progress, time.monotonic())
        self._commands.put((Command.ADD, (request, caller)))
        try:
            result = await caller.future
        except asyncio.CancelledError:
            self.abort(request.request_id)
            raise
        name = request.timing
        result.timings = {**(upstream or {}), name: time.monotonic() - caller.added_at,
                          f"{name}_queued": caller.queued_s or 0.0}
        return result

    async def stream(self, request, upstream: dict[str, float] | None = None) -> AsyncIterator[StreamItem]:
        """``StepDone`` after every step of ``request`` (then ``Preview`` when the step has one), then ``Finished``
        with its stage result (timed as ``generate`` times it). Closing the stream aborts it."""
        steps: asyncio.Queue = asyncio.Queue()

        def on_progress(done: int, total: int, preview: Any) -> None:
            follows = Follows.PREVIEW if preview is not None else Follows.RESULT if done == total else Follows.NOTHING
            steps.put_nowait(StepDone(done, total, follows))
            if preview is not None:
                steps.put_nowait(Preview(preview))

        result = asyncio.ensure_future(self.generate(request, on_progress, upstream))
        try:
            while not result.done() or not steps.empty():
                step = asyncio.ensure_future(steps.get())
                await asyncio.wait({step, result}, return_when=asyncio.FIRST_COMPLETED)
                if step.done():
                    yield step.result()
                else:
                    step.cancel()
            yield Finished(result.result())
        finally:
            result.cancel()

    async def call(self, method: Callable[[EngineCoreProtocol], Any]) -> Any:
        """``method(core)``'s result, run on the engine's thread between two steps (as vLLM's utility calls run on
        its engine core): how callers change what the core holds, such as the DiT's LoRA adapters."""
        if not self._thread.is_alive():
            raise EngineError("engine loop is not running", self.name)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put((Command.CALL, (method, _Caller(loop, future, None))))
        return await future

    def submit(self, method: Callable[[EngineCoreProtocol], Any]) -> None:
        """As ``call``, for a caller that does not wait (a deployment's live settings): ``method(core)`` runs on the
        engine's thread between two steps; a failure is logged."""
        self._commands.put((Command.CALL, (method, None)))

    def abort(self, request_id: str) -> None:
        self._commands.put((Command.ABORT, request_id))

    def check_health(self) -> None:
        """Raises if the loop thread died or one step has run longer than ``stall_timeout_s``."""
        if not self._thread.is_alive():
            raise EngineError("engine loop is dead", self.name)
        busy_since = self._busy_since
        if busy_since is not None and time.monotonic() - busy_since > self.stall_timeout_s:
            raise EngineError(f"one step has run for over {self.stall_timeout_s:.0f} s", self.name)

    def shutdown(self) -> None:
        """Stops the loop (failing requests still in it) and shuts the core down."""
        self._stopping = True
        self._commands.put((Command.WAKE, None))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        try:
            self.core = self.build_core()
            self._publish()  # stats before anyone can read them
        except BaseException as err:
            self._build_error = err
            return
        finally:
            self._ready.set()
        try:
            self._loop()
        finally:
            for request_id in list(self._callers):
                self._deliver(EngineCoreOutput.failed(request_id, EngineError("engine shut down")))
            self.core.shutdown()

    def _loop(self) -> None:
        while not self._stopping:
            self._apply_commands(block=not self.core.has_unfinished_requests())
            self._publish()
            if self._stopping:
                break
            started = self._busy_since = time.monotonic()
            try:
                outputs = self.core.step()
            except StepError as err:  # the step failed as a whole: fail the requests it ran, keep the loop
                logger.exception("%s engine step failed", self.name)
                outputs = self._fail(err.request_ids, request_failure(err.__cause__ or err))
            finally:
                self._busy_since = None
            self.num_steps += 1
            for output in outputs:
                self._deliver(output, started)
            self._publish()
            if self.on_step is not None and outputs:
                self.on_step(time.monotonic() - started, len(outputs))

    def _publish(self) -> None:
        self.stats = EngineStats(self.num_steps, self.num_requests, self.num_aborted, len(self._callers),
                                 self.core.stats())

    def _apply_commands(self, block: bool) -> None:
        command = self._commands.get() if block else self._next_command()
        while command is not None:
            kind, payload = command
            if kind is Command.ADD:
                request, caller = payload
                self._add(request, caller)
            elif kind is Command.CALL:
                method, caller = payload
                try:
                    result = method(self.core)
                except Exception as err:
                    if caller is None:
                        logger.exception("%s: a call on the engine's thread failed", self.name)
                    result = err
                if caller is not None:
                    _resolve(caller, result)
            elif kind is Command.ABORT and self._callers.pop(payload, None) is not None:
                self.core.abort_requests([payload])
                self.num_aborted += 1
            command = self._next_command()

    def _next_command(self) -> tuple[Command, Any] | None:
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _add(self, request, caller: _Caller) -> None:
        if caller.future.done():  # cancelled before it reached the loop
            return
        if request.request_id in self._callers:
            _resolve(caller, EngineError(f"duplicate request id {request.request_id!r}", self.name))
            return
        try:
            self.core.add_request(request)
        except Exception as err:
            _resolve(caller, self._named(request_failure(err)))
            return
        self._callers[request.request_id] = caller
        self.num_requests += 1

    def _fail(self, request_ids: list[str], error: EngineError) -> list[EngineCoreOutput]:
        self.core.abort_requests(request_ids)
        return [EngineCoreOutput.failed(request_id, error) for request_id in request_ids]

    def _named(self, error: EngineError) -> EngineError:
        """The error with this engine's stage name, when the raiser did not know it."""
        error.stage = error.stage or self.name
        return error

    def _deliver(self, output: EngineCoreOutput, step_started: float | None = None) -> None:
        caller = self._callers.get(output.request_id)
        if caller is None:  # aborted meanwhile
            return
        if caller.queued_s is None and step_started is not None:
            caller.queued_s = max(0.0, step_started - caller.added_at)
        if caller.on_progress is not None and output.progress is not None:
            caller.loop.call_soon_threadsafe(caller.on_progress, *output.progress, output.preview)
        if not output.finished:
            return
        del self._callers[output.request_id]
        if output.finish_reason == "error":
            _resolve(caller, self._named(output.error or EngineError("request failed")))
        else:
            _resolve(caller, output.result)


def _resolve(caller: _Caller, result: Any) -> None:
    def settle() -> None:
        if caller.future.done():
            return
        if isinstance(result, BaseException):
            caller.future.set_exception(result)
        else:
            caller.future.set_result(result)

    try:
        caller.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the caller's event loop is closed: nobody is waiting
        pass
