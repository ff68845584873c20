"""The encoder's prompt-embedding cache: a least-recently-used map bounded in bytes.

A text's embeddings are a function of the checkpoint, the token ids the template made of the prompt (template text,
truncation and prompt all in them; for Qwen-Image 2.1 its raw template for that number of images) and, for an edit,
the input images' pixels (2.1's image slots follow from the same). The key is a SHA-256 of exactly
those, so two prompts that differ in one character, or images that differ in one pixel, never share an entry; and
a hit returns a copy of the stored tensor, which no caller can change in place.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from omni_ray.records import PromptEmbeds


class PromptCache:
    """Embeddings by ``key``; at most ``max_bytes`` of them, the least recently used leaving first."""

    def __init__(self, max_bytes: int, model: str, template: str):
        self.max_bytes = max_bytes
        self._salt = f"{model}\0{template}\0".encode()
        self._entries: OrderedDict[bytes, PromptEmbeds] = OrderedDict()
        self.nbytes = 0
        self.num_hits = 0
        self.num_misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def key(self, token_ids: list[int], image_digest: bytes | None = None) -> bytes:
        """A text's key: its token ids, and for an edit its images' ``image_digest`` (made once per request: an
        image of a million pixels takes milliseconds to hash, and a request has two texts)."""
        digest = hashlib.sha256(self._salt)
        digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
        if image_digest is not None:
            digest.update(image_digest)
        return digest.digest()

    @staticmethod
    def image_digest(images: tuple[np.ndarray, ...]) -> bytes:
        """A SHA-256 of the images' shapes, dtypes and pixels, in order."""
        digest = hashlib.sha256()
        for image in images:
            digest.update(repr((image.shape, image.dtype.str)).encode())
            digest.update(np.ascontiguousarray(image).tobytes())
        return digest.digest()

    def get(self, key: bytes) -> PromptEmbeds | None:
        """A copy of the stored embeddings, or None; counts the hit or miss."""
        embeds = self._entries.get(key)
        if embeds is None:
            self.num_misses += 1
            return None
        self.num_hits += 1
        self._entries.move_to_end(key)
        return copy_embeds(embeds)

    def put(self, key: bytes, embeds: PromptEmbeds) -> None:
        size = _nbytes(embeds)
        if key in self._entries or size > self.max_bytes:
            return
        self._entries[key] = copy_embeds(embeds)
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= _nbytes(evicted)


def copy_embeds(embeds: PromptEmbeds) -> PromptEmbeds:
    """A copy no holder of ``embeds`` can change: its tensor, and its image slots (Qwen-Image 2.1) with it."""
    slots = embeds.image_slots
    return PromptEmbeds(embeds.embeds.clone(), None if slots is None else slots.clone())


def _nbytes(embeds: PromptEmbeds) -> int:
    size = embeds.embeds.element_size() * embeds.embeds.nelement()
    if embeds.image_slots is not None:
        size += embeds.image_slots.element_size() * embeds.image_slots.nelement()
    return size
