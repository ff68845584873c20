"""Step-level continuous batching for the DiT.

Every ``schedule()`` picks one batch key (image size, true CFG on or off, an edit's input image size) and steps
every admitted request of that key once. Waiting requests of that key join at the step boundary while the batch has
room; finished and aborted requests leave at the boundary. Admitted requests keep their state in the runner, so a key
can pause and resume at any step: when another key has waited ``max_wait_steps`` steps, the scheduler switches to
it, and no key starves.
"""

from __future__ import annotations

from collections import Counter, deque

from omni_ray.engine.output import EngineCoreOutput
from omni_ray.engine.scheduler import Scheduler
from omni_ray.records import BatchKey, DenoiseBatch, DenoiseOutput, DenoiseRequest


class DiTScheduler(Scheduler[DenoiseRequest, DenoiseBatch, DenoiseOutput]):
    def __init__(self, max_batch_size: int, max_wait_steps: int):
        assert max_batch_size > 0 and max_wait_steps > 0
        self.max_batch_size = max_batch_size
        self.max_wait_steps = max_wait_steps
        self.waiting: deque[DenoiseRequest] = deque()
        self.running: dict[BatchKey, list[str]] = {}  # key -> admitted request ids, in admission order
        self.key_of: dict[str, BatchKey] = {}  # request id -> key, for every unfinished request
        self.arrived_at: dict[str, tuple[int, int]] = {}  # request id -> (steps run before it arrived, arrival no.)
        self.last_served: dict[BatchKey, int] = {}  # key -> steps run when it last ran (its step included)
        self.freed_ids: list[str] = []  # left the runner's care since the last step
        self.current_key: BatchKey | None = None
        self.num_steps = 0
        self.num_arrivals = 0
        self.batch_sizes: Counter[int] = Counter()  # requests per step -> steps run with that many

    def add_request(self, request: DenoiseRequest) -> None:
        assert request.request_id not in self.key_of, f"duplicate request id {request.request_id}"
        self.waiting.append(request)
        self.key_of[request.request_id] = self.batch_key(request)
        self.arrived_at[request.request_id] = (self.num_steps, self.num_arrivals)
        self.num_arrivals += 1

    def finish_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            key = self.key_of.get(request_id)
            if key is None:
                continue
            if request_id in self.running.get(key, ()):
                self.running[key].remove(request_id)
                self.freed_ids.append(request_id)
            else:
                self.waiting = deque(r for r in self.waiting if r.request_id != request_id)
            self._forget(request_id)

    def schedule(self) -> DenoiseBatch:
        freed, self.freed_ids = self.freed_ids, []
        key = self._pick_key()
        self.num_steps += 1
        if key is None:
            return DenoiseBatch(new_requests=[], request_ids=[], freed_ids=freed)
        running = self.running.setdefault(key, [])
        new = self._admit(key, self.max_batch_size - len(running))
        running.extend(request.request_id for request in new)
        self.last_served[key] = self.num_steps
        self.batch_sizes[len(running)] += 1
        return DenoiseBatch(new_requests=new, request_ids=list(running), freed_ids=freed)

    def update_from_output(self, scheduler_output: DenoiseBatch, runner_output: DenoiseOutput) -> list[EngineCoreOutput]:
        outputs = [
            EngineCoreOutput(request_id, progress=progress, preview=runner_output.previews.get(request_id))
            for request_id, progress in runner_output.progress.items()
            if request_id not in runner_output.finished
        ]
        for request_id, latents in runner_output.finished.items():
            outputs.append(EngineCoreOutput(request_id, latents, "stop", progress=runner_output.progress[request_id]))
        outputs += [EngineCoreOutput.failed(request_id, error) for request_id, error in runner_output.errors.items()]
        for output in outputs:
            if output.finished:
                self.running[self.key_of[output.request_id]].remove(output.request_id)
                self._forget(output.request_id)
        return outputs

    def batch_key(self, request: DenoiseRequest) -> BatchKey:
        """Requests with equal keys may share a step (the request's own key: size, CFG mode, edit image size)."""
        return request.batch_key

    def has_unfinished_requests(self) -> bool:
        return bool(self.key_of)

    def has_finished_requests(self) -> bool:
        return bool(self.freed_ids)

    def _pick_key(self) -> BatchKey | None:
        """The current key while it has work and no other key has waited too long; else the longest-waiting key."""
        keys = {key for key, ids in self.running.items() if ids} | {self.key_of[r.request_id] for r in self.waiting}
        if not keys:
            self.current_key = None
            return None
        if self.current_key in keys:
            starving = [key for key in keys if key != self.current_key and self._waited(key) >= self.max_wait_steps]
            if not starving:
                return self.current_key
            keys = starving
        self.current_key = min(keys, key=lambda key: (-self._waited(key), self._oldest(key)[1]))
        return self.current_key

    def _waited(self, key: BatchKey) -> int:
        """Steps run without the key since it last ran, or since its oldest request arrived if that was later."""
        return self.num_steps - max(self.last_served.get(key, 0), self._oldest(key)[0])

    def _oldest(self, key: BatchKey) -> tuple[int, int]:
        return min(self.arrived_at[rid] for rid, k in self.key_of.items() if k == key)

    def _admit(self, key: BatchKey, room: int) -> list[DenoiseRequest]:
        admitted, kept = [], deque()
        for request in self.waiting:
            if self.key_of[request.request_id] == key and len(admitted) < room:
                admitted.append(request)
            else:
                kept.append(request)
        self.waiting = kept
        return admitted

    def _forget(self, request_id: str) -> None:
        key = self.key_of.pop(request_id)
        del self.arrived_at[request_id]
        if key not in self.key_of.values():  # the key's last request: keep no trace of it
            self.running.pop(key, None)
            self.last_served.pop(key, None)
