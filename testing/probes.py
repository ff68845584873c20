"""A probe of a served app's cheap routes, in a process of its own so that a test's request threads (and their
share of its GIL) do not add to the times it measures:

    python -m testing.probes BASE_URL OUT_FILE [EVERY_S]

Reads ``/health`` and ``/v1/models`` every ``EVERY_S`` seconds (and the page every fourth time), each with a 10 s
timeout, until killed; writes one JSON line per read to ``OUT_FILE``: the path, when it was sent
(``time.monotonic()``, the same clock across the machine's processes), the seconds it took and its status (0: no
answer). ``Probes`` starts and stops one and reads what it wrote.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass


@dataclass(frozen=True)
class Probe:
    path: str
    sent: float  # time.monotonic()
    seconds: float
    status: int  # 0: no answer within the timeout


def probe_forever(base: str, out: pathlib.Path, every_s: float) -> None:
    rounds = 0
    with out.open("a", buffering=1) as lines:
        while True:
            for path in ("/health", "/v1/models") + (("/",) if rounds % 4 == 0 else ()):
                sent = time.monotonic()
                try:
                    with urllib.request.urlopen(base + path, timeout=10) as response:
                        response.read()
                        status = response.status
                except urllib.error.HTTPError as err:
                    status = err.code
                except OSError:
                    status = 0
                lines.write(json.dumps([path, sent, time.monotonic() - sent, status]) + "\n")
            rounds += 1
            time.sleep(every_s)


class Probes:
    """A ``testing.probes`` process over ``base`` while in the ``with`` block; ``read()`` what it measured."""

    def __init__(self, base: str, out: pathlib.Path, every_s: float = 0.5):
        self.base, self.out, self.every_s = base, out, every_s

    def __enter__(self) -> Probes:
        self.process = subprocess.Popen([sys.executable, "-m", "testing.probes", self.base, str(self.out),
                                         str(self.every_s)], cwd=pathlib.Path(__file__).resolve().parents[1])
        return self

    def __exit__(self, *exc) -> None:
        self.process.kill()
        self.process.wait(timeout=30)

    def read(self, path: str | None = None, start: float = 0.0, end: float = float("inf")) -> list[Probe]:
        probes = [Probe(*json.loads(line)) for line in self.out.read_text().splitlines() if line.strip()]
        return [p for p in probes if (path is None or p.path == path) and start <= p.sent <= end]


if __name__ == "__main__":
    probe_forever(sys.argv[1], pathlib.Path(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 0.5)
