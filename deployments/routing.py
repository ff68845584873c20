"""Serve's router for the DiT: each call goes to the replica with the least queued work, not the fewest requests.

Each DiT replica reports its work in cost-seconds (``DiT.record_routing_stats``: its requests' remaining steps at
its measured step times) every ``ROUTING_STATS_PERIOD_S``; between two reports the router adds, for every
``denoise`` call it sent a replica, that replica's mean request cost, so that a burst does not all go to the replica
that looked idle at the last report. A request naming a LoRA adapter prefers the replicas that hold it (Serve's
model multiplexing), one stacking adapters those that hold more of them, least work first within each preference.
Ties go to the replica with the shortest queue that Serve's own probes saw.

A request the coordinator admitted was promised by one replica: the one its ``estimate`` call was routed to (by the
same order), which reserved its work (``DiTLoad.admit``). Its ``denoise`` calls (``{request id}-{index}``) go to that
replica while it runs, whatever the work figures say by then: the promise holds only there, and that replica counts
the work already. A ``release`` call (the request was refused after its admission: its key's quota) goes there too.

One router lives in each process that holds a handle to the DiT (each coordinator replica).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import (
    FIFOMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from omni_ray.engine.dit_load import RESERVATION_HOLD_S, reservation_for

ROUTING_STATS_PERIOD_S = 0.5


class LeastWorkRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self._sent: dict[ReplicaID, tuple[float, int]] = {}  # replica -> (report time, denoise calls since)
        self._promised: dict[str, tuple[ReplicaID, float]] = {}  # request id -> (replica that admitted it, when)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """One rank per replica, least work first (within each multiplexing preference)."""
        model_id = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if "," in model_id:  # a stack of adapters (``records.stack_id``)
            ranks = self._rank_for_stack(candidate_replicas, frozenset(model_id.split(",")))
        elif model_id:
            ranks = self.rank_replicas_via_multiplex(candidate_replicas, model_id)
        else:
            ranks = [candidate_replicas]
        ordered = [[replica] for rank in ranks for replica in sorted(rank, key=self._work)]
        promised = self._promised_replica(pending_request)
        return sorted(ordered, key=lambda rank: rank[0].replica_id != promised) if promised is not None else ordered

    def _rank_for_stack(self, replicas: list[RunningReplica], names: frozenset[str]) -> list[list[RunningReplica]]:
        """Serve's multiplex ranking stretched to a stack: the replicas holding more of its adapters first; of those
        holding none, the ones holding the fewest adapters (with free slots, likely) before the others."""
        fewest = self._get_replica_ids_with_fewest_multiplexed_models()

        def rank(replica: RunningReplica) -> tuple[int, bool]:
            held = len(names & replica.multiplexed_model_ids)
            return -held, held == 0 and replica.replica_id not in fewest

        ordered = sorted(replicas, key=rank)
        return [list(group) for _, group in itertools.groupby(ordered, key=rank)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        method = pending_request.metadata.call_method
        if method == "estimate" and pending_request.kwargs.get("reservation") is not None:
            now = time.monotonic()
            self._promised = {key: value for key, value in self._promised.items()
                              if now - value[1] < RESERVATION_HOLD_S}
            self._promised[pending_request.kwargs["reservation"]] = (replica_id, now)
        if method == "release" and pending_request.args:
            self._promised.pop(str(pending_request.args[0]), None)
        if method != "denoise" or replica_id not in self._replicas or self._promised_replica(pending_request):
            return  # a promised call's work is in its replica's report already
        reported_at = self._replicas[replica_id].routing_stats.get("at", 0.0)
        at, count = self._sent.get(replica_id, (reported_at, 0))
        self._sent[replica_id] = (reported_at, count + 1 if at == reported_at else 1)

    def _promised_replica(self, pending_request: PendingRequest | None) -> ReplicaID | None:
        """The replica that admitted the request a ``denoise`` call belongs to, or a ``release`` call gives up (None
        for other calls)."""
        if pending_request is None or not pending_request.args:
            return None
        method, call_id = pending_request.metadata.call_method, str(pending_request.args[0])
        if method == "release":
            return self._promised.get(call_id, (None,))[0]
        key = reservation_for(call_id, self._promised) if method == "denoise" else None
        return self._promised[key][0] if key is not None else None

    def _work(self, replica: RunningReplica) -> tuple[float, int]:
        stats = replica.routing_stats or {}
        work = stats.get("queued_work_s", 0.0)
        at, count = self._sent.get(replica.replica_id, (None, 0))
        if at == stats.get("at", 0.0):  # calls sent since that report
            work += count * stats.get("request_s", 0.0)
        queue_len = self._replica_queue_len_cache.get(replica.replica_id)
        return work, queue_len if queue_len is not None else 0


def router_config() -> RequestRouterConfig:
    """The DiT deployment's ``request_router_config``."""
    return RequestRouterConfig(request_router_class=LeastWorkRouter,
                               request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
                               request_routing_stats_timeout_s=ROUTING_STATS_PERIOD_S * 4)
