"""The DiT's transformer blocks streamed through the GPU (``dit.offload``), for a card that cannot hold them all.

The first ``resident`` blocks (the first one always: cache acceleration reads its modulation before it runs), and
everything outside the blocks (the input and output projections, the timestep embedder), stay on the device. Every other block's weights live in host memory (pinned, on CUDA) and pass through
the device as the forward reaches them: when a block starts, the next streamed block's copy is issued on a side
stream, so it arrives while this one computes; when a streamed block ends, its device copy is dropped. So at any
moment at most ``resident + 2`` blocks' weights are on the device (the one computing and the one arriving).

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
        self.host: dict[int, list[tuple[nn.Module, str, torch.Tensor]]] = {}
        self.arrived: dict[int, torch.cuda.Event | None] = {}  # streamed blocks on the device: their copy's event
        self.peak = 0  # most blocks' weights on the device at once
        self.fetches = 0  # streamed blocks copied in
        self.bytes_per_pass = 0  # a forward's copies, every streamed block once
        for index in self.streamed:
            self.host[index] = self._to_host(blocks[index])
            self.bytes_per_pass += sum(t.numel() * t.element_size() for _, _, t in self.host[index])
            blocks[index].register_forward_pre_hook(lambda _, __, i=index: self._starting(i))
            blocks[index].register_forward_hook(lambda _, __, ___, i=index: self._ended(i))
        for index in range(self.resident):
            blocks[index].register_forward_pre_hook(lambda _, __, i=index: self._prefetch(self._after(i)))
        self.peak = self.resident_now

    @property
    def resident_now(self) -> int:
        return self.resident + len(self.arrived)

    def _to_host(self, block: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
        """Moves the block's weights to host memory, leaving empty tensors of their dtype on the device."""
        held = []
        for module in block.modules():
            for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                host = tensor.data.to("cpu")  # the same storage when it is there already (a model loaded on the host)
                if self.device.type == "cuda":
                    host = host.pin_memory()
                held.append((module, name, host))
                getattr(module, name).data = torch.empty(0, dtype=tensor.dtype, device=self.device)
        return held

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
        for module, name, host in self.host[index]:
            getattr(module, name).data = torch.empty(0, dtype=host.dtype, device=self.device)

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
