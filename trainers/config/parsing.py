"""JSON or YAML text into a mapping, bounded on every input: a small body can neither blow up nor
crash the parser, and whatever it holds can be stored as JSON."""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal

import yaml

from trainers.config.errors import SpecError

# What a spec may look like before it is even read: a job spec has a few hundred values at most.
MAX_DEPTH = 32
MAX_NODES = 20_000
MAX_INT_DIGITS = 30
# The longest text a spec holds: a path, a URI, a factory name. Every route that shows a spec (and every
# regex that reads one) then works on short strings, whatever a tenant sends.
MAX_STRING_CHARS = 4096
MAX_KEY_CHARS = 256


class _SpecLoader(yaml.CSafeLoader):
    """libyaml's C loader with whole numbers capped (Python would build a 10,000-digit int)."""

    def construct_bounded_int(self, node: yaml.ScalarNode) -> int:
        if len(node.value.lstrip("+-").replace("_", "")) > MAX_INT_DIGITS:
            raise SpecError([f"line {node.start_mark.line + 1}: a number of {len(node.value)} digits: "
                             f"numbers in a spec have at most {MAX_INT_DIGITS} digits"])
        return self.construct_yaml_int(node)

    def construct_timestamp_text(self, node: yaml.ScalarNode) -> str:
        """A date or time as written: a spec is stored as JSON, which has no dates."""
        return self.construct_scalar(node)


_SpecLoader.add_constructor("tag:yaml.org,2002:int", _SpecLoader.construct_bounded_int)
_SpecLoader.add_constructor("tag:yaml.org,2002:timestamp", _SpecLoader.construct_timestamp_text)

# What YAML can hold and JSON cannot (the spec is stored and passed on as JSON), by the tag a user wrote.
_NOT_JSON = {bytes: "binary data (!!binary)", set: "a set (!!set)"}


def _json_unsafe(data: Any) -> str | None:
    """Where ``data`` holds a value (or a key) JSON cannot, as 'path: what', or None; walked without recursion."""
    stack = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for key, child in value.items():
                where = f"{path}.{key}" if path else str(key)
                if not isinstance(key, (str, int, float, bool)) and key is not None:
                    return f"{where}: {_NOT_JSON.get(type(key), type(key).__name__)} as a key"
                stack.append((child, where))
        elif isinstance(value, (list, tuple)):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(value))
        elif not isinstance(value, (str, int, float, bool)) and value is not None:
            return f"{path or '(top level)'}: {_NOT_JSON.get(type(value), type(value).__name__)}"
    return None


def _yaml_shape_problem(text: str) -> str | None:
    """Why YAML text may not be loaded (aliases, depth, size), from libyaml's events, or None.

    Aliases are refused outright: six lines of them expand to megabytes. The event stream is
    flat (libyaml keeps its own stack), so this pass cannot recurse however deep the text nests.
    """
    depth = nodes = 0
    for event in yaml.parse(text, Loader=yaml.CSafeLoader):
        where = f"line {event.start_mark.line + 1}"
        if (isinstance(event, yaml.ScalarEvent) and len(event.value) > MAX_STRING_CHARS
                and not re.fullmatch(r"[-+]?[0-9_]+", event.value)):  # a long number: the int loader says so
            return f"{where}: {_long_text(event.value)}"
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            return f"{where}: YAML anchors and aliases (& and *) are not accepted: write the values out"
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                return f"{where}: nested deeper than {MAX_DEPTH} levels: a job spec is a few levels deep"
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
        if isinstance(event, yaml.NodeEvent):
            nodes += 1
            if nodes > MAX_NODES:
                return f"{where}: more than {MAX_NODES} values: a job spec has a few hundred"
    return None


def _bounded_json_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise SpecError([f"a number of {len(digits)} digits: numbers in a spec have at most {MAX_INT_DIGITS} digits"])
    return int(digits)


def _long_text(text: str, what: str = "a text") -> str:
    limit = MAX_KEY_CHARS if what == "a key" else MAX_STRING_CHARS
    return (f"{what} of {len(text)} characters ({json.dumps(text[:40])[:-1]}...\"): a spec's texts have at most "
            f"{limit} characters: shorten it (data belongs in storage, named by a path)")


def _refuse_constant(name: str) -> float:
    raise SpecError([f"{name}: not a number a spec can hold: write a finite number"])


def _json_shape_problem(data: Any) -> str | None:
    """Depth, size, text lengths and finite numbers of parsed data, walked without recursion."""
    nodes, stack = 0, [(data, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        nodes += 1
        where = f"{path}: " if path else ""
        if depth > MAX_DEPTH:
            return f"nested deeper than {MAX_DEPTH} levels: a job spec is a few levels deep"
        if nodes > MAX_NODES:
            return f"more than {MAX_NODES} values: a job spec has a few hundred"
        if isinstance(value, str) and len(value) > MAX_STRING_CHARS:
            return where + _long_text(value)
        if isinstance(value, float) and not math.isfinite(value):
            return f"{where}{value}: not a number a spec can hold: write a finite number"
        if isinstance(value, dict):
            long_key = next((k for k in value if isinstance(k, str) and len(k) > MAX_KEY_CHARS), None)
            if long_key is not None:
                return where + _long_text(long_key, "a key")
            stack.extend((child, depth + 1, f"{path}.{key}" if path else str(key)) for key, child in value.items())
        elif isinstance(value, list):
            stack.extend((child, depth + 1, f"{path}[{i}]") for i, child in enumerate(value))
    return None


def parse_text(text: str, source: str, fmt: Literal["auto", "json"] = "auto") -> dict:
    """Parse JSON or YAML text into a mapping; syntax errors name the line and column.

    Bounded on every input: no YAML aliases, at most MAX_DEPTH levels, MAX_NODES values and
    MAX_INT_DIGITS digits per number, so a small body can neither blow up nor crash the parser.
    """
    stripped = text.lstrip()
    if not stripped:
        raise SpecError([f"{source}: the file is empty: write a job spec (see configs/)"])
    try:
        if fmt == "json" or stripped.startswith("{"):
            data = json.loads(text, parse_int=_bounded_json_int, parse_constant=_refuse_constant)
            problem = _json_shape_problem(data)
        else:
            problem, data = _yaml_shape_problem(text), None
            if not problem:
                data = yaml.load(text, Loader=_SpecLoader)  # noqa: S506 (a safe loader)
                unsafe = _json_unsafe(data)
                if unsafe:
                    problem = (f"{unsafe}: a spec holds text, numbers, true/false, lists and mappings only: "
                               "write the value as a string")
                else:
                    problem = _json_shape_problem(data)  # keys' lengths, NaN and infinities (.nan, .inf)
    except SpecError as exc:
        raise SpecError([f"{source}: {p}" for p in exc.problems]) from None
    except json.JSONDecodeError as exc:
        raise SpecError([f"{source}: line {exc.lineno}, column {exc.colno}: {exc.msg}: fix the JSON syntax"]) from None
    except RecursionError:
        raise SpecError([f"{source}: nested deeper than {MAX_DEPTH} levels: a job spec is a few levels deep"]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError([f"{source}: {where}: {problem}: fix the YAML syntax"]) from None
    except ValueError as exc:  # what the parsers raise for values they cannot hold (e.g. a huge exponent)
        raise SpecError([f"{source}: {exc}: fix the value"]) from None
    if problem:
        raise SpecError([f"{source}: {problem}"])
    if not isinstance(data, dict):
        raise SpecError([f"{source}: top level is {type(data).__name__}: a job spec is a mapping of sections"])
    return data
