"""The LoRA adapters loaded at run time, kept where every coordinator replica reads them.

A replica that took ``POST /v1/load_lora_adapter`` is one of several, and may be replaced at any time; the adapters
it added must be served by all of them from the moment the call returns, and by their replacements. The store is
asked on every request that names an adapter the preset does not have: in the app, Ray's GCS key-value store
(``serve.coordinator.ClusterAdapters``, as long as the cluster lives), in tests a dict.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

from omni_ray.config import LoraEntry


@dataclass(frozen=True, slots=True)
class Adapter:
    """A run-time adapter: its file, resolved by the DiT that checked it (never sent to a client), when it was
    added (``/v1/models``' ``created``), and the sampling recipe found beside it."""

    path: str
    created: int  # Unix seconds
    recipe: dict | None = None  # config.SamplingRecipe's fields

    @property
    def entry(self) -> LoraEntry:
        """What planning reads: the file and its recipe."""
        return LoraEntry(path=self.path, recipe=self.recipe)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Adapter:
        return cls(**json.loads(data))


class AdapterStore(ABC):
    """Adapters by name, shared by every coordinator replica of one app."""

    @abstractmethod
    async def get(self, name: str) -> Adapter | None: ...

    @abstractmethod
    async def all(self) -> dict[str, Adapter]: ...

    @abstractmethod
    async def add(self, name: str, adapter: Adapter) -> bool:
        """Adds ``name`` unless it is taken; whether it was added (one of two racing loads wins)."""

    @abstractmethod
    async def remove(self, name: str) -> bool:
        """Whether ``name`` was there."""


class MemoryAdapters(AdapterStore):
    """One process's adapters: the in-process coordinator's, and tests'."""

    def __init__(self):
        self._adapters: dict[str, Adapter] = {}

    async def get(self, name: str) -> Adapter | None:
        return self._adapters.get(name)

    async def all(self) -> dict[str, Adapter]:
        return dict(self._adapters)

    async def add(self, name: str, adapter: Adapter) -> bool:
        return self._adapters.setdefault(name, adapter) is adapter

    async def remove(self, name: str) -> bool:
        return self._adapters.pop(name, None) is not None
