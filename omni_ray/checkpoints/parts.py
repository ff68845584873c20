"""What the offline checkpoints share (``tiny`` for Qwen-Image, ``tiny21`` for Qwen-Image 2.1): Qwen's special
tokens, a caption corpus for their tokenizers, Qwen-Image's scheduler config, the transformer sizes, and how weights
are drawn."""

from __future__ import annotations

import json

import torch

# Qwen2.5-VL's special tokens, in Qwen's order, so that the vision path (image editing) finds them too.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen/Qwen-Image's scheduler/scheduler_config.json.
SCHEDULER_CONFIG = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}

TRANSFORMER_SIZES = {
    # name: (num_layers, num_attention_heads); heads are 32 wide
    "tiny": (2, 2),
    "small": (4, 4),
}

CORPUS = (
    "A photo of a red cat sitting on a wooden table next to a blue cup of coffee.",
    "An oil painting of a lighthouse at sunset, with waves crashing against the rocks.",
    "A watercolor of mountains and a lake in the morning mist, soft green and grey tones.",
    "A neon sign that reads open in a rainy city street at night, reflections on the road.",
    "Close-up of a yellow flower with water drops, a bee flying in the background.",
    "A small robot reading a book in a quiet library, warm light from the window.",
    "Two children flying a kite on a beach under a bright summer sky.",
    "A bowl of fruit: apples, oranges, bananas and grapes on a white plate.",
)


def randomised(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Redraws every parameter from one seeded generator.

    Default initialisers zero some output projections (so a random model would predict nothing) and draw from the
    global generator; here every weight is drawn, scaled by its fan-in so activations stay of order one.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1 and ("norm" in name or name.endswith("gamma")):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif param.ndim == 1:
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))
            else:
                fan_in = param[0].numel()
                param.copy_(torch.randn(param.shape, generator=generator) / fan_in**0.5)
    return model.eval()


def trained_tokenizer(texts: list[str]):
    """A byte-level BPE in Qwen2's format (Qwen3 uses the same class) trained on ``texts`` (repeat a text to make
    each of its words one token, as in Qwen's vocabulary), with Qwen's special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(texts, trainer=trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=merges, unk_token=None, eos_token="<|im_end|>",
                               pad_token="<|endoftext|>", model_max_length=131072)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    tokenizer.add_special_tokens({"pad_token": SPECIAL_TOKENS[0]})
    return tokenizer
