"""A stage replica's gang on Ray (the DiT's or the VAE's): one actor per rank, in the replica's own placement group.

With ``dit.parallel`` (or ``vae.parallel``) above world size 1, ``deployments.app`` gives the stage's deployment a
placement group per replica (``omni_ray.placement.gang_bundles``, ``STRICT_PACK``: the gang shares a node): the
replica takes bundle 0, rank r's ``RankWorker`` bundle 1 + r. The replica's engine drives the ranks through
``RayExecutor`` (``collective_rpc``, as vLLM's Ray executor does): every call goes to every rank in the same order,
each rank runs it on its runner (``omni_ray.engine.executor.GangWorker``), rank 0's result comes back. The ranks
rendezvous over TCP at rank 0's node address; NCCL on CUDA, gloo on the CPU.

The rank actors are the replica's children: Ray ends them when the replica's process ends, however it ends, and
``shutdown`` kills them when the engine stops. A rank that dies (``RayActorError``) or a call that runs past the
stage's ``parallel.timeout_s`` is a ``GangError``; from then on the executor is unhealthy and ``on_failure`` is told
once.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import NoReturn

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from omni_ray.config import DiTConfig, GangSettings, VAEConfig
from omni_ray.engine.executor import (
    Executor,
    GangWorker,
    Method,
    Outcome,
    RunnerFactory,
    gang_backend,
    method_name,
    settle,
)
from omni_ray.errors import EngineError, GangError

logger = logging.getLogger("ray.serve")

RANK_ACTOR_PREFIX = "omni-ray-gang:"  # then "<stage>:<replica actor id>:rank<r>" (`ray list actors` names the stage)


@ray.remote(concurrency_groups={"health": 1})
class RankWorker:
    """One rank of a stage replica's gang: a ``GangWorker`` in a Ray actor. Calls run one at a time, in the order sent,
    on one thread; ``ping`` answers on a thread of its own, even while a step runs."""

    def __init__(self, rank: int):
        self.rank = rank
        self.worker: GangWorker | None = None

    def rendezvous(self) -> str:
        """A ``tcp://`` address on this rank's node, with a port free now, for the gang to meet at (rank 0's)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def start(self, make_runner: RunnerFactory, settings: GangSettings, init_method: str, backend: str) -> None:
        self.worker = GangWorker(make_runner, settings, self.rank, init_method, backend)

    def call(self, payload: tuple[Method, tuple, dict], reply: bool):
        method, args, kwargs = payload
        return self.worker.call(method, args, kwargs, reply)

    @ray.method(concurrency_group="health")
    def ping(self) -> int:
        return self.rank

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


