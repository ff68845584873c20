"""Which LoRA adapters a DiT engine holds on its device, loaded on a request's first use.

At most ``max_loras`` are resident. When a request needs one more, the least recently used adapter that no running
request uses leaves first; while every resident adapter is in use, the request waits for one to be released (as
vLLM's LRU cache of LoRA slots does, a running request's adapter never leaves). A request stacking adapters takes
them all at once or waits holding none. Files are read on a worker thread;
the weights reach the runner between two steps (``AsyncEngine.call``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass

from omni_ray.config import LoraEntry, PipelineConfig
from omni_ray.engine.async_engine import AsyncEngine
from omni_ray.errors import EngineError, RequestError
from omni_ray.records import LoraKey, LoraRef
from omni_ray.runners.lora import AdapterFiles

logger = logging.getLogger(__name__)

@dataclass(slots=True)
class _Resident:
    loading: asyncio.Task  # reads the file and hands the weights to the runner; done once the runner holds them
    users: int = 0  # requests using it now


class LoraResidency:
    def __init__(self, engine: AsyncEngine, max_loras: int, files: AdapterFiles,
                 on_load: Callable[[str], None] | None = None):
        """``engine`` drives a ``DiTEngineCore``; ``files`` finds and reads adapters' files for the runner."""
        self.engine, self.max_loras, self.files = engine, max_loras, files
        self.on_load = on_load  # called with an adapter's name each time it is loaded, for metrics
        self._shapes: Mapping[str, tuple[int, int]] | None = None  # the layers an adapter may adapt
        self.resident: OrderedDict[LoraKey, _Resident] = OrderedDict()  # least recently used first
        self._released: list[asyncio.Future] = []  # requests waiting for a resident adapter to fall idle
        self.num_loads = 0

    @classmethod
    def from_config(cls, engine: AsyncEngine, config: PipelineConfig,
                    on_load: Callable[[str], None] | None = None) -> LoraResidency:
        """The preset's residency: ``dit.max_loras`` slots, the preset's adapters' files and ``lora.roots``."""
        files = AdapterFiles([entry.path for entry in config.loras.values()], config.lora.roots)
        return cls(engine, config.dit.max_loras, files, on_load)

    async def check(self, path: str) -> LoraEntry:
        """A run-time adapter under ``lora.roots`` that the transformer can take (its resolved path, and its recipe
        when one lies beside it); RequestError naming ``lora_path`` otherwise."""
        return await asyncio.to_thread(self.files.check, path, await self.shapes())

    async def shapes(self) -> Mapping[str, tuple[int, int]]:
        """The Linear layers an adapter may adapt (module name -> (in, out features)), asked of the core once."""
        if self._shapes is None:
            self._shapes = await self.engine.call(lambda core: core.lora_shapes)
        return self._shapes

    @contextlib.asynccontextmanager
    async def use(self, loras: Sequence[LoraRef]) -> AsyncIterator[None]:
        """Holds ``loras`` (a request's adapters: none, one or a stack) resident while the context lasts, loading
        those that are not. A stack is taken whole or not at all: while its adapters cannot all be resident (the
        slots they would need serve running requests), it holds none and waits, so two waiting stacks never hold
        slots the other needs."""
        if not loras:
            yield
            return
        entries = await self._acquire(loras)
        try:
            yield
        finally:
            for entry in entries:
                entry.users -= 1
            if any(entry.users == 0 for entry in entries):
                self._wake()

    async def _acquire(self, loras: Sequence[LoraRef]) -> list[_Resident]:
        keys = [lora.key for lora in loras]
        while True:
            if all(key in self.resident for key in keys):
                entries = [self.resident[key] for key in keys]
                for key, entry in zip(keys, entries):  # taken before any wait: no other request can evict them now
                    entry.users += 1
                    self.resident.move_to_end(key)
                try:
                    for entry in entries:
                        if not entry.loading.done():  # shielded: a caller that goes away does not stop the load
                            await asyncio.shield(entry.loading)
                        entry.loading.result()  # raises what loading raised
                except BaseException:
                    for entry in entries:
                        entry.users -= 1
                    self._wake()
                    raise
                return entries
            missing = list({lora.key: lora for lora in loras if lora.key not in self.resident}.values())
            if len(self.resident) + len(missing) <= self.max_loras:
                for lora in missing:
                    self.resident[lora.key] = _Resident(asyncio.ensure_future(self._load(lora)))
                continue
            idle = next((key for key, e in self.resident.items()
                         if e.users == 0 and e.loading.done() and key not in keys), None)
            if idle is None:  # the slots it needs serve running requests (or are loading): wait for one to finish
                waiter = asyncio.get_running_loop().create_future()
                self._released.append(waiter)
                await waiter
                continue
            del self.resident[idle]
            logger.info("LoRA adapter %r leaves (least recently used)", idle[0])
            await self.engine.call(lambda core, key=idle: core.remove_lora(key))

    async def _load(self, lora: LoraRef) -> None:
        try:
            try:
                layers = await asyncio.to_thread(self.files.read, lora.path, await self.shapes())
            except RequestError as err:  # the file was fine when it was registered: not the request's fault now
                raise EngineError(f"LoRA adapter {lora.name!r} could not be loaded: {err}", "dit") from None
            await self.engine.call(lambda core: core.add_lora(lora.key, layers))
        except BaseException:
            del self.resident[lora.key]  # its slot is free again
            self._wake()
            raise
        self.num_loads += 1
        if self.on_load is not None:
            self.on_load(lora.name)
        logger.info("LoRA adapter %r loaded from %s", lora.name, lora.path)

    def _wake(self) -> None:
        released, self._released = self._released, []
        for waiter in released:
            if not waiter.done():
                waiter.set_result(None)
