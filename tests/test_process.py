"""Reading how long a thread waited for a CPU (the coordinator's event-loop watch subtracts it from a stall), how
long the hypervisor kept each CPU (the load benchmark reports it beside the stalls), and the coordinator's garbage
collection when idle."""

import multiprocessing
import os
import time

from benchmarks.load import cpu_steal_s
from deployments.process import cpu_wait_s


def test_cpu_wait_counts_the_time_a_ready_thread_waits_for_a_cpu():
    stop = time.monotonic() + 1.0

    def spin() -> None:
        while time.monotonic() < stop:
            pass

    # Busy processes, twice as many as CPUs: this thread, busy too, must queue for its turns.
    spinners = [multiprocessing.get_context("fork").Process(target=spin) for _ in range(2 * (os.cpu_count() or 1))]
    before = cpu_wait_s()
    for process in spinners:
        process.start()
    spin()
    for process in spinners:
        process.join()
    assert cpu_wait_s() - before > 0.1


def test_cpu_steal_is_seconds_per_cpu_since_boot():
    first = cpu_steal_s()
    time.sleep(0.05)
    second = cpu_steal_s()
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    assert len(first) == len(second) == os.cpu_count()
    assert all(0 <= a <= b <= uptime for a, b in zip(first, second))


def test_garbage_in_cycles_is_collected_once_requests_ended_and_none_is_in_flight():
    """What Ray Serve's router leaves (a cycle holding a reference) is freed when the coordinator is idle, not while a
    request runs, and not again and again without new requests."""
    import asyncio
    import gc
    import weakref

    from deployments.process import collect_when_idle

    class Held:
        pass

    counts = [1, 0]  # in flight, ended

    async def main():
        gc.disable()  # only collect_when_idle collects here
        try:
            held = Held()
            held.cycle = held
            alive = weakref.ref(held)
            del held
            task = asyncio.ensure_future(collect_when_idle(lambda: tuple(counts), period_s=0.01))
            await asyncio.sleep(0.05)
            kept_while_busy = alive() is not None
            counts[:] = [0, 1]
            await asyncio.sleep(0.05)
            task.cancel()
            return kept_while_busy, alive() is None
        finally:
            gc.enable()

    assert asyncio.run(main()) == (True, True)
