"""Tokens (kept hashed, read from a file or the environment) and what a role may name in a spec."""

from __future__ import annotations

import json

import pytest

from service.auth import (TokenConfigError, Tokens, bootstrap_admin, hash_token, in_tenant_data, is_under, load_tokens,
                          parse_entries, policy_problems)
from service.store import Store


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
    ("[{tenant: a, role: root, token: 'aaaaaaaaaaaaaaaaaaaa'}]", "[0].role: Input should be 'admin', 'user' or 'code'"),
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
    state = Store(str(tmp_path / "state"))
    entries, token = bootstrap_admin(state)
    assert token and entries[0].role == "admin"
    assert token.encode() not in (tmp_path / "state" / "service.sqlite3").read_bytes()
    again, none = bootstrap_admin(Store(str(tmp_path / "state")))
    assert none is None and Tokens(again).authenticate(token).is_admin


# ---------------------------------------------------------------- what a role may put in a spec

ROOT = "/srv/etrain/tenants/team-a"
POLICY = [
    # role, spec, expected problem (None: allowed)
    ("user", {"data": {"factory": "subprocess:run", "options": {"args": ["sh"]}}},
     "data.factory: \"subprocess:run\": not allowed for role 'user': the factories allowed are exactly: "
     "userpkg:make_model, userpkg.sub:make_data, userpkg:x, userpkg:a, userpkg.sub:b"),
    ("user", {"model": {"factory": "os:system"}}, "model.factory: \"os:system\": not allowed for role 'user'"),
    ("user", {"model": {"factory": "no_such_module_at_all:fn"}}, "model.factory: \"no_such_module_at_all:fn\": not allowed"),
    ("user", {"model": {"factory": "userpkgevil:make"}}, "model.factory: \"userpkgevil:make\": not allowed"),
    ("user", {"data": {"factory": ["x"]}}, "data.factory: [\"x\"]: not allowed"),
    ("user", {"model": {"factory": "userpkg:make_model"}, "data": {"factory": "userpkg.sub:make_data"}}, None),
    ("user", {"train_loop": "userpkg:own_loop"}, "train_loop: not allowed for role 'user'"),
    ("user", {"data": {"source": "/srv/etrain/tenants/team-b/d.parquet"}}, "data.source: \"/srv/etrain/tenants/team-b"),
    ("user", {"data": {"source": "/srv/etrain/tenants/team-a/../team-b/d.parquet"}}, "outside your data"),
    ("user", {"data": {"source": "/srv/etrain/tenants/team-ab/d.parquet"}}, "outside your data"),
    ("user", {"data": {"source": "s3://other/x.parquet"}}, "outside your data"),
    ("user", {"data": {"source": "/srv/etrain/tenants/team-a/data/d.parquet"}}, None),
    ("user", {"data": {"source": "s3://shared-data/public/x/"}}, None),
    ("user", {"data": {"source": "builtin:digits"}}, None),
    ("user", {"data": {"source": "../team-b/d.parquet"}}, "data.source: \"../team-b/d.parquet\": outside your data"),
    ("user", {"data": {"source": "data/d.parquet"}}, None),
    # %-escapes are decoded where the URI is opened (pyarrow), so they are decoded before the check
    ("user", {"data": {"source": "file:///srv/etrain/tenants/team-a/%2e%2e/team-b/d.parquet"}}, "outside your data"),
    ("user", {"data": {"source": "file:///srv/etrain/tenants/team-a/..%2fteam-b/d.parquet"}}, "outside your data"),
    ("user", {"data": {"source": "s3://shared-data/public/%2E%2E/private/x.parquet"}}, "outside your data"),
    ("user", {"data": {"source": "file:///srv/etrain/tenants/team-a/data%20set/d.parquet"}}, None),
    # pretrained weights: read like data, only under the tenant's prefix (or URIs the operator allows)
    ("user", {"model": {"init_from": "pretrained/w.safetensors"}}, None),
    ("user", {"model": {"init_from": "/srv/etrain/tenants/team-a/jobs/j-1/checkpoints"}}, None),
    ("user", {"model": {"init_from": "s3://shared-data/public/bert.pt"}}, None),
    ("user", {"model": {"init_from": "/srv/etrain/tenants/team-b/jobs/j-2/checkpoints"}},
     "model.init_from: \"/srv/etrain/tenants/team-b/jobs/j-2/checkpoints\": outside your data: role 'user' reads "
     "only under its own storage prefix (give a path relative to it, e.g. 'pretrained/model.safetensors') or URIs "
     "your operator allows"),
    ("user", {"model": {"init_from": "../team-b/w.pt"}}, "model.init_from: \"../team-b/w.pt\": outside your data"),
    ("user", {"model": {"init_from": "s3://other/w.pt"}}, "model.init_from: \"s3://other/w.pt\": outside your data"),
    ("user", {"model": {"init_from": "file:///srv/etrain/tenants/team-a/%2e%2e/team-b/w.pt"}}, "outside your data"),
    ("code", {"model": {"init_from": "/anywhere/w.pt"}}, None),
    ("user", {"sweep": {"space": {"model.init_from": {"choice": ["a.pt", "b.pt"]}}}},
     "sweep.space.model.init_from: sets model.init_from: not searchable over HTTP"),
    ("code", {"sweep": {"space": {"model": {"choice": [{"hidden_size": 8}, {"init_from": "a.pt"}]}}}},
     "sweep.space.model: sets model.init_from: not searchable over HTTP"),
    ("user", {"model": {"init_from": "w.pt"}, "sweep": {"space": {"model": {"choice": [{"hidden_size": 8}]}}}}, None),
    ("user", {"sweep": {"space": {"labels.tenant": {"choice": ["b"]}}}}, "sweep.space.labels.tenant: not searchable"),
    ("user", {"sweep": {"space": {"data.factory": {"choice": ["userpkg:x", "subprocess:run"]}}}},
     "sweep.space.data.factory: \"subprocess:run\": data.factory: \"subprocess:run\": not allowed for role 'user'"),
    ("user", {"sweep": {"space": {"model.factory": {"choice": ["userpkg:a", "userpkg.sub:b"]}}}}, None),
    ("user", {"sweep": {"space": {"train_loop": {"choice": ["userpkg:own_loop"]}}}},
     "sweep.space.train_loop: \"userpkg:own_loop\": train_loop: not allowed for role 'user'"),
    # a whole section swept: what lies inside it is checked too
    ("user", {"sweep": {"space": {"data": {"choice": [{"factory": "subprocess:run", "options": {"args": ["sh"]}}]}}}},
     "sweep.space.data: not searchable over HTTP"),
    ("user", {"sweep": {"space": {"model": {"grid": [{"factory": "userpkg:a"}, {"factory": "os:system"}]}}}},
     "sweep.space.model: {\"factory\": \"os:system\"}: model.factory: \"os:system\": not allowed for role 'user'"),
    ("user", {"sweep": {"space": {"model": {"choice": [{"factory": "userpkg:a", "hidden_size": 8}]}}}}, None),
    ("code", {"sweep": {"space": {"data": {"choice": [{"source": "/srv/etrain/tenants/team-b/d.parquet"}]}}}},
     "sweep.space.data: not searchable"),
    ("code", {"sweep": {"space": {"checkpoint": {"choice": [{"storage_root": "/srv/etrain/tenants/team-b"}]}}}},
     "sweep.space.checkpoint: not searchable"),
    ("code", {"sweep": {"space": {"name": {"choice": ["x"]}}}}, "sweep.space.name: not searchable"),
    ("user", {"sweep": {"space": {1: {"choice": ["x"]}}}}, None),  # a YAML key that is no spec key: 422 later, no crash
    ("code", {"sweep": {"space": {"data.num_workers": {"choice": [0, 2]}, "model": {"choice": [{"factory": "x:y"}]}}}},
     None),
    ("code", {"train_loop": "anything:fn", "data": {"factory": "x:y", "source": "/elsewhere/d.parquet"}}, None),
    ("admin", {"model": {"factory": "os:system"}}, None),
]


