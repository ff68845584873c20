"""Serve's router for the DiT: each call goes to the replica with the least queued work, not the fewest requests.

Each DiT replica reports its work in cost-seconds (``DiT.record_routing_stats``: its requests' remaining steps at
its measured step times) every ``ROUTING_STATS_PERIOD_S``; between two reports the router adds, for every
``denoise`` call it sent a replica, that replica's mean request cost, so that a burst does not all go to the replica
that looked idle at the last report. A request naming a LoRA adapter prefers the replicas that hold it (Serve's
model multiplexing), least work first within each preference. Ties go to the replica with the shortest queue that
Serve's own probes saw.

One router lives in each process that holds a handle to the DiT (each coordinator replica).
"""

from __future__ import annotations

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

ROUTING_STATS_PERIOD_S = 0.5


class LeastWorkRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self._sent: dict[ReplicaID, tuple[float, int]] = {}  # replica -> (report time, denoise calls since)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """One rank per replica, least work first (within each multiplexing preference)."""
        model_id = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        ranks = self.rank_replicas_via_multiplex(candidate_replicas, model_id) if model_id else [candidate_replicas]
        return [[replica] for rank in ranks for replica in sorted(rank, key=self._work)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        if pending_request.metadata.call_method != "denoise" or replica_id not in self._replicas:
            return
        reported_at = self._replicas[replica_id].routing_stats.get("at", 0.0)
        at, count = self._sent.get(replica_id, (reported_at, 0))
        self._sent[replica_id] = (reported_at, count + 1 if at == reported_at else 1)

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
