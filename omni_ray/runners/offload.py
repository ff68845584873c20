"""The DiT's transformer blocks streamed through the GPU (``dit.offload``), for a card that cannot hold them all.

The first ``resident`` blocks (the first one always: cache acceleration reads its modulation before it runs), and
everything outside the blocks (the input and output projections, the timestep embedder), stay on the device. Every
other block's weights live in host memory (pinned, on CUDA) and pass through the device as the forward reaches them:
when a block starts, the next streamed block's copy is issued on a side stream, so it arrives while this one
computes; when a streamed block ends, its device copy is dropped. So at any moment at most ``resident + 2`` blocks'
weights are on the device (the one computing and the one arriving).

A whole model can leave the device between its stage's turns on a shared card the same way (``ParkedWeights``), and
``DeviceMemory`` says what a stage holds there (``engine.card``).

A step copies each streamed block's weights once, whatever the number of rows in it, which is why a streamed DiT
wants deep step batches: the transfer is a fixed cost per step that the rows share (the DiT's load learns it as its
steps' overhead, ``engine.dit_load.StepTimes``). A block a step does not reach (first-block cache reusing its
residual) is dropped at the end of the forward that fetched it; a block a step runs twice (cache acceleration's
sub-batches) is fetched twice.

diffusers' ``apply_group_offloading`` streams groups of blocks the same way, but keeps none resident and offers no
count of what is on the device; this keeps the first blocks resident, which a card with room for some blocks wants,
and counts (``resident_now``, ``peak``, ``fetches``) what the tests and the DiT's stats read. It swaps each weight's
storage (``param.data``), so the modules, their adapters (``LoraLinear`` wraps them) and GGUF weights are untouched.
Not with compiled blocks: the swap runs in hooks that a compiled block would trace.
"""

from __future__ import annotations

import torch
from torch import nn


class BlockStreamer:
    """Streams ``blocks[resident:]`` through ``device``; its hooks stay on the blocks for the module's life."""

    def __init__(self, blocks: nn.ModuleList, resident: int, device: torch.device | str):
        self.blocks = blocks
        self.device = torch.device(device)
        self.resident = min(max(resident, 1), len(blocks))
        self.streamed = list(range(self.resident, len(blocks)))
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # each streamed block's tensors: (the Parameter or buffer's owner and name, its host copy)
        self.host: dict[int, Parked] = {}
        self.arrived: dict[int, torch.cuda.Event | None] = {}  # streamed blocks on the device: their copy's event
        self.peak = 0  # most blocks' weights on the device at once
        self.fetches = 0  # streamed blocks copied in
        self.bytes_per_pass = 0  # a forward's copies, every streamed block once
        for index in self.streamed:
            self.host[index] = park(blocks[index], device=self.device)
            self.bytes_per_pass += sum(t.numel() * t.element_size() for _, _, t in self.host[index])
            blocks[index].register_forward_pre_hook(lambda _, __, i=index: self._starting(i))
            blocks[index].register_forward_hook(lambda _, __, ___, i=index: self._ended(i))
        for index in range(self.resident):
            blocks[index].register_forward_pre_hook(lambda _, __, i=index: self._prefetch(self._after(i)))
        self.peak = self.resident_now

    @property
    def resident_now(self) -> int:
        return self.resident + len(self.arrived)

    def _after(self, index: int) -> int | None:
        """The first streamed block after ``index`` (wrapping round to the first, for the next forward)."""
        later = [i for i in self.streamed if i > index]
        return later[0] if later else (self.streamed[0] if self.streamed else None)

    def _prefetch(self, index: int | None) -> None:
        if index is None or index in self.arrived:
            return
        event = None
        if self.copy_stream is not None:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                self._copy_in(index)
                event = torch.cuda.Event()
                event.record(self.copy_stream)
        else:
            self._copy_in(index)
        self.arrived[index] = event
        self.fetches += 1
        self.peak = max(self.peak, self.resident_now)

    def _copy_in(self, index: int) -> None:
        compute = torch.cuda.current_stream(self.device) if self.copy_stream is not None else None
        for module, name, host in self.host[index]:
            copy = host.to(self.device, non_blocking=True, copy=True)
            if compute is not None:
                copy.record_stream(compute)  # the allocator keeps it until the compute stream is done with it
            getattr(module, name).data = copy

    def _starting(self, index: int) -> None:
        if index not in self.arrived:  # not prefetched (the first forward, or a block run twice): fetch it now
            self._prefetch(index)
        event = self.arrived[index]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        self._prefetch(self._after(index))

    def _ended(self, index: int) -> None:
        self._drop(index)

    def _drop(self, index: int) -> None:
        if self.arrived.pop(index, "absent") == "absent":
            return
        leave_empty(self.host[index], self.device)

    def forward_ended(self) -> None:
        """After a whole forward: drops a block fetched ahead that the forward did not reach (a reused residual
        skipped it), but the first streamed one, which the next forward starts with."""
        for index in list(self.arrived):
            if self.streamed and index != self.streamed[0]:
                self._drop(index)


