"""The service's durable records and Idempotency-Keys, in a private folder."""

from __future__ import annotations

import time

from service.store import Record, Store


def record(i: int) -> Record:
    now = time.time()
    return Record(id=f"j-{i}", kind="job", tenant="a", name=f"n{i}", spec={}, spec_uri="x", storage="y",
                  created_at=now + i, updated_at=now + i)


def test_records_survive_a_new_store_in_a_private_folder(tmp_path):
    store = Store(str(tmp_path / "state"))
    r = record(1)
    r.move("RUNNING", "submitted")
    store.save(r)
    store.save(record(2))
    again = Store(str(tmp_path / "state"))
    assert [x.id for x in again.all()] == ["j-1", "j-2"]
    assert again.get("j-1").history[-1].state == "RUNNING" and again.get("j-1").state == "RUNNING"
    assert again.get("nope") is None
    assert (tmp_path / "state").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "state" / "service.sqlite3").stat().st_mode & 0o777 == 0o600


def test_an_idempotency_key_binds_once(tmp_path):
    store = Store(str(tmp_path))
    assert store.claim_key("a", "k", "j-1", "h1")["id"] == "j-1"
    assert store.claim_key("a", "k", "j-2", "h2")["id"] == "j-1"  # the first binding wins
    assert store.claim_key("b", "k", "j-3", "h3")["id"] == "j-3"  # keys are per tenant
    assert store.key_binding("a", "k")["body_sha256"] == "h1" and store.key_binding("a", "other") is None
    assert Store(str(tmp_path)).key_binding("a", "k")["id"] == "j-1"  # and kept
