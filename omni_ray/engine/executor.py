"""Executors: where a stage's model runner runs, on one rank or on a gang of them (after vLLM V1's executors): the
DiT's (``dit.parallel``) and the VAE's (``vae.parallel``).

An executor runs the same call on every rank's runner, in the same order everywhere (``collective_rpc``), so the
scheduler in the replica decides once and every rank receives the same batch; rank 0 returns the output.
``UniProcExecutor`` is world size 1, the runner in the caller's process. ``MultiprocExecutor`` starts one process per
rank on this machine (the in-process pipeline, tests); ``deployments.gang.RayExecutor`` runs one Ray actor per rank in
the Serve replica's placement group. Each rank is a ``GangWorker``: it joins the gang's mesh (``Mesh.init``) and
builds its runner with a picklable ``make_runner(mesh)``.

A rank that dies, or a call that runs past its timeout, raises ``GangError`` and leaves the executor unhealthy for
good (``check_health`` raises): the ranks may have diverged (one ran a step the others did not), so the gang is
replaced, never repaired. A call that raises the same way on every rank is the runner's own error and passes as is.
``GangRunner`` gives the engine core the model runner it expects, over any executor.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import tempfile
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from multiprocessing import connection, get_context
from typing import Any, NoReturn

from omni_ray.config import GangSettings
from omni_ray.errors import GangError
from omni_ray.records import DenoiseBatch, DenoiseOutput, LoraKey, VaeBatch, VaeOutput
from omni_ray.runners.parallel.mesh import Mesh

logger = logging.getLogger(__name__)

RunnerFactory = Callable[[Mesh | None], Any]  # picklable: one rank's runner on its mesh (None: world size 1)
Method = str | Callable[..., Any]  # a runner's method name, or a picklable function called with the runner first
Outcome = tuple[bool, Any]  # (returned, its value) or (raised, the exception)


def gang_backend(device: str) -> str:
    """torch.distributed's backend for a gang on ``device``: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device.startswith("cuda") else "gloo"


def run_method(target: Any, method: Method, args: tuple, kwargs: dict) -> Any:
    if isinstance(method, str):
        return getattr(target, method)(*args, **kwargs)
    return method(target, *args, **kwargs)


class Executor(ABC):
    """Runs calls on the runner of every rank of one replica."""

    world_size: int = 1

    @abstractmethod
    def collective_rpc(self, method: Method, args: tuple = (), kwargs: dict | None = None,
                       unique_reply_rank: int | None = None, timeout_s: float | None = None) -> list:
        """``getattr(runner, method)(*args, **kwargs)`` (or ``method(runner, ...)``) on every rank, in the order the
        calls were made; their results in rank order, or only ``unique_reply_rank``'s (a list of one; the other
        ranks send nothing back). Raises GangError when a rank died or did not answer within ``timeout_s``."""

    def check_health(self) -> None:
        """Raises GangError once the gang broke."""

    def shutdown(self) -> None:
        """Stops every rank; idempotent."""


ExecutorFactory = Callable[[RunnerFactory], Executor]  # a gang's executor, given how each rank builds its runner


class UniProcExecutor(Executor):
    """World size 1: the runner in this process."""

    def __init__(self, runner: Any):
        self.runner = runner

    def collective_rpc(self, method: Method, args: tuple = (), kwargs: dict | None = None,
                       unique_reply_rank: int | None = None, timeout_s: float | None = None) -> list:
        return [run_method(self.runner, method, args, kwargs or {})]


class GangWorker:
    """One rank: joins the gang's mesh, builds its runner on it, and runs the calls its executor sends. It lives in a
    process of its own (``MultiprocExecutor``) or in a Ray actor (``deployments.gang.RankWorker``)."""

    def __init__(self, make_runner: RunnerFactory, settings: GangSettings, rank: int, init_method: str,
                 backend: str):
        self.rank = rank
        self.mesh = Mesh.init(settings, rank, init_method, backend)
        self.runner = make_runner(self.mesh)

    def call(self, method: Method, args: tuple, kwargs: dict, reply: bool) -> Any:
        result = run_method(self.runner, method, args, kwargs)
        return result if reply else None

    def shutdown(self) -> None:
        self.mesh.shutdown()


