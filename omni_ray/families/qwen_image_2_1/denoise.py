"""Denoise stage for Qwen-Image 2.1: its transformer advancing a batch of requests by one flow-match step.

The runner has ``DenoiseRunner``'s contract (``execute_model``, the states, the adapters, ``load``), so the engine
core holds either. Numerics follow diffusers' ``QwenImage21Pipeline.__call__`` with its KV cache: a request's first
step runs each of its passes whole and keeps the keys and values of its condition (text and condition images; under
``causal_condition`` they do not change with the timestep); later steps compute only the target's tokens, every
cached pass of the batch in one forward (``forward21``), each row attending to its own condition. True CFG is
2.1's, ``neg + scale * (cond - neg)`` with no norm rescale.

A condition cache lives in its request's state from its first step until the request finishes, is aborted
(``DenoiseBatch.freed_ids``) or fails; a request the scheduler leaves out of a step (paused) keeps it.

Known limits: one rank (``dit.parallel`` of world size 1); no compiled blocks, no FP8, no cache acceleration
(``params.cache``) and no masked edits; a step's first-step passes run one after another.
"""

from __future__ import annotations

import logging

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel

from omni_ray.families.qwen_image_2_1.facts import check_side
from omni_ray.families.qwen_image_2_1.forward import ConditionCache, JointLayout, decode, prefill
from omni_ray.families.qwen_image_2_1.state import Denoise21State, check_inputs, prepare_state
from omni_ray.records import DenoiseParams, Latents, PromptEmbeds
from omni_ray.runners.host import to_host
from omni_ray.runners.parallel.mesh import Mesh
from omni_ray.runners.random_weights import random_model
from omni_ray.runners.stepping import SteppingRunner

logger = logging.getLogger(__name__)


