"""Runs a function on every rank of a gang of CPU processes joined over gloo, for the parallel tests.

``run_gang(fn, settings, *args)`` starts ``settings.world_size`` processes (forked from a preloaded forkserver, as a
CPU ``MultiprocExecutor``'s are: ``gang_context``); each joins the process group
(``Mesh.init`` over a ``file://`` rendezvous), calls ``fn(mesh, *args)`` and sends back what it returns (picklable,
tensors included). Results come back in rank order; a rank that raised fails the call with its traceback. Every
process is joined before it returns, so nothing is left behind.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback

from omni_ray.config import ParallelSettings
from omni_ray.engine.executor import gang_context


def _rank_main(rank: int, fn, settings: ParallelSettings, rendezvous: str, args: tuple, queue) -> None:
    from omni_ray.runners.parallel.mesh import Mesh

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    mesh = Mesh.init(settings, rank, f"file://{rendezvous}")
    try:
        # pickled here, by value: a tensor put on a torch.multiprocessing queue as it is travels as a shared-memory file
        # descriptor that the parent fetches from this process, which may have exited by then (ConnectionResetError)
        queue.put((rank, True, pickle.dumps(fn(mesh, *args))))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        mesh.shutdown()


def run_gang(fn, settings: ParallelSettings, *args, timeout_s: float = 300.0) -> list:
    """``fn(mesh, *args)`` on every rank of ``settings``' gang; their results in rank order."""
    context = gang_context("gloo")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        rendezvous = os.path.join(folder, "rendezvous")
        processes = [context.Process(target=_rank_main, args=(rank, fn, settings, rendezvous, args, queue))
                     for rank in range(settings.world_size)]
        for process in processes:
            process.start()
        try:
            results = {}
            for _ in processes:
                rank, ok, value = queue.get(timeout=timeout_s)
                if not ok:
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                results[rank] = pickle.loads(value)
            return [results[rank] for rank in range(settings.world_size)]
        finally:
            for process in processes:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()
                    process.join()
