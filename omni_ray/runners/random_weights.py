"""Models built from their config with random weights (``weights: dummy``): made on the target device in the
target dtype, so a 20B-parameter transformer never exists as float32 on the host; drawn from a fixed seed, so that
every rank of a gang (and every replica) holds the same weights."""

from __future__ import annotations

import torch


def random_model(cls, config: dict, dtype: torch.dtype, device: str, seed: int = 0) -> torch.nn.Module:
    """``cls.from_config(config)`` (a diffusers model; a transformers model's ``_from_config``, which takes its dtype
    from the config unless told) with the layers' own random initialisation from ``seed``, on ``device`` in
    ``dtype``; the caller's random state is left as it was."""
    if hasattr(cls, "from_config"):
        build = cls.from_config
    else:
        def build(config):
            return cls._from_config(config, dtype=dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    devices = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.device(device):
            torch.manual_seed(seed)
            return build(config).eval()
    finally:
        torch.set_default_dtype(previous)