@pytest.mark.parametrize("role,spec,expected", POLICY)
def test_what_a_role_may_name(role, spec, expected):
    problems = policy_problems(role, spec, ["userpkg:make_model", "userpkg.sub:make_data", "userpkg:x", "userpkg:a",
                                            "userpkg.sub:b"], ROOT, ["s3://shared-data/public"])
    if expected is None:
        assert problems == []
    else:
        assert any(expected in p for p in problems), problems


def test_relative_sources_are_read_in_the_tenants_prefix_and_cannot_climb_out():
    assert in_tenant_data("data/d.parquet", ROOT) == ROOT + "/data/d.parquet"
    assert in_tenant_data("shards/", "s3://b/p/tenants/a") == "s3://b/p/tenants/a/shards/"
    assert not is_under(in_tenant_data("../team-b/d.parquet", ROOT), ROOT)
    assert not is_under(in_tenant_data("../../service/x.parquet", "s3://b/tenants/a"), "s3://b/tenants/a")
    assert in_tenant_data("builtin:text", ROOT) == "builtin:text"


@pytest.mark.parametrize("escaped", ["%2e%2e/bob", "..%2fbob", "%2E%2E%2Fbob"])
def test_a_percent_escaped_climb_that_pyarrow_would_follow_is_refused(tmp_path, escaped):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainers.data import ParquetFiles

    (tmp_path / "tenants" / "alice").mkdir(parents=True)
    (tmp_path / "tenants" / "bob").mkdir()
    pq.write_table(pa.table({"secret": [42]}), tmp_path / "tenants" / "bob" / "x.parquet")
    uri = f"file://{tmp_path}/tenants/alice/{escaped}/x.parquet"
    assert ParquetFiles(uri).read(0, ["secret"]).column(0).to_pylist() == [42]  # the reader decodes it: bob's data
    problems = policy_problems("user", {"data": {"source": uri}}, [], str(tmp_path / "tenants" / "alice"))
    assert problems and "outside your data" in problems[0]


