"""LoRA adapters for the DiT, with different adapters in one step batch.

Adapters come as diffusers writes and reads them for Qwen-Image: ``pytorch_lora_weights.safetensors`` with
``transformer.<module>.lora_A.weight`` / ``lora_B.weight`` and the LoRA config (rank, alpha, their per-module
patterns) in the file's metadata; the other spellings ``QwenImagePipeline.lora_state_dict`` accepts (kohya's
``lora_unet_``, ``diffusion_model.``, peft's ``.default``, ``.alpha`` keys) it converts, and so do we, by calling it.

The base weights never change. Each adapted ``nn.Linear`` becomes a ``LoraLinear`` that adds, per row of the batch,
the updates ``scale * (alpha / r) * B(A(x))`` of that row's adapters (peft's arithmetic; a stack's updates summed, as
diffusers' ``set_adapters`` with adapter weights), gathered from the adapters resident on the device and computed as
two batched matmuls over every (row, adapter) pair, whatever adapters and ranks the rows mix. Rows without an adapter
add nothing, so a batch without adapters runs the base model alone. On a tensor-parallel transformer
(``parallel.tensor``) an adapter is read and checked whole, and each rank keeps its slice of it, as of the Linear it
adapts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from omni_ray.config import LoraEntry, read_recipe, recipe_file
from omni_ray.errors import RequestError
from omni_ray.records import LoraKey, LoraRef
from omni_ray.runners.parallel.tensor import ParallelLinear, RowParallelLinear

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoraLayer:
    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scaling: float  # alpha / rank (alpha / sqrt(rank) with rsLoRA), as peft scales it


def confine(path: str, roots: Sequence[str]) -> str:
    """``path`` resolved (``~``, '..' and every symlink followed, without opening it) when that lies under one of
    ``roots``, taken under the first when relative; RequestError naming ``lora_path`` (and not the path) otherwise."""
    if not roots:
        raise RequestError("lora_path: this server reads no adapter files at run time (lora.roots is empty)",
                           param="lora_path")
    resolved = os.path.realpath(os.path.join(os.path.expanduser(roots[0]), os.path.expanduser(path)))
    for root in roots:
        root = os.path.realpath(os.path.expanduser(root))
        if os.path.commonpath([resolved, root]) == root:
            return resolved
    logger.warning("run-time adapter refused: %s resolves to %s, outside lora.roots", path, resolved)
    raise RequestError("lora_path: outside the folders this server reads adapters from (lora.roots)",
                       param="lora_path")


class AdapterFiles:
    """The adapter files a DiT reads: the preset's as they are, any other only under ``roots`` (``lora.roots``),
    checked again at each read, so that a folder swapped for a symlink after its adapter was loaded is refused."""

    def __init__(self, preset: Collection[str] = (), roots: Sequence[str] = ()):
        self.preset, self.roots = frozenset(preset), tuple(roots)

    def check(self, path: str, shapes: Mapping[str, tuple[int, int]]) -> LoraEntry:
        """A run-time adapter the transformer (``shapes``) can take: its resolved path and the sampling recipe beside
        it (``config.recipe_file``); RequestError naming ``lora_path`` otherwise, without reading a file outside
        ``roots`` (the recipe's path is confined as the adapter's is)."""
        resolved = confine(path, self.roots)
        read_lora(resolved, shapes)
        beside = recipe_file(resolved)
        if not os.path.lexists(beside):
            return LoraEntry(path=resolved)
        try:
            return LoraEntry(path=resolved, recipe=read_recipe(confine(str(beside), self.roots)))
        except ValueError as err:
            raise RequestError(f"lora_path: the adapter's {err}", param="lora_path") from None

    def read(self, path: str, shapes: Mapping[str, tuple[int, int]]) -> dict[str, LoraLayer]:
        """``read_lora``, for ``LoraResidency``."""
        return read_lora(path if path in self.preset else confine(path, self.roots), shapes)


def read_lora(path: str, shapes: Mapping[str, tuple[int, int]]) -> dict[str, LoraLayer]:
    """An adapter file (or a folder holding ``pytorch_lora_weights.safetensors``) on the CPU, by module name, checked
    against the transformer's Linear layers (``shapes``: module -> (in, out)); RequestError naming ``lora_path``,
    whose message never holds the path (what went wrong with the file is logged)."""
    from diffusers import QwenImagePipeline

    def refuse(why: str) -> RequestError:
        return RequestError(f"lora_path: the adapter {why}", param="lora_path")

    try:
        state, metadata = QwenImagePipeline.lora_state_dict(path, return_lora_metadata=True)
    except Exception as err:
        logger.warning("adapter %s not read: %s", path, err)
        raise refuse("is not a LoRA file diffusers can read (or there is no such file)") from None
    config = {k.removeprefix("transformer."): v for k, v in (metadata or {}).items() if k.startswith("transformer.")}
    if config.get("use_dora"):
        raise refuse("is a DoRA adapter; only LoRA is supported")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        match = re.fullmatch(r"(?:transformer\.)?(.+)\.lora_([AB])\.weight", key)
        if match is None:
            raise refuse(f"holds {key!r}, which is not a LoRA A or B weight of the transformer")
        pairs.setdefault(match[1], {})[match[2]] = tensor
    if not pairs:
        raise refuse("holds no LoRA weights")
    layers = {}
    for module, pair in pairs.items():
        if module not in shapes:
            raise refuse(f"adapts {module!r}, which is not a Linear layer of this transformer")
        if set(pair) != {"A", "B"}:
            raise refuse(f"has lora_A without lora_B (or the reverse) for {module!r}")
        a, b = pair["A"], pair["B"]
        in_features, out_features = shapes[module]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != in_features or b.shape[0] != out_features or \
                a.shape[0] != b.shape[1]:
            raise refuse(f"has shapes A {tuple(a.shape)}, B {tuple(b.shape)} for {module!r}, whose Linear is "
                         f"{in_features} -> {out_features}")
        layers[module] = LoraLayer(a.float().contiguous(), b.float().contiguous(), _scaling(module, a.shape[0], config))
    return layers


def _scaling(module: str, rank: int, config: dict) -> float:
    """peft's scaling for one module: alpha / r, each from its per-module pattern when one matches. Without a config
    in the file, diffusers takes alpha = rank (scaling 1)."""
    if "r" not in config:
        return 1.0
    r = _pattern_value(config.get("rank_pattern") or {}, module, config["r"])
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", r))
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _pattern_value(patterns: dict | str, module: str, default: float) -> float:
    if isinstance(patterns, str):
        patterns = json.loads(patterns)
    for pattern, value in patterns.items():  # peft matches a pattern against the module name's tail
        if re.fullmatch(rf"(.*\.)?({pattern})", module):
            return value
    return default


@dataclass(slots=True)
class LoraRows:
    """Which resident adapters each row of a forward pass uses (their slots: none, one, or a stack) and at which
    scales. Layers adapted by the same adapters pick the same rows, so each pick is made once per pass and kept."""

    table: LoraTable
    slot_list: tuple[tuple[int, ...], ...]  # per row, its adapters' slots
    scale_list: tuple[tuple[float, ...], ...]  # per row, their scales
    device: torch.device
    dtype: torch.dtype
    _picks: dict = field(default_factory=dict)  # slots a layer has -> ``pick``'s tensors, or None
    _repeats: dict = field(default_factory=dict)  # k -> these rows k times over

    def take(self, rows: list[int]) -> LoraRows:
        return LoraRows(self.table, tuple(self.slot_list[r] for r in rows), tuple(self.scale_list[r] for r in rows),
                        self.device, self.dtype)

    def applied(self) -> contextlib.AbstractContextManager:
        """These rows are the rows of the adapted layers' inputs while the context lasts."""
        return self.table.applied(self)

    def for_batch(self, n: int) -> LoraRows:
        """The rows of an input with ``n`` rows: Qwen-Image's edit models run the timestep embedding twice over
        (the second half at timestep 0), so an input may hold each row k times, block after block."""
        if n == len(self.slot_list):
            return self
        assert n % len(self.slot_list) == 0, f"{n} input rows for {len(self.slot_list)} batch rows"
        k = n // len(self.slot_list)
        if k not in self._repeats:
            self._repeats[k] = LoraRows(self.table, self.slot_list * k, self.scale_list * k, self.device, self.dtype)
        return self._repeats[k]

    def pick(self, filled: frozenset[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool] | None:
        """For each (row, adapter) pair whose adapter is in ``filled``: its row, its slot and its scale, on the device,
        and whether those rows are every row once, in order; None for no pair."""
        if filled not in self._picks:
            pairs = [(row, slot, scale) for row, (slots, scales) in enumerate(zip(self.slot_list, self.scale_list))
                     for slot, scale in zip(slots, scales) if slot in filled]
            rows = [row for row, _, _ in pairs]
            self._picks[filled] = (
                torch.tensor(rows, device=self.device),
                torch.tensor([slot for _, slot, _ in pairs], device=self.device),
                torch.tensor([scale for _, _, scale in pairs], device=self.device, dtype=self.dtype),
                rows == list(range(len(self.slot_list))),
            ) if pairs else None
        return self._picks[filled]


class LoraLinear(nn.Module):
    """A Linear layer plus, per row, the low-rank update of that row's adapter (if it has one and adapts this
    layer). Adapters sit in slots: ``a`` [slots, rank, in] and ``b`` [slots, out, rank], zero-padded to the largest
    rank resident here, so one gather and two batched matmuls serve every adapter of the step."""

    def __init__(self, base: nn.Linear, table: LoraTable):
        super().__init__()
        self.base, self.table = base, table
        self.a: torch.Tensor | None = None
        self.b: torch.Tensor | None = None
        self.scaling = torch.zeros(table.max_loras, **_computed_like(base))  # [slots]
        # alpha / rank of each slot's adapter
        self.filled: frozenset[int] = frozenset()  # slots whose adapter adapts this layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a row-parallel base sums the tensor ranks' partial outputs: this rank's share of the update (its columns of
        # A) joins its partial output before that sum
        row_parallel = isinstance(self.base, RowParallelLinear)
        y = self.base.partial(x) if row_parallel else self.base(x)
        if self.filled and self.table.current is not None:
            y = y + self._update(x)  # rows without an adapter here add exact zeros
        return self.base.reduce(y) if row_parallel else y

    @torch.compiler.disable  # which rows use which slots changes every step: in a compiled block, run it eagerly
    def _update(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's own low-rank updates (a stack's summed), shaped as the layer's output."""
        shape = (*x.shape[:-1], self.base.out_features)
        picked = self.table.current.for_batch(x.shape[0]).pick(self.filled)
        if picked is None:
            return x.new_zeros(shape)
        index, slots, scales, every_row = picked  # k (row, adapter) pairs
        xs = (x if every_row else x[index]).reshape(len(index), -1, x.shape[-1])  # [k, tokens, in]
        down = torch.bmm(xs, self.a[slots].transpose(1, 2))  # [k, tokens, rank]
        up = torch.bmm(down, self.b[slots].transpose(1, 2))  # [k, tokens, out]
        up = (up * (self.scaling[slots] * scales).view(-1, 1, 1)).reshape(len(index), *shape[1:])
        return up if every_row else x.new_zeros(shape).index_add(0, index, up)  # a row's pairs add up

    def fill(self, slot: int, layer: LoraLayer) -> None:
        """Puts an adapter's factors for the whole Linear (``read_lora``'s) into ``slot``; a tensor-parallel base
        keeps this rank's slice of them, as of its weight."""
        down, up = (self.base.shard_lora(layer.a, layer.b) if isinstance(self.base, ParallelLinear)
                    else (layer.a, layer.b))  # A, B
        rank = down.shape[0]
        if self.a is None or self.a.shape[1] < rank:  # (re)allocate, padded to the largest rank
            like = _computed_like(self.base)
            a = torch.zeros(self.table.max_loras, rank, self.base.in_features, **like)
            b = torch.zeros(self.table.max_loras, self.base.out_features, rank, **like)
            if self.a is not None:
                a[:, : self.a.shape[1]], b[:, :, : self.a.shape[1]] = self.a, self.b
            self.a, self.b = a, b
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.a[slot, :rank] = down.to(self.a)
        self.b[slot, :, :rank] = up.to(self.b)
        self.scaling[slot] = layer.scaling
        self.filled |= {slot}

    def clear(self, slot: int) -> None:
        if slot in self.filled:
            self.filled -= {slot}
            self.a[slot].zero_()
            self.b[slot].zero_()


def _computed_like(base: nn.Linear) -> dict:
    """The device and dtype a Linear computes in: its weight's, but a GGUF weight's ``compute_dtype`` (its own
    dtype is its bytes'); torchao's float8 weight reports the dtype it computes in."""
    return {"device": base.weight.device, "dtype": getattr(base, "compute_dtype", None) or base.weight.dtype}


class LoraTable:
    """The adapters resident in one transformer, ``max_loras`` slots of them; what each forward's rows use."""

    def __init__(self, transformer: nn.Module, max_loras: int):
        self.transformer, self.max_loras = transformer, max_loras
        self.slot_of: dict[LoraKey, int] = {}
        self.layers: dict[str, LoraLinear] = {}  # module name -> its wrapper, once an adapter adapted it
        self.current: LoraRows | None = None  # the rows of the forward pass now running
        # module name -> (in, out) features of the whole Linear, tensor-parallel ones too: adapters are read and
        # checked whole, and sharded as they fill a layer (LoraLinear.fill)
        self.shapes = {name: m.full_features if isinstance(m, ParallelLinear) else (m.in_features, m.out_features)
                       for name, m in transformer.named_modules() if isinstance(m, nn.Linear)}

    def add(self, key: LoraKey, layers: dict[str, LoraLayer]) -> None:
        """Puts an adapter (``read_lora``'s) into a free slot on the transformer's device and dtype."""
        if key in self.slot_of:
            return
        free = sorted(set(range(self.max_loras)) - set(self.slot_of.values()))
        if not free:
            raise RuntimeError(f"all {self.max_loras} LoRA slots are taken")
        slot = self.slot_of[key] = free[0]
        for name, layer in layers.items():
            self._wrapped(name).fill(slot, layer)

    def remove(self, key: LoraKey) -> None:
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            for layer in self.layers.values():
                layer.clear(slot)

    def rows(self, loras: Sequence[Sequence[LoraRef]]) -> LoraRows | None:
        """The rows of a forward pass whose row i adds the updates of the adapters ``loras[i]`` (none, one or a
        stack); None when no row has an adapter."""
        if not any(loras):
            return None
        missing = [lora.name for stack in loras for lora in stack if lora.key not in self.slot_of]
        assert not missing, f"adapters not resident: {missing}"
        weight = next(self.transformer.parameters())
        return LoraRows(self, tuple(tuple(self.slot_of[lora.key] for lora in stack) for stack in loras),
                        tuple(tuple(lora.scale for lora in stack) for stack in loras), weight.device, weight.dtype)

    @contextlib.contextmanager
    def applied(self, rows: LoraRows | None) -> Iterator[None]:
        before, self.current = self.current, rows
        try:
            yield
        finally:
            self.current = before

    def _wrapped(self, name: str) -> LoraLinear:
        if name not in self.layers:
            parent_name, _, child = name.rpartition(".")
            parent = self.transformer.get_submodule(parent_name) if parent_name else self.transformer
            self.layers[name] = LoraLinear(getattr(parent, child), self)
            setattr(parent, child, self.layers[name])
        return self.layers[name]
