"""The service's own state: job and sweep records, Idempotency-Keys and token hashes.

They live in one SQLite file in the service's state folder (``ServiceSettings.state_dir``,
default ``~/.etrain/service``, mode 0700) on the disk of the node that runs the service,
never under the storage root. Jobs are handed the storage root (their tenant's prefix of
it) and nothing else: no path to this folder, no variable naming it, so a job that walks
its storage finds no record to rewrite and no token file to add itself to. The folder is
refused at start-up if it lies inside the storage root.

Why SQLite rather than files in storage: records are few and small, a transaction makes an
Idempotency-Key binding exclusive without a storage feature (S3 conditional PUTs), and the
state's only reader and writer is the service. Keep the folder on a persistent disk (an EBS
volume on the head) to survive the head node's replacement.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from service.states import JobState

ID_PATTERN = r"^[js]-[0-9a-f]{12}$"
DB_FILE = "service.sqlite3"


class Transition(BaseModel):
    state: JobState
    at: float
    reason: str = ""


class Record(BaseModel):
    id: str
    kind: Literal["job", "sweep"]
    tenant: str
    name: str  # the name in the user's spec; the run itself is named by ``id``
    state: JobState = JobState.PENDING
    history: list[Transition] = []
    spec: dict[str, Any]
    spec_uri: str
    spec_sha256: str | None = Field(None, description="digest of the stored spec's bytes: every attempt checks it "
                                                     "before it parses the spec")
    storage: str  # the job's folder (or the sweep's) in storage
    slots: int = Field(1, description="how much of the tenant's quota it holds while unfinished: a sweep's "
                                      "concurrent trials")
    state_key: str | None = Field(None, description="a sweep's key for its Tune state (cluster.signed_fs): given to "
                                                   "its driver only, never shown")
    cpus: float = Field(0.0, description="CPUs it holds of the tenant's quota while unfinished (service.limits)")
    gpus: float = Field(0.0, description="GPUs likewise")
    submissions: list[str] = Field(default_factory=list, description="Ray Jobs submission id per attempt")
    created_at: float
    updated_at: float
    summary: dict[str, Any] | None = None
    error: str | None = None

    def move(self, state: JobState | str, reason: str = "") -> bool:
        """Change state (recording why); False when it is already in that state."""
        state = JobState(state)  # assignment is not validated: a plain name must not stay a plain str
        if state == self.state:
            return False
        now = time.time()
        self.history.append(Transition(state=state, at=now, reason=reason))
        self.state, self.updated_at = state, now
        return True


def new_id(kind: str) -> str:
    return f"{kind[0]}-{uuid.uuid4().hex[:12]}"


SCHEMA = """
CREATE TABLE IF NOT EXISTS records (id TEXT PRIMARY KEY, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS idempotency (tenant TEXT NOT NULL, key_sha256 TEXT NOT NULL, record_id TEXT NOT NULL,
                                        body_sha256 TEXT NOT NULL, at REAL NOT NULL,
                                        PRIMARY KEY (tenant, key_sha256));
CREATE TABLE IF NOT EXISTS tokens (sha256 TEXT PRIMARY KEY, body TEXT NOT NULL);
"""


class Store:
    """Records in memory, written through to SQLite; keys and token hashes read from it."""

    def __init__(self, state_dir: str):
        state_dir = os.path.abspath(os.path.expanduser(state_dir))
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
        os.chmod(state_dir, 0o700)
        self.path = os.path.join(state_dir, DB_FILE)
        self._lock = threading.RLock()
        # One connection, shared by the replica's threads under the lock; autocommit, WAL, fsync'd.
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        os.chmod(self.path, 0o600)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)
        self._records: dict[str, Record] = {}
        for (body,) in self._db.execute("SELECT body FROM records"):
            record = Record.model_validate_json(body)
            self._records[record.id] = record

    def save(self, record: Record) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO records (id, body) VALUES (?, ?)",
                             (record.id, record.model_dump_json()))
            self._records[record.id] = record.model_copy(deep=True)

    def get(self, record_id: str) -> Record | None:
        with self._lock:
            r = self._records.get(record_id)
            return r.model_copy(deep=True) if r else None

    def all(self) -> list[Record]:
        with self._lock:
            return sorted((r.model_copy(deep=True) for r in self._records.values()), key=lambda r: r.created_at)

    # ------------------------------------------------------------ idempotency keys

    def claim_key(self, tenant: str, key: str, record_id: str, body_sha256: str) -> dict:
        """Bind an Idempotency-Key to a record id, exclusively; return the binding that won."""
        digest = hashlib.sha256(key.encode()).hexdigest()
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO idempotency VALUES (?, ?, ?, ?, ?)",
                             (tenant, digest, record_id, body_sha256, time.time()))
            return self.key_binding(tenant, key)

    def key_binding(self, tenant: str, key: str) -> dict | None:
        digest = hashlib.sha256(key.encode()).hexdigest()
        with self._lock:
            row = self._db.execute("SELECT record_id, body_sha256, at FROM idempotency WHERE tenant=? AND key_sha256=?",
                                   (tenant, digest)).fetchone()
        return {"id": row[0], "body_sha256": row[1], "at": row[2]} if row else None

    # ------------------------------------------------------------ token hashes (the bootstrap admin)

    def tokens(self) -> list[dict]:
        with self._lock:
            return [json.loads(body) for (body,) in self._db.execute("SELECT body FROM tokens ORDER BY rowid")]

    def add_token(self, entry: dict) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO tokens (sha256, body) VALUES (?, ?)",
                             (entry["sha256"], json.dumps(entry)))

    def close(self) -> None:
        with self._lock:
            self._db.close()
