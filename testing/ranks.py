"""Stand-in runners for a gang's ranks in the executor tests, in a module of their own: a spawned rank imports the
module its runner factory lives in, and this one imports torch alone (a test module would import the whole engine
and take seconds per rank)."""

from __future__ import annotations

import os
import time

import torch


class Recorder:
    """A rank's stand-in runner: records its calls; ``total`` sums a value over the gang (the mesh works)."""

    lora_shapes = {"block.0": (4, 4)}

    def __init__(self, mesh):
        self.mesh = mesh
        self.calls = []
        self.warmup_s = 0.5 + mesh.rank

    def record(self, value):
        self.calls.append(value)
        return self.mesh.rank, value

    def total(self, value):
        return self.mesh.world.all_reduce(torch.tensor([float(value)])).item()

    def fail(self, on_rank=None):
        if on_rank is None or on_rank == self.mesh.rank:
            raise ValueError(f"no good on rank {self.mesh.rank}")

    def sleep(self, seconds):
        time.sleep(seconds)

    def pid(self):
        return os.getpid()


def history(runner: Recorder) -> list:
    return list(runner.calls)


def make_recorder(mesh) -> Recorder:
    return Recorder(mesh)


def broken_runner(mesh):
    return 1 / 0


def holdings(runner) -> tuple[list[str], list]:
    """What a rank's DiT runner holds: the requests it keeps state for and the adapters resident in it."""
    return sorted(runner.states), sorted(runner.loras.slot_of)
