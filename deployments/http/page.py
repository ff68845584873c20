"""The try-it page at ``/``: a form over the images API with live previews (``web/``), told the preset's settings."""

from __future__ import annotations

import json
import pathlib

from omni_ray.config import PipelineConfig
from omni_ray.families import family_of

WEB = pathlib.Path(__file__).resolve().parent / "web"
WEB_FILES = {name: (kind, (WEB / name).read_bytes())
             for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css"))}


def page_html(config: PipelineConfig, api_key: bool = False) -> str:
    """index.html with what the page needs of the preset: its name, family and mode, input images an edit takes,
    ControlNets and how many a request may apply, how many LoRA adapters a request may stack, a Layered preset's
    resolution buckets and layer bounds, default size and steps, sizes to offer, and whether the server takes an API
    key (the page then asks for it)."""
    limits = config.requests
    default = f"{limits.default_width}x{limits.default_height}"
    squares = [f"{side}x{side}" for side in (64, 128, 256, 512, 1024, 1328)
               if limits.min_side <= side <= limits.max_side]
    # ControlNets run on a Qwen-Image text-to-image preset's generations only (an edit preset's are refused); the page
    # has no mask field, so it offers no inpainting ControlNet (the API takes those).
    controlnets = [name for name in config.controlnets if name not in config.inpaint_controlnets] \
        if config.edit is None and family_of(config).controlnets else []
    settings = {"model": config.name, "edit": config.edit is not None, "default_size": default,
                "max_images": config.edit.max_images if config.edit is not None else 0,
                "controlnets": controlnets, "max_controls": limits.max_controls if controlnets else 0,
                "default_steps": limits.default_steps, "sizes": list(dict.fromkeys([default, *squares])),
                "api_key": api_key, "family": config.family, **family_of(config).page_settings(config),
                # adapters a request may stack: none when the preset has none and takes none at run time
                "max_loras": min(config.lora.max_per_request, config.dit.max_loras)
                if config.loras or config.lora.allow_runtime_updates else 0}
    # "</" cannot end the script element early: JSON allows "<\/" for "</".
    return (WEB / "index.html").read_text().replace("__SETTINGS__", json.dumps(settings).replace("</", "<\\/"))
