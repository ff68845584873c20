"""The LoRA adapters loaded at run time, kept where every coordinator replica reads them, and the routes that load,
unload and list them.

A replica that took ``POST /v1/load_lora_adapter`` is one of several, and may be replaced at any time; the adapters
it added must be served by all of them from the moment the call returns, and by their replacements. The store is
asked on every request that names an adapter the preset does not have: in the app, Ray's GCS key-value store
(``ClusterAdapters``, as long as the cluster lives; with GCS fault tolerance, its restarts too), read through a copy
(``MirroredAdapters``) that answers while the GCS does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

from fastapi import Request

from deployments import ray_private
from deployments.http import bodies
from omni_ray.api.schema import ImageGenerationRequest
from omni_ray.config import LoraEntry, PipelineConfig
from omni_ray.errors import ForbiddenError, NotFoundError, RequestError
from omni_ray.request_path import Stages

logger = logging.getLogger("ray.serve")
ADAPTER_NAME = re.compile(r"[\w.:-]+")


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

    @property
    def stale_s(self) -> float | None:
        """How old the answers are, where a copy answers for a store that does not (None: they are the store's)."""
        return None


class ClusterAdapters(AdapterStore):
    """The app's run-time adapters in the GCS's key-value store, which every replica reads and which outlives them
    (as long as the cluster lives; with GCS fault tolerance, its restarts too)."""

    NAMESPACE = "omni_ray_adapters"

    def __init__(self, app_name: str, read_timeout_s: float = ray_private.KV_TIMEOUT_S):
        self.prefix = f"{app_name}/"
        self.read_timeout_s = read_timeout_s

    async def get(self, name: str) -> Adapter | None:
        data = await ray_private.kv_get(self.prefix + name, self.NAMESPACE, self.read_timeout_s)
        return Adapter.from_json(data) if data is not None else None

    async def all(self) -> dict[str, Adapter]:
        items = await ray_private.kv_items(self.prefix, self.NAMESPACE, self.read_timeout_s)
        return {key.removeprefix(self.prefix): Adapter.from_json(value) for key, value in items.items()}

    async def add(self, name: str, adapter: Adapter) -> bool:
        return await ray_private.kv_add(self.prefix + name, adapter.to_json(), self.NAMESPACE)

    async def remove(self, name: str) -> bool:
        return await ray_private.kv_delete(self.prefix + name, self.NAMESPACE)


class MirroredAdapters(AdapterStore):
    """``store`` read through, with a copy of what it last said. When a read is not answered within
    ``READ_TIMEOUT_S`` (the GCS down or restarting), the copy answers it and every read after it, at once, until
    ``refresh`` (the coordinator's, every second meanwhile) finds the store answering again: ``/v1/models`` and
    requests naming a run-time adapter keep their answers through an outage, as they were when it began.
    ``stale_s`` says how old the copy is while it stands in (None while the store answers); the log says when that
    starts and ends. Loads and unloads go to the store alone, so during an outage they fail rather than half happen."""

    READ_TIMEOUT_S = 0.5

    def __init__(self, store: AdapterStore, clock: Callable[[], float] = time.monotonic):
        self.store, self.clock = store, clock
        self.copy: dict[str, Adapter] = {}
        self.copied_at: float | None = None  # when the store last listed every adapter
        self.standing_in_since: float | None = None  # the copy answers in the store's place since then

    @property
    def stale_s(self) -> float | None:
        if self.standing_in_since is None:
            return None
        return self.clock() - (self.copied_at if self.copied_at is not None else self.standing_in_since)

    async def get(self, name: str) -> Adapter | None:
        found = await self._read(lambda: self.store.get(name)) if self.standing_in_since is None else _UNANSWERED
        if found is _UNANSWERED:
            return self.copy.get(name)
        if found is None:
            self.copy.pop(name, None)
        else:
            self.copy[name] = found
        return found

    async def all(self) -> dict[str, Adapter]:
        if self.standing_in_since is not None:
            return dict(self.copy)
        return await self.refresh()

    async def refresh(self) -> dict[str, Adapter]:
        """Lists the store into the copy, the copy standing in if it does not answer."""
        listed = await self._read(self.store.all)
        if listed is _UNANSWERED:
            return dict(self.copy)
        self.copy, self.copied_at = dict(listed), self.clock()
        if self.standing_in_since is not None:
            logger.info("the adapter store answers again, after %.0f s", self.clock() - self.standing_in_since)
            self.standing_in_since = None
        return listed

    async def add(self, name: str, adapter: Adapter) -> bool:
        added = await self.store.add(name, adapter)
        if added:
            self.copy[name] = adapter
        return added

    async def remove(self, name: str) -> bool:
        self.copy.pop(name, None)
        return await self.store.remove(name)

    async def _read(self, read: Callable[[], Awaitable]):
        """``read()``'s result, or _UNANSWERED once ``READ_TIMEOUT_S`` passed without one (the read is left to end
        by itself, not waited for: a GCS call in flight may take its time to cancel) or it failed."""
        task = asyncio.ensure_future(read())
        done, _ = await asyncio.wait({task}, timeout=self.READ_TIMEOUT_S)
        error = task.exception() if done else None
        if done and error is None:
            return task.result()
        if not done:
            task.add_done_callback(lambda late: late.cancelled() or late.exception())  # its error, once, unlogged
        if self.standing_in_since is None:
            self.standing_in_since = self.clock()
            logger.warning("the adapter store did not answer (%s): run-time adapters are served from this replica's "
                           "copy until it does", repr(error) if error is not None else f"{self.READ_TIMEOUT_S} s")
        return _UNANSWERED


_UNANSWERED = object()


class Adapters:
    """The models a request may name: the base model, the preset's adapters (``loras``) and the run-time ones in
    ``store``; and loading and unloading run-time ones where the preset allows it (``lora.allow_runtime_updates``)."""

    def __init__(self, config: PipelineConfig, store: AdapterStore, started: int):
        self.config, self.store = config, store
        self.started = started  # `created` of the base model and the preset's adapters

    async def for_request(self, body: dict | ImageGenerationRequest) -> dict[str, LoraEntry]:
        """The adapters the request names, ``model``'s or each of ``loras``' (name -> its file and recipe), when all
        exist; else every adapter, for the refusal to list."""
        if not isinstance(body, (dict, ImageGenerationRequest)):
            return {}  # not a JSON object: planning refuses it
        named = {}
        for name in _adapter_names(body):
            if name == self.config.name:
                continue
            if name in self.config.loras:
                named[name] = self.config.loras[name]
            elif (adapter := await self.store.get(name)) is not None:
                named[name] = adapter.entry
            else:
                return {**self.config.loras, **{name: a.entry for name, a in (await self.store.all()).items()}}
        return named

    async def model_list(self) -> dict:
        """OpenAI's model list: the base model, then each LoRA adapter (``parent``: the base it adapts, as vLLM
        lists them)."""
        base = {"id": self.config.name, "object": "model", "created": self.started, "owned_by": "omni-ray"}
        adapters = {name: self.started for name in self.config.loras}
        adapters.update({name: adapter.created for name, adapter in sorted((await self.store.all()).items())})
        return {"object": "list", "data": [base, *({"id": name, "object": "model", "created": created,
                                                    "owned_by": "omni-ray", "parent": self.config.name}
                                                   for name, created in adapters.items())]}

    async def model(self, name: str) -> dict:
        """One model of ``model_list``; NotFoundError (404, ``model_not_found``) naming ``model`` for any other."""
        listed = await self.model_list()
        for model in listed["data"]:
            if model["id"] == name:
                return model
        known = ", ".join(model["id"] for model in listed["data"])
        raise NotFoundError(f"model: {name!r} does not exist here; the models are {known}", param="model")

    async def load(self, request: Request, stages: Stages) -> dict:
        """Adds an adapter (``{"lora_name", "lora_path"}``) once a DiT replica has found the file under
        ``lora.roots`` and fitting the transformer; a path outside the roots or a broken file is a 400 naming
        ``lora_path`` and changes nothing. Every coordinator replica serves it once this returns."""
        self._check_runtime_updates()
        body = await bodies.json_object(request, ("lora_name", "lora_path"))
        name, path = body["lora_name"], body["lora_path"]
        if not ADAPTER_NAME.fullmatch(name) or name == self.config.name:
            raise RequestError(f"lora_name: {name!r} must be letters, digits, '_', '.', ':' or '-', and not the "
                               "base model's name", param="lora_name")
        taken = RequestError(f"lora_name: {name!r} is already loaded; unload it first", param="lora_name")
        if name in self.config.loras or await self.store.get(name) is not None:
            raise taken
        entry = await stages.check_lora(path)
        recipe = entry.recipe.model_dump() if entry.recipe is not None else None
        if not await self.store.add(name, Adapter(entry.path, int(time.time()), recipe)):
            raise taken  # another load of the name won meanwhile
        logger.info("LoRA adapter %r added from %s%s", name, entry.path, " with its recipe" if recipe else "")
        return {"lora_name": name, "status": "loaded"}

    async def unload(self, request: Request) -> dict:
        """Removes a run-time adapter (``{"lora_name"}``): requests naming it get a 404 from now on, on every
        coordinator replica; each DiT replica frees its slot when it needs the room."""
        self._check_runtime_updates()
        name = (await bodies.json_object(request, ("lora_name",)))["lora_name"]
        if name in self.config.loras:
            raise RequestError(f"lora_name: {name!r} comes from the preset (loras); remove it there", param="lora_name")
        if not await self.store.remove(name):
            raise NotFoundError(f"lora_name: no adapter {name!r} is loaded", param="lora_name")
        logger.info("LoRA adapter %r removed", name)
        return {"lora_name": name, "status": "unloaded"}

    def _check_runtime_updates(self) -> None:
        if not self.config.lora.allow_runtime_updates:
            raise ForbiddenError("loading and unloading adapters at run time is off on this server (the preset's "
                                 "lora.allow_runtime_updates)", param=None)


def _adapter_names(body: dict | ImageGenerationRequest) -> list[str]:
    """The adapter names a request gives: its ``model`` and the names in its ``loras`` (JSON text in a multipart
    form). What is not a name is left to the schema to refuse."""
    if isinstance(body, ImageGenerationRequest):
        return [name for name in (body.model, *(spec.name for spec in body.loras or ())) if name is not None]
    loras = body.get("loras")
    if isinstance(loras, str):
        with contextlib.suppress(ValueError):
            loras = json.loads(loras)
    specs = loras if isinstance(loras, list) else []
    names = [body.get("model"), *(spec.get("name") for spec in specs if isinstance(spec, dict))]
    return [name for name in names if isinstance(name, str)]
