"""Reading how long a thread waited for a CPU (the coordinator's event-loop watch subtracts it from a stall)."""

import multiprocessing
import os
import time

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
