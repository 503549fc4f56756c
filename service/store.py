"""Durable job and sweep records under the storage root, so they outlive replicas and the head node.

Layout under ``<storage root>/service/``::

    records/<id>.json                 one record per job or sweep, rewritten whole (atomically)
    idempotency/<tenant>/<sha>.json   Idempotency-Key -> record id, created exclusively
    tokens.json                       the bootstrap admin token's hash (never the token)

A record holds the spec, owner, state history, Ray submission ids per attempt and the
last summary. Writes are whole-object: a rename locally, one PUT on S3. Records are few
and small, so the store keeps them in memory and writes through.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from cluster.storage import StorageRoot

State = Literal["PENDING", "RUNNING", "STOPPING", "STOPPED", "SUCCEEDED", "FAILED"]
TERMINAL: frozenset[str] = frozenset({"STOPPED", "SUCCEEDED", "FAILED"})
ACTIVE: frozenset[str] = frozenset({"PENDING", "RUNNING", "STOPPING"})


class Transition(BaseModel):
    state: State
    at: float
    reason: str = ""


class Record(BaseModel):
    id: str
    kind: Literal["job", "sweep"]
    tenant: str
    name: str  # the name in the user's spec; the run itself is named by ``id``
    state: State = "PENDING"
    history: list[Transition] = []
    spec: dict[str, Any]
    spec_uri: str
    storage: str  # the job's folder (or the sweep's) in storage
    submissions: list[str] = Field(default_factory=list, description="Ray Jobs submission id per attempt")
    created_at: float
    updated_at: float
    summary: dict[str, Any] | None = None
    error: str | None = None

    def move(self, state: str, reason: str = "") -> bool:
        """Change state (recording why); False when it is already in that state."""
        if state == self.state:
            return False
        now = time.time()
        self.history.append(Transition(state=state, at=now, reason=reason))
        self.state, self.updated_at = state, now
        return True


def new_id(kind: str) -> str:
    return f"{kind[0]}-{uuid.uuid4().hex[:12]}"


class Store:
    def __init__(self, root: StorageRoot):
        self.root = root
        self._lock = threading.RLock()
        self._records: dict[str, Record] = {}
        for name in self._list("records"):
            if name.endswith(".json"):
                record = Record.model_validate(root.read_json("records", name))
                self._records[record.id] = record

    def _list(self, *parts: str) -> list[str]:
        import pyarrow.fs as pafs

        if not self.root.exists(*parts):
            return []
        infos = self.root.fs.get_file_info(pafs.FileSelector(self.root.path(*parts)))
        return sorted(os.path.basename(i.path) for i in infos if i.type == pafs.FileType.File)

    def save(self, record: Record) -> None:
        with self._lock:
            self.root.write_json(record.model_dump(mode="json"), "records", f"{record.id}.json")
            self._records[record.id] = record.model_copy(deep=True)

    def get(self, record_id: str) -> Record | None:
        with self._lock:
            r = self._records.get(record_id)
            return r.model_copy(deep=True) if r else None

    def all(self) -> list[Record]:
        with self._lock:
            return sorted((r.model_copy(deep=True) for r in self._records.values()), key=lambda r: r.created_at)

    # ------------------------------------------------------------ idempotency keys

    @staticmethod
    def _key_file(tenant: str, key: str) -> tuple[str, str, str]:
        return "idempotency", tenant, hashlib.sha256(key.encode()).hexdigest() + ".json"

    def claim_key(self, tenant: str, key: str, record_id: str, body_sha256: str) -> dict:
        """Bind an Idempotency-Key to a record id, exclusively; return the binding that won."""
        parts = self._key_file(tenant, key)
        entry = {"id": record_id, "body_sha256": body_sha256, "at": time.time()}
        with self._lock:
            if create_exclusive(self.root, json.dumps(entry).encode(), *parts):
                return entry
            return self.root.read_json(*parts)

    def key_binding(self, tenant: str, key: str) -> dict | None:
        parts = self._key_file(tenant, key)
        return self.root.read_json(*parts) if self.root.exists(*parts) else None


def create_exclusive(root: StorageRoot, data: bytes, *parts: str) -> bool:
    """Create a file only if it does not exist: O_EXCL locally, a conditional PUT on S3."""
    import pyarrow.fs as pafs

    path = root.path(*parts)
    if isinstance(root.fs, pafs.LocalFileSystem):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True
    import boto3
    from botocore.exceptions import ClientError

    bucket, _, key = path.partition("/")
    try:
        boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict"):
            return False
        raise
    return True
