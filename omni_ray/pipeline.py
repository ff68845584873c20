"""The three stages chained in one process: encode -> denoise -> decode, no engine, no Ray.

It batches as diffusers' ``QwenImagePipeline`` batches (all prompts together, the negative prompts in a second
encoder pass, one decode), which makes it the reference the served pipeline is checked against, and the quickest
way to see an image: ``python -m omni_ray.pipeline "a red cat" --out cat.png`` (an edit:
``python -m omni_ray.pipeline "make it blue" --image cat.png --stage-config stage_configs/qwen_image_edit_tiny.yaml``).
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np
import torch

from omni_ray.config import PipelineConfig, load_config
from omni_ray.protocol import load_input_image
from omni_ray.stages.decode import VaeRunner
from omni_ray.stages.denoise import DenoiseParams, DenoiseRunner
from omni_ray.stages.encode import EDIT, TEXT_TO_IMAGE, PromptEncoder

DEFAULT_PRESET = pathlib.Path(__file__).resolve().parent.parent / "stage_configs" / "qwen_image_tiny.yaml"


class LocalPipeline:
    """Loads each stage from a preset and runs requests through them in one process."""

    def __init__(self, config: PipelineConfig):
        self.config = config
        self.encoder = PromptEncoder(
            config.model,
            _dtype(config.encoder.dtype),
            config.encoder.device,
            config.encoder.max_sequence_length,
            EDIT if config.edit is not None else TEXT_TO_IMAGE,
        )
        self.denoiser = DenoiseRunner(config.model, _dtype(config.dit.dtype), config.dit.device)
        self.decoder = VaeRunner(config.model, _dtype(config.vae.dtype), config.vae.device)

    def generate(
        self,
        prompts: list[str],
        *,
        seeds: list[int],
        height: int,
        width: int,
        num_inference_steps: int,
        negative_prompts: list[str] | None = None,
        true_cfg_scale: float = 4.0,
        image: np.ndarray | None = None,
    ) -> np.ndarray:
        """Images for ``prompts`` (one seed each), as uint8 ``[B, H, W, 3]``; an edit preset edits ``image``
        (uint8 ``[H, W, 3]`` at its working size: ``protocol.working_size`` and ``resize_image``)."""
        if len(seeds) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seeds")
        if (image is not None) != (self.config.edit is not None):
            raise ValueError("an edit preset takes an image and a text-to-image preset none")
        prompt_embeds = self.encoder.encode(prompts, image)
        use_cfg = true_cfg_scale > 1 and negative_prompts is not None
        negative_embeds = self.encoder.encode(negative_prompts, image) if use_cfg else [None] * len(prompts)
        image_latents = self.decoder.encode([image])[0] if image is not None else None
        states = [
            self.denoiser.prepare(
                DenoiseParams(height, width, num_inference_steps, seed, true_cfg_scale), prompt, negative, image_latents
            )
            for prompt, negative, seed in zip(prompt_embeds, negative_embeds, seeds)
        ]
        for _ in range(num_inference_steps):
            self.denoiser.step(states, fuse_cfg=False)
        return self.decoder.decode([self.denoiser.finish(state) for state in states])


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def main(argv: list[str] | None = None) -> None:
    from PIL import Image

    parser = argparse.ArgumentParser(prog="python -m omni_ray.pipeline", description=__doc__.split("\n")[0])
    parser.add_argument("prompt")
    parser.add_argument("--negative-prompt", default=None)
    parser.add_argument("--stage-config", default=str(DEFAULT_PRESET), help="preset YAML (default: the tiny one)")
    parser.add_argument("--model", default=None, help="checkpoint directory or hub id overriding the preset's")
    parser.add_argument("--image", default=None, help="the image to edit (an edit preset)")
    parser.add_argument("--size", default=None, help="WxH (default 256x256, or the edit image's working size)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--true-cfg-scale", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="omni-ray.png")
    args = parser.parse_args(argv)
    config = load_config(args.stage_config, model=args.model)
    source = None
    if args.image is not None:
        source = load_input_image(pathlib.Path(args.image).read_bytes(), config)
    default = "x".join(map(str, source.shape[1::-1])) if source is not None else "256x256"
    width, height = (int(side) for side in (args.size or default).lower().split("x"))

    pipeline = LocalPipeline(config)
    image = pipeline.generate(
        [args.prompt],
        seeds=[args.seed],
        height=height,
        width=width,
        num_inference_steps=args.steps,
        negative_prompts=[args.negative_prompt] if args.negative_prompt is not None else None,
        true_cfg_scale=args.true_cfg_scale,
        image=source,
    )[0]
    Image.fromarray(image).save(args.out)
    print(f"wrote {args.out} ({width}x{height}, {args.steps} steps, seed {args.seed})")


if __name__ == "__main__":
    main()
