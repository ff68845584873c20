"""Serve's autoscaling policy for the DiT: replicas from the work they hold, in cost-seconds, not their requests.

A DiT request's cost ranges over two orders of magnitude (a 512x512 image of 8 steps against a 1328x1328 one of 50
with true CFG), so a count of ongoing requests says little of how loaded a replica is. Each replica reports its
queued and running work (``DiT.record_autoscaling_stats``: remaining steps at its measured step times); the policy
asks for as many replicas as that work over ``target_work_s`` each. Serve applies the preset's bounds and its up and
down delays. A replica being scaled down takes no new requests and finishes those it holds (paused ones included:
with nothing new arriving they run) within the deployment's graceful shutdown timeout, the request deadline.
"""

from __future__ import annotations

from ray.serve.config import AutoscalingContext

METRIC = "queued_work_s"


class QueuedWorkPolicy:
    def __init__(self, target_work_s: float):
        self.target_work_s = target_work_s

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict]:
        work = (ctx.aggregated_metrics or {}).get(METRIC, {})
        if not work:  # no report yet (replicas starting): keep the count
            return ctx.target_num_replicas, {}
        return sum(work.values()) / self.target_work_s, {}
