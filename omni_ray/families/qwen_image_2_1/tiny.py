"""A randomly initialised Qwen-Image 2.1 checkpoint, offline, in diffusers' layout (``QwenImage21Pipeline``):
``model_index.json`` (with the pipeline's ``sample_sigmas``), ``scheduler/``, ``text_encoder/`` (Qwen3-VL),
``processor/`` (Qwen3-VL's processor: tokenizer, image processor, chat template), ``transformer/`` and ``vae/``.

    python -m omni_ray.checkpoints.tiny OUT_DIR --qwen-image-2-1 [--seed N] [--size tiny|small]

Only the sizes are small:

- the tokenizer is a byte-level BPE trained here (Qwen's special tokens, the template's words as single tokens);
- the text encoder's and the vision tower's attention heads are 32 wide (vLLM's CPU attention needs at least 32);
- the image processor is Qwen3-VL's (16-pixel patches merged 2x2, so one vision token per 32x32 tile) with a pixel
  floor low enough that small condition images keep their size;
- the VAE keeps 2.1's 16x compression, 64 latent channels, RGBA and non-trivial latent statistics;
- the transformer keeps 64 latent channels, patch 1 and ``causal_condition``;
- ``sample_sigmas`` are four steps, so that a request left at the checkpoint's defaults runs four.
"""

from __future__ import annotations

import pathlib

import torch

from omni_ray.checkpoints.parts import CORPUS, SCHEDULER_CONFIG, TRANSFORMER_SIZES, randomised, trained_tokenizer
from omni_ray.families.qwen_image_2_1.facts import SYSTEM_PROMPT, SYSTEM_TURN, template

TEXT_HIDDEN_SIZE = 64  # two heads of 32
SAMPLE_SIGMAS = (1.0, 0.75, 0.5, 0.25)

# Qwen's chat template, reduced to what the pipeline asks of it: turns of text (and image) items.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}<|im_start|>{{ message.role + '\\n' }}"
    "{%- if message.content is string -%}{{ message.content }}{%- else -%}{%- for item in message.content -%}"
    "{%- if item.type == 'text' -%}{{ item.text }}{%- else -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- endif -%}{%- endfor -%}{%- endif -%}{{ '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# Qwen3-VL's preprocessor_config.json, with a pixel floor of 32x32 (Qwen's is 256x256).
IMAGE_PROCESSOR_CONFIG = {
    "size": {"shortest_edge": 32 * 32, "longest_edge": 16777216},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def build_tokenizer():
    """A byte-level BPE in Qwen2's format (Qwen3's tokenizer class), trained on 2.1's templates and a few captions."""
    words = [SYSTEM_PROMPT, "system\n", "user\n", "assistant\n"] + [f"<image{i}>" for i in (1, 2, 3)]
    return trained_tokenizer(words * 64 + list(CORPUS) * 8)


def build_processor(tokenizer, image_processor_config: dict = IMAGE_PROCESSOR_CONFIG):
    """Qwen3-VL's processor over ``tokenizer`` (the tiny one, or the dummy checkpoint's Qwen-sized one), its image
    processor with ``image_processor_config``'s settings (a ``preprocessor_config.json``'s), and the chat template
    the pipeline counts its system turn by."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    settings = {key: value for key, value in image_processor_config.items() if key in IMAGE_PROCESSOR_CONFIG}
    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**settings), tokenizer=tokenizer,
                                 video_processor=Qwen3VLVideoProcessor(), chat_template=CHAT_TEMPLATE)
    dropped = processor.apply_chat_template(
        [{"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]}], tokenize=True, return_dict=False)
    if len(dropped[0]) != len(tokenizer(SYSTEM_TURN).input_ids):
        raise RuntimeError("the chat template's system turn is not 2.1's")
    return processor


def build_text_encoder(tokenizer, seed: int):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    head_dim = 32
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": TEXT_HIDDEN_SIZE,
            "intermediate_size": 2 * TEXT_HIDDEN_SIZE,
            "num_hidden_layers": 2,
            "num_attention_heads": TEXT_HIDDEN_SIZE // head_dim,
            "num_key_value_heads": TEXT_HIDDEN_SIZE // head_dim,
            "head_dim": head_dim,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [4, 6, 6],
                                "mrope_interleaved": True},
            "bos_token_id": ids("<|endoftext|>"),
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids("<|endoftext|>"),
            "dtype": "float32",
        },
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "out_hidden_size": TEXT_HIDDEN_SIZE,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        dtype="float32",
    )
    torch.manual_seed(seed)
    return randomised(Qwen3VLForConditionalGeneration(config), seed)


def build_transformer(size: str, seed: int):
    from diffusers import QwenImage21Transformer2DModel

    num_layers, num_heads = TRANSFORMER_SIZES[size]
    torch.manual_seed(seed)
    model = QwenImage21Transformer2DModel(
        patch_size=1, in_channels=64, out_channels=64, num_layers=num_layers, attention_head_dim=32,
        num_attention_heads=num_heads, context_in_dim=TEXT_HIDDEN_SIZE, mlp_ratio=3, axes_dims_rope=(8, 12, 12),
        causal_condition=True,
    )
    return randomised(model, seed + 1)


def build_vae(seed: int):
    from diffusers import AutoencoderKLQwenImage21

    stats = torch.Generator().manual_seed(seed + 2)
    latents_mean = (torch.randn(64, generator=stats) * 0.5).tolist()
    latents_std = (torch.rand(64, generator=stats) * 1.5 + 0.75).tolist()
    torch.manual_seed(seed)
    model = AutoencoderKLQwenImage21(
        base_dim=8, decoder_base_dim=8, z_dim=64, dim_mult=[1, 2, 2, 2, 2], num_res_blocks=1,
        temperal_downsample=[False, True, True, True],
        latents_mean=[round(x, 4) for x in latents_mean], latents_std=[round(x, 4) for x in latents_std],
    )
    return randomised(model, seed + 3)


def write_checkpoint(out_dir: str | pathlib.Path, seed: int = 0, size: str = "tiny") -> pathlib.Path:
    """Writes the checkpoint to ``out_dir`` and returns its path; the same seed writes the same weights."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline

    if size not in TRANSFORMER_SIZES:
        raise ValueError(f"size must be one of {sorted(TRANSFORMER_SIZES)}, got {size!r}")
    out = pathlib.Path(out_dir)
    tokenizer = build_tokenizer()
    for num_images in (0, 1, 3):  # every template the tokenizer must read
        tokenizer(template(num_images))
    pipe = QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=build_vae(seed),
        text_encoder=build_text_encoder(tokenizer, seed),
        processor=build_processor(tokenizer),
        transformer=build_transformer(size, seed),
        sample_sigmas=list(SAMPLE_SIGMAS),
    )
    pipe.save_pretrained(out, safe_serialization=True)
    return out
