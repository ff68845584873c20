"""The config's building blocks: its number types, the frozen model every section is, ``ConfigError`` and a
pydantic error told field by field."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

PositiveInt = Annotated[int, Field(gt=0)]


NonNegativeInt = Annotated[int, Field(ge=0)]


Dtype = Literal["float32", "bfloat16", "float16"]


def _int_as_float(value):
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


Number = Annotated[float, BeforeValidator(_int_as_float)]


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ConfigError(ValueError):
    """A preset that does not validate. The message names the file and the field."""


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def field_errors(err: ValidationError, unknown: str = "unknown field") -> list[tuple[str | None, str]]:
    """Each problem of a pydantic error as (the field's dotted name or None for the whole, the message); a field the
    schema does not have is called ``unknown``."""
    problems = []
    for error in err.errors():
        field = ".".join(str(part) for part in error["loc"]) or None
        if error["type"] == "extra_forbidden":
            message = unknown
        elif error["type"] == "value_error":  # our validators' own words, without pydantic's "Value error, "
            message = str(error["ctx"]["error"])
        else:
            message = error["msg"]
        problems.append((field, message))
    return problems


def describe(err: ValidationError) -> str:
    """A pydantic error as one line, each problem led by its field's name."""
    return "; ".join(f"{field}: {message}" if field else message for field, message in field_errors(err))
