"""A mixed step batch denoised on a gang of ranks or on one, for the parallel tests and ``benchmarks.parallel``.

``denoise_mix(mesh, model, adapters, steps)`` admits the same requests on whatever rank calls it: rows of two
prompts of different lengths, with and without true CFG, with first-block cache and TeaCache, with two different
LoRA adapters, both stacked (each at its scale) and none, and an edit with an input image's latents; an odd-sized
image (15 tokens) so that a sequence split pads. Each batch key's requests step together through
``DenoiseRunner.execute_model``, as the engine runs them. Returns every request's final latents, and the bytes this
rank sent per step.
"""

from __future__ import annotations

import numpy as np
import torch

from omni_ray.config import CacheSettings
from omni_ray.records import Control, DenoiseBatch, DenoiseParams, DenoiseRequest, Latents, LoraRef, PromptEmbeds
from omni_ray.runners.lora import read_lora

FIRST_BLOCK = CacheSettings(kind="first_block", threshold=0.2)
TEACACHE = CacheSettings(kind="teacache", threshold=0.3)


def mix_requests(dim: int, adapters: dict[str, str], steps: int = 4) -> list[list[DenoiseRequest]]:
    """The requests, one list per batch key (``base`` and ``cfg-plain`` carry neither an adapter nor a cache: what
    diffusers' pipeline can run from the same embeddings, ``diffusers_image``)."""
    generator = torch.Generator().manual_seed(0)
    prompts = [PromptEmbeds(torch.randn(n, dim, generator=generator)) for n in (7, 12)]
    negative = PromptEmbeds(torch.randn(5, dim, generator=generator))
    a, b = (LoraRef(name, path, scale) for (name, path), scale in zip(sorted(adapters.items()), (1.0, 0.7)))
    half_b = LoraRef(b.name, b.path, 0.5)  # the second adapter of a stack, at its own scale

    def request(rid, prompt, height=48, width=80, cfg=False, **params):
        params = DenoiseParams(height, width, steps, seed=len(rid) * 7 + ord(rid[-1]), true_cfg=cfg,
                               true_cfg_scale=4.0 if cfg else 1.0, **params)
        return DenoiseRequest(rid, params, prompts[prompt], negative if cfg else None, **extra.pop(rid, {}))

    image = Latents(torch.randn(2 * 3, 64, generator=generator), 32, 48)  # an edit's input image, 2x3 tokens
    extra = {"edit": {"images": (image,)}}
    return [
        [request("plain-a", 0, loras=(a,)), request("plain-b", 1, loras=(b,)), request("cached", 0, cache=FIRST_BLOCK),
         request("base", 1), request("tea", 1, cache=TEACACHE), request("stack-ab", 0, loras=(a, half_b))],
        [request("cfg-a", 0, cfg=True, loras=(a,)), request("cfg-tea", 1, cfg=True, cache=TEACACHE),
         request("cfg-b", 1, cfg=True, loras=(b,)), request("cfg-plain", 0, cfg=True),
         request("cfg-stack-ba", 1, cfg=True, loras=(b, a))],
        [request("edit", 0, height=64, width=64, loras=(b,))],
    ]


def denoise_mix(mesh, model: str, adapters: dict[str, str], steps: int = 4, split: str = "sequence",
                compile: bool = False, weights_file: str | None = None, offload_resident: int | None = None,
                quantization: str = "none") -> tuple[dict[str, torch.Tensor], list]:
    """Every request's final latents on this rank (``mesh`` None: one process), and the bytes sent per step;
    every step split as ``split`` says (``DenoiseBatch.split``); with ``compile``, the blocks compiled; with
    ``weights_file``, the transformer's weights from that GGUF file; with ``offload_resident``, the blocks past
    that many streamed (the bytes sent then end with the streamer's figures: peak, fetches); ``quantization``, the
    weights quantized at load (``dit.quantization``)."""
    from omni_ray.runners.denoise import DenoiseRunner

    torch.manual_seed(0)
    runner = DenoiseRunner.load(model, mesh=mesh, compile=compile, weights_file=weights_file,
                                offload_resident=offload_resident, quantization=quantization)
    for name, path in adapters.items():
        runner.add_lora((name, path), read_lora(path, runner.lora_shapes))
    dim = runner.transformer.config.joint_attention_dim
    latents, sent = {}, []
    for group in mix_requests(dim, adapters, steps):
        ids = [r.request_id for r in group]
        new = group
        for _ in range(steps):
            before = dict(runner.mesh.sent)
            output = runner.execute_model(DenoiseBatch(new, ids, [], split))
            assert not output.errors, output.errors
            new = []
            sent.append({op: n - before.get(op, 0) for op, n in runner.mesh.sent.items()})
            latents.update({rid: result.latents for rid, result in output.finished.items()})
    if runner.streamer is not None:
        sent.append({"peak": runner.streamer.peak, "fetches": runner.streamer.fetches})
    return latents, sent


