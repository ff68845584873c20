"""CPU and GPU benchmarks; each writes JSON and a PNG plot (see README.md here)."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable


def write_report(report: dict, out: str | pathlib.Path, plot: Callable[[dict, pathlib.Path], None]) -> pathlib.Path:
    """Writes ``report`` as JSON to ``out`` and ``plot``'s PNG beside it; returns the JSON's path."""
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return out
