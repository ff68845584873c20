"""Write a randomly initialised Qwen-Image (or Qwen-Image-Edit) checkpoint offline, in diffusers' on-disk layout.

    python -m omni_ray.checkpoints.tiny OUT_DIR [--seed N] [--size tiny|small] [--edit | --edit-plus | --layered |
                                                                        --qwen-image-2-1]
    python -m omni_ray.checkpoints.tiny OUT_DIR --controlnet --from CHECKPOINT [--seed N] [--layers N]

The folders are the ones ``Qwen/Qwen-Image`` ships (``model_index.json``, ``scheduler/``, ``text_encoder/``,
``tokenizer/``, ``transformer/``, ``vae/``), so ``QwenImagePipeline.from_pretrained(OUT_DIR)`` loads it and vLLM
loads ``text_encoder/`` as a Qwen2.5-VL model. ``--edit`` writes ``Qwen/Qwen-Image-Edit``'s layout instead: the same
folders plus ``processor/`` (Qwen2.5-VL's processor, for the vision path), loaded by ``QwenImageEditPipeline``;
``--edit-plus`` writes the same files under the pipeline class of ``Qwen/Qwen-Image-Edit-2509`` and 2511,
``QwenImageEditPlusPipeline``, which takes the same components. ``--layered`` writes ``Qwen/Qwen-Image-Layered``'s
layout (``QwenImageLayeredPipeline``): the edit layout's folders, a transformer with the layer axis in its rotary
embedding and the "RGB or RGBA" timestep term (``use_layer3d_rope``, ``use_additional_t_cond``), and an RGBA VAE
(``input_channels`` 4); its text encoder keeps its vision tower, which writes the caption of an image without a
prompt. Only the sizes are small:

- the tokenizer is a byte-level BPE trained here on a small corpus, so that the dropped prefixes of diffusers'
  prompt templates tokenise to 34 (text to image) and 64 (edit) tokens, as they do with Qwen's own vocabulary;
- the text encoder's and the vision tower's attention heads are 32 wide (vLLM's CPU attention needs at least 32);
- the image processor is Qwen2.5-VL's, with Qwen-Image-Edit's pixel bounds;
- the VAE keeps Qwen-Image's 8x spatial compression and 16 latent channels, with non-trivial latent statistics;
- the scheduler config is Qwen-Image's own.

``--qwen-image-2-1`` writes a Qwen-Image 2.1 checkpoint instead (``omni_ray.families.qwen_image_2_1.tiny``).

``--controlnet --from CHECKPOINT`` writes a ``QwenImageControlNetModel`` for that checkpoint's transformer instead
(``write_controlnet``): the folder a preset's ``controlnets`` names.

``--size small`` widens and deepens the transformer (4 layers, 128 wide) so that compute, not per-call overhead,
dominates a request on a CPU; it is the benchmark checkpoint. The same seed writes the same bytes.
"""

from __future__ import annotations

import argparse
import pathlib

import torch

from omni_ray.checkpoints.parts import (
    CORPUS,
    SCHEDULER_CONFIG,
    TRANSFORMER_SIZES,
    randomised,
    trained_tokenizer,
)
from omni_ray.families.qwen_image.facts import TEMPLATES
from omni_ray.families.qwen_image_layered.facts import IMAGE_CHANNELS

TEXT_HIDDEN_SIZE = 64  # two heads of 32


def build_tokenizer():
    """A byte-level BPE in Qwen2's format, trained on the prompt template and a few captions."""
    # The templates' text is repeated so that each of its words becomes one token, as in Qwen's vocabulary.
    template_texts = list(dict.fromkeys(  # Edit-Plus drops Edit's system turn
        template.dropped_text.replace("<|im_start|>", "").replace("<|im_end|>", "") for template in TEMPLATES
    ))
    tokenizer = trained_tokenizer(template_texts * 64 + list(CORPUS) * 8 + ["assistant\n"] * 64)
    for template in TEMPLATES:
        num_dropped = len(tokenizer(template.dropped_text).input_ids)
        if num_dropped != template.drop:
            raise RuntimeError(f"template prefix is {num_dropped} tokens, expected {template.drop}")
    return tokenizer


