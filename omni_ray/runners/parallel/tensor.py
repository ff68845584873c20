"""Tensor parallelism for the DiT (``dit.parallel.tensor``): each block's heads and MLP columns sharded over the
tensor ranks, one all-reduce per sub-block.

Megatron's split of a block: the attention's query, key and value projections (image and text) and each MLP's first
Linear keep this rank's slice of their output features (colwise: its heads, its MLP columns), and the Linear after
each keeps the matching slice of its input features (rowwise), so a rank computes a partial sum of that Linear's
output from its own columns and the tensor ranks add theirs up: four all-reduces per block (the attention's image and
text outputs, the image and text MLPs' outputs). Which Linear is which is diffusers'
``QwenImageTransformer2DModel._tp_plan``, read from the model's class; everything it does not name (the modulation
Linears, norms, embedders, the output norm and projection) stays whole on every rank. Per-head RMS norms and rotary
embeddings act within a head, so they run unchanged on a rank's heads; the attention processors reshape by head size
(``inner_dim // heads``, both divided here) and take the head count from the width they are given.

Why our own modules rather than torch's DTensor ``ColwiseParallel``/``RowwiseParallel`` (which diffusers'
``enable_parallelism`` applies):

- A LoRA adapter adds its per-row update inside the adapted Linear (``lora.LoraLinear``). Sharded, that update must be
  this rank's slice too (B's rows for a colwise Linear, A's columns for a rowwise one: ``ParallelLinear.shard_lora``),
  and a rowwise Linear's update, linear in its input, must join the partial sum before the all-reduce: DTensor's
  hooks reduce the base Linear's output alone (and diffusers refuses a model with adapter layers). Here
  ``RowParallelLinear`` splits its forward into ``partial`` and ``reduce``, and ``LoraLinear`` adds its update between.
- The all-reduce goes through the mesh's ``Comm``, which counts bytes (``tensor_bytes_per_forward``), is a no-op for
  one rank and runs on gloo in the tests; diffusers' tensor parallelism takes accelerator meshes only.

Compilation and FP8 still apply. The sharded Linears are ``nn.Linear`` subclasses with plain weights under the same
module names, so ``quantization.quantize_fp8`` (which swaps a Linear's ``weight`` for a float8 tensor, by name, and
keeps ``img_mlp.net.2`` in bf16 by name) quantizes this rank's slice: shard first, then quantize; a rowwise Linear's
``F.linear`` then runs on the float8 slice and its all-reduce sums bf16. ``compile_blocks`` compiles the sharded blocks
whole: Dynamo traces ``Comm.all_reduce`` as a functional collective and replays its byte count at each call (checked
with Inductor on the CPU over gloo: no graph break, the eager output, the bytes counted per call). The one eager island
is an adapter's update (``LoraLinear._update``), as without tensor parallelism.

Known limit: the runner loads the whole transformer on every rank and then shards it, so each rank holds the full
weights on its host for a moment (40 GB for the 20B model in bf16) before moving its slice to its GPU. Reading only
this rank's slice from the safetensors files, as diffusers' sharded ``from_pretrained`` does, would avoid that.
"""

from __future__ import annotations

import re
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from omni_ray.runners.parallel.mesh import Comm, Mesh


class ParallelLinear(nn.Linear):
    """An ``nn.Linear`` holding this rank's slice of a Linear sharded over the tensor ranks: its ``in_features``,
    ``out_features``, weight and bias are the slice's; ``full_features`` is the whole Linear's (in, out)."""

    sharded_dim: ClassVar[int]  # of the weight [out, in]: 0 shards the output features, 1 the input features

    def __init__(self, full: nn.Linear, comm: Comm):
        nn.Module.__init__(self)  # nn.Linear's own would allocate a whole weight
        self.comm = comm
        self.full_features = (full.in_features, full.out_features)
        self.weight = nn.Parameter(self.shard(full.weight.detach(), self.sharded_dim), full.weight.requires_grad)
        self.bias = None
        if full.bias is not None:
            bias = self.shard(full.bias.detach(), 0) if self.sharded_dim == 0 else full.bias.detach()
            self.bias = nn.Parameter(bias, full.bias.requires_grad)
        self.out_features, self.in_features = self.weight.shape

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of ``tensor`` along ``dim``, copied so that the whole tensor can be freed."""
        size, ranks = tensor.shape[dim], self.comm.size
        assert size % ranks == 0, f"{size} features do not split over {ranks} tensor ranks"
        part = tensor.narrow(dim, self.comm.rank * (size // ranks), size // ranks)
        return part.clone(memory_format=torch.contiguous_format)

    def shard_lora(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's factors of a LoRA update ``B A`` of the whole Linear (``a`` [rank, in], ``b`` [out, rank])."""
        raise NotImplementedError


