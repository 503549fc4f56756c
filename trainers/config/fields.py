"""What every section of a job spec shares: unknown keys are errors, ``pkg.module:fn`` references
name something callable (or, where nothing a spec names may run, only look like one), and
free-form options stay small plain data."""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Base for every section: unknown keys are errors, values are checked on assignment too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


REF_PATTERN = r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*"
# Whether validating a spec imports the modules it names. The service turns this off: importing
# runs a module's code, and the service must never run code a tenant names (it checks the names
# against the tenant's role instead; the job imports them itself when it starts).
_IMPORT_REFS: contextvars.ContextVar[bool] = contextvars.ContextVar("import_refs", default=True)


@contextlib.contextmanager
def refs_not_imported():
    """Validate specs in this block by the shape of ``pkg.module:fn`` only, importing nothing."""
    token = _IMPORT_REFS.set(False)
    try:
        yield
    finally:
        _IMPORT_REFS.reset(token)


def refs_imported() -> bool:
    """Whether this validation may look at what is installed (False in the service: a job's
    cluster has its own environment)."""
    return _IMPORT_REFS.get()


def check_import_ref(ref: str) -> str:
    """Check that ``pkg.module:attr`` names something importable and callable (or only its shape)."""
    if not re.fullmatch(REF_PATTERN, ref):
        raise ValueError("must look like 'package.module:function'")
    if not _IMPORT_REFS.get():
        return ref
    module_name, attr = ref.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # boundary: any import failure is the user's to fix
        raise ValueError(
            f"cannot import module {module_name!r} ({type(exc).__name__}: {exc}): "
            "install it or put it on PYTHONPATH"
        ) from None
    if not callable(getattr(module, attr, None)):
        raise ValueError(f"module {module_name!r} has no callable {attr!r}")
    return ref


MAX_OPTIONS_DEPTH = 6
MAX_OPTIONS_BYTES = 16 << 10


def check_options(options: dict[str, Any]) -> dict[str, Any]:
    """Free-form keyword arguments stay small plain data: a factory's settings, not a payload."""
    depth, stack = 0, [(options, 1)]
    while stack:
        value, level = stack.pop()
        depth = max(depth, level)
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((child, level + 1) for child in children)
    if depth > MAX_OPTIONS_DEPTH:
        raise ValueError(f"nested {depth} levels deep: options are at most {MAX_OPTIONS_DEPTH} levels: flatten them")
    size = len(json.dumps(options, default=str))
    if size > MAX_OPTIONS_BYTES:
        raise ValueError(f"{size} bytes as JSON: options hold at most {MAX_OPTIONS_BYTES} bytes: put data in "
                         "storage and pass its path")
    return options
