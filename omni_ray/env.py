"""The environment variables omni-ray reads, each named and parsed here once."""

from __future__ import annotations

import os
from collections.abc import Mapping

API_KEY = "OMNI_RAY_API_KEY"  # the server's API keys; the Python client sends the first


def api_keys(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The keys ``OMNI_RAY_API_KEY`` names: one, or several separated by commas (blanks around them dropped); none
    when it is unset."""
    return [key.strip() for key in environ.get(API_KEY, "").split(",") if key.strip()]


KEY_LIMITS = "OMNI_RAY_KEY_LIMITS"  # per-key quotas (omni_ray.quotas.QuotaSettings.parse's syntax)
KEY_LIMITS_FILE = "OMNI_RAY_KEY_LIMITS_FILE"  # or a file holding them: a Kubernetes Secret mounted as a volume


def key_limits(environ: Mapping[str, str] = os.environ) -> str | None:
    """The per-key quota settings' text: ``OMNI_RAY_KEY_LIMITS``, else the file ``OMNI_RAY_KEY_LIMITS_FILE`` names
    (None when that file does not exist: an optional Secret not created); None when neither is set. ValueError when
    both are (which one counts would be a guess)."""
    text, path = environ.get(KEY_LIMITS, "").strip(), environ.get(KEY_LIMITS_FILE, "").strip()
    if text and path:
        raise ValueError(f"set {KEY_LIMITS} or {KEY_LIMITS_FILE}, not both")
    if path:
        try:
            with open(path, encoding="utf-8") as file:
                return file.read()
        except FileNotFoundError:
            return None
    return text or None


TRACE_DIR = "OMNI_RAY_TRACE_DIR"  # where omni_ray.tracing.export:jsonl writes each process's spans


def trace_dir(environ: Mapping[str, str] = os.environ) -> str:
    """The directory ``OMNI_RAY_TRACE_DIR`` names for span files; ``<tmp>/omni-ray-spans`` when it is unset."""
    import tempfile

    return environ.get(TRACE_DIR) or os.path.join(tempfile.gettempdir(), "omni-ray-spans")
