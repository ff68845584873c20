"""A local Ray cluster serving a Serve config, for tests and benchmarks: `ray start` then `serve run`.

    with LocalServe("config.yaml", model="/tmp/tiny") as served:
        ...  # served.base_url, served.address, served.client_address (ray://, the head's Ray Client server)

``preset`` replaces the stage config the app is built from (a preset's YAML as a dict); ``env`` is added to the
environment of the cluster's processes (``OMNI_RAY_API_KEY``, say), and ``head_args`` to the head's `ray start` (with
``RAY_REDIS_ADDRESS`` in ``env``, ``--redis-password=...`` turns GCS fault tolerance on: testing/gcs_fault.py). With
``workers``, more raylets join the head on this machine (``ray start --address``), each a node of its own with the
custom resources given, so presets that pin stages by resource run across nodes as on a real cluster.

Metrics are exported for Prometheus at ``served.metrics_url``. The head runs without the dashboard (it costs about
1.4 GB) unless ``dashboard`` asks for it, and with more logical CPUs than cores, so the CPU presets' fractional
replicas always fit. With the dashboard, ``served.deploy(config)`` applies a changed Serve config as an operator does,
with ``serve deploy`` (the dashboard's REST API, which KubeRay's operator uses too), and ``served.applications()``
reads what ``serve status`` reports.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import psutil
import yaml

BIN = pathlib.Path(sys.executable).parent


def tool(name: str) -> str:
    """A console script of Ray's (``ray``, ``serve``): beside this interpreter, as in a virtual environment, or on
    the PATH, where ``pip install --target`` left it (the GPU plan's wheels: benchmarks/gpu_plan.sh)."""
    beside = BIN / name
    return str(beside) if beside.exists() else shutil.which(name) or str(beside)
WORKER_STORE_BYTES = 512 << 20  # each worker raylet's object store: they all share this machine's memory


_HANDED_OUT: set[int] = set()  # ports this process has chosen: a cluster started later may not yet listen on them


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free now and never handed out before by this process. The sockets stay bound
    until all are chosen: closed one at a time, the kernel could give the same port twice (it did: a head's GCS and
    metrics ports, and `ray start` failed)."""
    sockets, ports = [], []
    try:
        while len(ports) < count:
            sockets.append(socket.socket())
            sockets[-1].bind(("127.0.0.1", 0))
            port = sockets[-1].getsockname()[1]
            if port not in _HANDED_OUT:
                ports.append(port)
                _HANDED_OUT.add(port)
    finally:
        for s in sockets:
            s.close()
    return ports


def free_port() -> int:
    return free_ports(1)[0]


class LocalServe:
    """Starts a Ray head and `serve run` on a copy of ``config`` (free port, optional model override)."""

    def __init__(self, config: str | pathlib.Path, model: str | None = None, num_cpus: int = 4,
                 ready_timeout_s: float = 300.0, head_resources: dict[str, float] | None = None,
                 workers: list[dict[str, float]] = (), preset: dict | None = None, env: dict[str, str] | None = None,
                 head_args: list[str] = (), dashboard: bool = False):
        self.config = yaml.safe_load(pathlib.Path(config).read_text())
        self.port, self.gcs_port, self.metrics_port, self.client_port, dashboard_port, self.agent_port = free_ports(6)
        self.dashboard_port = dashboard_port if dashboard else None
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}" if dashboard else None
        self.preset = preset
        self.config["http_options"]["port"] = self.port
        if model is not None:
            self.config["applications"][0]["args"]["model"] = model
        self.num_cpus = num_cpus
        self.head_resources = head_resources or {}
        self.workers = list(workers)
        self.head_args = list(head_args)
        self.ready_timeout_s = ready_timeout_s
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.address = f"127.0.0.1:{self.gcs_port}"
        self.client_address = f"ray://127.0.0.1:{self.client_port}"  # not the default 10001: another cluster's
        # Metrics reach the exporter every second instead of every ten, so tests see them soon.
        self.env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
                        RAY_metrics_report_interval_ms="1000", **(env or {}))
        self.workdir = pathlib.Path(tempfile.mkdtemp(prefix="omni-ray-serve-"))
        self.log_path = self.workdir / "serve.log"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> LocalServe:
        self.started_at = time.time()
        if self.preset is not None:
            (self.workdir / "preset.yaml").write_text(yaml.safe_dump(self.preset))
            self.config["applications"][0]["args"]["stage_config"] = str(self.workdir / "preset.yaml")
        (self.workdir / "config.yaml").write_text(yaml.safe_dump(self.config))
        subprocess.run(
            [tool("ray"), "start", "--head", f"--port={self.gcs_port}", f"--num-cpus={self.num_cpus}",
             f"--metrics-export-port={self.metrics_port}", f"--ray-client-server-port={self.client_port}",
             *self._dashboard_flags(), "--disable-usage-stats",
             f"--resources={json.dumps(self.head_resources)}", *self.head_args],
            check=True, env=self.env, capture_output=True, timeout=120,
        )
        for resources in self.workers:
            subprocess.run(
                [tool("ray"), "start", f"--address={self.address}", f"--num-cpus={self.num_cpus}",
                 f"--resources={json.dumps(resources)}", f"--object-store-memory={WORKER_STORE_BYTES}",
                 "--disable-usage-stats"],
                check=True, env=self.env, capture_output=True, timeout=120,
            )
        self.process = subprocess.Popen(
            [tool("serve"), "run", "config.yaml", f"--address={self.address}"],
            cwd=self.workdir, env=self.env, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT,
            start_new_session=True,  # a signal sent to it (tests send SIGINT and SIGTERM) stays with it
            # Ctrl-C stops it as at a terminal, even when this process was started in the background by a
            # shell without job control, which leaves SIGINT ignored for its children.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _dashboard_flags(self) -> list[str]:
        if self.dashboard_port is None:
            return ["--include-dashboard=false"]
        return ["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
                f"--dashboard-agent-listen-port={self.agent_port}"]

    def deploy(self, config: dict, app: str = "omni-ray", timeout_s: float = 60.0) -> None:
        """Applies ``config`` (a whole Serve config, its HTTP port this cluster's) to the running cluster with
        ``serve deploy``; returns once the controller took it for ``app`` (the upgrade then runs: ``wait_running``)."""
        path = self.workdir / f"deploy-{time.monotonic_ns()}.yaml"
        path.write_text(yaml.safe_dump(config))
        before = self.applications()[app]["last_deployed_time_s"]
        subprocess.run([tool("serve"), "deploy", str(path), f"--address={self.dashboard_url}"],
                       check=True, env=self.env, capture_output=True, timeout=120, cwd=self.workdir)
        deadline = time.monotonic() + timeout_s
        while self.applications()[app]["last_deployed_time_s"] == before:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the controller did not take {path.name} in {timeout_s:.0f} s")
            time.sleep(0.2)

    def applications(self) -> dict:
        """The Serve applications' status, as ``serve status`` has it (the dashboard's ``/api/serve/applications/``):
        each application's status and its deployments', with every replica (its id, state, pid)."""
        with urllib.request.urlopen(self.dashboard_url + "/api/serve/applications/", timeout=30) as response:
            return json.loads(response.read())["applications"]

    def wait_running(self, app: str = "omni-ray", timeout_s: float = 600.0) -> dict:
        """Waits until ``app`` and each of its deployments is RUNNING (HEALTHY) with no replica but running ones, as
        many as its target; returns its status."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.applications().get(app, {})
            deployments = status.get("deployments", {}).values()
            if status.get("status") == "RUNNING" and all(
                    d["status"] == "HEALTHY" and {r["state"] for r in d["replicas"]} == {"RUNNING"}
                    and len(d["replicas"]) == d["target_num_replicas"] for d in deployments):
                return status
            if status.get("status") == "DEPLOY_FAILED" or time.monotonic() > deadline:
                raise RuntimeError(f"{app} not running: {json.dumps(status)[-4000:]}")
            time.sleep(1)

    def __exit__(self, *exc) -> None:
        """Kills the cluster, `serve run` with it. Serve's own shutdown (every replica drained and stopped, 7-9 s a
        cluster) is left to the tests that signal `serve run` themselves; here it would only add to the suite."""
        self._stop_cluster()
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        if self.process is not None:
            self.process.wait(timeout=30)

    def _stop_cluster(self) -> None:
        """Kills this cluster's processes, as ``ray stop --force`` would, but only this cluster's: that command kills
        every Ray process of the machine, another test run's or benchmark's cluster too."""
        processes = self._cluster_processes()
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(processes, timeout=30)
        # `ray start --head` wrote the cluster's address here, and `ray stop` would remove it; left behind, a later
        # `serve run` without an address tries to join the dead cluster for ever.
        current = pathlib.Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        with contextlib.suppress(OSError):
            if current.read_text().strip().endswith(f":{self.gcs_port}"):
                current.unlink()

    def _cluster_processes(self) -> list[psutil.Process]:
        """The processes naming this cluster's GCS port or its session directory (the head's and the worker
        raylets', GCS, monitors, agents), and all their children (the workers and replicas)."""
        listed = [(p, " ".join(p.info["cmdline"] or [])) for p in psutil.process_iter(["cmdline"])]
        ports = (f":{self.gcs_port} ", f":{self.gcs_port}\n", f"={self.gcs_port} ")
        named = {p.pid: cmd for p, cmd in listed if any(mark in cmd + "\n" for mark in ports)}
        sessions = {m.group(0) for cmd in named.values() if (m := re.search(r"/session_[\w.-]+", cmd))}
        own = {p.pid: p for p, cmd in listed if p.pid in named or any(s in cmd for s in sessions)}
        for process in list(own.values()):
            with contextlib.suppress(psutil.NoSuchProcess):
                own.update({child.pid: child for child in process.children(recursive=True)})
        own.pop(os.getpid(), None)
        return list(own.values())

    def store_bytes(self) -> int:
        """Bytes in the cluster's object store that requests can account for: what Serve's controller keeps of
        the replicas it started (one more for every replica it replaced) is left out. Needs ``ray.init`` here."""
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address, memory_summary

        used = get_memory_info_reply(get_state_from_address(self.address)).store_stats.object_store_bytes_used
        controllers = {str(p.pid) for p in psutil.process_iter(["cmdline"])
                       if (p.info["cmdline"] or [""])[0].startswith("ray::ServeController")}
        held = {}  # object id -> (size, pids holding it), from the table `ray memory` prints
        for line in memory_summary(self.address, line_wrap=False, stats_only=False).splitlines():
            cells = [cell.strip() for cell in line.split("|")]  # ip | pid | type | ... | size | reference | id
            sizes = [cell for cell in cells if cell.endswith(" B")]
            if len(cells) >= 8 and sizes:
                size, pids = held.get(cells[-1], (float(sizes[0][:-2]), set()))
                held[cells[-1]] = (size, pids | {cells[1]})
        # Objects past 100 KiB live in the store; smaller ones inline in their owner's memory.
        return used - int(sum(size for size, pids in held.values() if size >= 100 * 1024 and pids <= controllers))

    def replica_pids(self) -> dict[str, int]:
        """The Serve replicas' process ids, by deployment name (Ray titles each replica's process)."""
        prefix = "ray::ServeReplica:"  # then "<app>:<deployment>", and ".<method>" while one runs
        return {cmd.removeprefix(prefix).split(":")[1].split(".")[0].split()[0]: p.pid
                for p in psutil.process_iter(["cmdline"])
                if (cmd := (p.info["cmdline"] or [""])[0]).startswith(prefix)}

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def _wait_ready(self) -> None:
        """Until /health answers 200. `serve run` stays up when the app cannot be built or a replica keeps failing
        to start (Serve retries it for ever): the log's first such failure, or its third, ends the wait at once."""
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"serve run exited:\n{self.log()[-4000:]}")
            log = self.log()
            if "' failed with exception" in log or log.count("Exception in Replica(") >= 3:
                raise RuntimeError(f"the app failed to deploy:\n{log[-6000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"serve run not ready in {self.ready_timeout_s:.0f} s:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