# Qwen/Qwen-Image-Edit's processor/preprocessor_config.json, in transformers' current names.
IMAGE_PROCESSOR_CONFIG = {
    "size": {"shortest_edge": 3136, "longest_edge": 12845056},
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def build_processor(tokenizer):
    """Qwen2.5-VL's processor over the tiny tokenizer: what the edit pipeline's vision path runs."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**IMAGE_PROCESSOR_CONFIG),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
    )


def build_text_encoder(tokenizer, seed: int):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    head_dim = 32
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": TEXT_HIDDEN_SIZE,
            "intermediate_size": 2 * TEXT_HIDDEN_SIZE,
            "num_hidden_layers": 2,
            "num_attention_heads": TEXT_HIDDEN_SIZE // head_dim,
            "num_key_value_heads": TEXT_HIDDEN_SIZE // head_dim,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]},
            "bos_token_id": ids("<|endoftext|>"),
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids("<|endoftext|>"),
            "torch_dtype": "float32",
        },
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "out_hidden_size": TEXT_HIDDEN_SIZE,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return randomised(Qwen2_5_VLForConditionalGeneration(config), seed)


def build_transformer(size: str, seed: int, layered: bool = False):
    from diffusers import QwenImageTransformer2DModel

    num_layers, num_heads = TRANSFORMER_SIZES[size]
    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=num_layers,
        attention_head_dim=32,
        num_attention_heads=num_heads,
        joint_attention_dim=TEXT_HIDDEN_SIZE,
        axes_dims_rope=(8, 12, 12),
        use_additional_t_cond=layered,
        use_layer3d_rope=layered,
    )
    return randomised(model, seed + 1)


def build_vae(seed: int, input_channels: int = 3):
    from diffusers import AutoencoderKLQwenImage

    stats = torch.Generator().manual_seed(seed + 2)
    latents_mean = (torch.randn(16, generator=stats) * 0.5).tolist()
    latents_std = (torch.rand(16, generator=stats) * 1.5 + 0.75).tolist()
    torch.manual_seed(seed)
    model = AutoencoderKLQwenImage(
        base_dim=16,
        z_dim=16,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[round(x, 4) for x in latents_mean],
        latents_std=[round(x, 4) for x in latents_std],
        input_channels=input_channels,
    )
    return randomised(model, seed + 3)


def write_checkpoint(
    out_dir: str | pathlib.Path, seed: int = 0, size: str = "tiny", edit: bool = False, plus: bool = False,
    layered: bool = False,
) -> pathlib.Path:
    """Writes the checkpoint (an edit one with ``edit``, an Edit-Plus one with ``plus`` as well, a Qwen-Image-Layered
    one with ``layered``) to ``out_dir`` and returns its path."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImageEditPlusPipeline,
        QwenImageLayeredPipeline,
        QwenImagePipeline,
    )

    if size not in TRANSFORMER_SIZES:
        raise ValueError(f"size must be one of {sorted(TRANSFORMER_SIZES)}, got {size!r}")
    if plus and not edit:
        raise ValueError("plus: an Edit-Plus checkpoint is an edit one; set edit as well")
    if layered and edit:
        raise ValueError("layered: a Qwen-Image-Layered checkpoint has its own layout; leave edit unset")
    out = pathlib.Path(out_dir)
    tokenizer = build_tokenizer()
    components = dict(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=build_vae(seed, input_channels=IMAGE_CHANNELS if layered else 3),
        text_encoder=build_text_encoder(tokenizer, seed),
        tokenizer=tokenizer,
        transformer=build_transformer(size, seed, layered=layered),
    )
    if layered:
        pipe = QwenImageLayeredPipeline(processor=build_processor(tokenizer), **components)
    elif edit:
        pipeline = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
        pipe = pipeline(processor=build_processor(tokenizer), **components)
    else:
        pipe = QwenImagePipeline(**components)
    pipe.save_pretrained(out, safe_serialization=True)
    return out


CONTROLNET_OUTPUT_SCALE = 0.25  # the residual projections' weights, over ``randomised``'s fan-in scale


