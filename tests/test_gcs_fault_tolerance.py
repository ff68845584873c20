"""GCS fault tolerance on a real Redis (issue 41): a head node whose GCS keeps its tables in Debian's redis-server,
the tiny app on it, and the GCS process killed with SIGKILL while requests flow (a quarter of the clients stream).
Serve's data plane (the proxy, the coordinator and the stage replicas, their handles to each other) never asks the
GCS, so the app answers throughout the outage; the GCS is then started again with the head's own command line, as a
KubeRay head pod's restart does, reloads its state from Redis, and the Serve controller answers `serve.status()`
with the app healthy. Every request sent is counted, and every one must come back 200 with its image."""

from __future__ import annotations

import dataclasses
import http.client
import itertools
import json
import secrets
import threading
import time

import psutil
import pytest
from conftest import REPO

from benchmarks.soak import Client, check
from omni_ray.api.client import connect_ray
from testing.gcs_fault import RedisServer, gcs_process, kill_gcs, start_gcs
from testing.local_serve import LocalServe

pytestmark = pytest.mark.serve
CLIENTS = 4  # one of them streams
OUTAGE_S = 10.0  # how long the GCS stays down; a head pod's restart takes about as long
RECOVERY_TIMEOUT_S = 90.0


@dataclasses.dataclass(frozen=True, slots=True)
class Sent:
    streamed: bool
    start: float  # time.monotonic()
    end: float
    problem: str | None  # None: a 200 with its image


class Load:
    """``CLIENTS`` clients sending requests back to back until stopped; every request's outcome recorded."""

    def __init__(self, base_url: str):
        self.client = Client(base_url)
        self.sent: list[Sent] = []
        self.numbers = itertools.count()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k == 0,), daemon=True) for k in range(CLIENTS)]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in self.threads), "a request still hangs"

    def _run(self, streamed: bool) -> None:
        while not self.stopping.is_set():
            i = next(self.numbers)
            body = {"prompt": f"a red cat, take {i}", "size": "64x64", "num_inference_steps": 2, "seed": i,
                    **({"stream": True} if streamed else {})}
            start = time.monotonic()
            try:
                status, data = self.client.send("/v1/images/generations", json.dumps(body).encode(),
                                                "application/json", timeout=60)
                problem = check(status, data, 1, streamed)
            except (OSError, http.client.HTTPException) as err:  # refused, reset, cut short, timed out: lost
                problem = f"{type(err).__name__}: {err}"
            self.sent.append(Sent(streamed, start, time.monotonic(), problem))

    def answered_between(self, start: float, end: float) -> list[Sent]:
        """The requests sent at or after ``start`` and answered by ``end``."""
        return [s for s in list(self.sent) if s.start >= start and s.end <= end and s.problem is None]

    def wait_answered_after(self, start: float, count: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.answered_between(start, float("inf"))) < count:
            assert time.monotonic() < deadline, f"fewer than {count} requests answered in {timeout_s:.0f} s"
            time.sleep(0.2)


def serve_status_once_healthy(address: str) -> dict:
    """Connects a driver to the cluster (through the restarted GCS) and waits until the Serve controller reports the
    app running and every deployment healthy; returns what `serve.status()` said."""
    import ray
    from ray import serve

    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    connect_ray(address)
    try:
        while True:
            try:
                status = serve.status()
                app = status.applications["omni-ray"]
                summary = {"app": app.status.value, **{name: d.status.value for name, d in app.deployments.items()},
                           "proxies": sorted({proxy.value for proxy in status.proxies.values()})}
                if app.status == "RUNNING" and all(d.status == "HEALTHY" for d in app.deployments.values()):
                    return summary
            except Exception as err:  # the controller may not answer at once
                summary = {"error": repr(err)}
            assert time.monotonic() < deadline, f"the app is not healthy {RECOVERY_TIMEOUT_S:.0f} s on: {summary}"
            time.sleep(1)
    finally:
        ray.shutdown()


def replace_a_replica(served: LocalServe, deployment: str) -> float:
    """Kills ``deployment``'s replica; returns the seconds until a new one answers a request through the app."""
    victim = psutil.Process(served.replica_pids()[deployment])
    start = time.monotonic()
    victim.kill()
    victim.wait(timeout=30)
    while served.replica_pids().get(deployment) in (None, victim.pid):
        assert time.monotonic() - start < RECOVERY_TIMEOUT_S, f"no new {deployment} replica"
        time.sleep(0.5)
    body = {"prompt": "a red cat", "size": "64x64", "num_inference_steps": 2}
    status, data = Client(served.base_url).send("/v1/images/generations", json.dumps(body).encode(),
                                                "application/json", timeout=RECOVERY_TIMEOUT_S)
    assert check(status, data, 1, False) is None
    return time.monotonic() - start


def test_the_app_answers_while_the_gcs_is_down_and_the_controller_recovers(tiny_dir):
    namespace = f"omni-ray-test-{secrets.token_hex(4)}"
    restarted = []  # the GCS this test started: reaped once the cluster is stopped
    with RedisServer() as redis:
        with LocalServe(REPO / "config.yaml", model=str(tiny_dir), env=redis.ray_env(namespace),
                        head_args=[f"--redis-password={redis.password}"]) as served:
            # The GCS keeps its tables in this Redis, under the cluster's namespace: what a new GCS reloads.
            assert redis.count_keys(f"*{namespace}*") > 0
            replicas = served.replica_pids()
            with Load(served.base_url) as load:
                load.wait_answered_after(0.0, 2 * CLIENTS)  # every client has been answered
                # 1. The GCS dies under load.
                down_at = time.monotonic()
                command = kill_gcs(served.gcs_port)
                time.sleep(OUTAGE_S)
                assert gcs_process(served.gcs_port) is None
                up_at = time.monotonic()
                during = load.answered_between(down_at, up_at)
                # 2. It is started again, as the head pod's restart would; the controller reports the app healthy.
                restarted.append(start_gcs(command))
                status = serve_status_once_healthy(served.address)
                recovered_at = time.monotonic()
                load.wait_answered_after(recovered_at, 2 * CLIENTS)  # answered after the recovery
            sent = load.sent
            assert served.replica_pids() == replicas  # the same replicas served throughout
            assert served.process.poll() is None, served.log()[-3000:]  # `serve run` outlived the outage
            # 3. The controller does the work that needs the GCS again: a replica killed now is replaced (a new
            # actor), and the app answers through the new one.
            replaced_in = replace_a_replica(served, "VAE")
        lost = [s for s in sent if s.problem is not None]
        summary = (f"{len(sent)} requests sent ({sum(s.streamed for s in sent)} streamed), {len(lost)} lost; "
                   f"GCS down {up_at - down_at:.1f} s: {len(during)} sent and answered in the outage "
                   f"({sum(s.streamed for s in during)} streamed); recovered {recovered_at - up_at:.1f} s after the "
                   f"restart: {status}; a VAE replica killed after it replaced in {replaced_in:.1f} s")
        print(summary)
        assert not lost, f"{summary}\nfirst lost: {lost[0].problem}"
        assert len(during) >= 2 * CLIENTS and any(s.streamed for s in during), summary
        assert status["proxies"] == ["HEALTHY"], summary
        # 4. Nothing is left of the cluster once it is stopped.
        for process in restarted:
            process.wait(timeout=30)
        assert served._cluster_processes() == []
    assert redis.process.poll() is not None
    with pytest.raises(ConnectionRefusedError):
        redis.command("PING")
