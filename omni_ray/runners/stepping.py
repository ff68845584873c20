"""What both DiT runners (Qwen-Image's ``DenoiseRunner``, Qwen-Image 2.1's ``Denoise21Runner``) do around their
model: one engine step's bookkeeping (requests freed, admitted, stepped with failures isolated, reported) and the
LoRA adapters resident on the transformer. Each runner says how a state is drawn (``prepare``), stepped (``step``)
and finished (``finish``)."""

from __future__ import annotations

import logging
import traceback
from typing import Any

from omni_ray.errors import EngineError, request_failure
from omni_ray.records import DenoiseBatch, DenoiseOutput, DenoiseRequest, Latents, LoraKey
from omni_ray.runners.host import to_host
from omni_ray.runners.lora import LoraLayer, LoraTable
from omni_ray.runners.parallel.mesh import Mesh

logger = logging.getLogger(__name__)


class SteppingRunner:
    """A DiT runner's request states and adapters. A state has ``params``, ``step_index``, ``progress``,
    ``is_finished`` and ``preview`` (the clean latents a step predicted, until handed out)."""

    def __init__(self, transformer, max_loras: int, mesh: Mesh | None = None):
        self.mesh = mesh or Mesh.single()  # this rank's place in the replica's gang
        self.states: dict[str, Any] = {}  # request id -> state, for every admitted request
        self.transformer = transformer.eval()
        self.loras = LoraTable(self.transformer, max_loras)
        self.device, self.dtype = transformer.device, transformer.dtype

    def device_modules(self) -> list:
        """What it holds on its device: the transformer (its adapters' factors inside it), and any ControlNets."""
        return [self.transformer, *getattr(self, "controlnets", {}).values()]

    @property
    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """The Linear layers an adapter may adapt: module name -> (in, out features)."""
        return self.loras.shapes

    def add_lora(self, key: LoraKey, layers: dict[str, LoraLayer]) -> None:
        """Makes an adapter (``read_lora``'s layers) resident; requests naming it may then step."""
        self.loras.add(key, layers)

    def remove_lora(self, key: LoraKey) -> None:
        """Frees an adapter's slot; no running request may use it."""
        assert not any(key in (lora.key for lora in s.params.loras) for s in self.states.values()), "adapter in use"
        self.loras.remove(key)

    def check_lora(self, params) -> None:
        """Raises EngineError unless each of the request's adapters is resident."""
        for lora in params.loras:
            if lora.key not in self.loras.slot_of:
                raise EngineError(f"LoRA adapter {lora.name!r} is not loaded on this replica")

    def execute_model(self, batch: DenoiseBatch) -> DenoiseOutput:
        """Runs one engine step: frees left requests, admits new ones, advances the batch by one step."""
        for request_id in batch.freed_ids:
            self.states.pop(request_id, None)
        output = DenoiseOutput()
        self._admit(batch.new_requests, output.errors)
        states = {rid: self.states[rid] for rid in batch.request_ids if rid in self.states}
        self._step_isolating_failures(states, output.errors, batch.split)
        self._report(states, output)
        return output

    def _admit(self, requests: list[DenoiseRequest], errors: dict[str, EngineError]) -> None:
        """Prepares each new request's state; a bad request fails alone."""
        for request in requests:
            try:
                state = self.prepare(request.params, request.prompt, request.negative, request.images, request.start,
                                     request.controls)
            except Exception as err:
                errors[request.request_id] = request_failure(err)
                continue
            self.admitted(state)
            self.states[request.request_id] = state

    def admitted(self, state) -> None:
        """Called with each new state before it joins the others (a gang places its caches here)."""

    def _report(self, states: dict[str, Any], output: DenoiseOutput) -> None:
        """The stepped requests' progress, the previews they asked for, and the finished ones' latents (their states
        dropped)."""
        for request_id, state in states.items():
            if request_id in output.errors:
                continue
            output.progress[request_id] = state.progress
            if state.preview is not None:
                output.previews[request_id] = Latents(to_host(state.preview[0]), state.params.height,
                                                      state.params.width, layers=state.params.layers)
                state.preview = None
            if state.is_finished:
                output.finished[request_id] = self.finish(self.states.pop(request_id))

    def _step_isolating_failures(self, states: dict[str, Any], errors: dict[str, EngineError],
                                 split: str = "sequence") -> None:
        """Steps the batch; if that fails, steps each request alone so that only the failing ones fail (and leave,
        their state with them). In a gang, ranks stepping requests alone could wait on different collectives, so
        there the step fails whole."""
        if not states:
            return
        if self.mesh.world.size > 1:
            self.step(list(states.values()), split)
            return
        started_at = {request_id: state.step_index for request_id, state in states.items()}
        try:
            self.step(list(states.values()))
            return
        except Exception:  # logged as text: a record holding the traceback would hold the step's tensors alive
            logger.error("DiT step of %d requests failed; retrying each alone\n%s", len(states),
                         traceback.format_exc())
        for request_id, state in states.items():
            if state.step_index != started_at[request_id]:  # advanced before the failure
                continue
            try:
                self.step([state])
            except Exception as err:
                errors[request_id] = request_failure(err)
                del self.states[request_id]
