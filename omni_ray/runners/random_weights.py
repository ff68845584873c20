"""Models built from their config with random weights (``weights: dummy``): made on the target device in the
target dtype, so a 20B-parameter transformer never exists as float32 on the host."""

from __future__ import annotations

import torch


def random_model(cls, config: dict, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """``cls.from_config(config)`` with the layers' own random initialisation, on ``device`` in ``dtype``."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls.from_config(config).eval()
    finally:
        torch.set_default_dtype(previous)
