"""OpenAI's images API as its publishers define it, to hold our bodies against: the response, event, error and model
schemas of OpenAI's published OpenAPI definition (``tests/openai_images_schemas.json``, its source named there),
and the official ``openai`` client's typed models.

``conforms(kind, body)`` validates ``body`` against the schema ``kind`` and parses it into the client's model of it,
which must give the body back whole: every field OpenAI defines typed as sent, every field of ours kept beside.
"""

from __future__ import annotations

import functools
import json
import pathlib

SCHEMAS = pathlib.Path(__file__).resolve().parents[1] / "tests" / "openai_images_schemas.json"
BASE = "urn:openai-images-schemas"


@functools.cache
def _registry():
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    # OpenAPI 3.1's schema objects are JSON Schema 2020-12 (the discriminator and x- keywords are annotations).
    document = json.loads(SCHEMAS.read_text())
    return Registry().with_resource(BASE, Resource.from_contents(document, default_specification=DRAFT202012))


def _typed(kind: str):
    import openai.types as types

    return {
        "ImagesResponse": types.ImagesResponse,
        "ImageGenStreamEvent": types.ImageGenStreamEvent,
        "ImageEditStreamEvent": types.ImageEditStreamEvent,
        "Model": types.Model,
    }.get(kind)


def schema_errors(kind: str, body: object) -> list[str]:
    """Where ``body`` breaks OpenAI's schema ``kind`` (``ImagesResponse``, ``ImageGenStreamEvent``, ...)."""
    from jsonschema import Draft202012Validator

    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$ref": f"{BASE}#/components/schemas/{kind}"}
    validator = Draft202012Validator(schema, registry=_registry())
    return [f"{'/'.join(map(str, error.absolute_path)) or '<body>'}: {error.message}"
            for error in validator.iter_errors(body)]


def conforms(kind: str, body: dict) -> None:
    """Asserts that ``body`` validates against OpenAI's schema ``kind`` and that the official client's typed model
    of it parses it strictly and gives it back whole."""
    from pydantic import TypeAdapter

    errors = schema_errors(kind, body)
    assert not errors, f"{kind}: {errors}"
    model = _typed(kind)
    if model is None:
        return
    parsed = TypeAdapter(model).validate_python(body)
    assert parsed.to_dict() == body, f"{kind}: the client's {type(parsed).__name__} lost or changed a field"


def event_kind(event: dict, edit: bool) -> str:
    """The schema of a streamed event: an error's body is OpenAI's error response (the client raises it)."""
    if event.get("type") == "error":
        return "ErrorResponse"
    return "ImageEditStreamEvent" if edit else "ImageGenStreamEvent"