class RayExecutor(Executor):
    """The ranks of this replica's gang as ``RankWorker`` actors in its placement group (see the module's doc);
    ``name``: the stage's (``dit``, ``vae``), for messages."""

    def __init__(self, make_runner: RunnerFactory, stage: DiTConfig | VAEConfig, name: str,
                 on_failure: Callable[[str], None] | None = None, start_timeout_s: float | None = None):
        settings = stage.parallel
        self.name = name
        self.world_size, self.timeout_s = settings.world_size, settings.timeout_s
        self.failure: str | None = None
        self.on_failure = None  # told once the gang has started: a gang that fails to start fails the replica's start
        self._lock = threading.Lock()  # one call at a time, so that every rank sees the calls in one order
        self._pings: list[ray.ObjectRef] | None = None
        self._pinged_at = 0.0
        group = get_current_placement_group()
        if group is None:
            raise EngineError(f"a gang ({name}.parallel) runs in its replica's placement group, and this process has "
                              f"none: deploy it with deployments.app, which gives the {name} its placement group "
                              "bundles")
        replica = ray.get_runtime_context().get_actor_id()
        self.workers = [
            RankWorker.options(
                name=f"{RANK_ACTOR_PREFIX}{name}:{replica}:rank{rank}",
                num_cpus=settings.rank_num_cpus,
                num_gpus=stage.deployment.num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=1 + rank),
            ).remote(rank)
            for rank in range(self.world_size)
        ]
        try:
            meeting = self._gather([self.workers[0].rendezvous.remote()], "rendezvous", start_timeout_s)
            init_method = settle(meeting, "rendezvous", None, self._fail)[0]
            backend = gang_backend(stage.device)
            starts = [w.start.remote(make_runner, settings, init_method, backend) for w in self.workers]
            settle(self._gather(starts, "start", start_timeout_s), "start", None, self._fail)
        except BaseException:
            self.shutdown()
            raise
        logger.info("%s gang of %d ranks started (%s over %s)", name, self.world_size, init_method, backend)
        self.on_failure = on_failure

    def collective_rpc(self, method: Method, args: tuple = (), kwargs: dict | None = None,
                       unique_reply_rank: int | None = None, timeout_s: float | None = None) -> list:
        with self._lock:
            self._raise_if_failed()
            payload = ray.put((method, args, kwargs or {}))  # stored once, read by every rank
            refs = [worker.call.remote(payload, unique_reply_rank is None or rank == unique_reply_rank)
                    for rank, worker in enumerate(self.workers)]
            outcomes = self._gather(refs, method_name(method), timeout_s or self.timeout_s)
            return settle(outcomes, method, unique_reply_rank, self._fail)

    def _gather(self, refs: list[ray.ObjectRef], what: str, timeout_s: float | None) -> list[Outcome]:
        """Every rank's outcome, in rank order, taken as each arrives so that a rank's death is seen at once even while
        the others wait for it in a collective."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        outcomes: dict[int, Outcome] = {}
        pending = list(refs)
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not ready:
                self._fail(f"rank(s) {sorted(rank_of[r] for r in pending)} did not finish {what} within "
                           f"{timeout_s:.0f} s")
            for ref in ready:
                rank = rank_of[ref]
                try:
                    outcomes[rank] = (True, ray.get(ref))
                except RayActorError as err:
                    self._fail(f"rank {rank} died during {what}: {str(err).splitlines()[0]}")
                except RayTaskError as err:  # the rank's runner raised
                    outcomes[rank] = (False, err.cause if err.cause is not None else err)
        return [outcomes[rank] for rank in range(len(refs))]

    def _fail(self, reason: str) -> NoReturn:
        """Marks the gang broken, kills its ranks (some may wait in a collective for the lost one), tells
        ``on_failure`` once, and raises."""
        first = self.failure is None
        self.failure = self.failure or reason
        if first:
            logger.error("%s gang broken: %s", self.name, reason)
            self._kill_ranks()
            if self.on_failure is not None:
                self.on_failure(reason)
        raise GangError(reason)

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise GangError(self.failure)

    def check_health(self) -> None:
        """Raises GangError once the gang broke. Each call also collects the pings the previous one sent each rank
        (without waiting for them), so a rank that died between steps is seen within a health-check period."""
        self._raise_if_failed()
        if self._pings is not None:
            ready, _ = ray.wait(self._pings, num_returns=len(self._pings), timeout=0)
            for ref in ready:
                try:
                    ray.get(ref)
                except RayActorError as err:
                    self._fail(f"rank {self._pings.index(ref)} died: {str(err).splitlines()[0]}")
            if len(ready) < len(self._pings) and time.monotonic() - self._pinged_at > self.timeout_s:
                self._fail(f"a rank did not answer a ping within {self.timeout_s:.0f} s")
            if len(ready) < len(self._pings):
                return
        self._pings = [worker.ping.remote() for worker in self.workers]
        self._pinged_at = time.monotonic()

    def shutdown(self) -> None:
        """Leaves the process group on every rank that still answers, then kills the rank actors."""
        if self.failure is None:
            try:
                ray.get([worker.stop.remote() for worker in self.workers], timeout=10)
            except Exception as err:  # going away regardless
                logger.warning("%s gang: a rank did not stop cleanly (%s)", self.name, err)
        self._kill_ranks()

    def _kill_ranks(self) -> None:
        for worker in self.workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # already gone
                pass
