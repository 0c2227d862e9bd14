"""User-facing errors: one line, what is wrong and how to mend it; the CLI exits with code 2."""

from __future__ import annotations

import difflib
import json
import types
from collections.abc import Callable
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError


class UserError(Exception):
    """Bad input from the user (unknown preset, layout that does not divide, corrupt file...)."""


def describe_validation_error(source: str, err: ValidationError, schema: type[BaseModel] | None = None,
                              origin: Callable[[tuple[str, ...]], str | None] | None = None,
                              section: str = "") -> str:
    """Turn a pydantic error into one line naming the field, e.g. ``tiny.yaml: moe.router.top_k: ...``.

    A bad value is quoted (``..., got "lots"``); an unknown field lists the fields ``schema`` (the model that
    was validated) has there. ``origin(loc)`` names where a field's value came from when the input was merged
    from several places (a config file, a plan, the flags); ``source`` otherwise. ``section``: where in the
    file the validated mapping sits (``parallel`` of a plan file)."""
    parts = []
    for item in err.errors():
        loc = tuple(str(x) for x in item["loc"])
        where = (origin(loc) if origin else None) or source
        field = ".".join((section, *loc) if section else loc)
        parts.append(f"{where}: {field}: {_problem(item, loc, schema)}" if field
                     else f"{where}: {_problem(item, loc, schema)}")
    return "; ".join(parts)


def _problem(item: Any, loc: tuple[str, ...], schema: type[BaseModel] | None) -> str:
    if item["type"] == "extra_forbidden":
        valid = fields_at(schema, loc[:-1]) if schema is not None else None
        if not valid:
            return "unknown field"
        close = difflib.get_close_matches(loc[-1], valid, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return f"unknown field{hint}; valid fields: {', '.join(valid)}"
    message = item["msg"].removeprefix("Value error, ")
    value = item.get("input")
    if isinstance(value, str | int | float | bool) or value is None and item["type"] != "missing":
        message += f", got {json.dumps(value)}"
    return message


def _model_classes(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field's annotation admits (through Optional, unions and Annotated)."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _model_classes(get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return [model for arg in get_args(annotation) for model in _model_classes(arg)]
    return [annotation] if isinstance(annotation, type) and issubclass(annotation, BaseModel) else []


def fields_at(schema: type[BaseModel], loc: tuple[str, ...]) -> list[str] | None:
    """The field names of the model at ``loc`` inside ``schema`` (None when ``loc`` leads to no one model).
    A discriminated union's tag in ``loc`` (``attention.mla``) picks its member."""
    models = [schema]
    for key in loc:
        tagged = [m for m in models if "kind" in m.model_fields and m.model_fields["kind"].default == key]
        if len(models) > 1 and tagged:
            models = tagged
            continue
        models = [inner for m in models if key in m.model_fields
                  for inner in _model_classes(m.model_fields[key].annotation)]
        if not models:
            return None
    return list(models[0].model_fields) if len(models) == 1 else None
