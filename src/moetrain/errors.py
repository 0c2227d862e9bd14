"""User-facing errors: one line, what is wrong and how to mend it; the CLI exits with code 2."""

from __future__ import annotations

from pydantic import ValidationError


class UserError(Exception):
    """Bad input from the user (unknown preset, layout that does not divide, corrupt file...)."""


def describe_validation_error(source: str, err: ValidationError) -> str:
    """Turn a pydantic error into one line naming the field, e.g. ``tiny.yaml: moe.router.top_k: ...``."""
    parts = []
    for item in err.errors():
        loc = ".".join(str(x) for x in item["loc"])
        msg = item["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return f"{source}: " + "; ".join(parts)
