"""The three stage engines in one process, behind the one request path: what the Serve app does across replicas,
without Ray. The quickest way to see an image:

    python -m omni_ray.pipeline "a red cat" --out cat.png
    python -m omni_ray.pipeline "make it blue" --image cat.png --stage-config stage_configs/qwen_image_edit_tiny.yaml

Each engine runs on its own thread; requests flow encoder -> DiT -> VAE as asyncio tasks, so concurrent requests
batch in every stage. vLLM binds threads for its whole process, so a process that holds the encoder engine runs the
other stages single-threaded too; the served app gives each stage its own process.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import uuid
from collections.abc import AsyncIterator

import numpy as np

from omni_ray import checkpoints
from omni_ray.api.images import load_input_images
from omni_ray.api.planning import plan_request
from omni_ray.api.schema import ImageGenerationRequest
from omni_ray.config import LoraEntry, PipelineConfig, load_config
from omni_ray.engine.async_engine import AsyncEngine
from omni_ray.engine.builders import build_dit_core, build_encoder_core, build_vae_core
from omni_ray.engine.card import LocalCard
from omni_ray.engine.lora_residency import LoraResidency
from omni_ray.errors import RequestError
from omni_ray.records import (
    Caption,
    CaptionRequest,
    Decoded,
    DecodeRequest,
    DenoiseParams,
    DenoiseRequest,
    EncodeRequest,
    ImageEncodeRequest,
    InputImages,
    OutputMode,
    upstream_timings,
)
from omni_ray.request_path import DenoiseEvent, RequestEvent, Stages, collect, run_request
from omni_ray.tokenizer import tokenizer_for

DEFAULT_PRESET = pathlib.Path(__file__).resolve().parent.parent / "stage_configs" / "qwen_image_tiny.yaml"


class LocalStages(Stages[object]):
    """The stage protocol on three in-process engines. Handles are the records themselves: asyncio tasks that will
    hold the encoders' results, the edit's pixels, the DiT's latents."""

    def __init__(self, encoder: AsyncEngine, dit: AsyncEngine, vae: AsyncEngine, loras: LoraResidency,
                 card: LocalCard | None = None):
        self.encoder, self.dit, self.vae, self.loras = encoder, dit, vae, loras
        self.card = card  # the turns on a shared card (``card``), whose ledger the stats read

    @classmethod
    def from_config(cls, config: PipelineConfig) -> LocalStages:
        card = LocalCard() if config.card is not None else None  # the stages' turns on one shared card
        dit = AsyncEngine(lambda: build_dit_core(config, card=card), "dit").start()
        return cls(AsyncEngine(lambda: build_encoder_core(config, card), "encoder").start(), dit,
                   AsyncEngine(lambda: build_vae_core(config, card=card), "vae").start(),
                   LoraResidency.from_config(dit, config), card)

    def put_image(self, image: np.ndarray) -> np.ndarray:
        return image

    def encode_prompt(self, request: EncodeRequest, images: tuple[np.ndarray, ...]) -> asyncio.Future:
        request.images = images
        return asyncio.ensure_future(self.encoder.generate(request))

    async def caption(self, request: CaptionRequest, image: np.ndarray) -> Caption:
        request.image = image
        return await self.encoder.generate(request)

    def encode_image(self, request_id: str, image: np.ndarray, seed: int | None = None, draw: int = 0,
                     mask: np.ndarray | None = None, *, priority: int = 0, tenant: str = "") -> asyncio.Future:
        request = ImageEncodeRequest(request_id, image, seed, draw, mask, priority, tenant)
        return asyncio.ensure_future(self.vae.generate(request))

    async def denoise(
        self, request_id: str, params: DenoiseParams, prompt: asyncio.Future, image_latents: tuple[asyncio.Future, ...],
        start: asyncio.Future | None = None, controls: tuple[asyncio.Future, ...] = (),
    ) -> AsyncIterator[DenoiseEvent]:
        # Shielded: the n images of a request share these calls, and one image's cancellation must not cancel them.
        encoded = await asyncio.shield(prompt)
        images = tuple([await asyncio.shield(latents) for latents in image_latents])
        start_latents = await asyncio.shield(start) if start is not None else None
        control_latents = tuple([await asyncio.shield(latents) for latents in controls])
        request = DenoiseRequest(request_id, params, encoded.prompt, encoded.negative, images, start_latents,
                                 control_latents)
        timings = upstream_timings(encoded, *images, *([start_latents] if start_latents is not None else []),
                                   *control_latents)
        async with self.loras.use(params.loras):
            async for item in self.dit.stream(request, timings):
                yield item  # the engine's typed stream; its latents are the handles

    async def decode(self, request_id: str, latents, output: OutputMode, preview: bool = False, *, priority: int = 0,
                     tenant: str = "") -> Decoded:
        request = DecodeRequest(request_id, latents, output, preview, priority, tenant)
        return await self.vae.generate(request, upstream=latents.timings)

    def cancel(self, handle) -> None:
        if isinstance(handle, asyncio.Future):
            handle.cancel()

    async def check_lora(self, path: str) -> LoraEntry:
        return await self.loras.check(path)

    def shutdown(self) -> None:
        for engine in (self.encoder, self.dit, self.vae):
            engine.shutdown()