def settle(outcomes: list[Outcome], method: Method, unique_reply_rank: int | None,
           fail: Callable[[str], NoReturn]) -> list:
    """The ranks' outcomes of one call as ``collective_rpc`` returns them: the results; the error when every rank
    raised (the runner's own error, raised alike everywhere); ``fail``'s GangError when only some did (the ranks
    diverged)."""
    failed = [rank for rank, (ok, _) in enumerate(outcomes) if not ok]
    if failed and len(failed) < len(outcomes):
        error = outcomes[failed[0]][1]
        fail(f"rank {failed[0]} of {len(outcomes)} raised in {method_name(method)} while others did not: "
             f"{type(error).__name__}: {error}")
    if failed:
        raise outcomes[0][1]
    values = [value for _, value in outcomes]
    return [values[unique_reply_rank]] if unique_reply_rank is not None else values


# What a CPU gang's ranks import once, in the forkserver they fork from (before any thread or process group exists).
GANG_PRELOAD = ["torch", "diffusers", "omni_ray.runners.denoise", "omni_ray.runners.vae", "omni_ray.engine.executor"]


def gang_context(backend: str):
    """How a gang's rank processes start: CPU ranks (gloo) fork from a forkserver that has imported torch, diffusers
    and the runners once (``GANG_PRELOAD``; a spawned rank imports them again, seconds each); CUDA ranks (nccl) are
    spawned, as vLLM's are, so that nothing of a CUDA context is inherited."""
    if backend == "nccl":
        return get_context("spawn")
    context = get_context("forkserver")
    context.set_forkserver_preload(GANG_PRELOAD)  # read when the server starts, by the process's first gang
    return context


def method_name(method: Method) -> str:
    return method if isinstance(method, str) else getattr(method, "__name__", repr(method))


