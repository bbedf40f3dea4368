"""How problems read: pydantic's validation errors as ``PolicyError`` lines that name the
source (file path, ``<dict>`` or preset name), where in it and the field, with a
"did you mean" for a misspelt name and a short quote of a bad value."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ValidationError

from ..errors import PolicyError


def suggest(name: str, valid: Iterable[str]) -> str:
    """ "did you mean 'x'? valid: a, b, c" (the hint only where one is close)."""
    valid = list(valid)
    close = difflib.get_close_matches(str(name), valid, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"{hint}valid: {', '.join(valid)}"


def show(value: Any) -> str:
    """``repr(value)``, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def translate(exc: ValidationError, source: str, where_of, root: type[BaseModel]) -> PolicyError:
    """Pydantic's errors as "source, where, field 'x': what is wrong" lines.

    ``where_of(loc)`` gives (where, field, model) for an error's ``loc``: the place in the
    document (``defaults``, ``rule N``, ``tensors[i]``...), the field, and the model whose
    fields a misspelt name is matched against.
    """
    lines = []
    for err in exc.errors(include_url=False):
        where, field, model = where_of(tuple(err["loc"]))
        ctx = err.get("ctx") or {}
        if field is None:
            field = ctx.get("field")
        kind = err["type"]
        if kind == "extra_forbidden":
            message = f"unknown field; {suggest(field, model.model_fields)}"
        elif kind == "missing":
            message = "required field is missing"
        elif kind == "kvpolicy":
            message = err["msg"]
        elif kind in ("model_type", "dict_type"):
            message = f"expected a mapping of fields (got {show(err['input'])})"
        else:
            message = (
                err["msg"].replace("a valid tuple", "a list") + f" (got {show(err['input'])})"
            )
        parts = [source] + ([where] if where else []) + ([f"field '{field}'"] if field else [])
        lines.append(f"{', '.join(parts)}: {message}")
    return PolicyError("\n".join(lines))