class ColumnParallelLinear(ParallelLinear):
    """This rank's output features (weight rows and bias); its output is this rank's slice of the whole output."""

    sharded_dim = 0

    def shard_lora(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a, self.shard(b, 0)


class RowParallelLinear(ParallelLinear):
    """This rank's input features (weight columns), for an input that is this rank's slice of the features: the
    ranks' partial outputs summed over ``comm``, the bias (whole on every rank) added once after the sum."""

    sharded_dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output: its input features through its columns of the weight."""
        return F.linear(x, self.weight)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The whole output from this rank's ``partial`` (which the all-reduce overwrites)."""
        out = self.comm.all_reduce(partial)
        return out if self.bias is None else out + self.bias

    def shard_lora(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.shard(a, 1), b


STYLES: dict[str, type[ParallelLinear]] = {"colwise": ColumnParallelLinear, "rowwise": RowParallelLinear}


def planned_linears(transformer: nn.Module) -> dict[str, str]:
    """The Linears the model class's ``_tp_plan`` shards: module name -> ``colwise`` or ``rowwise`` (a pattern's
    ``*`` stands for a block's index, as diffusers expands it)."""
    plan = type(transformer)._tp_plan or {}
    patterns = [(re.compile(re.escape(pattern).replace(r"\*", r"\d+")), style) for pattern, style in plan.items()]
    planned = {}
    for name, module in transformer.named_modules():
        for pattern, style in patterns:
            if pattern.fullmatch(name):
                assert style in STYLES and isinstance(module, nn.Linear), f"{name}: {style} {type(module).__name__}"
                planned[name] = style
    return planned


def shard_transformer(transformer: nn.Module, mesh: Mesh) -> None:
    """Keeps, in place, this rank's slice of the Linears the model's ``_tp_plan`` names, and divides each sharded
    attention's head count and widths by the tensor degree. Nothing changes for one tensor rank. ValueError naming
    ``dit.parallel.tensor`` when the degree does not divide the heads."""
    comm = mesh.tensor
    if comm.size == 1:  # a RowParallelLinear would add its bias after the matmul, not inside it as diffusers does
        return
    heads = transformer.config.num_attention_heads
    if heads % comm.size:
        raise ValueError(f"dit.parallel.tensor: {comm.size} does not divide the transformer's {heads} attention heads")
    planned = planned_linears(transformer)
    if not planned:
        raise ValueError(f"dit.parallel.tensor: {type(transformer).__name__} has no tensor-parallel plan (_tp_plan)")
    for name, style in planned.items():
        parent_name, _, child = name.rpartition(".")
        parent = transformer.get_submodule(parent_name)
        setattr(parent, child, STYLES[style](getattr(parent, child), comm))
    for module in transformer.modules():
        if isinstance(getattr(module, "to_q", None), ColumnParallelLinear):  # an attention whose heads are sharded
            module.heads //= comm.size
            module.inner_dim //= comm.size
            module.inner_kv_dim //= comm.size


def tensor_bytes_per_forward(num_layers: int, dim: int, rows: int, image_tokens: int, text_tokens: int, tensor: int,
                             element_size: int) -> int:
    """Bytes one rank sends over ``mesh.tensor`` in a forward of ``rows`` rows through all ``num_layers`` blocks:
    per block, one all-reduce of a ``[rows, tokens, dim]`` tensor after each sub-block (the attention's image and text
    outputs, the image and text MLPs' outputs), each counted as ``Comm.all_reduce`` counts a ring all-reduce,
    ``2 (tensor - 1) / tensor`` of its bytes. ``image_tokens`` counts an edit's input-image tokens too."""
    if tensor == 1:
        return 0
    sizes = [rows * tokens * dim * element_size for tokens in (image_tokens, text_tokens)] * 2
    return num_layers * sum(size * 2 * (tensor - 1) // tensor for size in sizes)