class MultiprocExecutor(Executor):
    """A gang of ``settings.world_size`` processes on this machine (``gang_context``), one per rank, each talking to
    this one over a pipe (pickled calls in, pickled outcomes back) and joined to the others over ``backend`` through
    a ``file://`` rendezvous. On CUDA, rank r sees only the r-th visible GPU."""

    def __init__(self, make_runner: RunnerFactory, settings: GangSettings, backend: str = "gloo",
                 start_timeout_s: float | None = None):
        self.world_size = settings.world_size
        self.timeout_s = settings.timeout_s
        self.failure: str | None = None
        self._lock = threading.Lock()
        self._folder = tempfile.mkdtemp(prefix="omni-ray-gang-")
        init_method = f"file://{os.path.join(self._folder, 'rendezvous')}"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(self.world_size)]
        context = gang_context(backend)
        self._conns, self._processes = [], []
        for rank in range(self.world_size):
            ours, theirs = context.Pipe()
            device = devices[rank] if backend == "nccl" else None
            process = context.Process(
                target=_rank_main, args=(theirs, make_runner, settings, rank, init_method, backend, device),
                name=f"omni-ray-rank{rank}", daemon=True,  # ended with this process, as vLLM's workers are
            )
            process.start()
            theirs.close()
            self._conns.append(ours)
            self._processes.append(process)
        try:
            self._receive("start", None, start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def collective_rpc(self, method: Method, args: tuple = (), kwargs: dict | None = None,
                       unique_reply_rank: int | None = None, timeout_s: float | None = None) -> list:
        with self._lock:
            self.check_health()
            for rank, conn in enumerate(self._conns):
                reply = unique_reply_rank is None or rank == unique_reply_rank
                try:
                    conn.send_bytes(pickle.dumps((method, args, kwargs or {}, reply)))
                except OSError as err:  # its end is closed: the process is gone
                    self._fail(f"rank {rank} is gone ({err}) before {method_name(method)}")
            outcomes = self._receive(method_name(method), method, timeout_s or self.timeout_s)
            return settle(outcomes, method, unique_reply_rank, self._fail)

    def _receive(self, what: str, method: Method | None, timeout_s: float | None) -> list[Outcome]:
        """Every rank's outcome, waiting on all of them at once so that a rank's death is seen at once even while
        the others wait for it in a collective."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        outcomes: dict[int, Outcome] = {}
        while len(outcomes) < self.world_size:
            pending = {rank: (self._conns[rank], self._processes[rank]) for rank in range(self.world_size)
                       if rank not in outcomes}
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            waitables = [c for c, _ in pending.values()] + [p.sentinel for _, p in pending.values()]
            ready = connection.wait(waitables, remaining)
            if not ready:
                late = sorted(pending)
                self._fail(f"rank(s) {late} did not finish {what} within {timeout_s:.0f} s")
            for rank, (conn, process) in pending.items():
                if conn in ready:
                    try:
                        outcomes[rank] = pickle.loads(conn.recv_bytes())
                        continue
                    except (EOFError, ConnectionError):  # the rank's end closed, or reset as it died
                        pass
                elif process.sentinel not in ready:
                    continue
                process.join(timeout=5)
                self._fail(f"rank {rank} (pid {process.pid}) exited with code {process.exitcode} during {what}")
        if method is None:  # start: a rank that failed to build its runner fails the gang
            errors = [value for ok, value in outcomes.values() if not ok]
            if errors:
                self._fail(f"a rank failed to start: {type(errors[0]).__name__}: {errors[0]}")
        return [outcomes[rank] for rank in range(self.world_size)]

    def _fail(self, reason: str) -> NoReturn:
        """Marks the gang broken, stops its processes (some may wait in a collective for the lost one) and raises."""
        self.failure = self.failure or reason
        logger.error("gang broken: %s", reason)
        self._stop(graceful=False)
        raise GangError(reason)

    def check_health(self) -> None:
        if self.failure is None:
            dead = [rank for rank, p in enumerate(self._processes) if not p.is_alive()]
            if dead:
                self.failure = f"rank(s) {dead} exited"
        if self.failure is not None:
            raise GangError(self.failure)

    def shutdown(self) -> None:
        with self._lock:
            self._stop(graceful=True)

    def _stop(self, graceful: bool) -> None:
        for conn, process in zip(self._conns, self._processes):
            if graceful and process.is_alive():
                try:
                    conn.send_bytes(pickle.dumps(None))
                except OSError:
                    pass
        for conn, process in zip(self._conns, self._processes):
            if graceful:
                process.join(timeout=10)
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
            conn.close()
        shutil.rmtree(self._folder, ignore_errors=True)


def _rank_main(conn, make_runner: RunnerFactory, settings: GangSettings, rank: int, init_method: str,
               backend: str, device: str | None) -> None:
    """A ``MultiprocExecutor`` rank: builds its ``GangWorker``, then runs the calls that come down its pipe until
    the executor says stop (None) or goes away (the pipe's end closes)."""
    if device is not None:  # before anything touches CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = device
    else:  # CPU ranks share the machine's cores rather than each taking all of them (10x slower steps, measured)
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // settings.world_size))
    try:
        worker = GangWorker(make_runner, settings, rank, init_method, backend)
    except BaseException as err:
        logger.exception("rank %d failed to start", rank)
        conn.send_bytes(_dumps((False, err)))
        return
    conn.send_bytes(_dumps((True, None)))
    try:
        while True:
            try:
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, ConnectionError):  # the executor is gone
                break
            if message is None:
                break
            method, args, kwargs, reply = message
            try:
                outcome = (True, worker.call(method, args, kwargs, reply))
            except Exception as err:
                logger.exception("rank %d: %s failed", rank, method_name(method))
                outcome = (False, err)
            conn.send_bytes(_dumps(outcome))
    finally:
        worker.shutdown()


def _dumps(outcome: Outcome) -> bytes:
    try:
        return pickle.dumps(outcome)
    except Exception:  # an exception that does not pickle: its text does
        ok, value = outcome
        text = "".join(traceback.format_exception(value)) if isinstance(value, BaseException) else repr(value)
        return pickle.dumps((False, RuntimeError(text)))


def _runner_facts(runner: Any) -> tuple[dict[str, tuple[int, int]], float | None]:
    return dict(getattr(runner, "lora_shapes", {})), getattr(runner, "warmup_s", None)


class GangRunner:
    """The model runner an engine core drives (the DiT's or the VAE's), over an executor: each step's batch goes to
    every rank and rank 0's output comes back; a DiT's adapters are added to and removed from every rank; what the
    core reads of its runner (``lora_shapes``, ``warmup_s``) is rank 0's, read once when the gang has started."""

    def __init__(self, executor: Executor):
        self.executor = executor
        self.lora_shapes, self.warmup_s = executor.collective_rpc(_runner_facts, unique_reply_rank=0)[0]

    def execute_model(self, batch: DenoiseBatch | VaeBatch) -> DenoiseOutput | VaeOutput:
        return self.executor.collective_rpc("execute_model", (batch,), unique_reply_rank=0)[0]

    def add_lora(self, key: LoraKey, layers: dict) -> None:
        self.executor.collective_rpc("add_lora", (key, layers))

    def remove_lora(self, key: LoraKey) -> None:
        self.executor.collective_rpc("remove_lora", (key,))

    def shutdown(self) -> None:
        self.executor.shutdown()
