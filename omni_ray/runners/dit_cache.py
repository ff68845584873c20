"""DiT cache acceleration decided per request inside a step batch: first-block cache and TeaCache.

Both skip transformer blocks at a step whose input barely changed since the last step that ran them, and add
instead the residual those blocks added then. Each CFG pass of each request keeps its own ``BranchCache`` (as
diffusers keeps ``cache_context("cond")`` and ``("uncond")``), and every decision reads that row's own tensors, never
the batch's, so a request's result does not depend on what it is batched with. Rows that reuse skip the blocks;
the others run them as a sub-batch.

- ``first_block`` (diffusers' ``FirstBlockCacheConfig``): every row runs the first block; a row whose first-block
  output residual changed by at most ``threshold`` (relative L1) since its last full step skips the other blocks.
- ``teacache`` (TeaCache, Liu et al. 2024): the relative L1 change of the first block's timestep-modulated input,
  rescaled by a polynomial fit to the model, accumulates over steps; while the sum stays under ``threshold`` the row
  skips every block. A request's first and last steps always run.

``cached_forward`` is Qwen-Image's transformer forward, operation for operation as diffusers'
``QwenImageTransformer2DModel.forward`` runs it (so rows that run every block get its values bit for bit), with
those decisions in between.

ControlNet residuals (``ControlRows``, diffusers' ``controlnet_block_samples``) are added to the rows that carry
them right after each block, as diffusers' forward adds them; rows without any get nothing added. They are part of
the blocks' output as the caches see it: a first-block row compares its first block's output with its residual
added, and what a cached row reuses (and keeps) is what the blocks added with their residuals. A row with control
and a cache is so decided from its own tensors alone, as every other row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from math import prod

import numpy as np
import torch
from diffusers import QwenImageTransformer2DModel
from diffusers.models.transformers.transformer_qwenimage import compute_text_seq_len_from_mask

from omni_ray.config import CacheSettings
from omni_ray.runners.attention import RealRope
from omni_ray.runners.lora import LoraRows
from omni_ray.runners.parallel.mesh import Mesh
from omni_ray.runners.parallel.sequence import SequenceParallelAttention
from omni_ray.runners.parallel.split import TokenShard


@dataclass(frozen=True, slots=True)
class BranchCache:
    """One CFG pass of one request: what its next decision compares with, and what it reuses. Immutable: a step
    returns new ones, which the runner keeps only once the whole step succeeded."""

    settings: CacheSettings
    reference: torch.Tensor | None = None  # [tokens, dim] first_block: the first block's residual at the last full
    # step; teacache: the modulated input at the last step
    residual: torch.Tensor | None = None  # [tokens, dim] what the skipped blocks added at the last full step
    accumulated: float = 0.0  # teacache: rescaled change since the last full step
    computed: int = 0  # passes that ran the blocks
    reused: int = 0  # passes that reused the residual


@dataclass(frozen=True, slots=True)
class ControlRows:
    """ControlNet residuals for some rows of a forward: ``samples[j]`` ``[len(rows), image_tokens, dim]`` is added to
    those rows' image tokens after block ``i`` when ``i // interval == j`` (diffusers: ``interval`` is
    ``ceil(num_layers / len(samples))``). Each row's samples are its controls' sum, already scaled."""

    samples: tuple[torch.Tensor, ...]
    rows: tuple[int, ...]  # the forward's rows they belong to, ascending
    interval: int

    @classmethod
    def of(cls, samples: tuple[torch.Tensor, ...], rows: tuple[int, ...], num_layers: int) -> ControlRows:
        return cls(tuple(samples), tuple(rows), math.ceil(num_layers / len(samples)))

    def take(self, rows: list[int]) -> ControlRows | None:
        """The residuals of those of ``rows`` that have them, numbered as in ``rows``; None when none has."""
        picked = [(new, self.rows.index(old)) for new, old in enumerate(rows) if old in self.rows]
        if not picked:
            return None
        new_rows, index = zip(*picked)
        if list(index) == list(range(len(self.rows))):
            return dataclasses.replace(self, rows=tuple(new_rows))
        at = torch.tensor(index, device=self.samples[0].device)
        return ControlRows(tuple(s[at] for s in self.samples), tuple(new_rows), self.interval)

    def map(self, fn) -> ControlRows:
        """The same rows, each sample replaced by ``fn(sample)`` (a sequence rank's chunk of its tokens)."""
        return dataclasses.replace(self, samples=tuple(fn(s) for s in self.samples))

    def add(self, hidden: torch.Tensor, block: int) -> torch.Tensor:
        """``hidden`` ``[rows, image_tokens, dim]`` after block ``block``, with the rows' residuals added."""
        sample = self.samples[block // self.interval]
        if self.rows == tuple(range(hidden.shape[0])):
            return hidden + sample
        return hidden.index_add(0, torch.tensor(self.rows, device=hidden.device), sample)


@dataclass(frozen=True, slots=True)
class _Rows:
    """The blocks' inputs for some rows of the batch."""

    hidden: torch.Tensor  # [rows, image_tokens, dim]
    encoder: torch.Tensor  # [rows, text_tokens, dim]
    mask: torch.Tensor | None  # [rows, text_tokens] bool, None when no row is padded
    temb: torch.Tensor  # [rows, dim]; [2 * rows, dim] with zero_cond_t (the second half at timestep 0)
    modulate_index: torch.Tensor | None  # [rows, image_tokens], with zero_cond_t
    lora: LoraRows | None  # each row's LoRA adapter, when a row has one
    image_mask: torch.Tensor | None = None  # [rows, image_tokens] bool, sequence-parallel with padded tokens
    attend: SequenceParallelAttention | None = None  # sequence-parallel: attention over the gang
    control: ControlRows | None = None  # ControlNet residuals of the rows that have them

    def take(self, rows: list[int]) -> _Rows:
        if rows == list(range(self.hidden.shape[0])):
            return self
        index = torch.tensor(rows, device=self.hidden.device)
        temb = self.temb[index]
        if self.modulate_index is not None:
            temb = torch.cat([temb, self.temb[index + self.hidden.shape[0]]])
        return _Rows(
            self.hidden[index], self.encoder[index], self.mask[index] if self.mask is not None else None, temb,
            self.modulate_index[index] if self.modulate_index is not None else None,
            self.lora.take(rows) if self.lora is not None else None,
            self.image_mask[index] if self.image_mask is not None else None, self.attend,
            self.control.take(rows) if self.control is not None else None,
        )

    def adapted(self) -> contextlib.AbstractContextManager:
        """The rows' LoRA adapters apply to the layers run inside."""
        return self.lora.applied() if self.lora is not None else contextlib.nullcontext()

    def run(self, block, rope, index: int) -> _Rows:
        """The rows through block ``index``, their ControlNet residuals added after it."""
        with self.adapted():
            rows = self._run(block, rope)
        if self.control is None:
            return rows
        return dataclasses.replace(rows, hidden=self.control.add(rows.hidden, index))

    @property
    def attention_kwargs(self) -> dict | None:
        """What the attention processor (``attention.JointAttention``) takes besides diffusers' arguments."""
        kwargs = {"image_mask": self.image_mask, "attend": self.attend}
        return {k: v for k, v in kwargs.items() if v is not None} or None

    def _run(self, block, rope) -> _Rows:
        encoder, hidden = block(
            hidden_states=self.hidden,
            encoder_hidden_states=self.encoder,
            encoder_hidden_states_mask=self.mask,
            temb=self.temb,
            image_rotary_emb=rope,
            joint_attention_kwargs=self.attention_kwargs,
            modulate_index=self.modulate_index,
        )
        return dataclasses.replace(self, hidden=hidden, encoder=encoder)


def cached_forward(
    transformer: QwenImageTransformer2DModel,
    latents: torch.Tensor,  # [rows, image_tokens, in_channels]
    timestep: torch.Tensor,  # [rows], in the transformer's units (diffusers' timestep / 1000)
    embeds: torch.Tensor,  # [rows, text_tokens, joint_attention_dim]
    mask: torch.Tensor | None,  # [rows, text_tokens], None when no row is padded
    img_shapes: list[list[tuple[int, int, int]]],
    caches: list[BranchCache | None],  # per row; None runs every block
    steps: list[tuple[int, int]],  # per row: (step index, steps in all)
    teacache_coefficients: tuple[float, ...],
    lora: LoraRows | None = None,  # each row's LoRA adapter; None when no row has one
    sequence: Mesh | None = None,  # a gang whose sequence ranks split each row's tokens (Ulysses, ring)
    control: ControlRows | None = None,  # ControlNet residuals of the rows that have them (the whole tokens)
) -> tuple[torch.Tensor, list[BranchCache | None]]:
    """The transformer's prediction for every row, and each row's cache after this step. Split over a gang's
    ``sequence`` ranks, every one of them calls it with the same rows, runs the blocks on its chunk of their tokens
    (``parallel.split.TokenShard``), attends over the gang (``SequenceParallelAttention``) and returns the whole
    prediction; each row's cache holds this rank's chunk. ``control``'s residuals cover each row's image tokens
    whole (an edit's image tokens excepted: ControlNets guide text-to-image only); each rank adds its chunk."""
    with lora.applied() if lora is not None else contextlib.nullcontext():
        return _cached_forward(transformer, latents, timestep, embeds, mask, img_shapes, caches, steps,
                               teacache_coefficients, lora, sequence, control)


def _cached_forward(transformer, latents, timestep, embeds, mask, img_shapes, caches, steps, teacache_coefficients,
                    lora, sequence, control):
    t = transformer
    caches = list(caches)  # each helper below replaces the entries of the rows it decides

    # 1. The blocks' inputs, as diffusers' forward computes them; with sequence ranks, this rank's chunk of them.
    x, rope = _block_inputs(t, latents, timestep, embeds, mask, img_shapes, lora)
    if control is not None:
        assert control.samples[0].shape[1:] == x.hidden.shape[1:], "control residuals cover the image tokens"
        x = dataclasses.replace(x, control=control)
    shard = None
    if sequence is not None and sequence.sequence.size > 1:
        shard = TokenShard(sequence.sequence, x.hidden.shape[1], x.encoder.shape[1])
        x, rope = _shard_inputs(shard, x, rope, SequenceParallelAttention(sequence))
    first, rest = t.transformer_blocks[0], t.transformer_blocks[1:]

    # 2. TeaCache rows decide from the first block's modulated input; those that reuse skip every block.
    skip_all = _teacache_skips(first, x, caches, steps, teacache_coefficients, t.zero_cond_t, shard)

    # 3. The other rows run the first block; first-block rows that changed little skip the rest.
    ran_first = [r for r in range(len(caches)) if r not in skip_all]
    x1, heads, skip_rest = _run_first_block(first, x, rope, ran_first, caches, shard)

    # 4. The rows that still need them run the remaining blocks, as one sub-batch.
    ran_all, out_all = _run_remaining_blocks(rest, x1, rope, ran_first, skip_rest)
    out = _gather(x.hidden, skip_all | skip_rest, ran_all, out_all)

    # 5. Rows that ran every block keep what the cached blocks added.
    _keep_residuals(caches, x.hidden, heads, out, skipped=skip_all.keys() | skip_rest.keys())

    # 6. The output norm and projection.
    temb_out = x.temb.chunk(2, dim=0)[0] if t.zero_cond_t else x.temb
    prediction = t.proj_out(t.norm_out(out, temb_out))
    return (shard.gather_image(prediction) if shard is not None else prediction), caches


def _block_inputs(t: QwenImageTransformer2DModel, latents, timestep, embeds, mask, img_shapes, lora
                  ) -> tuple[_Rows, RealRope]:
    """Every row's input to the first block, and the rotary tables: the image and text projections, the timestep
    embedding (with zero_cond_t, an edit image's tokens conditioned on timestep 0; with use_additional_t_cond,
    Qwen-Image-Layered's, its "RGB" term added) and the text mask. With use_layer3d_rope the rotary tables number
    the frames (``img_shapes``' entries) by layer, the last, the input image, at -1."""
    hidden = t.img_in(latents)
    timestep = timestep.to(hidden.dtype)
    modulate_index = None
    if t.zero_cond_t:  # edit models that condition the input image's tokens on timestep 0
        timestep = torch.cat([timestep, timestep * 0], dim=0)
        modulate_index = torch.tensor(
            [[0] * prod(shapes[0]) + [1] * sum(prod(s) for s in shapes[1:]) for shapes in img_shapes],
            device=timestep.device, dtype=torch.int,
        )
    encoder = t.txt_in(t.txt_norm(embeds))
    text_seq_len, _, mask = compute_text_seq_len_from_mask(encoder, mask)
    additional = None
    if t.time_text_embed.use_additional_t_cond:  # Qwen-Image-Layered: 0 ("RGB") for every row, as its pipeline
        additional = torch.zeros(timestep.shape[0], dtype=torch.long, device=timestep.device)
    temb = t.time_text_embed(timestep, hidden, additional)
    rope = RealRope.of(t.pos_embed(img_shapes, max_txt_seq_len=text_seq_len, device=hidden.device))
    return _Rows(hidden, encoder, mask, temb, modulate_index, lora), rope


def _shard_inputs(shard: TokenShard, x: _Rows, rope: RealRope, attend: SequenceParallelAttention
                  ) -> tuple[_Rows, RealRope]:
    """This sequence rank's chunk of the blocks' inputs and of the rotary tables; with padded tokens, masks that
    keep them out of every row's keys (the text mask, and the image tokens' mask the attention reads)."""
    rows, device = x.hidden.shape[0], x.hidden.device
    mask, image_mask = x.mask, None
    if shard.padded:
        full = mask if mask is not None else torch.ones(x.encoder.shape[:2], dtype=torch.bool, device=device)
        mask, image_mask = shard.text(full, fill=False), shard.image_mask(rows, device)
    elif mask is not None:
        mask = shard.text(mask)
    modulate_index = shard.image(x.modulate_index) if x.modulate_index is not None else None
    rope = RealRope(shard.image(rope.image_cos, 0, 1), shard.image(rope.image_sin, 0), shard.text(rope.text_cos, 0, 1),
                    shard.text(rope.text_sin, 0))
    control = x.control.map(shard.image) if x.control is not None else None
    rows = _Rows(shard.image(x.hidden), shard.text(x.encoder), mask, x.temb, modulate_index, x.lora, image_mask, attend,
                 control)
    return rows, rope


def _teacache_skips(first, x: _Rows, caches: list[BranchCache | None], steps: list[tuple[int, int]],
                     coefficients: tuple[float, ...], zero_cond_t: bool, shard: TokenShard | None
                     ) -> dict[int, torch.Tensor]:
    """The TeaCache rows' decisions, their caches replaced: row -> its output of the blocks, for the rows that
    reuse."""
    skip_all: dict[int, torch.Tensor] = {}
    tea = [r for r in range(len(caches)) if caches[r] is not None and caches[r].settings.kind == "teacache"]
    if tea:
        modulated = _modulated_input(first, x.take(tea), zero_cond_t)
        changes = _relative_l1(modulated, [caches[r].reference for r in tea], shard)
        for i, r in enumerate(tea):
            reuse, accumulated = _teacache_decides(caches[r], changes[i], *steps[r], coefficients)
            if reuse:
                skip_all[r] = x.hidden[r] + caches[r].residual
            caches[r] = _replace(caches[r], reuse, reference=modulated[i].clone(), accumulated=accumulated)
    return skip_all


def _run_first_block(first, x: _Rows, rope, ran_first: list[int], caches: list[BranchCache | None],
                     shard: TokenShard | None) -> tuple[_Rows | None, dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """The first block over the rows ``ran_first`` and the first-block rows' decisions, their caches replaced: the
    block's output (None when no row runs it), row -> its output of the first block, and row -> its output of the
    blocks for the rows that reuse."""
    if not ran_first:
        return None, {}, {}
    x0 = x.take(ran_first)
    x1 = x0.run(first, rope, 0)
    heads = dict(zip(ran_first, x1.hidden))
    skip_rest: dict[int, torch.Tensor] = {}
    fbc = [i for i, r in enumerate(ran_first) if caches[r] is not None and caches[r].settings.kind == "first_block"]
    if fbc:
        residuals = x1.hidden[fbc] - x0.hidden[fbc]
        changes = _relative_l1(residuals, [caches[ran_first[i]].reference for i in fbc], shard)
        for i, change, residual in zip(fbc, changes, residuals):
            r = ran_first[i]
            reuse = change <= caches[r].settings.threshold  # diffusers runs the blocks when change > threshold
            if reuse:
                skip_rest[r] = caches[r].residual + heads[r]
            caches[r] = _replace(caches[r], reuse, **({} if reuse else {"reference": residual.clone()}))
    return x1, heads, skip_rest


def _run_remaining_blocks(rest, x1: _Rows | None, rope, ran_first: list[int], skip_rest: dict[int, torch.Tensor]
                          ) -> tuple[list[int], torch.Tensor | None]:
    """The blocks after the first over the rows of ``x1`` (``ran_first``) that do not skip them: those rows, and
    their output (None when there are none)."""
    ran_all = [i for i, r in enumerate(ran_first) if r not in skip_rest]
    if not ran_all:
        return [], None
    x2 = x1.take(ran_all)
    for index, block in enumerate(rest, start=1):
        x2 = x2.run(block, rope, index)
    return [ran_first[i] for i in ran_all], x2.hidden


def _gather(hidden: torch.Tensor, skipped: dict[int, torch.Tensor], ran_all: list[int], out_all: torch.Tensor | None
            ) -> torch.Tensor:
    """Every row's output of the blocks: reused for the rows that skipped, run for the others."""
    if len(ran_all) == hidden.shape[0]:
        return out_all
    out = torch.empty_like(hidden)
    for r, value in skipped.items():
        out[r] = value
    if ran_all:
        out[torch.tensor(ran_all, device=out.device)] = out_all
    return out


def _keep_residuals(caches: list[BranchCache | None], hidden: torch.Tensor, heads: dict[int, torch.Tensor],
                    out: torch.Tensor, skipped: set[int]) -> None:
    """The rows that ran every block keep what the cached blocks added (TeaCache: all of them; first-block cache:
    those after the first), their caches replaced."""
    for r, cache in enumerate(caches):
        if cache is None or r in skipped:
            continue
        start = hidden[r] if cache.settings.kind == "teacache" else heads[r]
        caches[r] = dataclasses.replace(cache, residual=out[r] - start)


def _modulated_input(block, x: _Rows, zero_cond_t: bool) -> torch.Tensor:
    """The first block's image input after its norm and timestep modulation (what TeaCache compares)."""
    temb = x.temb.chunk(2, dim=0)[0] if zero_cond_t else x.temb
    with x.adapted():
        shift, scale, _ = block.img_mod(temb).chunk(2, dim=-1)[0].chunk(3, dim=-1)
    return block.img_norm1(x.hidden) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def _relative_l1(current: torch.Tensor, previous: list[torch.Tensor | None], shard: TokenShard | None
                 ) -> list[float]:
    """Per row: mean |current - previous| / mean |previous| (diffusers' first-block rule, read per row); inf for a
    row with nothing to compare with. One device sync for the whole batch. Sequence-parallel, each rank holds a
    chunk of the tokens: the sums of its real tokens are summed over the ranks, so every rank decides the same."""
    known = [i for i, p in enumerate(previous) if p is not None]
    changes = [float("inf")] * len(previous)
    if known:
        now, before = current[known], torch.stack([previous[i] for i in known])
        if shard is None:
            values = ((now - before).abs().mean(dim=(1, 2)) / before.abs().mean(dim=(1, 2))).tolist()
        else:
            real = shard.image_mask(1, now.device)[0, :, None]
            sums = torch.stack([((now - before).abs() * real).sum(dim=(1, 2)), (before.abs() * real).sum(dim=(1, 2))])
            total = shard.total(sums)
            values = (total[0] / total[1]).tolist()
        for i, value in zip(known, values):
            changes[i] = value
    return changes


def _teacache_decides(
    cache: BranchCache, change: float, step_index: int, num_steps: int, coefficients: tuple[float, ...]
) -> tuple[bool, float]:
    """(whether the row reuses, its accumulated change after this step)."""
    if cache.residual is None or step_index in (0, num_steps - 1):
        return False, 0.0
    # Past the range it was fit on, the polynomial can turn negative, which would read as "no change" however much
    # the input moved; the raw change stands in for it there.
    rescaled = float(np.polyval(coefficients, change))
    accumulated = cache.accumulated + (rescaled if rescaled > 0 else change)
    if accumulated < cache.settings.threshold:
        return True, accumulated
    return False, 0.0


def _replace(cache: BranchCache, reuse: bool, **fields) -> BranchCache:
    counted = {"reused": cache.reused + 1} if reuse else {"computed": cache.computed + 1}
    return dataclasses.replace(cache, **counted, **fields)