def stream_blocks(transformer: nn.Module, resident: int, device: torch.device | str) -> BlockStreamer:
    """``dit.offload``: the blocks past the first ``resident`` of a transformer still on the host streamed through
    ``device``, and the rest of it moved there. Call ``forward_ended`` after each forward."""
    streamer = BlockStreamer(transformer.transformer_blocks, resident, device)
    transformer.to(device)  # the streamed blocks' weights are empty there already
    return streamer


Parked = list[tuple[nn.Module, str, torch.Tensor]]  # each tensor's owner, its name there, and its host copy


def park(*modules: nn.Module, device: torch.device) -> Parked:
    """Moves the modules' weights (parameters and buffers; a submodule they share once) to host memory (pinned, for
    a CUDA ``device``), leaving empty tensors of their dtype on the device."""
    held, seen = [], set()
    owners = [owner for module in modules for owner in module.modules()]
    for owner in owners:
        if id(owner) in seen:
            continue
        seen.add(id(owner))
        for name, tensor in [*owner.named_parameters(recurse=False), *owner.named_buffers(recurse=False)]:
            host = tensor.data.to("cpu")  # the same storage when it is there already (a model loaded on the host)
            if device.type == "cuda":
                host = host.pin_memory()
            held.append((owner, name, host))
    leave_empty(held, device)
    return held


def leave_empty(held: Parked, device: torch.device) -> None:
    for owner, name, host in held:
        getattr(owner, name).data = torch.empty(0, dtype=host.dtype, device=device)


def device_bytes(modules: list[nn.Module]) -> int:
    """The bytes of the modules' weights that are on their device now (each tensor once; an empty one, parked on
    the host, counts nothing)."""
    seen, total = set(), 0
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                total += tensor.numel() * tensor.element_size()
    return total


class ParkedWeights:
    """Models whose weights leave the device between their stage's turns on a shared card (``engine.card``): the
    encoder's. Away, the device keeps empty tensors and the weights wait in host memory (pinned on CUDA), copied
    there once: they never change, so later departures only drop the device's copies, and each return is one copy
    in (on the CPU, the host tensors handed back). For models run eagerly: a captured graph (CUDA graphs, a compiled
    module) would keep the old addresses."""

    def __init__(self, modules: list[nn.Module], device: torch.device | str):
        self.modules = modules
        self.device = torch.device(device)
        self.host: Parked | None = None  # the weights' host copies, once made
        self.away = False
        self.moves = 0  # times brought back

    def send_away(self) -> None:
        if self.away:
            return
        if self.host is None:
            self.host = park(*self.modules, device=self.device)
        else:
            leave_empty(self.host, self.device)
        self.away = True

    def bring(self) -> None:
        if not self.away:
            return
        for owner, name, host in self.host:
            getattr(owner, name).data = host.to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.away = False
        self.moves += 1


class DeviceMemory:
    """What a stage holds on its device, for the card's ledger (``engine.card.TurnMemory``): on CUDA the caching
    allocator's figures for this process (weights, activations, and what the allocator keeps: ``held`` is its
    reserve, which only ``release`` hands back to the card); elsewhere the bytes
    of ``modules``' weights on the device (the CPU has no per-process allocator to read: activations go
    uncounted there)."""

    def __init__(self, modules: list[nn.Module], device: torch.device | str):
        self.modules = modules
        self.device = torch.device(device)
        self._peak = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._peak = device_bytes(self.modules)

    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return max(self._peak, device_bytes(self.modules))

    def held(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_reserved(self.device)
        return device_bytes(self.modules)

    def release(self) -> None:
        """Hands what the allocator keeps but no tensor uses back to the card, for the other stages' turns."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
