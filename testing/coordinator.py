"""The ``CrossEngineCoordinator`` outside Serve, for tests of its routes: over a stage protocol (``FakeStages`` by
default), with its run-time adapters in a dict, driven by starlette's ``TestClient``."""

from __future__ import annotations

from fastapi.testclient import TestClient

from deployments.coordinator import CrossEngineCoordinator
from deployments.http.adapters import Adapter, AdapterStore
from deployments.http.routes import build_api
from testing.fake_stages import FakeStages


class MemoryAdapters(AdapterStore):
    """One process's run-time adapters (the app keeps them in the cluster's key-value store)."""

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


def coordinator(config, stages=None, adapters: AdapterStore | None = None, **options) -> CrossEngineCoordinator:
    """A coordinator over ``stages`` (fake ones by default); ``options`` are ``CrossEngineCoordinator.over``'s."""
    return CrossEngineCoordinator.over(stages or FakeStages(), config, adapters or MemoryAdapters(), **options)


def client(config, stages=None, **options) -> TestClient:
    """Its routes, as HTTP reaches them."""
    return TestClient(build_api(coordinator(config, stages, **options)))