def test_factories_are_allowed_by_exact_name_never_by_module(tmp_path):
    """An allowed module's other names (a helper that opens a path for writing, a class, an imported
    name) take the tenant's keyword arguments too: only the listed module:function passes."""
    from service.auth import policy_problems
    from service.settings import ServiceSettings

    allowed = ["acme_models.vision:make_resnet"]
    root = str(tmp_path / "tenants" / "t")
    assert policy_problems("user", {"model": {"factory": allowed[0]}, "data": {"factory": allowed[0]}},
                           allowed, root) == []
    for ref in ("acme_models.vision:open_for_write", "acme_models.vision:os", "acme_models:make_resnet",
                "acme_models.vision.sub:make_resnet", "acme_models.vision:make_resnet_x"):
        problems = policy_problems("user", {"model": {"factory": ref}}, allowed, root)
        assert problems == [f'model.factory: "{ref}": not allowed for role \'user\': the factories allowed are '
                            'exactly: acme_models.vision:make_resnet (your operator sets the list)'], problems
    with pytest.raises(ValueError, match="factory_modules: replaced by allowed_factories"):
        ServiceSettings(storage_root=str(tmp_path), ray_dashboard_url="http://x", factory_modules=["acme"])
    with pytest.raises(ValueError, match="'acme_models' is not 'package.module:function'"):
        ServiceSettings(storage_root=str(tmp_path), ray_dashboard_url="http://x", allowed_factories=["acme_models"])


def test_a_user_loads_hugging_face_models_only_from_its_own_data(tmp_path):
    tenant = str(tmp_path / "tenants" / "alice")
    mine = {"model": {"hf": {"path": f"{tenant}/models/bert", "task": "causal_lm",
                             "tokenizer": "s3://shared-models/tok"}}}
    assert policy_problems("user", mine, [], tenant, ["s3://shared-models"]) == []
    theirs = {"model": {"hf": {"path": f"{tenant}/../bob/models/bert", "task": "causal_lm", "tokenizer": "models/tok"}}}
    problems = policy_problems("user", theirs, [], tenant)
    assert any(p.startswith(f'model.hf.path: "{tenant}/../bob/models/bert": outside your data') for p in problems)
    assert any(p.startswith('model.hf.tokenizer: "models/tok": outside your data: role \'user\' loads models only '
                            "from a full URI or absolute path") for p in problems)
    assert policy_problems("code", theirs, [], tenant) == []
    swept = {**mine, "sweep": {"space": {"model.hf.path": {"choice": ["/etc"]}}}}
    assert any(p.startswith('sweep.space.model.hf.path: "/etc": model.hf.path: "/etc": outside your data')
               for p in policy_problems("user", swept, [], tenant))
