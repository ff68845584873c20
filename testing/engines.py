"""Helpers for tests that drive an engine core by hand."""

from __future__ import annotations


def run_to_completion(core, max_steps=50):
    results, batches = {}, []
    for _ in range(max_steps):
        if not core.has_unfinished_requests() and not core.scheduler.has_requests():
            break
        outputs = core.step()
        batches.append(sorted({o.request_id for o in outputs}))
        results.update({o.request_id: o.result for o in outputs if o.finish_reason == "stop"})
    return results, batches
