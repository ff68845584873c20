"""API keys: with ``OMNI_RAY_API_KEY`` set (one key, or several separated by commas), every ``/v1/...`` route takes
``Authorization: Bearer <key>``, as OpenAI's clients send it; without it the server is open.

Keys are compared as SHA-256 digests, each against every key with ``hmac.compare_digest``, so that the time taken
says nothing of how much of a key was right, nor which key matched. A key is never logged or echoed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping

from omni_ray import env
from omni_ray.errors import AuthenticationError


class ApiKeys:
    """The keys a server takes; none: every request is let in."""

    def __init__(self, keys: Iterable[str] = ()):
        self._digests = [_digest(key) for key in keys]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ApiKeys:
        """The keys ``OMNI_RAY_API_KEY`` names (``env.api_keys``)."""
        return cls(env.api_keys(environ))

    @property
    def required(self) -> bool:
        return bool(self._digests)

    @property
    def count(self) -> int:
        """How many keys: their names are key0 .. key<count - 1>."""
        return len(self._digests)

    def check(self, authorization: str | None) -> str | None:
        """The matching key's name (``key0``, ``key1``: its place in the list, never the key), or None when the
        server takes no keys. Raises AuthenticationError (a 401) unless ``authorization`` (the header's value) is
        ``Bearer <key>`` with one of the keys."""
        if not self._digests:
            return None
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthenticationError("no API key: send it as the header `Authorization: Bearer <key>`")
        given = _digest(key.strip())
        matched = None
        for index, digest in enumerate(self._digests):  # every key, whichever matches
            if hmac.compare_digest(given, digest):
                matched = index
        if matched is None:
            raise AuthenticationError("incorrect API key provided")
        return f"key{matched}"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
