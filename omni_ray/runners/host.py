"""Stage results leave the device as plain CPU tensors: what Ray's object store and the next stage take.

Copies from a GPU go through pinned (page-locked) host memory, which the GPU writes by DMA; a copy into pageable
memory is staged through a driver buffer and takes longer. PyTorch caches pinned blocks, so this costs an allocation
once per size. The copy is also made outside ``torch.inference_mode``, so what leaves is a normal tensor that a
caller may change in place.
"""

from __future__ import annotations

import torch


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``tensor``, owned by the caller."""
    if tensor.device.type == "cpu":
        return tensor.clone(memory_format=torch.contiguous_format)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()  # the copy is asynchronous; the result must be whole
    return host
