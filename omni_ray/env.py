"""The environment variables omni-ray reads, each named and parsed here once."""

from __future__ import annotations

import os
from collections.abc import Mapping

API_KEY = "OMNI_RAY_API_KEY"  # the server's API keys; the Python client sends the first


def api_keys(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The keys ``OMNI_RAY_API_KEY`` names: one, or several separated by commas (blanks around them dropped); none
    when it is unset."""
    return [key.strip() for key in environ.get(API_KEY, "").split(",") if key.strip()]


TRACE_DIR = "OMNI_RAY_TRACE_DIR"  # where omni_ray.tracing.export:jsonl writes each process's spans


def trace_dir(environ: Mapping[str, str] = os.environ) -> str:
    """The directory ``OMNI_RAY_TRACE_DIR`` names for span files; ``<tmp>/omni-ray-spans`` when it is unset."""
    import tempfile

    return environ.get(TRACE_DIR) or os.path.join(tempfile.gettempdir(), "omni-ray-spans")