def diffusers_image(model: str, request: DenoiseRequest) -> np.ndarray:
    """What diffusers' ``QwenImagePipeline`` makes of a request without an adapter or a cache, from its embeddings:
    uint8 ``[H, W, 3]``."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(model)
    params = request.params

    def embeds(prompt: PromptEmbeds | None):
        if prompt is None:
            return None, None
        return prompt.embeds[None], torch.ones(1, prompt.embeds.shape[0], dtype=torch.long)

    (prompt, mask), (negative, negative_mask) = embeds(request.prompt), embeds(request.negative)
    image = pipe(prompt_embeds=prompt, prompt_embeds_mask=mask, negative_prompt_embeds=negative,
                 negative_prompt_embeds_mask=negative_mask, true_cfg_scale=params.true_cfg_scale,
                 height=params.height, width=params.width, num_inference_steps=params.num_inference_steps,
                 generator=torch.Generator("cpu").manual_seed(params.seed)).images[0]
    return np.asarray(image)


def control_requests(dim: int, steps: int = 4) -> list[list[DenoiseRequest]]:
    """ControlNet rows (controlnets ``a`` and ``b``, see ``denoise_controls``), one list per batch key: with and
    without true CFG, a row without control beside them, a row with two controls, one with a window, one with a
    first-block cache; 48x80 (15 tokens), so that a sequence split pads. The control latents are drawn at random:
    the runner takes them as they come."""
    generator = torch.Generator().manual_seed(1)
    prompts = [PromptEmbeds(torch.randn(n, dim, generator=generator)) for n in (7, 12)]
    negative = PromptEmbeds(torch.randn(5, dim, generator=generator))

    def request(rid, prompt, controls, cfg=False, **params):
        latents = tuple(Latents(torch.randn(15, 64, generator=generator), 48, 80) for _ in controls)
        params = DenoiseParams(48, 80, steps, seed=len(rid) * 7 + ord(rid[-1]), true_cfg=cfg,
                               true_cfg_scale=4.0 if cfg else 1.0, controls=controls, **params)
        return DenoiseRequest(rid, params, prompts[prompt], negative if cfg else None, controls=latents)

    a, b = Control("a"), Control("b", 0.8, 0.25, 0.75)
    return [
        [request("ctl-a", 0, (a,)), request("ctl-none", 1, ()), request("ctl-ab", 1, (a, b)),
         request("ctl-cached", 0, (b,), cache=FIRST_BLOCK)],
        [request("cfg-ctl-a", 1, (a,), cfg=True), request("cfg-ctl-none", 0, (), cfg=True),
         request("cfg-ctl-b", 0, (Control("b", 1.2),), cfg=True, cache=TEACACHE)],
    ]


def denoise_controls(mesh, model: str, controlnets: dict[str, str], steps: int = 4, split: str = "sequence"
                     ) -> dict[str, torch.Tensor]:
    """``control_requests``' final latents on this rank (``mesh`` None: one process), each batch key's requests
    stepped together through ``DenoiseRunner.execute_model``."""
    from omni_ray.runners.denoise import DenoiseRunner

    torch.manual_seed(0)
    runner = DenoiseRunner.load(model, mesh=mesh, controlnets=controlnets)
    latents = {}
    for group in control_requests(runner.transformer.config.joint_attention_dim, steps):
        ids, new = [r.request_id for r in group], group
        for _ in range(steps):
            output = runner.execute_model(DenoiseBatch(new, ids, [], split))
            assert not output.errors, output.errors
            new = []
            latents.update({rid: result.latents for rid, result in output.finished.items()})
    return latents
