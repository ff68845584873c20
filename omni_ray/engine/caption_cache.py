"""The encoder's caption cache: Qwen-Image-Layered's captions by image, a least-recently-used map bounded in entries.

A caption is a function of the checkpoint, the template (its language), the bound on new tokens (greedy decoding is
otherwise deterministic) and the image's pixels. The key is a SHA-256 of exactly those, so images that differ in one
pixel (or only in shape) never share an entry. Captions are small (at most ``max_tokens`` ids and their text), so the
bound is a count.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from omni_ray.records import Caption

MAX_ENTRIES = 4096  # a 512-token caption is a few kB: the cache stays within tens of MB


class CaptionCache:
    """Captions by ``key``; at most ``max_entries`` of them, the least recently used leaving first."""

    def __init__(self, checkpoint: str, max_tokens: int, max_entries: int = MAX_ENTRIES):
        self.max_entries = max_entries
        self._salt = f"{checkpoint}\0{max_tokens}\0".encode()
        self._entries: OrderedDict[bytes, Caption] = OrderedDict()
        self.num_hits = 0
        self.num_misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def key(self, image: np.ndarray, language: str) -> bytes:
        """A SHA-256 of the salt, the language, the image's shape and dtype, and its pixels."""
        digest = hashlib.sha256(self._salt)
        digest.update(f"{language}\0{image.shape}\0{image.dtype.str}\0".encode())
        digest.update(np.ascontiguousarray(image).tobytes())
        return digest.digest()

    def get(self, key: bytes) -> Caption | None:
        """A copy of the stored caption, marked ``cached``; or None. Counts the hit or miss."""
        caption = self._entries.get(key)
        if caption is None:
            self.num_misses += 1
            return None
        self.num_hits += 1
        self._entries.move_to_end(key)
        return Caption(caption.text, caption.token_ids, cached=True)

    def put(self, key: bytes, caption: Caption) -> None:
        self._entries[key] = Caption(caption.text, caption.token_ids)  # not the caller's: its timings change
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
