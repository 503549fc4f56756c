"""A spec in: a file (local, or in storage as the service writes it, checked against its digest),
``--set`` overrides, then validation: the one way a spec becomes a ``JobSpec``."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import yaml
from pydantic import ValidationError

from trainers.config.errors import SpecError, format_errors
from trainers.config.job import JobSpec, cross_field_problems
from trainers.config.parsing import parse_text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``key.path=value`` overrides; values are read as YAML (``10``, ``true``, ``{min: 1, max: 2}``)."""
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"--set {item}: expected key.path=value, e.g. training.max_steps=20")
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[parts[-1]] = value
    if problems:
        raise SpecError(problems)
    return data


def validate(data: dict) -> JobSpec:
    """The one way in: field checks, then rules that span sections."""
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_errors(exc, JobSpec)) from None
    problems = cross_field_problems(spec)
    if problems:
        raise SpecError(problems)
    return spec


def load_spec(path: str | Path, overrides: list[str] | None = None, sha256: str | None = None) -> JobSpec:
    """Load, override and validate a spec file; the job name defaults to the file's stem.
    With ``sha256``, the file's bytes must have that digest (read_spec_file)."""
    data = read_spec_file(path, sha256)
    if "name" not in data:
        data["name"] = default_name(Path(str(path)).stem)
    return validate(apply_overrides(data, overrides or []))


def read_spec_file(path: str | Path, sha256: str | None = None) -> dict:
    """Parse a spec file: a local path, or a URI in storage (s3://bucket/key) as the service writes.

    ``sha256``: the digest of the bytes the service checked. A stored spec lies where others may
    write (a tenant's keys reach its prefix); bytes that differ are refused before they are parsed.
    """
    where = str(path)
    try:
        if "://" in where:
            from cluster.storage import open_root

            parent, _, leaf = where.rpartition("/")
            raw = open_root(parent).read_bytes(leaf)
        else:
            raw = Path(where).read_bytes()
        text = raw.decode()
    except (OSError, ValueError) as exc:
        if isinstance(exc, UnicodeDecodeError):
            raise SpecError([f"{where}: not text: a job spec is JSON or YAML"]) from None
        reason = getattr(exc, "strerror", None) or str(exc)
        raise SpecError([f"{where}: cannot read: {reason}: check the path"]) from None
    if sha256 is not None and hashlib.sha256(raw).hexdigest() != sha256:
        raise SpecError([f"{where}: its SHA-256 is not {sha256}, the digest of the spec that was checked: it was "
                         "changed after it was checked, so it is not run; submit the spec again"])
    return parse_text(text, where)


def add_digest_arg(parser) -> None:
    """``--spec-sha256``: what the service passes with the spec it checked (both entry points)."""
    parser.add_argument("--spec-sha256", metavar="HEX", default=None, type=str.lower,
                        help="run the spec only if its bytes have this SHA-256 (the service passes the digest of "
                             "the spec it checked, so a spec changed in storage after the check is not run)")


def default_name(stem: str) -> str:
    name = re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-._") or "job"
    return name[:63]
