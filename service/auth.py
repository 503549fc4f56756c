"""Bearer tokens mapped to tenants and roles, and what each role may put in a spec.

Tokens come from a file (``--tokens FILE``, JSON or YAML) or ``ETRAIN_TOKENS`` (JSON), as a
list of ``{tenant, role, sha256}`` (or ``token`` in clear, hashed on load); only SHA-256
hashes are kept. With none configured, ``etrain serve`` makes one admin token, keeps its
hash in the service's own state (never under the storage root jobs write to) and prints
the token once, as Jupyter does.

Roles: ``admin`` sees every tenant and may run anything; ``code`` may run its own code
(``train_loop``, any factory: trusted within the cluster); ``user`` runs built-in workloads
and exactly the factories (``module:function``) the operator allows, and reads data only under its own prefix
of the storage root or URIs the operator allows it. The checks read the spec's strings
only: the service never imports a module a spec names, so an answer never tells whether
a module exists.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import posixpath
import secrets
from dataclasses import dataclass
from typing import Any, Literal, Sequence
from urllib.parse import unquote, urlparse

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from trainers.api import trial_spec_view


TENANT_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
Role = Literal["admin", "user", "code"]
ROLES: tuple[str, ...] = ("admin", "user", "code")


class TokenEntry(BaseModel):
    tenant: str = Field(pattern=TENANT_PATTERN)
    role: Role = "user"
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    token: str | None = Field(None, min_length=16, description="in clear: hashed on load, never kept")

    @model_validator(mode="after")
    def _hash(self) -> "TokenEntry":
        if self.token:
            self.sha256, self.token = hash_token(self.token), None
        if not self.sha256:
            raise ValueError("give sha256 (of the token) or token")
        return self


@dataclass(frozen=True)
class Principal:
    tenant: str
    role: str

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return "et_" + secrets.token_urlsafe(32)


class Tokens:
    def __init__(self, entries: list[TokenEntry]):
        self._by_hash = {e.sha256: Principal(e.tenant, e.role) for e in entries}

    def authenticate(self, token: str | None) -> Principal | None:
        if not token:
            return None
        digest = hash_token(token)
        for known, principal in self._by_hash.items():
            if hmac.compare_digest(known, digest):
                return principal
        return None

    def __len__(self) -> int:
        return len(self._by_hash)

    def tenants_with_role(self, role: str) -> list[str]:
        return sorted({p.tenant for p in self._by_hash.values() if p.role == role})


class TokenConfigError(Exception):
    pass


def parse_entries(text: str, source: str) -> list[TokenEntry]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TokenConfigError(f"{source}: not JSON or YAML ({exc}): fix the syntax") from None
    if not isinstance(data, list):
        raise TokenConfigError(f"{source}: expected a list of {{tenant, role, sha256}} entries")
    entries = []
    for i, item in enumerate(data):
        try:
            entries.append(TokenEntry.model_validate(item))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "entry"
            raise TokenConfigError(f"{source}[{i}].{where}: {first['msg']}: see `etrain serve --help`") from None
    return entries


def load_tokens(path: str | None = None, env: dict | None = None) -> list[TokenEntry]:
    """Configured tokens: the file if given, else ETRAIN_TOKENS, else none."""
    env = os.environ if env is None else env
    if path:
        try:
            text = open(path).read()
        except OSError as exc:
            raise TokenConfigError(f"--tokens {path}: cannot read: {exc.strerror}") from None
        return parse_entries(text, path)
    if env.get("ETRAIN_TOKENS"):
        return parse_entries(env["ETRAIN_TOKENS"], "ETRAIN_TOKENS")
    return []


# ---------------------------------------------------------------- what a role may put in a spec

# Fields a sweep over HTTP may not vary, nor any section that holds one: they say who owns a trial
# and where it reads and writes. What code a trial may run is checked on every trial's spec instead.
UNSWEEPABLE = ("name", "labels", "checkpoint.storage_root", "data.source")
# Fields a sweep over HTTP may not set, though it may vary the section that holds them in values without them.
SET_ONCE = ("model.init_from",)
# The fields spec_problems reads: a sweep key that can change none of them cannot change its answer.
ROLE_FIELDS = ("train_loop", "data.factory", "model.factory", "data.source", "model.init_from", "model.hf")
# The paths a tenant's job reads, each only under the tenant's prefix (or URIs the operator allows it)
READ_PATHS = ("data.source", "model.init_from")


def location_key(uri: str) -> str:
    """A URI or path in one normal form, for prefix checks: 's3://bucket/a/b' or '/a/b' ('..' resolved).

    A URI's %-escapes are decoded first, as pyarrow decodes them when it opens one: otherwise
    '%2e%2e' would pass here as a name and be read there as '..'. A plain path is taken as written.
    """
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        return "s3://" + posixpath.normpath("/" + unquote(parsed.netloc + parsed.path)).lstrip("/")
    path = unquote(parsed.path) if parsed.scheme == "file" else uri
    return posixpath.normpath(path) if path.startswith("/") else "relative:" + posixpath.normpath(path)


def is_under(uri: str, prefix: str) -> bool:
    """Whether ``uri`` is ``prefix`` or inside it (by path components, after resolving '..')."""
    a, b = location_key(uri), location_key(prefix).rstrip("/")
    return a == b or a.startswith(b + "/")


def in_tenant_data(source: str, tenant_root: str) -> str:
    """A spec's data source with a relative path read as relative to the tenant's storage prefix."""
    if source.startswith("builtin:") or "://" in source or source.startswith("/"):
        return source
    scheme, sep, base = tenant_root.rpartition("://")
    joined = scheme + sep + posixpath.normpath(posixpath.join(base, source))
    return joined + "/" if source.endswith("/") else joined


def factory_allowed(ref: str, allowed: Sequence[str]) -> bool:
    """Exactly a listed 'module:function': never another name of the same module (a class, an
    imported helper, a function that writes files would all take the tenant's keyword arguments)."""
    return ref in allowed


def _get(data: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, dict):
            return None
        data = data.get(part)
    return data


def _overlaps(key: str, field: str) -> bool:
    """Whether setting ``key`` can change ``field``: the same, inside it, or a section holding it."""
    return key == field or key.startswith(field + ".") or field.startswith(key + ".")


def policy_problems(role: str, data: dict, allowed_factories: Sequence[str], tenant_root: str,
                    data_uris: Sequence[str] = ()) -> list[str]:
    """What ``role`` may not put in this spec (a job's, or a sweep's with its space).

    Pure and string-only: nothing named is imported or opened. A relative ``data.source`` is
    read under ``tenant_root``; ``data_uris`` are what the operator allows the tenant besides;
    ``allowed_factories`` the exact 'module:function' names a user's factories may be. A sweep's every
    listed value is checked in the trial spec it makes. Messages echo values as given, never
    where the server keeps things, nor what exists.
    """
    base = {k: v for k, v in data.items() if k != "sweep"}
    problems = spec_problems(role, base, allowed_factories, tenant_root, data_uris)
    space = _get(data, "sweep.space")
    for key, domain in space.items() if isinstance(space, dict) else ():
        if not isinstance(key, str):
            continue  # not a spec key at all: the sweep's own checks refuse it
        if any(_overlaps(key, f) for f in UNSWEEPABLE):
            problems.append(f"sweep.space.{key}: not searchable over HTTP: it says (or holds what says) who owns "
                            "a trial or what it reads: set it once in the spec, and sweep the fields beside it")
            continue
        values = next(iter(domain.values())) if isinstance(domain, dict) and len(domain) == 1 else None
        values = values if isinstance(values, list) else []
        set_here = [f for f in SET_ONCE if key == f or key.startswith(f + ".") or (f.startswith(key + ".") and any(
            _get(v, f[len(key) + 1:]) is not None for v in values))]
        if set_here:
            problems.append(f"sweep.space.{key}: sets {set_here[0]}: not searchable over HTTP: it says what a trial "
                            "reads: set it once in the spec, and sweep the fields beside it")
            continue
        if not any(_overlaps(key, f) for f in ROLE_FIELDS):
            continue
        for value in values:
            trial = spec_problems(role, trial_spec_view(base, key, value), allowed_factories, tenant_root, data_uris)
            new = [p for p in trial if p not in problems]
            if new:
                problems.extend(f"sweep.space.{key}: {json.dumps(value, default=str)[:200]}: {p}" for p in new)
                break
    return problems


def spec_problems(role: str, data: dict, allowed_factories: Sequence[str], tenant_root: str,
                  data_uris: Sequence[str] = ()) -> list[str]:
    """What ``role`` may not put in one job spec (see policy_problems)."""
    if role in ("admin", "code"):
        return []
    problems = []
    if _get(data, "train_loop") is not None:
        problems.append("train_loop: not allowed for role 'user': your own training loop needs a tenant with "
                        "role 'code' (ask your operator), or use the built-in loop with model/data factories")
    allowed = ", ".join(allowed_factories) if allowed_factories else "none"
    for field in ("data.factory", "model.factory"):
        ref = _get(data, field)
        if ref is not None and not (isinstance(ref, str) and factory_allowed(ref, allowed_factories)):
            problems.append(f"{field}: {json.dumps(ref, default=str)[:200]}: not allowed for role 'user': "
                            f"the factories allowed are exactly: {allowed} (your operator sets the list)")
    for field, example in zip(READ_PATHS, ("data/train.parquet", "pretrained/model.safetensors")):
        path = _get(data, field)
        if isinstance(path, str) and not (field == "data.source" and path.startswith("builtin:")) and not any(
                is_under(in_tenant_data(path, tenant_root), r) for r in (tenant_root, *data_uris)):
            problems.append(f"{field}: {json.dumps(path)[:300]}: outside your data: role 'user' "
                            "reads only under its own storage prefix (give a path relative to it, e.g. "
                            f"'{example}') or URIs your operator allows")
    for field in ("model.hf.path", "model.hf.tokenizer"):
        folder = _get(data, field)
        if isinstance(folder, str) and not (("://" in folder or folder.startswith("/")) and any(
                is_under(folder, r) for r in (tenant_root, *data_uris))):
            problems.append(f"{field}: {json.dumps(folder)[:300]}: outside your data: role 'user' loads models only "
                            "from a full URI or absolute path under its own storage prefix or URIs your operator "
                            "allows")
    return problems


# ---------------------------------------------------------------- the bootstrap admin


def bootstrap_admin(state) -> tuple[list[TokenEntry], str | None]:
    """The stored admin hash, or a new admin token (returned once, to print) with its hash stored.

    ``state`` is the service's own store (service.store.Store), out of every job's reach.
    """
    stored = state.tokens()
    if stored:
        return [TokenEntry.model_validate(e) for e in stored], None
    token = new_token()
    entry = TokenEntry(tenant="admin", role="admin", sha256=hash_token(token))
    state.add_token(entry.model_dump(exclude={"token"}))
    return [entry], token
