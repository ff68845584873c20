"""LoRA adapters for the tests and benchmarks, made with peft on a checkpoint's transformer and saved as diffusers
saves them (``QwenImagePipeline.save_lora_weights``, the LoRA config in the file's metadata), or in kohya's spelling.

peft initialises ``lora_B`` to zeros (an adapter that changes nothing); these draw every LoRA weight from a seed.
"""

from __future__ import annotations

import pathlib

import torch

TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
           "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")


def make_adapter(checkpoint: str | pathlib.Path, out: str | pathlib.Path, rank: int, alpha: float | None = None,
                 targets: tuple[str, ...] = TARGETS, seed: int = 0, std: float = 0.1,
                 metadata: bool = True) -> pathlib.Path:
    """Writes ``out/pytorch_lora_weights.safetensors``; without ``metadata`` the file carries no LoRA config (and
    diffusers takes alpha = rank)."""
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
    from peft import LoraConfig, get_peft_model_state_dict

    transformer = QwenImageTransformer2DModel.from_pretrained(checkpoint, subfolder="transformer")
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else rank, target_modules=list(targets))
    transformer.add_adapter(config)
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in transformer.named_parameters():
        if "lora_" in name:
            parameter.data = torch.randn(parameter.shape, generator=generator) * std
    QwenImagePipeline.save_lora_weights(
        out, transformer_lora_layers=get_peft_model_state_dict(transformer),
        transformer_lora_adapter_metadata=config.to_dict() if metadata else None,
    )
    return pathlib.Path(out)


def to_kohya(adapter: str | pathlib.Path, out: str | pathlib.Path, alpha: float) -> pathlib.Path:
    """The same adapter in the spelling ComfyUI and kohya's trainers write (``diffusion_model.<module>.lora_down``,
    ``lora_up`` and an ``alpha`` per module), with ``lora_up`` divided by alpha / rank so that it means the same."""
    from safetensors.torch import load_file, save_file

    state = load_file(pathlib.Path(adapter) / "pytorch_lora_weights.safetensors")
    converted = {}
    for key, tensor in state.items():
        module = key.removeprefix("transformer.").rsplit(".lora_", 1)[0]
        rank = state[f"transformer.{module}.lora_A.weight"].shape[0]
        if ".lora_A." in key:
            converted[f"diffusion_model.{module}.lora_down.weight"] = tensor
            converted[f"diffusion_model.{module}.alpha"] = torch.tensor(float(alpha))
        else:
            converted[f"diffusion_model.{module}.lora_up.weight"] = tensor / (alpha / rank)
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(converted, out / "pytorch_lora_weights.safetensors")
    return out


def two_adapters(checkpoint, root: pathlib.Path) -> dict[str, str]:
    """Two adapters of ``checkpoint``'s transformer under ``root``, by name, of different ranks: A (rank 4, alpha 8)
    and B (rank 8)."""
    return {"A": str(make_adapter(checkpoint, root / "A", rank=4, alpha=8, seed=1)),
            "B": str(make_adapter(checkpoint, root / "B", rank=8, seed=2))}
