"""The bytes of a Qwen-Image 2.1 request's condition cache: what the DiT scheduler counts against
``dit.cache_memory_bytes`` (omni_ray/engine/dit_scheduler.py). They follow from the checkpoint's transformer config
(``transformer/config.json``: its blocks and their width), read as JSON: no model code is imported.

Each CFG branch that runs (the prompt's, and the negative's with true CFG) caches the keys and values of its
condition tokens in every block: the encoder's tokens, each condition-image slot widened to the 2x2 latent tokens of
its tile (``qwen_image21.condition_tokens``, ``qwen_image21.cache_bytes``).
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

from omni_ray.families.qwen_image_2_1 import facts as qwen_image21
from omni_ray.records import DenoiseRequest, PromptEmbeds

CONFIG_FILE = "transformer/config.json"


def condition_tokens(prompt: PromptEmbeds) -> int:
    """The condition tokens one branch caches: its encoder tokens, each image slot widened to
    ``qwen_image21.TOKENS_PER_SLOT`` tokens."""
    slots = int(prompt.image_slots.sum()) if prompt.image_slots is not None else 0
    return prompt.num_tokens + (qwen_image21.TOKENS_PER_SLOT - 1) * slots


@dataclass(frozen=True)
class ConditionCacheSize:
    """A request -> its condition cache's bytes, for one transformer in one dtype (picklable)."""

    num_layers: int
    inner_dim: int  # num_attention_heads * attention_head_dim: the width of a block's keys and values
    dtype_bytes: int

    @classmethod
    def from_config(cls, config: dict, dtype_bytes: int) -> ConditionCacheSize:
        """From the transformer's config (``transformer/config.json``'s fields)."""
        return cls(config["num_layers"], config["num_attention_heads"] * config["attention_head_dim"], dtype_bytes)

    @classmethod
    def from_checkpoint(cls, model: str, dtype_bytes: int, local: bool = True) -> ConditionCacheSize | None:
        """From ``model``'s ``transformer/config.json`` (``config_file``); None when it cannot be had."""
        path = config_file(model, local)
        return cls.from_config(json.loads(path.read_text()), dtype_bytes) if path is not None else None

    def __call__(self, request: DenoiseRequest) -> int:
        branches = [request.prompt] + ([request.negative] if request.params.true_cfg else [])
        return sum(qwen_image21.cache_bytes(condition_tokens(branch), self.num_layers, self.inner_dim,
                                            self.dtype_bytes) for branch in branches if branch is not None)


def config_file(model: str, local: bool = True) -> pathlib.Path | None:
    """``model``'s transformer config: in its directory (``local``), or for a hub id the file alone, from the Hugging
    Face cache or downloaded as the runner would download the checkpoint (with ``HF_HUB_OFFLINE``, from the cache
    only); None when neither has it (a directory without it, a hub id neither cached nor reachable)."""
    if local:
        path = pathlib.Path(model).expanduser() / CONFIG_FILE
        return path if path.is_file() else None
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError
    except ImportError:
        return None
    try:
        return pathlib.Path(hf_hub_download(model, CONFIG_FILE))
    except (OSError, ValueError, EntryNotFoundError):  # offline and not cached, unreachable, no such repo or file
        return None
