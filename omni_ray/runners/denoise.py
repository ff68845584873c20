"""Denoise stage: Qwen-Image's transformer advancing a batch of requests by one flow-match step.

Each request carries its own state (latents, scheduler with its timesteps and step index, prompt embeddings), so
requests with different step counts, seeds, prompts and CFG scales share one forward pass; the engine decides which
states step together. Numerics follow diffusers' ``QwenImagePipeline.__call__``: the noise, the dynamic-shift
schedule and the Euler update (``denoise_state``), the forward (``dit_cache``) and the true-CFG norm rescale are the
same operations on the same values. An edit
(``QwenImageEditPipeline``, or ``QwenImageEditPlusPipeline`` with up to three) also carries its input images' packed
latents: they ride behind the noisy latents in every forward pass, one after another, each with its own entry in the
rotary shapes, and the prediction for them is dropped.

ControlNets (``QwenImageControlNetPipeline``; the preset's ``controlnets``, InstantX's Qwen-Image ControlNet Union)
add residuals to the image tokens after each block, for the rows whose request applies them (``controls``): each
controlnet runs once per step over the states that use it (their latents, control latents, conditional prompts and
timesteps, batched), each of its samples scaled by the request's scale while its step lies in the control's window,
and a request's controls summed in its order (as ``QwenImageMultiControlNetModel`` sums them). A true-CFG request's
unconditional pass reuses the residuals of its conditional one, as diffusers' does. Rows without control get
nothing added. In a gang each rank runs the controlnets whole for the states of the passes it runs (every sequence
rank the same states) and adds its own chunk of their tokens; CFG ranks running one request's two passes each
compute its residuals.

An inpainting ControlNet (``QwenImageControlNetInpaintPipeline``, InstantX's Qwen-Image-ControlNet-Inpainting, whose
``extra_condition_channels`` are the packed mask channel's 4) runs the same way on 68-channel control latents (the
masked control image's sample and the control mask: ``runners.vae``), beside plain ones, each controlnet batched over
its own rows. That pipeline is a controlnet-guided text-to-image: no latents are blended back.

Qwen-Image-Layered (``QwenImageLayeredPipeline``; a transformer with ``use_layer3d_rope`` and
``use_additional_t_cond``) runs as an edit with one input image at the output's size whose request denoises
``params.layers + 1`` frames (``denoise_state``); its true CFG rescales only with ``params.cfg_normalize`` (the
pipeline's ``cfg_normalize``). A replica of it takes layered requests only, and only from it does a request with
``layers`` step.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import time

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImageControlNetModel,
    QwenImageTransformer2DModel,
)

from omni_ray.config import ParallelSettings
from omni_ray.families.qwen_image.facts import QWEN_IMAGE_TEACACHE, VAE_COMPRESSION, check_side, latent_grid
from omni_ray.records import (
    Control,
    DenoiseParams,
    Latents,
    LoraRef,
    PromptEmbeds,
)
from omni_ray.runners import gguf_weights as gguf
from omni_ray.runners.attention import use_real_rope
from omni_ray.runners.denoise_state import DenoiseState, prepare_state
from omni_ray.runners.dit_cache import BranchCache, ControlRows, cached_forward
from omni_ray.runners.host import to_host
from omni_ray.runners.offload import BlockStreamer, stream_blocks
from omni_ray.runners.parallel.mesh import Comm, Mesh
from omni_ray.runners.parallel.split import assign_passes, gather_passes
from omni_ray.runners.parallel.tensor import shard_transformer
from omni_ray.runners.quantization import quantize_fp8, quantize_int4, quantize_int8
from omni_ray.runners.random_weights import random_model
from omni_ray.runners.stepping import SteppingRunner

logger = logging.getLogger(__name__)


class DenoiseRunner(SteppingRunner):
    """Holds the transformer and the scheduler config; prepares request states and steps batches of them."""

    def __init__(
        self,
        transformer: QwenImageTransformer2DModel,
        scheduler_config: dict,
        teacache_coefficients: tuple[float, ...] = QWEN_IMAGE_TEACACHE,
        max_loras: int = 4,
        mesh: Mesh | None = None,
        controlnets: dict[str, QwenImageControlNetModel] | None = None,
    ):
        super().__init__(transformer, max_loras, mesh)
        check_heads(transformer.config.num_attention_heads, self.mesh.settings)
        use_real_rope(transformer)
        self.controlnets = dict(controlnets or {})  # name -> the preset's controlnet, on the runner's device
        check_controlnets(transformer, self.controlnets)
        for controlnet in self.controlnets.values():
            use_real_rope(controlnet.eval())
        self.teacache_coefficients = teacache_coefficients
        self.scheduler_config = scheduler_config
        self.num_channels_latents = transformer.config.in_channels // 4
        self.warmup_s: float | None = None  # how long warm_up took (compiling, with compiled blocks)
        self.streamer: BlockStreamer | None = None  # dit.offload's: the blocks streamed through the device
        self.step_overhead_s = 0.0  # a step's known fixed cost (the streamed blocks' copies), for the DiT's load

    @classmethod
    def load(
        cls, model: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
        teacache_coefficients: tuple[float, ...] = QWEN_IMAGE_TEACACHE, dummy: bool = False, max_loras: int = 4,
        compile: bool = False, quantization: str = "none", mesh: Mesh | None = None,
        controlnets: dict[str, str] | None = None, weights_file: str | None = None,
        offload_resident: int | None = None, offload_gbps: float = 25.0,
    ) -> DenoiseRunner:
        """The runner of a checkpoint in diffusers' layout (``transformer/``, ``scheduler/``, ``vae/``); with
        ``dummy``, its transformer built from the config with random weights; with ``quantization="fp8"``, its
        blocks' Linears in float8 (``quantization.quantize_fp8``), with ``"int8"`` or ``"int4"`` their weights in
        int8 or int4 (``quantization.quantize_int8``, ``quantize_int4``); with ``compile``, its blocks compiled (dynamic
        shapes: batch sizes, sub-batches of cache acceleration and text lengths vary). In a gang (``mesh``) with
        tensor ranks, each keeps its slice of the blocks' Linears (``parallel.tensor.shard_transformer``) before
        the transformer reaches the device. Known limit: each rank reads the whole checkpoint on its host first
        (about 41 GB in bf16 at full size) rather than only its slice. ``controlnets`` (the preset's: name ->
        folder of a ``QwenImageControlNetModel``) are loaded whole on every rank, in ``dtype`` on ``device``
        (neither quantized nor compiled). ``weights_file``: a GGUF file of the transformer's weights in place of
        the checkpoint's (``checkpoints.gguf``), checked against its config first. ``offload_resident``: the blocks
        kept on the device, the others streamed through it (``offload.stream_blocks``) at ``offload_gbps`` GB/s
        (what its step-time fit starts from); None: all on it."""
        tensor_parallel = mesh is not None and mesh.tensor.size > 1
        on_host_first = tensor_parallel or offload_resident is not None  # only part of the model reaches the device
        if dummy:
            config = QwenImageTransformer2DModel.load_config(model, subfolder="transformer")
            transformer = random_model(QwenImageTransformer2DModel, config, dtype, "cpu" if on_host_first else device)
        elif weights_file is not None:
            transformer_config = QwenImageTransformer2DModel.load_config(model, subfolder="transformer")
            summary = gguf.check(pathlib.Path(weights_file).expanduser(), transformer_config)
            logger.info("DiT weights from %s: %s, %.2f GiB", weights_file, summary.quant_types, summary.bytes / 2**30)
            transformer = gguf.load_transformer(pathlib.Path(weights_file).expanduser(), model, dtype)
        else:
            transformer = QwenImageTransformer2DModel.from_pretrained(model, subfolder="transformer", torch_dtype=dtype)
        vae_config = AutoencoderKLQwenImage.load_config(model, subfolder="vae")
        if 2 ** len(vae_config["temperal_downsample"]) != VAE_COMPRESSION:
            raise ValueError(f"{model}: not Qwen-Image's VAE (its compression is not {VAE_COMPRESSION}x)")
        scheduler_config = FlowMatchEulerDiscreteScheduler.load_config(model, subfolder="scheduler")
        if tensor_parallel:
            shard_transformer(transformer, mesh)
        streamer = stream_blocks(transformer, offload_resident, device) if offload_resident is not None else None
        transformer = transformer.to(device)
        if quantization == "fp8":
            logger.info("FP8: %d Linears quantized", quantize_fp8(transformer))
        elif quantization == "int8":
            logger.info("int8 weights: %d Linears quantized", quantize_int8(transformer))
        elif quantization == "int4":
            logger.info("int4 weights: %d Linears quantized", quantize_int4(transformer))
        if compile:
            compile_blocks(transformer)
        nets = {name: QwenImageControlNetModel.from_pretrained(path, torch_dtype=dtype).to(device)
                for name, path in (controlnets or {}).items()}
        runner = cls(transformer, scheduler_config, teacache_coefficients, max_loras, mesh, nets)
        runner.streamer = streamer
        if streamer is not None:  # one forward a step, CFG's passes in it: each streamed block copied once
            runner.step_overhead_s = streamer.bytes_per_pass / (offload_gbps * 1e9)
        return runner

    def warm_up(self, height: int, width: int, text_tokens: int = 64) -> float:
        """Steps an image of this size alone, with true CFG, and with true CFG and a shorter negative prompt, so
        that the compiled blocks' three variants (one row; several rows; several with padded text) compile here
        rather than on a user's request; returns the seconds it took. Nothing is kept."""
        start = time.perf_counter()
        dim = self.transformer.config.joint_attention_dim
        prompt, shorter = (PromptEmbeds(torch.zeros(n, dim)) for n in (text_tokens, text_tokens - 1))
        for negative in (None, prompt, shorter):
            params = DenoiseParams(height, width, num_inference_steps=2, seed=0, true_cfg_scale=4.0,
                                   true_cfg=negative is not None)
            self.step([self.prepare(params, prompt, negative)])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warmup_s = time.perf_counter() - start
        return self.warmup_s

    def admitted(self, state: DenoiseState) -> None:
        """With CFG ranks, a cached request's home: the CFG rank holding fewest caches (every rank admits the same
        requests in the same order, so each reckons the same home: ``parallel.split``)."""
        if state.caches and self.mesh.cfg.size > 1:
            homes = [s.home for s in self.states.values() if s.home is not None]
            state.home = min(range(self.mesh.cfg.size), key=lambda r: (homes.count(r), r))

    def prepare(
        self,
        params: DenoiseParams,
        prompt: PromptEmbeds,
        negative: PromptEmbeds | None = None,
        images: tuple[Latents, ...] = (),
        start: Latents | None = None,
        controls: tuple[Latents, ...] = (),
    ) -> DenoiseState:
        """Refuses a request this replica cannot run, then draws its state (``denoise_state.prepare_state``): noise
        and schedule; an edit's image latents in order; a masked edit's start from ``start``; the control images'
        latents ``controls``, one per ``params.controls``, in order."""
        check_side("height", params.height)
        check_side("width", params.width)
        self.check_lora(params)
        self.check_controls(params, images, controls)
        self.check_layers(params, images)
        return prepare_state(
            params, prompt, negative, images, start, controls, scheduler_config=self.scheduler_config,
            channels=self.num_channels_latents, device=self.device, dtype=self.dtype,
        )

    def check_controls(self, params: DenoiseParams, images: tuple[Latents, ...], controls: tuple[Latents, ...]
                       ) -> None:
        """Raises ValueError naming ``control`` unless the request's ControlNets are this replica's and each comes
        with its control image's latents at the output's size (text to image only: no edit, no masked edit)."""
        if not params.controls and not controls:
            return
        if len(controls) != len(params.controls):
            raise ValueError(f"control: {len(params.controls)} ControlNets applied but {len(controls)} control "
                             "images' latents given")
        if images or params.inpaint is not None:
            raise ValueError("control: ControlNets guide text-to-image generation, not edits or masked edits")
        rows, cols = latent_grid(params.height, params.width)
        tokens = (rows // 2) * (cols // 2)
        for k, (control, latents) in enumerate(zip(params.controls, controls)):
            if control.name not in self.controlnets:
                known = ", ".join(sorted(self.controlnets)) or "none"
                raise ValueError(f"control: no ControlNet named {control.name!r} on this replica (it has: {known})")
            extra = self.controlnets[control.name].config.extra_condition_channels
            if control.mask != bool(extra):
                raise ValueError(f"control: ControlNet {control.name!r} "
                                 f"{'is an inpainting one: its control needs' if extra else 'takes no'} a mask")
            channels = self.transformer.config.in_channels + extra
            if not 0.0 <= control.start < control.end <= 1.0:
                raise ValueError(f"control: ControlNet {k}'s window {control.start}..{control.end} is not within "
                                 "0..1 with its start before its end")
            if (latents.height, latents.width) != (params.height, params.width) or \
                    tuple(latents.latents.shape) != (tokens, channels):
                raise ValueError(f"control: control image {k}'s latents are {tuple(latents.latents.shape)} for "
                                 f"{latents.width}x{latents.height}, not {(tokens, channels)} for the output's "
                                 f"{params.width}x{params.height}")

    @property
    def is_layered(self) -> bool:
        """Whether the transformer is Qwen-Image-Layered's (its rotary embedding numbers frames by layer)."""
        return bool(self.transformer.config.get("use_layer3d_rope", False))

    def check_layers(self, params: DenoiseParams, images: tuple[Latents, ...]) -> None:
        """Raises ValueError naming the field unless a request with ``layers`` comes to a Qwen-Image-Layered
        transformer with its one input image's latents at the output's size and no masked edit, and a request
        without comes to any other transformer."""
        if not params.layers:
            if self.is_layered:
                raise ValueError("layers: this replica serves Qwen-Image-Layered, which decomposes an image into "
                                 "layers; a request must set them")
            return
        if not self.is_layered:
            raise ValueError(f"layers: {params.layers} asked of a replica whose transformer is not "
                             "Qwen-Image-Layered's")
        if params.inpaint is not None:
            raise ValueError("inpaint: Qwen-Image-Layered decomposes its input image whole; it has no masked edit")
        rows, cols = latent_grid(params.height, params.width)
        tokens = (rows // 2) * (cols // 2)
        if len(images) != 1 or images[0].layers or (images[0].height, images[0].width) != (params.height,
                                                                                            params.width):
            sizes = ", ".join(f"{i.width}x{i.height}" for i in images) or "none"
            raise ValueError(f"image: Qwen-Image-Layered takes one input image at the output's "
                             f"{params.width}x{params.height}; given {sizes}")
        if tuple(images[0].latents.shape) != (tokens, self.transformer.config.in_channels):
            raise ValueError(f"image: its latents are {tuple(images[0].latents.shape)}, not "
                             f"{(tokens, self.transformer.config.in_channels)} for {params.width}x{params.height}")

    @torch.inference_mode()
    def step(self, states: list[DenoiseState], split: str = "sequence") -> None:
        """Advances every state by one denoising step. The states must share a batch key. In a gang, ``split``
        says how the step uses the sequence ranks (``DenoiseBatch.split``)."""
        assert states and len({s.batch_key for s in states}) == 1, "mixed batch keys"
        cfg = states[0].params.true_cfg
        cond, uncond, caches = self.predict(states, split)
        num_tokens = states[0].latents.shape[1]  # the prediction for the edit images' tokens is dropped
        for row, state in enumerate(states):
            pred = cond[row : row + 1, :num_tokens]
            if cfg:
                pred = guide(pred, uncond[row : row + 1, :num_tokens], state.params.true_cfg_scale,
                             state.params.cfg_normalize)
            state.advance(pred, caches[row :: len(states)])

    def predict(
        self, states: list[DenoiseState], split: str = "sequence"
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[BranchCache | None]]:
        """The transformer's conditional prediction for every state, with true CFG the unconditional one, and the
        caches after the step (the conditional passes' in state order, then the unconditional ones'). On one rank,
        one forward: the unconditional passes ride behind the conditional ones, text padded to the longest of both.
        With CFG ranks, each runs its passes (``parallel.split.assign_passes``) and one all-gather hands every rank
        every pass's prediction; a pass's cache stays on the rank that ran it, the others count its decision.

        ``split="rows"`` spreads the passes over the CFG and sequence ranks together, each run whole (throughput
        rather than one request's latency). A step with a cached row runs sequence-split all the same: its cache
        holds this rank's chunk of its tokens, and moving it whole to one rank and back would cost two exchanges
        of every block's residual."""
        cfg = states[0].params.true_cfg
        passes = [(state, 0) for state in states] + ([(state, 1) for state in states] if cfg else [])
        by_rows = split == "rows" and self.mesh.sequence.size > 1 and not any(s.caches for s in states)
        comm = self.mesh.rows if by_rows else self.mesh.cfg
        ranks = assign_passes([s.home for s, _ in passes], [branch for _, branch in passes], cfg and not by_rows,
                              comm.size)
        mine = [i for i, rank in enumerate(ranks) if rank == comm.rank]
        before = [s.caches[branch] if s.caches else None for s, branch in passes]
        sequence = None if by_rows else self.mesh
        prediction, caches = self._forward_passes([passes[i] for i in mine], sequence) if mine else (None, [])
        if comm.size > 1:
            prediction, caches = self._share(comm, ranks, mine, prediction, caches, before, states[0])
        rows = len(states)
        return prediction[:rows], (prediction[rows:] if cfg else None), caches

    def _share(self, comm: Comm, ranks: list[int], mine: list[int], prediction: torch.Tensor | None,
               caches: list[BranchCache | None], before: list[BranchCache | None], state: DenoiseState
               ) -> tuple[torch.Tensor, list[BranchCache | None]]:
        """Every pass's prediction and cache from this rank's (the passes ``mine`` of those ``ranks`` ran): the
        predictions and each pass's cache decision (reused or not) all-gathered over ``comm``; another rank's pass
        keeps its tensors there and has its decision counted here."""
        like = state.latents.new_zeros(self._prediction_shape(state))
        prediction = gather_passes(comm, ranks, prediction, like)
        flags = [float(c is not None and c.reused > before[i].reused) for i, c in zip(mine, caches)]
        flag = like.new_zeros((), dtype=torch.float32)  # on the gang's device: NCCL sends no host tensor
        reused = gather_passes(comm, ranks, flag.new_tensor(flags) if mine else None, flag).tolist()
        local = dict(zip(mine, caches))
        return prediction, [local[i] if i in local else _counted(before[i], bool(reused[i])) for i in range(len(ranks))]

    def _prediction_shape(self, state: DenoiseState) -> tuple[int, int]:
        """One pass's prediction: every image token (an edit's input images' included), the output channels."""
        tokens = state.latents.shape[1] + (state.image.shape[1] if state.image is not None else 0)
        return tokens, self.transformer.config.out_channels * self.transformer.config.patch_size ** 2

    def _forward_passes(self, passes: list[tuple[DenoiseState, int]], sequence: Mesh | None
                        ) -> tuple[torch.Tensor, list[BranchCache | None]]:
        """One forward over these passes (state, branch: 0 conditional, 1 unconditional), their tokens split over
        ``sequence``: their predictions in order, and their caches after the step."""
        states = [state for state, _ in passes]
        latents = torch.cat([s.latents for s in states])
        if states[0].image is not None:  # edits: the images' tokens follow the noisy ones
            latents = torch.cat([latents, torch.cat([s.image for s in states])], dim=1)
        timesteps = torch.stack([s.scheduler.timesteps[s.step_index] for s in states])
        return self._forward(
            latents, timesteps, [s.negative if branch else s.prompt for s, branch in passes],
            [s.img_shapes for s in states], [s.caches[branch] if s.caches else None for s, branch in passes],
            [(s.step_index, s.num_steps) for s in states], [s.params.loras for s in states], sequence,
            self._control(states),
        )

    def _control(self, rows: list[DenoiseState]) -> ControlRows | None:
        """The ControlNet residuals of the forward whose row i steps ``rows[i]`` (a true-CFG request's two passes
        share its conditional residuals), for the rows with a control acting at their step; None when none has."""
        unique = list({id(s): s for s in rows if s.controls}.values())
        sums = self._control_residuals(unique)
        if not sums:
            return None
        with_control = [i for i, s in enumerate(rows) if id(s) in sums]
        layers = len(next(iter(sums.values())))
        samples = tuple(torch.cat([sums[id(rows[i])][j] for i in with_control]) for j in range(layers))
        return ControlRows.of(samples, tuple(with_control), len(self.transformer.transformer_blocks))

    def _control_residuals(self, states: list[DenoiseState]) -> dict[int, list[torch.Tensor]]:
        """id(state) -> its residuals, one ``[1, image_tokens, dim]`` per controlnet block: each controlnet run once
        over the (state, control) pairs that use it at this step (diffusers' ``controlnet_keep``: the step's share
        ``i / steps`` to ``(i + 1) / steps`` within the control's window), scaled by the control's scale, and a
        state's controls summed in its order. States whose controls all sit outside their windows are absent."""
        scaled: dict[tuple[int, int], list[torch.Tensor]] = {}  # (id(state), k) -> its control's scaled samples
        by_net: dict[str, list[tuple[DenoiseState, int, float]]] = {}
        for state in states:
            for k, control in enumerate(state.params.controls):
                factor = control.scale * keep(control, state.step_index, state.num_steps)
                if factor:  # outside its window a control adds exactly nothing: it is not run
                    by_net.setdefault(control.name, []).append((state, k, factor))
        for name, uses in by_net.items():
            for (state, k, _), samples in zip(uses, self._run_controlnet(self.controlnets[name], uses)):
                scaled[(id(state), k)] = samples
        sums: dict[int, list[torch.Tensor]] = {}
        for state in states:
            for k in range(len(state.params.controls)):
                samples = scaled.get((id(state), k))
                if samples is None:
                    continue
                total = sums.get(id(state))
                sums[id(state)] = samples if total is None else [a + b for a, b in zip(total, samples)]
        return sums

    def _run_controlnet(self, controlnet: QwenImageControlNetModel, uses: list[tuple[DenoiseState, int, float]]
                        ) -> list[list[torch.Tensor]]:
        """One controlnet over the (state, control index, scale) ``uses`` as one batch: per use, its scaled samples
        ``[1, image_tokens, dim]``. The scale multiplies in float32 and rounds once to the runner's dtype, as
        diffusers' ``sample * conditioning_scale`` with a Python float does."""
        states = [state for state, _, _ in uses]
        latents = torch.cat([s.latents for s in states])
        cond = torch.cat([state.controls[k] for state, k, _ in uses])
        embeds, mask = pad_text([s.prompt for s in states])
        timestep = torch.stack([s.scheduler.timesteps[s.step_index] for s in states]).to(latents.dtype) / 1000
        samples = controlnet(
            hidden_states=latents, controlnet_cond=cond, conditioning_scale=1.0, encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask, timestep=timestep, img_shapes=[s.img_shapes for s in states],
            return_dict=False,
        )
        factors = torch.tensor([factor for _, _, factor in uses], dtype=torch.float32, device=latents.device)
        scaled = [(sample.float() * factors[:, None, None]).to(sample.dtype) for sample in samples]
        return [[sample[i : i + 1] for sample in scaled] for i in range(len(uses))]

    def _forward(
        self,
        latents: torch.Tensor,  # [rows, image_seq_len, in_channels]
        timesteps: torch.Tensor,  # [rows]
        texts: list[torch.Tensor],  # rows x [num_tokens_i, hidden]
        img_shapes: list[list[tuple[int, int, int]]],
        caches: list[BranchCache | None],
        steps: list[tuple[int, int]],  # rows x (step index, steps in all)
        loras: list[tuple[LoraRef, ...]],  # rows x the row's adapters (a stack, or none)
        sequence: Mesh | None = None,  # a gang whose sequence ranks split the rows' tokens
        control: ControlRows | None = None,  # the rows' ControlNet residuals (``_control``)
    ) -> tuple[torch.Tensor, list[BranchCache | None]]:
        """The transformer's prediction per row (diffusers' forward, with each row's cache deciding which blocks
        it runs and its adapter adding to the layers it adapts), and each row's cache after the step."""
        embeds, mask = pad_text(texts)
        timestep = timesteps.to(latents.dtype) / 1000
        prediction = cached_forward(
            self.transformer, latents, timestep, embeds, mask, img_shapes, caches, steps, self.teacache_coefficients,
            self.loras.rows(loras), sequence, control,
        )
        if self.streamer is not None:
            self.streamer.forward_ended()
        return prediction

    def finish(self, state: DenoiseState) -> Latents:
        """The finished state's latents, moved to the CPU for the VAE stage."""
        assert state.is_finished
        if state.caches:
            passes = {"computed": sum(c.computed for c in state.caches), "reused": sum(c.reused for c in state.caches)}
        else:
            passes = {"computed": state.progress[1] * (2 if state.params.true_cfg else 1), "reused": 0}
        return Latents(
            to_host(state.latents[0]), state.params.height, state.params.width, layers=state.params.layers,
            dit_passes=passes,
        )


def keep(control: Control, step_index: int, num_steps: int) -> float:
    """diffusers' ``controlnet_keep``: 1 while the step's share of the schedule lies within the control's window."""
    return 1.0 - float(step_index / num_steps < control.start or (step_index + 1) / num_steps > control.end)


def check_controlnets(transformer: QwenImageTransformer2DModel, controlnets: dict[str, QwenImageControlNetModel]
                      ) -> None:
    """The preset's controlnets must fit the transformer (their residuals are added to its image tokens), take no
    extra condition channels but an inpainting ControlNet's packed mask (``patch_size ** 2``: one channel packed
    2x2, as ``QwenImageControlNetInpaintPipeline`` packs it), and have one number of blocks (a request's controls
    are summed block by block, as diffusers' multi-controlnet sums); ValueError naming ``controlnets`` otherwise."""
    t = transformer.config
    width = t.num_attention_heads * t.attention_head_dim
    for name, net in controlnets.items():
        c = net.config
        if (c.num_attention_heads * c.attention_head_dim, c.in_channels, c.joint_attention_dim, c.patch_size) != \
                (width, t.in_channels, t.joint_attention_dim, t.patch_size):
            raise ValueError(f"controlnets: {name!r} does not fit the transformer (its width, input channels, text "
                             "width or patch size differ)")
        if c.extra_condition_channels not in (0, c.patch_size ** 2):
            raise ValueError(f"controlnets: {name!r} takes {c.extra_condition_channels} extra condition channels; an "
                             f"inpainting ControlNet takes the packed mask's {c.patch_size ** 2}")
    if len({net.config.num_layers for net in controlnets.values()}) > 1:
        raise ValueError("controlnets: they have different numbers of blocks; a request's controls are summed block "
                         "by block, so they must have one")


def check_heads(heads: int, parallel: ParallelSettings) -> None:
    """A gang splits heads over its Ulysses and tensor ranks: they must divide evenly."""
    if heads % (parallel.ulysses * parallel.tensor):
        raise ValueError(f"dit.parallel: the transformer's {heads} attention heads do not divide by ulysses x tensor "
                         f"({parallel.ulysses} x {parallel.tensor})")


def _counted(cache: BranchCache | None, reused: bool) -> BranchCache | None:
    """Another CFG rank's pass, as this rank keeps it: its decision counted, its tensors left on that rank."""
    if cache is None:
        return None
    counted = {"reused": cache.reused + 1} if reused else {"computed": cache.computed + 1}
    return dataclasses.replace(cache, **counted)


def compile_blocks(transformer: QwenImageTransformer2DModel) -> None:
    """``dit.compile``: each transformer block compiled (regional compilation), with dynamic shapes.

    Without duck sizing, a size that happens to equal another (text tokens and a model width, image tokens and the
    head size) stays a size of its own instead of being tied to it and specialised: other image sizes, text lengths
    and batch sizes then run the same compiled code (``DenoiseRunner.warm_up`` compiles its three variants)."""
    from torch.fx.experimental import _config as fx_config

    fx_config.use_duck_shape = False
    transformer.compile_repeated_blocks(dynamic=True)


def guide(cond: torch.Tensor, uncond: torch.Tensor, scale: float, normalize: bool = True) -> torch.Tensor:
    """True CFG with Qwen-Image's rescale: the guided prediction keeps the conditional one's per-token norm
    (without ``normalize``, Qwen-Image-Layered's ``cfg_normalize=False``, the guided prediction as it is)."""
    combined = uncond + scale * (cond - uncond)
    if not normalize:
        return combined
    return combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))


def pad_text(texts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Right-pads text embeddings with zeros; the mask is None when no row needed padding (as diffusers passes it)."""
    max_len = max(t.shape[0] for t in texts)
    if all(t.shape[0] == max_len for t in texts):
        return torch.stack(texts), None
    embeds = torch.stack([torch.cat([t, t.new_zeros(max_len - t.shape[0], t.shape[1])]) for t in texts])
    mask = torch.zeros((len(texts), max_len), dtype=torch.long, device=embeds.device)
    for row, t in enumerate(texts):
        mask[row, : t.shape[0]] = 1
    return embeds, mask