def write_controlnet(
    out_dir: str | pathlib.Path, transformer: str | pathlib.Path, seed: int = 0, num_layers: int = 2,
    inpaint: bool = False,
) -> pathlib.Path:
    """Writes a ``QwenImageControlNetModel`` (InstantX's Qwen-Image ControlNet Union's class) of ``num_layers``
    blocks matching the transformer of ``transformer`` (a checkpoint folder with ``transformer/``, or the
    transformer's own folder) to ``out_dir``, loadable with ``QwenImageControlNetModel.from_pretrained(out_dir)``;
    returns its path.

    Every weight is drawn (``parts.randomised``): the real initialisation zeroes the residual projections
    (``controlnet_blocks``) and the control image's embedder, so a fresh controlnet would add nothing and a test
    of it would prove nothing. The residual projections are scaled by ``CONTROLNET_OUTPUT_SCALE`` so that the
    residuals move the image clearly without swamping the transformer's own activations. The same seed writes the
    same bytes. With ``inpaint``, an inpainting ControlNet (InstantX's Qwen-Image-ControlNet-Inpainting's layout,
    ``QwenImageControlNetInpaintPipeline``'s): ``extra_condition_channels`` is the packed mask channel's
    ``patch_size ** 2`` (4), its control embedder taking the 68 channels of 17 packed ones."""
    from diffusers import QwenImageControlNetModel, QwenImageTransformer2DModel

    folder = pathlib.Path(transformer)
    if (folder / "transformer" / "config.json").exists():
        folder = folder / "transformer"
    config = QwenImageTransformer2DModel.load_config(folder)
    torch.manual_seed(seed)
    model = QwenImageControlNetModel(
        patch_size=config["patch_size"],
        in_channels=config["in_channels"],
        out_channels=config["out_channels"],
        num_layers=num_layers,
        attention_head_dim=config["attention_head_dim"],
        num_attention_heads=config["num_attention_heads"],
        joint_attention_dim=config["joint_attention_dim"],
        axes_dims_rope=tuple(config["axes_dims_rope"]),
        extra_condition_channels=config["patch_size"] ** 2 if inpaint else 0,
    )
    model = randomised(model, seed + 5)
    with torch.no_grad():
        for block in model.controlnet_blocks:
            block.weight.mul_(CONTROLNET_OUTPUT_SCALE)
    out = pathlib.Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m omni_ray.checkpoints.tiny", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", help="directory to write the checkpoint to")
    parser.add_argument("--seed", type=int, default=0, help="seed for every weight (default 0)")
    parser.add_argument("--size", choices=sorted(TRANSFORMER_SIZES), default="tiny", help="transformer size")
    layout = parser.add_mutually_exclusive_group()
    layout.add_argument("--edit", action="store_true", help="write a Qwen-Image-Edit checkpoint (with processor/)")
    layout.add_argument("--edit-plus", action="store_true",
                        help="write a Qwen-Image-Edit-2509/2511 checkpoint (QwenImageEditPlusPipeline, with "
                        "processor/)")
    layout.add_argument("--layered", action="store_true",
                        help="write a Qwen-Image-Layered checkpoint (QwenImageLayeredPipeline: layered RoPE, the "
                        "RGBA VAE, with processor/)")
    layout.add_argument("--qwen-image-2-1", action="store_true",
                        help="write a Qwen-Image 2.1 checkpoint (QwenImage21Pipeline: Qwen3-VL, the block-causal "
                        "transformer, the 16x RGBA VAE)")
    layout.add_argument("--controlnet", action="store_true",
                        help="write a QwenImageControlNetModel for the checkpoint --from names (random weights)")
    parser.add_argument("--from", dest="source", metavar="CHECKPOINT",
                        help="--controlnet: the checkpoint (or its transformer/ folder) whose widths it takes")
    parser.add_argument("--layers", type=int, default=2, help="--controlnet: its number of blocks (default 2)")
    parser.add_argument("--inpaint", action="store_true",
                        help="--controlnet: an inpainting ControlNet (a control mask beside the control image)")
    args = parser.parse_args(argv)
    if args.controlnet:
        if args.source is None:
            parser.error("--controlnet needs --from CHECKPOINT")
        out = write_controlnet(args.out_dir, args.source, seed=args.seed, num_layers=args.layers,
                               inpaint=args.inpaint)
        kind = "inpainting ControlNet" if args.inpaint else "ControlNet"
        print(f"wrote a {args.layers}-layer {kind} for {args.source} (seed {args.seed}) to {out}")
        return
    if args.qwen_image_2_1:
        from omni_ray.families.qwen_image_2_1 import tiny as tiny21

        out = tiny21.write_checkpoint(args.out_dir, seed=args.seed, size=args.size)
        print(f"wrote a {args.size} Qwen-Image 2.1 checkpoint (seed {args.seed}) to {out}")
        return
    edit = args.edit or args.edit_plus
    out = write_checkpoint(args.out_dir, seed=args.seed, size=args.size, edit=edit, plus=args.edit_plus,
                           layered=args.layered)
    kind = "Qwen-Image-Edit-2509/2511" if args.edit_plus else "Qwen-Image-Edit" if args.edit else "Qwen-Image"
    kind = "Qwen-Image-Layered" if args.layered else kind
    print(f"wrote a {args.size} {kind} checkpoint (seed {args.seed}) to {out}")


if __name__ == "__main__":
    main()
