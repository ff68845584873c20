"""Helpers for tests that drive an engine core by hand."""

from __future__ import annotations

import asyncio
import dataclasses


def run_to_completion(core, max_steps=50):
    results, batches = {}, []
    for _ in range(max_steps):
        if not core.has_unfinished_requests() and not core.scheduler.has_requests():
            break
        outputs = core.step()
        batches.append(sorted({o.request_id for o in outputs}))
        results.update({o.request_id: o.result for o in outputs if o.finish_reason == "stop"})
    return results, batches


def run_batch(runner, requests, max_batch_size: int = 8):
    """``requests`` (copies) through a DiT engine core over ``runner``, to the end: ``run_to_completion``'s results
    and step batches."""
    from omni_ray.engine.core import EngineCore
    from omni_ray.engine.dit_scheduler import DiTScheduler

    core = EngineCore(DiTScheduler(max_batch_size=max_batch_size, max_wait_steps=4), runner)
    for request in requests:
        core.add_request(dataclasses.replace(request))
    return run_to_completion(core)


class AdapterRecordingDiT:
    """An AsyncEngine's ``call`` over a DiT core that only records which adapters it holds and in what order they
    came and went: for the tests whose subject is LoRA residency."""

    lora_shapes: dict = {}

    def __init__(self):
        self.core, self.held, self.log = self, set(), []

    async def call(self, method):
        await asyncio.sleep(0)
        return method(self.core)

    def add_lora(self, key, layers):
        assert key not in self.held
        self.held.add(key)
        self.log.append(("add", key[0]))

    def remove_lora(self, key):
        self.held.remove(key)
        self.log.append(("remove", key[0]))
