"""The service's pure parts: reconcile decisions, tokens, durable records and idempotency keys."""

from __future__ import annotations

import json
import time

import pytest

from cluster.storage import open_root
from service.auth import TokenConfigError, Tokens, bootstrap_admin, hash_token, load_tokens, parse_entries
from service.jobs import reconcile_decision
from service.store import Record, Store, create_exclusive

DECISIONS = [
    # state, Ray's status of the latest attempt, the run's own summary status -> next state, action
    ("RUNNING", "RUNNING", None, "RUNNING", None),
    ("PENDING", "PENDING", None, "RUNNING", None),
    ("STOPPING", "RUNNING", None, "STOPPING", None),
    ("RUNNING", "SUCCEEDED", "succeeded", "SUCCEEDED", None),
    ("RUNNING", "FAILED", "stopped", "STOPPED", None),  # exit 3: stopped with a checkpoint
    ("STOPPING", "FAILED", "stopped", "STOPPED", None),
    ("RUNNING", "FAILED", "failed", "FAILED", None),
    ("RUNNING", "FAILED", None, "FAILED", None),
    ("STOPPING", "STOPPED", None, "STOPPED", None),  # Ray's stop after the grace period
    ("RUNNING", "MISSING", None, "RUNNING", "resubmit"),  # Ray lost it (head restarted): resubmit, it resumes
    ("PENDING", None, None, "RUNNING", "resubmit"),  # stored but never sent (the replica died in between)
    ("STOPPING", "MISSING", None, "STOPPED", None),
    ("SUCCEEDED", "MISSING", None, "SUCCEEDED", None),  # finished records are never touched
    ("FAILED", "RUNNING", None, "FAILED", None),
    ("RUNNING", "UNREACHABLE", None, "RUNNING", "wait"),  # a 5xx or a timeout is no news: back off
    ("STOPPING", "UNREACHABLE", None, "STOPPING", "wait"),
    ("PENDING", "UNREACHABLE", None, "PENDING", "wait"),
]


@pytest.mark.parametrize("state,ray_status,outcome,expected,action", DECISIONS)
def test_reconcile_decision(state, ray_status, outcome, expected, action):
    assert reconcile_decision(state, ray_status, outcome) == (expected, action)


def test_tokens_are_kept_hashed_and_checked():
    entries = parse_entries(json.dumps([{"tenant": "team-a", "token": "a-secret-token-123"},
                                        {"tenant": "ops", "role": "admin", "sha256": hash_token("root-token-xyz-123")}]),
                            "test")
    assert all(e.token is None and len(e.sha256) == 64 for e in entries)
    tokens = Tokens(entries)
    assert tokens.authenticate("a-secret-token-123").tenant == "team-a"
    assert tokens.authenticate("root-token-xyz-123").is_admin
    assert tokens.authenticate("nope") is None and tokens.authenticate(None) is None


@pytest.mark.parametrize("text,expected", [
    ("{tenant: a}", "expected a list"),
    ("[{tenant: a}]", "give sha256 (of the token) or token"),
    ("[{tenant: 'Team A', token: 'aaaaaaaaaaaaaaaaaaaa'}]", "[0].tenant: String should match pattern"),
    ("[{tenant: a, role: root, token: 'aaaaaaaaaaaaaaaaaaaa'}]", "[0].role"),
    ("[{tenant: a, token: short}]", "[0].token: String should have at least 16 characters"),
    ("[", "not JSON or YAML"),
])
def test_bad_token_files_name_the_entry(text, expected):
    with pytest.raises(TokenConfigError) as err:
        parse_entries(text, "tokens.yaml")
    assert expected in str(err.value) and "tokens.yaml" in str(err.value)


def test_tokens_come_from_the_file_or_the_environment(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text("- {tenant: a, token: aaaaaaaaaaaaaaaaaaaa}\n")
    assert load_tokens(str(f), {})[0].tenant == "a"
    assert load_tokens(None, {"ETRAIN_TOKENS": '[{"tenant": "b", "token": "bbbbbbbbbbbbbbbbbbbb"}]'})[0].tenant == "b"
    assert load_tokens(None, {}) == []
    with pytest.raises(TokenConfigError, match="cannot read"):
        load_tokens(str(tmp_path / "missing.yaml"), {})


def test_the_bootstrap_admin_token_is_printed_once_and_only_its_hash_kept(tmp_path):
    root = open_root(str(tmp_path))
    entries, token = bootstrap_admin(root)
    assert token and entries[0].role == "admin"
    assert token not in (tmp_path / "tokens.json").read_text()
    again, none = bootstrap_admin(root)
    assert none is None and Tokens(again).authenticate(token).is_admin


def record(i: int) -> Record:
    now = time.time()
    return Record(id=f"j-{i}", kind="job", tenant="a", name=f"n{i}", spec={}, spec_uri="x", storage="y",
                  created_at=now + i, updated_at=now + i)


def test_records_survive_a_new_store(tmp_path):
    store = Store(open_root(str(tmp_path)))
    r = record(1)
    r.move("RUNNING", "submitted")
    store.save(r)
    store.save(record(2))
    again = Store(open_root(str(tmp_path)))
    assert [x.id for x in again.all()] == ["j-1", "j-2"]
    assert again.get("j-1").history[-1].state == "RUNNING" and again.get("j-1").state == "RUNNING"
    assert again.get("nope") is None


def test_an_idempotency_key_binds_once(tmp_path):
    store = Store(open_root(str(tmp_path)))
    assert store.claim_key("a", "k", "j-1", "h1")["id"] == "j-1"
    assert store.claim_key("a", "k", "j-2", "h2")["id"] == "j-1"  # the first binding wins
    assert store.claim_key("b", "k", "j-3", "h3")["id"] == "j-3"  # keys are per tenant
    assert store.key_binding("a", "k")["body_sha256"] == "h1" and store.key_binding("a", "other") is None


def test_exclusive_create_on_s3_uses_a_conditional_put(s3_server):
    import boto3

    boto3.client("s3").create_bucket(Bucket="excl")
    root = open_root("s3://excl/svc")
    assert create_exclusive(root, b"first", "k.json")
    assert not create_exclusive(root, b"second", "k.json")
    assert root.read_bytes("k.json") == b"first"
