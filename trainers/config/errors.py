"""How a spec's problems are told: one plain line each, ``field.path: value: what is wrong: how to fix``,
every problem at once, so nothing starts until the spec is clean."""

from __future__ import annotations

import json
import typing
from typing import Any

from pydantic import BaseModel, ValidationError


class SpecError(Exception):
    """A spec that cannot run; ``problems`` holds one plain line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))

    def render(self, source: str = "job spec") -> str:
        n = len(self.problems)
        head = f"invalid {source}: {n} problem{'s' if n != 1 else ''}"
        return "\n".join([head, *(f"  - {p}" for p in self.problems)])


def nested_models(ann: Any) -> list[type[BaseModel]]:
    """Every model class inside a (possibly Annotated or union) annotation."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    return [m for arg in typing.get_args(ann) for m in nested_models(arg)]


def _model_at(loc: tuple, root: type[BaseModel]) -> type[BaseModel] | None:
    """The model class that holds the field at ``loc`` (for listing valid keys)."""
    model = root
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        nested = nested_models(field.annotation) if field else []
        if not nested:
            return None
        model = nested[0]
    return model


FIXES = {
    "int_type": "use a whole number",
    "int_parsing": "use a whole number",
    "int_from_float": "use a whole number",
    "float_type": "use a number",
    "float_parsing": "use a number",
    "bool_type": "use true or false",
    "bool_parsing": "use true or false",
    "string_type": "use a string",
    "greater_than": "use a larger value",
    "greater_than_equal": "use a larger value",
    "less_than": "use a smaller value",
    "less_than_equal": "use a smaller value",
    "literal_error": "use one of the listed values",
    "string_pattern_mismatch": "use lowercase letters, digits, '.', '_' or '-', starting with a letter or digit",
    "model_type": "use a mapping of keys to values",
    "model_attributes_type": "use a mapping of keys to values",
    "dict_type": "use a mapping",
}


def format_errors(exc: ValidationError, root: type[BaseModel], prefix: str = "") -> list[str]:
    """Turn pydantic's errors into ``path: value: problem: fix`` lines (paths under ``prefix``)."""
    lines = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in ("int", "range"))))
        path = ".".join(str(p) for p in (prefix.split(".") if prefix else []) + list(loc)) or "(top level)"
        value = err.get("input")
        shown = json.dumps(value, default=str) if not isinstance(value, dict) or len(str(value)) < 80 else "{...}"
        kind = err["type"]
        if kind == "extra_forbidden":
            holder = _model_at(loc, root)
            valid = ", ".join(holder.model_fields) if holder else "see the documentation"
            lines.append(f"{path}: unknown key: valid keys here are {valid}")
            continue
        if kind == "missing":
            lines.append(f"{path}: missing: add it")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        fix = FIXES.get(kind)
        line = f"{path}: {shown}: {msg}" + (f": {fix}" if fix else "")
        if line not in lines:
            lines.append(line)
    return lines
