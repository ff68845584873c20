"""Checks a Serve config before it is deployed: ``python -m deployments.check CONFIG`` (a Serve config, or a KubeRay
RayService whose ``serveConfigV2`` holds one).

For each application of omni-ray's (``deployments.app:build_app``) it loads the preset that the ``args`` name, with
their ``overrides``, as ``build_app`` will (writing nothing), and reads each ``deployments`` entry's ``user_config``
as that deployment's live settings (``omni_ray.live_settings``). A running replica cannot refuse a ``user_config``
by failing (Serve would stop it: ``deployments.live``), so this is where a key that cannot change live is caught:
run it before ``serve deploy``, or in the pipeline that applies the RayService. Exit status 0 when every
application holds, 1 with one line per problem.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import yaml
from pydantic import ValidationError

from omni_ray.config import load_config
from omni_ray.live_settings import LIVE_SETTINGS, LiveSettingsError

BUILDER = "deployments.app:build_app"


def problems(serve_config: dict, model: str | None = None) -> list[str]:
    """What is wrong with each omni-ray application of ``serve_config``, one line each, naming the field;
    ``model``: a checkpoint directory in place of each application's (where its own is not on this machine)."""
    from deployments.app import AppArgs, resolve_stage_config

    found = []
    for app in serve_config.get("applications") or []:
        if app.get("import_path") != BUILDER:
            continue
        name = app.get("name", "default")
        try:
            args = AppArgs.model_validate(app.get("args") or {})
            config = load_config(resolve_stage_config(args.stage_config), model=model or args.model,
                                 overrides=args.overrides)
        except (ValueError, ValidationError, OSError) as err:
            found.append(f"{name}: args: {err}")
            continue
        for entry in app.get("deployments") or []:
            settings = LIVE_SETTINGS.get(entry.get("name"))
            if settings is None:
                found.append(f"{name}: deployments: no deployment is named {entry.get('name')!r} (the app's are "
                             f"{', '.join(LIVE_SETTINGS)})")
            elif "user_config" in entry:
                try:
                    settings.parse(entry["user_config"], settings.start(config))
                except LiveSettingsError as err:
                    found.append(f"{name}: {err}")
    return found


def serve_config_of(document: dict) -> dict:
    """The Serve config a file holds: itself, or a RayService's ``spec.serveConfigV2``."""
    if document.get("kind") == "RayService":
        return yaml.safe_load(document["spec"]["serveConfigV2"])
    return document


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=pathlib.Path, help="a Serve config, or a RayService manifest")
    parser.add_argument("--model", help="a checkpoint directory of the same model in place of the applications' "
                        "(a RayService's /models volume, say; `python -m omni_ray.checkpoints.dummy DIR` writes one)")
    args = parser.parse_args(argv)
    found = problems(serve_config_of(yaml.safe_load(args.config.read_text())), args.model)
    for line in found:
        print(line, file=sys.stderr)
    if not found:
        print(f"{args.config}: ok")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
