"""Ray's GCS fault tolerance on this machine, for tests: a real Redis (Debian's `redis-server`, started like any
service a test needs) and the head's GCS killed and started again, as a KubeRay head pod's restart does.

    with RedisServer() as redis, LocalServe("config.yaml", env=redis.ray_env("ns"),
                                            head_args=[f"--redis-password={redis.password}"]) as served:
        gcs = kill_gcs(served.gcs_port)   # SIGKILL; the raylets, replicas and proxies live on
        process = start_gcs(gcs)          # the same command line and environment: it reloads its state from Redis

Nothing restarts a killed GCS on a plain `ray start` cluster; in Kubernetes the head pod's restart does (KubeRay
docs: GCS fault tolerance). ``start_gcs`` runs the command the head ran, read from the dead process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import secrets
import shutil
import socket
import subprocess
import tempfile
import time

import psutil

from testing.local_serve import free_port


class RedisServer:
    """Debian's `redis-server` on a free loopback port with a password (in its config file, not on its command line),
    nothing saved to disk; stopped by ``SHUTDOWN NOSAVE`` on exit."""

    def __init__(self, password: str | None = None):
        self.port = free_port()
        self.password = password or secrets.token_hex(16)
        self.address = f"127.0.0.1:{self.port}"
        self.workdir = pathlib.Path(tempfile.mkdtemp(prefix="omni-ray-redis-"))
        self.process: subprocess.Popen | None = None

    def ray_env(self, namespace: str) -> dict[str, str]:
        """The head's environment for GCS fault tolerance on this Redis, as KubeRay sets it from
        ``gcsFaultToleranceOptions`` (the password goes to `ray start --redis-password`)."""
        return {"RAY_REDIS_ADDRESS": self.address, "RAY_external_storage_namespace": namespace}

    def __enter__(self) -> RedisServer:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is missing: `make install` installs Debian's redis-server package"
        config = self.workdir / "redis.conf"
        config.write_text(f"port {self.port}\nbind 127.0.0.1\nrequirepass {self.password}\nsave \"\"\n"
                          f"appendonly no\ndir {self.workdir}\ndaemonize no\n")
        self.process = subprocess.Popen([binary, str(config)], stdout=(self.workdir / "redis.log").open("w"),
                                        stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError):
                if self.command("PING") == b"+PONG":
                    return self
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"redis-server did not start:\n{(self.workdir / 'redis.log').read_text()}")
            time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(OSError):
            self.command("SHUTDOWN", "NOSAVE")
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def command(self, *args: str) -> bytes:
        """One command after AUTH, in Redis's wire protocol; its reply's first line (``+PONG``, ``:12``, ...)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as conn, conn.makefile("rb") as replies:
            for command in (("AUTH", self.password), args):
                conn.sendall(f"*{len(command)}\r\n".encode()
                             + b"".join(f"${len(a.encode())}\r\n{a}\r\n".encode() for a in command))
                reply = replies.readline().rstrip(b"\r\n")
                if command[0] == "SHUTDOWN":
                    return reply
                if reply.startswith(b"-"):
                    raise RuntimeError(f"redis: {reply.decode()}")
            return reply

    def count_keys(self, pattern: str = "*") -> int:
        """How many keys match ``pattern`` (``KEYS``: fine for the few hundred a test cluster writes)."""
        return int(self.command("KEYS", pattern).removeprefix(b"*"))


@dataclasses.dataclass(frozen=True)
class GcsCommand:
    """How the head started its GCS: what a restart runs again."""

    cmdline: list[str]
    environ: dict[str, str]
    cwd: str


def gcs_process(gcs_port: int) -> psutil.Process | None:
    """The GCS server listening on ``gcs_port``, if one runs."""
    for process in psutil.process_iter(["name", "cmdline"]):
        cmdline = process.info["cmdline"] or []
        if process.info["name"] == "gcs_server" and f"--gcs_server_port={gcs_port}" in cmdline:
            return process
    return None


def kill_gcs(gcs_port: int) -> GcsCommand:
    """SIGKILLs the GCS server of the cluster on ``gcs_port``; returns how it was started."""
    process = gcs_process(gcs_port)
    assert process is not None, f"no gcs_server on port {gcs_port}"
    command = GcsCommand(process.cmdline(), process.environ(), process.cwd())
    process.kill()
    process.wait(timeout=30)
    return command


def start_gcs(command: GcsCommand) -> subprocess.Popen:
    """Starts the GCS server again with the command line and environment it had (the same port, session and
    external storage namespace), in a session of its own as `ray start` leaves it."""
    return subprocess.Popen(command.cmdline, env=command.environ, cwd=command.cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
