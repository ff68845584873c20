"""Plain `serve run config.yaml` as a newcomer runs it (issue 28), with omni-ray's start-up hook in the `serve run`
process (deployments/run_hook.py): an address file left by a killed cluster does not make it hang, and SIGTERM
stops it cleanly."""

import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest
import yaml
from conftest import REPO

from testing.local_serve import free_port

pytestmark = pytest.mark.serve
ADDRESS_FILE = pathlib.Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"


@pytest.fixture
def stale_address_file():
    """A ray_current_cluster naming an address where nothing listens, as a cluster killed without `ray stop`
    leaves it; whatever file was there before is put back after."""
    before = ADDRESS_FILE.read_text() if ADDRESS_FILE.exists() else None
    dead = f"127.0.0.1:{free_port()}"
    ADDRESS_FILE.parent.mkdir(parents=True, exist_ok=True)
    ADDRESS_FILE.write_text(dead)
    yield dead
    if before is not None:
        ADDRESS_FILE.write_text(before)
    elif ADDRESS_FILE.exists() and ADDRESS_FILE.read_text() == dead:
        ADDRESS_FILE.unlink()


def test_serve_run_starts_past_a_dead_clusters_address_and_sigterm_exits_0(tiny_dir, tmp_path, stale_address_file):
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    config["applications"][0]["args"]["model"] = str(tiny_dir)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    log = tmp_path / "serve.log"
    process = subprocess.Popen([str(pathlib.Path(sys.executable).parent / "serve"), "run", "config.yaml"],
                               cwd=tmp_path, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        start, deadline = time.monotonic(), time.monotonic() + 300  # LocalServe's start time
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no /health in 300 s:\n{log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        print(f"serve run answered /health in {time.monotonic() - start:.0f} s")
        assert not ADDRESS_FILE.exists() or ADDRESS_FILE.read_text() != stale_address_file
        assert "nothing answers at" in log.read_text()  # the hook said what it removed

        stopped = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log.read_text()[-3000:]
        print(f"SIGTERM: exit 0 in {time.monotonic() - stopped:.1f} s")
        text = log.read_text()
        assert "*** SIGTERM received" not in text and "Traceback" not in text.split("shutting down")[-1]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
