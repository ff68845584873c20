"""The model families omni-ray serves, each one package under here, behind one interface.

A family is what the preset's ``family`` names: its facts (``facts.py``), its request rules and refusals, its
preset's checks, its runners and its checkpoint writers. Everything outside this package asks the family object
(``family_of``) what it supports and how to do its part; nothing branches on which family a preset names. What the
families share (the step loop, batching, caches, adapters, gangs, streaming, the Qwen-Image architecture's runners
that Qwen-Image and Qwen-Image-Layered both build) stays in ``engine/`` and ``runners/``.

``FAMILIES`` is the registry, after vLLM's model registry: a name to the family class's module and name, imported
when first asked for: the request path loads no family's runner code, and this module imports nothing of omni-ray's,
so that any layer may ask it (a family's code imports the shared layers, never the other way). The interface is
``omni_ray.families.base.Family``; docs/adding-a-family.md says what a new family adds.
"""

from __future__ import annotations

import functools
import importlib

__all__ = ["FAMILIES", "family_of", "register", "unregister"]

# The preset's ``family`` -> "module:class" of its Family.
FAMILIES: dict[str, str] = {
    "qwen-image": "omni_ray.families.qwen_image:QwenImage",
    "qwen-image-2.1": "omni_ray.families.qwen_image_2_1:QwenImage21",
    "qwen-image-layered": "omni_ray.families.qwen_image_layered:QwenImageLayered",
}


def register(name: str, target: str | type) -> None:
    """Adds a family under ``name`` ("module:class", or the class itself): a preset may then name it."""
    FAMILIES[name] = target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"
    _load.cache_clear()


def unregister(name: str) -> None:
    """Removes the family ``name`` (a test's, say)."""
    del FAMILIES[name]
    _load.cache_clear()


@functools.cache
def _load(name: str):
    module, _, cls = FAMILIES[name].partition(":")
    family = getattr(importlib.import_module(module), cls)()
    if family.name != name:
        raise ValueError(f"family {name!r} is registered to {FAMILIES[name]}, whose name is {family.name!r}")
    return family


def family_of(config_or_name):
    """The ``Family`` of a preset (anything with a ``family``) or of a family's name; KeyError naming the known ones."""
    name = config_or_name if isinstance(config_or_name, str) else config_or_name.family
    if name not in FAMILIES:
        raise KeyError(f"family {name!r} is not one of {', '.join(sorted(FAMILIES))}")
    return _load(name)
