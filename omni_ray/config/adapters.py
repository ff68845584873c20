"""LoRA adapters (``loras``) and their sampling recipes (``recipe.json`` beside an adapter)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from pydantic import Field, ValidationError, model_validator

from omni_ray.config.base import Frozen, describe

RECIPE_SCHEDULER_KEYS = frozenset({
    "base_image_seq_len", "base_shift", "max_image_seq_len", "max_shift", "shift", "shift_terminal",
    "time_shift_type", "use_dynamic_shifting", "invert_sigmas", "use_karras_sigmas", "use_exponential_sigmas",
    "use_beta_sigmas", "num_train_timesteps",
})  # not stochastic_sampling: its noise would come from the process's RNG, not the request's seed


RECIPE_MAX_BYTES = 64 << 10


RECIPE_FILE = "recipe.json"  # beside an adapter: in its folder, or as <file stem>.recipe.json


class SamplingRecipe(Frozen):
    """How an adapter's authors sample with it (a few-step distillation such as Qwen-Image-Lightning): what a request
    naming the adapter gets for each field it does not set itself."""

    num_inference_steps: int | None = Field(None, ge=1, le=200, description="Denoising steps (Lightning: 4 or 8), "
                                            "within the API's range.")
    true_cfg_scale: float | None = Field(
        None, ge=1, le=20, description="True CFG scale, within the API's range; 1 turns true CFG off (Lightning's), "
        "whatever the negative prompt.",
    )
    scheduler: dict[str, bool | int | float | str | None] = Field(
        default_factory=dict,
        description="FlowMatchEulerDiscreteScheduler settings over the checkpoint's (Lightning: base_shift and "
        "max_shift log(3), max_image_seq_len 8192, shift_terminal null); each request keeps its own sigmas, so "
        "requests of other recipes share its step batches.",
    )

    @model_validator(mode="after")
    def _check_scheduler(self) -> SamplingRecipe:
        unknown = sorted(set(self.scheduler) - RECIPE_SCHEDULER_KEYS)
        if unknown:
            raise ValueError(f"scheduler: {', '.join(unknown)} not among {', '.join(sorted(RECIPE_SCHEDULER_KEYS))}")
        return self


class LoraEntry(Frozen):
    """An adapter the preset knows: its file and, optionally, its sampling recipe."""

    path: str = Field(..., description="diffusers' pytorch_lora_weights.safetensors, or its folder.")
    recipe: SamplingRecipe | None = Field(
        None, description=f"The adapter's sampling recipe; without one here, a {RECIPE_FILE} beside the file (in its "
        "folder, or as <file stem>.recipe.json) when the machine reading the preset has it.",
    )


def lora_entry(value: Any) -> Any:
    return {"path": value} if isinstance(value, str) else value


class LoraSettings(Frozen):
    """Adapters loaded at run time (POST /v1/load_lora_adapter): off unless the operator allows them, and then only
    from files under the given folders; how many one request may stack."""

    allow_runtime_updates: bool = Field(
        False, description="Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter; off, both answer 403.",
    )
    roots: tuple[str, ...] = Field(
        (), description="Folders (on the DiT's nodes) whose files run-time adapters may come from: a `lora_path` "
        "that resolves (symlinks and '..' followed, before anything is read) outside all of them is refused. A "
        "relative `lora_path` is taken under the first.",
    )
    max_per_request: int = Field(
        3, ge=1, le=16, description="Adapters one request may stack (`loras`), each at its own scale; a stack also "
        "needs as many of the DiT's `max_loras` slots.",
    )

    @model_validator(mode="after")
    def _check_roots(self) -> LoraSettings:
        if self.allow_runtime_updates and not self.roots:
            raise ValueError("roots: allow_runtime_updates needs at least one folder adapters may be read from")
        if relative := [root for root in self.roots if not root.startswith(("/", "~"))]:
            raise ValueError(f"roots: {relative[0]!r} is not an absolute path")
        return self


def recipe_file(adapter_path: str) -> pathlib.Path:
    """Where an adapter's sampling recipe lies: ``recipe.json`` in its folder, or ``<file stem>.recipe.json`` beside
    its file (whether or not it is there)."""
    adapter = pathlib.Path(adapter_path).expanduser()
    return adapter / RECIPE_FILE if adapter.is_dir() else adapter.with_name(f"{adapter.stem}.{RECIPE_FILE}")


def read_recipe(path: str | pathlib.Path) -> SamplingRecipe:
    """The sampling recipe in the file at ``path`` (``recipe_file``'s); ValueError, naming neither the file nor its
    folder, for one that cannot be read or is not a valid recipe."""
    try:
        with open(path, "rb") as file:
            data = file.read(RECIPE_MAX_BYTES + 1)
        if len(data) > RECIPE_MAX_BYTES:
            raise ValueError(f"larger than {RECIPE_MAX_BYTES} bytes")
        return SamplingRecipe.model_validate(json.loads(data))
    except ValidationError as err:
        raise ValueError(f"recipe file: {describe(err)}") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"recipe file: {err.strerror if isinstance(err, OSError) else err}") from None
