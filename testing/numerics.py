"""How far two float32 computations of the same values may drift apart on any CPU, for the tests that compare a
result with the same result computed another way: a row batched against the same row alone, a gang against one
process, compiled against eager, a tiled decode against a whole one.

Such a change alters no value a result depends on, only the order in which float32 sums are added: oneDNN, the BLAS
and Inductor choose their blocking (which partial sums are formed, in what order they meet) from the batch size, the
shapes, the number of ranks and the machine's instruction set (AVX2, AVX-512, AMX), so two machines can disagree where
one agrees with itself. One reordered reduction moves its result by a few units in the last place (ulps) of the
largest term it adds; a tiny model's output has passed through a few dozen of them (two blocks of attention and MLP
matmuls, each step of up to eight feeding the next). So the bound is ``REORDER_ULPS`` ulps of the expected tensor's
largest magnitude (at least 1, as latents and pixels in [-1, 1] are): float32's ulp at 1 is 2**-23, 1.19e-7.

Measured (2026-11, 2-core Intel Xeons): at most 17 ulps over the suite's 108 such comparisons on one machine, and 88
on another, whose kernels summed a ControlNet step batch of several rows in another order than a row alone (1.05e-5 on
latents under 1 in magnitude). The bound is three times that; a batch-mate's leak, a wrong row or a skipped block moves
a result by 1e-3 or more, thirty times the bound and over. uint8 pixels round such values, so one that lands on a
rounding edge moves one level: ``assert_within_a_level``.
"""

from __future__ import annotations

import numpy as np
import torch

REORDER_ULPS = 256
FLOAT32_ULP = torch.finfo(torch.float32).eps  # at 1.0: 2**-23


def reorder_tolerance(expected: torch.Tensor) -> float:
    """The largest difference float32 reordering may make to ``expected``: ``REORDER_ULPS`` ulps of its largest
    magnitude (at least 1)."""
    return REORDER_ULPS * FLOAT32_ULP * max(1.0, expected.detach().abs().max().item())


def assert_reordered(got: torch.Tensor, expected: torch.Tensor, what: object = "") -> None:
    """``got`` is ``expected`` computed with its float32 sums in another order: equal shapes, and within
    ``reorder_tolerance(expected)``."""
    assert got.shape == expected.shape, (what, got.shape, expected.shape)
    difference = (got.detach().float() - expected.detach().float()).abs().max().item()
    bound = reorder_tolerance(expected.float())
    assert difference <= bound, f"{what}: {difference:.3g} apart, over the {bound:.3g} float32 reordering allows"


def assert_within_a_level(got: np.ndarray, expected: np.ndarray, what: object = "") -> None:
    """uint8 images that differ by float32 reordering before rounding: one level at most where a value lands on a
    rounding edge."""
    assert got.shape == expected.shape and got.dtype == expected.dtype == np.uint8, (what, got.shape, expected.shape)
    levels = int(np.abs(got.astype(int) - expected.astype(int)).max())
    assert levels <= 1, f"{what}: {levels} levels apart"
