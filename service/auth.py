"""Bearer tokens mapped to tenants and roles; only their SHA-256 hashes are kept.

Tokens come from a file (``--tokens FILE``, JSON or YAML) or ``ETRAIN_TOKENS`` (JSON), as a
list of ``{tenant, role, sha256}`` (or ``token`` in clear, hashed on load). With none
configured, ``etrain serve`` makes one admin token, keeps its hash under the storage root
and prints the token once, as Jupyter does.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from typing import Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from cluster.storage import StorageRoot

TENANT_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"


class TokenEntry(BaseModel):
    tenant: str = Field(pattern=TENANT_PATTERN)
    role: Literal["admin", "user"] = "user"
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


def bootstrap_admin(root: StorageRoot) -> tuple[list[TokenEntry], str | None]:
    """The stored admin hash, or a new admin token (returned once, to print) with its hash stored."""
    if root.exists("tokens.json"):
        return [TokenEntry.model_validate(e) for e in root.read_json("tokens.json")], None
    token = new_token()
    entry = TokenEntry(tenant="admin", role="admin", sha256=hash_token(token))
    root.write_bytes(json.dumps([entry.model_dump(exclude={"token"})]).encode(), "tokens.json")
    return [entry], token
