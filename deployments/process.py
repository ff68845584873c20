"""Process-wide settings of a replica, applied once it has started."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Moves everything the replica built at start-up (modules, the app, models, the engine) out of the garbage
    collector's reach. Otherwise every full collection walks all of it while no thread of the process runs: 1.26 s
    measured in a coordinator under load (485k objects), a stall of its event loop. Objects made later are collected
    as usual."""
    gc.collect()
    gc.freeze()