class Denoise21Runner(SteppingRunner):
    """Holds Qwen-Image 2.1's transformer and the scheduler config; prepares request states and steps batches of
    them."""

    def __init__(self, transformer: QwenImage21Transformer2DModel, scheduler_config: dict, max_loras: int = 4,
                 mesh: Mesh | None = None):
        if mesh is not None and mesh.world.size > 1:
            raise ValueError(f"dit.parallel: Qwen-Image 2.1's DiT runs on one rank, not a gang of {mesh.world.size}")
        if not transformer.config.causal_condition:
            raise ValueError("the transformer's causal_condition is off: its condition cannot be cached")
        super().__init__(transformer, max_loras, mesh)
        self.scheduler_config = scheduler_config
        self.warmup_s: float | None = None  # no warm-up: nothing is compiled

    @classmethod
    def load(cls, model: str, dtype: torch.dtype = torch.float32, device: str = "cpu", dummy: bool = False,
             max_loras: int = 4, mesh: Mesh | None = None) -> Denoise21Runner:
        """The runner of a checkpoint in diffusers' layout (``transformer/``, ``scheduler/``); with ``dummy``, its
        transformer built from the config with random weights."""
        if dummy:
            config = QwenImage21Transformer2DModel.load_config(model, subfolder="transformer")
            transformer = random_model(QwenImage21Transformer2DModel, config, dtype, device)
        else:
            transformer = QwenImage21Transformer2DModel.from_pretrained(model, subfolder="transformer",
                                                                        torch_dtype=dtype).to(device)
        scheduler_config = FlowMatchEulerDiscreteScheduler.load_config(model, subfolder="scheduler")
        return cls(transformer, scheduler_config, max_loras, mesh)

    def cache_bytes(self, request_id: str | None = None) -> int:
        """Bytes the condition caches hold: one request's, or every admitted request's."""
        states = self.states.values() if request_id is None else [self.states.get(request_id)]
        return sum(state.cache_bytes for state in states if state is not None)

    def prepare(self, params: DenoiseParams, prompt: PromptEmbeds, negative: PromptEmbeds | None = None,
                images: tuple[Latents, ...] = (), start: Latents | None = None,
                controls: tuple[Latents, ...] = ()) -> Denoise21State:
        """Refuses a request this replica cannot run, then draws its state (``denoise21_state.prepare_state``)."""
        check_side("height", params.height)
        check_side("width", params.width)
        if params.controls or controls:
            raise ValueError("control: Qwen-Image 2.1 has no ControlNet")
        if params.inpaint is not None or start is not None:
            raise ValueError("inpaint: Qwen-Image 2.1 has no masked edit")
        if params.cache is not None:
            raise ValueError("cache: Qwen-Image 2.1 caches its condition instead of skipping blocks")
        self.check_lora(params)
        check_inputs(params, [prompt] + ([negative] if params.true_cfg else []), images,
                     self.transformer.config.context_in_dim)
        return prepare_state(params, prompt, negative, images, scheduler_config=self.scheduler_config,
                             device=self.device, dtype=self.dtype)

    @torch.inference_mode()
    def step(self, states: list[Denoise21State]) -> None:
        """Advances every state by one denoising step. The states must share a batch key."""
        assert states and len({s.batch_key for s in states}) == 1, "mixed batch keys"
        rows = len(states)
        passes = [(state, branch) for branch in range(len(states[0].passes)) for state in states]
        prediction, caches = self.predict(passes)
        for row, state in enumerate(states):
            pred = prediction[row : row + 1]
            if state.params.true_cfg:
                pred = guide(pred, prediction[rows + row : rows + row + 1], state.params.true_cfg_scale)
            state.advance(pred, caches[row::rows])

    def predict(self, passes: list[tuple[Denoise21State, int]]) -> tuple[torch.Tensor, list[ConditionCache]]:
        """The transformer's prediction for each pass (state, branch: 0 conditional, 1 unconditional)
        ``[passes, target_tokens, 64]``, and each pass's condition cache after the step. A pass's first step runs
        it whole, alone; the cached passes run together."""
        predictions: list[torch.Tensor | None] = [None] * len(passes)
        caches = [state.passes[branch].cache for state, branch in passes]
        cached = [index for index, cache in enumerate(caches) if cache is not None]
        for index, (state, branch) in enumerate(passes):
            if caches[index] is None:
                predictions[index], caches[index] = self._prefill(state, branch)
        if cached:
            decoded = self._decode([passes[index] for index in cached])
            for row, index in enumerate(cached):
                predictions[index] = decoded[row : row + 1]
        return torch.cat(predictions), caches

    def _prefill(self, state: Denoise21State, branch: int) -> tuple[torch.Tensor, ConditionCache]:
        """A pass's first step, whole, under its request's adapter."""
        one = state.passes[branch]
        layout = JointLayout.of(self.transformer, one.image_slots, state.shapes)
        with self.loras.applied(self.loras.rows([state.params.loras])):
            return prefill(self.transformer, state.latents, state.condition, one.text[None], state.timestep, layout)

    def _decode(self, passes: list[tuple[Denoise21State, int]]) -> torch.Tensor:
        """Cached passes' target tokens in one forward, each row under its request's adapter."""
        states = [state for state, _ in passes]
        latents = torch.cat([state.latents for state in states])
        timesteps = torch.cat([state.timestep for state in states])
        caches = [state.passes[branch].cache for state, branch in passes]
        with self.loras.applied(self.loras.rows([state.params.loras for state in states])):
            return decode(self.transformer, latents, timesteps, caches)

    def finish(self, state: Denoise21State) -> Latents:
        """The finished state's latents ``[target_tokens, 64]``, moved to the CPU for the VAE stage."""
        assert state.is_finished
        passes = {"computed": state.num_steps * len(state.passes), "reused": 0}
        return Latents(to_host(state.latents[0]), state.params.height, state.params.width, dit_passes=passes)


def guide(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """2.1's true CFG: no norm rescale (unlike Qwen-Image's ``denoise.guide``)."""
    return uncond + scale * (cond - uncond)
