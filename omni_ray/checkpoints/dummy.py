"""A full-size Qwen-Image without weights: the shipped configs and a locally built tokenizer, for `weights: dummy`.

    python -m omni_ray.checkpoints.dummy OUT_DIR             # Qwen-Image's real architecture (its family's configs/)
    python -m omni_ray.checkpoints.dummy OUT_DIR --layers 1  # the same widths, 1 transformer block, 1 encoder layer
    python -m omni_ray.checkpoints.dummy OUT_DIR --edit      # Qwen-Image-Edit's layout: the same, plus processor/
    python -m omni_ray.checkpoints.dummy OUT_DIR --edit-plus # Qwen-Image-Edit-2509's: as --edit, Edit-Plus's pipeline
    python -m omni_ray.checkpoints.dummy OUT_DIR --edit-plus --configs qwen-image-edit-2511  # 2511's: zero_cond_t
    python -m omni_ray.checkpoints.dummy OUT_DIR --configs qwen-image-2.1  # Qwen-Image 2.1's (QwenImage21Pipeline)
    python -m omni_ray.checkpoints.dummy OUT_DIR --configs qwen-image-layered  # Qwen-Image-Layered's, with processor/

The directory is in diffusers' layout with every component's config and no weight file; a preset with
``weights: dummy`` builds each stage from it with random weights on its device, in its dtype (the encoder through
vLLM's own dummy load format). Timings do not depend on the weights' values; the images are noise.

The tokenizer is the tiny checkpoint's byte-level BPE (the prompt templates' dropped prefixes keep Qwen's 34 and 64
tokens), its vocabulary padded to Qwen's 151,643 regular tokens so that Qwen's special tokens take Qwen's ids
(``<|endoftext|>`` 151643 ... ``<|image_pad|>`` 151655). Prompts tokenise to more tokens than with Qwen's vocabulary
(about one per 1.5 characters of ordinary text, against one per 4), which lengthens the text part of a DiT step a
little.

A Qwen-Image 2.1 checkpoint (``--configs qwen-image-2.1``) has one layout for generations and edits, its own:
``processor/`` holds the same tokenizer (``model_max_length`` as published), Qwen3-VL's image processor with the
published settings (``processor/preprocessor_config.json`` of the configs) and a chat template reduced to what the
pipeline renders (its system turn as Qwen's); there is no ``tokenizer/`` folder.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil

from omni_ray.checkpoints.full_size import BASE_CONFIGS, configs_dir, pipeline_class, published_configs, write_configs

QWEN_REGULAR_TOKENS = 151_643  # Qwen2's vocabulary before its special tokens


def qwen_sized_tokenizer(model_max_length: int = 131072):
    """The tiny tokenizer with its vocabulary padded so that the special tokens take Qwen's ids."""
    from transformers import Qwen2Tokenizer

    from omni_ray.checkpoints.parts import SPECIAL_TOKENS
    from omni_ray.checkpoints.tiny import build_tokenizer

    tiny = build_tokenizer()
    vocab = {token: index for token, index in tiny.get_vocab().items() if token not in SPECIAL_TOKENS}
    # Fillers no merge produces: they only move the special tokens to Qwen's ids.
    vocab.update({f"<|unused_{index}|>": index for index in range(len(vocab), QWEN_REGULAR_TOKENS)})
    merges = json.loads(tiny.backend_tokenizer.to_str())["model"]["merges"]
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges],
        unk_token=None,
        eos_token=None,
        pad_token=None,
        model_max_length=model_max_length,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})  # in Qwen's order
    tokenizer.add_special_tokens({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    return tokenizer


def write_dummy_checkpoint(out_dir: str | pathlib.Path, layers: int | None = None, edit: bool = False,
                           plus: bool = False, configs: str = BASE_CONFIGS) -> pathlib.Path:
    """Writes the published configs ``configs`` names (in their family's ``configs/``; with ``layers`` transformer
    blocks, language-model layers and vision blocks, if given) and the tokenizer to ``out_dir``; no weights. ``edit``
    writes Qwen-Image-Edit's layout: its pipeline class and Qwen2.5-VL's processor (``processor/``) for the vision path;
    ``plus`` (with ``edit``) names Qwen-Image-Edit-2509's and 2511's pipeline class, ``QwenImageEditPlusPipeline``,
    instead. The edit checkpoints' transformer, VAE and text encoder have Qwen-Image's architecture (2511's transformer
    sets ``zero_cond_t``: ``configs="qwen-image-edit-2511"``). ``configs="qwen-image-2.1"`` writes Qwen-Image 2.1's
    layout, which serves edits as it is (neither ``edit`` nor ``plus``)."""
    if plus and not edit:
        raise ValueError("plus: an Edit-Plus checkpoint is an edit one; set edit as well")
    out = pathlib.Path(out_dir).expanduser()
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    if pipeline_class(configs) == "QwenImage21Pipeline":
        if edit:
            raise ValueError("edit: a Qwen-Image 2.1 checkpoint has one layout, which serves edits as it is")
        _write_21(partial, configs, layers)
        return _publish(partial, out)
    write_configs(configs, partial, ignore=shutil.ignore_patterns("tokenizer"))
    if layers is not None:
        _edit(partial / "transformer" / "config.json", lambda c: c.update(num_layers=layers))
        _edit(partial / "text_encoder" / "config.json", lambda c: (c["text_config"].update(
            num_hidden_layers=layers, max_window_layers=layers, layer_types=["full_attention"] * layers),
            c["vision_config"].update(depth=layers, fullatt_block_indexes=[layers - 1])))
    tokenizer = qwen_sized_tokenizer()
    tokenizer.save_pretrained(partial / "tokenizer")
    layered = pipeline_class(configs) == "QwenImageLayeredPipeline"  # its own index names its processor
    if edit or layered:
        from omni_ray.checkpoints.tiny import build_processor

        build_processor(tokenizer).save_pretrained(partial / "processor")
    if edit and not layered:
        pipeline = "QwenImageEditPlusPipeline" if plus else "QwenImageEditPipeline"
        _edit(partial / "model_index.json", lambda c: c.update(
            _class_name=pipeline, processor=["transformers", "Qwen2VLProcessor"]))
    return _publish(partial, out)


def _write_21(partial: pathlib.Path, configs: str, layers: int | None) -> None:
    """Qwen-Image 2.1's configs and ``processor/`` (the Qwen-sized tokenizer, the published image processor
    settings, the chat template) to ``partial``."""
    from omni_ray.families.qwen_image_2_1.tiny import build_processor

    write_configs(configs, partial, ignore=shutil.ignore_patterns("processor"))
    if layers is not None:
        _edit(partial / "transformer" / "config.json", lambda c: c.update(num_layers=layers))
        _edit(partial / "text_encoder" / "config.json", lambda c: (
            c["text_config"].update(num_hidden_layers=layers),
            c["vision_config"].update(depth=layers, deepstack_visual_indexes=[layers - 1])))
    settings = configs_dir(configs) / "processor"
    tokenizer_config = json.loads((settings / "tokenizer_config.json").read_text())
    tokenizer = qwen_sized_tokenizer(model_max_length=tokenizer_config["model_max_length"])
    image_processor_config = json.loads((settings / "preprocessor_config.json").read_text())
    build_processor(tokenizer, image_processor_config).save_pretrained(partial / "processor")


def _publish(partial: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    try:
        partial.rename(out)  # whole or not at all: replicas starting together see a complete directory
    except OSError:  # another process wrote it first
        shutil.rmtree(partial, ignore_errors=True)
    return out


def _edit(path: pathlib.Path, change) -> None:
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m omni_ray.checkpoints.dummy", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", help="directory to write to")
    parser.add_argument("--layers", type=int, default=None,
                        help="transformer blocks, language-model layers and vision blocks (default: the "
                        "published ones: Qwen-Image's 60, 28 and 32; Qwen-Image 2.1's 32, 36 and 27)")
    layout = parser.add_mutually_exclusive_group()
    layout.add_argument("--edit", action="store_true", help="Qwen-Image-Edit's layout (with processor/)")
    layout.add_argument("--edit-plus", action="store_true",
                        help="Qwen-Image-Edit-2509's and 2511's layout (QwenImageEditPlusPipeline, with processor/)")
    parser.add_argument("--configs", choices=published_configs(), default=BASE_CONFIGS,
                        help="the published configs to write (omni_ray/families/*/configs/<configs>/, over "
                        "qwen-image/'s)")
    args = parser.parse_args(argv)
    edit = args.edit or args.edit_plus
    out = write_dummy_checkpoint(args.out_dir, args.layers, edit=edit, plus=args.edit_plus, configs=args.configs)
    kind = "Qwen-Image-Edit-2509/2511" if args.edit_plus else "Qwen-Image-Edit" if args.edit else "Qwen-Image"
    if pipeline_class(args.configs) == "QwenImage21Pipeline":
        kind = "Qwen-Image 2.1"
    elif pipeline_class(args.configs) == "QwenImageLayeredPipeline":
        kind = "Qwen-Image-Layered"
    print(f"wrote a weightless {kind} ({args.configs} configs) to {out}")


if __name__ == "__main__":
    main()