class Pipeline:
    """Requests in the images API's terms, run in this process: for scripts, tests and benchmarks."""

    def __init__(self, config: PipelineConfig, stages: LocalStages | None = None):
        self.config = checkpoints.ensure(config)
        self.stages = stages or LocalStages.from_config(config)
        self.tokenizer = tokenizer_for(config)

    def events(
        self,
        body: dict | ImageGenerationRequest,
        image: np.ndarray | InputImages | None = None,
        request_id: str | None = None,
        output: OutputMode = "pixels",
    ) -> AsyncIterator[RequestEvent]:
        """The request's event stream; an edit preset takes ``image`` (one image's pixels at its working size, or
        ``api.images.load_inputs``' inputs)."""
        plan = plan_request(body, self.config, self.tokenizer.num_tokens, image, self.config.loras)
        return run_request(self.stages, plan, request_id or uuid.uuid4().hex, self.config.requests, output)

    async def generate(self, body: dict | ImageGenerationRequest, image: np.ndarray | InputImages | None = None,
                       request_id: str | None = None, output: OutputMode = "pixels") -> list[Decoded]:
        """Every image of the request (``n`` of them), per ``output``."""
        return await collect(self.events(body, image, request_id, output))

    def shutdown(self) -> None:
        self.stages.shutdown()


def main(argv: list[str] | None = None) -> None:
    from PIL import Image

    parser = argparse.ArgumentParser(prog="python -m omni_ray.pipeline", description=__doc__.split("\n")[0])
    parser.add_argument("prompt")
    parser.add_argument("--negative-prompt", default=None)
    parser.add_argument("--stage-config", default=str(DEFAULT_PRESET), help="preset YAML (default: the tiny one)")
    parser.add_argument("--model", default=None, help="checkpoint directory or hub id overriding the preset's")
    parser.add_argument("--image", action="append", default=None,
                        help="the image to edit (an edit preset; repeat it for an Edit-Plus preset's several)")
    parser.add_argument("--size", default=None, help="WxH (default: the preset's, or the edit image's working size)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the preset's)")
    parser.add_argument("--true-cfg-scale", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", default=None, metavar="KIND:THRESHOLD",
                        help="DiT cache acceleration, e.g. first_block:0.2 or teacache:0.4; 'none' turns the "
                        "preset's off (default: the preset's)")
    parser.add_argument("--out", default="omni-ray.png")
    args = parser.parse_args(argv)
    config = load_config(args.stage_config, model=args.model)
    source = None
    if args.image is not None:
        try:
            source = load_input_images([pathlib.Path(path).read_bytes() for path in args.image], config)
        except RequestError as err:
            parser.error(str(err))
    body = {"prompt": args.prompt, "negative_prompt": args.negative_prompt, "size": args.size,
            "num_inference_steps": args.steps, "true_cfg_scale": args.true_cfg_scale, "seed": args.seed}
    if args.cache is not None:
        body["cache"] = parse_cache(args.cache, parser)
    pipeline = Pipeline(config)
    try:
        (image,) = asyncio.run(pipeline.generate(body, source))
    except RequestError as err:
        parser.error(str(err))
    finally:
        pipeline.shutdown()
    Image.fromarray(image.pixels).save(args.out)
    height, width = image.pixels.shape[:2]
    passes = image.dit_passes
    print(f"wrote {args.out} ({width}x{height}, seed {args.seed}; DiT passes computed {passes['computed']}, "
          f"reused {passes['reused']})")


def parse_cache(text: str, parser: argparse.ArgumentParser) -> dict | None:
    """``--cache``'s ``KIND:THRESHOLD`` (or ``none``) as the request's ``cache`` field."""
    if text.lower() == "none":
        return None
    kind, _, threshold = text.partition(":")
    try:
        return {"kind": kind, "threshold": float(threshold)}
    except ValueError:
        parser.error(f"--cache: expected KIND:THRESHOLD such as first_block:0.2, got {text!r}")


if __name__ == "__main__":
    main()
