"""The service's pure parts: reconcile decisions, tokens, roles' rules, durable records and idempotency keys."""

from __future__ import annotations

import json
import time

import pytest

from service.auth import (Principal, TokenConfigError, Tokens, bootstrap_admin, hash_token, in_tenant_data, is_under,
                          load_tokens, parse_entries, policy_problems)
from service.jobs import Forbidden, JobManager, QuotaExceeded, reconcile_decision, sweep_trials
from service.settings import ServiceSettings
from service.store import Record, Store
from trainers.config import SpecError

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


def manager(tmp_path, **settings) -> JobManager:
    return JobManager(ServiceSettings(storage_root=str(tmp_path / "root"), state_dir=str(tmp_path / "state"),
                                      ray_dashboard_url="http://127.0.0.1:1", **settings), client=object())


ALICE = Principal(tenant="alice", role="user")


@pytest.mark.parametrize("spec,error,echoed", [
    ({"data": {"source": "../bob/x.parquet"}}, Forbidden, '"../bob/x.parquet": outside your data'),
    ({"sweep": {"space": {"model": {"choice": [{"factory": "os:system"}]}}}}, Forbidden, '"os:system": not allowed'),
    ({"data": {"source": "data/x.csv"}}, SpecError, 'data.source: "data/x.csv": must be a .parquet file'),
])
def test_refusals_echo_the_spec_as_given_never_the_servers_paths(tmp_path, spec, error, echoed):
    mgr = manager(tmp_path)
    kind = "sweep" if "sweep" in spec else "job"
    with pytest.raises(error) as info:
        mgr.check_spec(kind, {"training": {"max_steps": 5}, **spec}, ALICE, "j-000000000000")
    assert any(echoed in p for p in info.value.problems), info.value.problems
    assert str(tmp_path) not in json.dumps(info.value.problems)


def test_a_relative_source_runs_from_the_tenants_prefix(tmp_path):
    mgr = manager(tmp_path)
    run = mgr.check_spec("job", {"data": {"source": "data/x.parquet"}}, ALICE, "j-000000000000").run
    assert run["data"]["source"] == str(tmp_path / "root" / "tenants" / "alice" / "data" / "x.parquet")


def test_a_grid_search_over_choices_counts_every_combination_against_the_trial_cap(tmp_path):
    mgr = manager(tmp_path)
    space = {"training.seed": {"choice": list(range(10))}, "training.learning_rate": {"choice": [0.1, 0.01, 0.001]}}
    with pytest.raises(QuotaExceeded, match="this sweep runs 60 trials, role 'user' may run at most 50 per sweep"):
        manager(tmp_path, max_sweep_trials={"user": 50}).check_spec(
            "sweep", {"sweep": {"search": "grid", "num_samples": 2, "space": space}}, ALICE, "s-000000000000")
    checked = mgr.check_spec("sweep", {"sweep": {"search": "grid", "max_concurrent_trials": 4, "space": space}},
                             ALICE, "s-000000000000")
    assert checked.slots == 4
    assert (checked.footprint.cpus, checked.footprint.gpus) == (8, 8)  # 4 trials at once, 2 workers each


def test_a_submit_checks_its_spec_without_holding_the_services_lock(tmp_path):
    import threading

    mgr = manager(tmp_path)
    seen = []

    def check_spec(*args):
        other = threading.Thread(target=lambda: seen.append(mgr._lock.acquire(blocking=False)))
        other.start()
        other.join()
        raise QuotaExceeded("stop here")

    mgr.check_spec = check_spec
    with pytest.raises(QuotaExceeded):
        mgr.create("job", ALICE, {}, None, "x")
    assert seen == [True]  # another request could take the lock meanwhile


def test_settings_refuse_a_state_folder_inside_the_storage_root(tmp_path):
    with pytest.raises(ValueError, match="inside the storage root"):
        ServiceSettings(storage_root=str(tmp_path), state_dir=str(tmp_path / "service"), ray_dashboard_url="x")
    ServiceSettings(storage_root=str(tmp_path / "root"), state_dir=str(tmp_path / "state"), ray_dashboard_url="x")


def test_a_jobs_environment_has_no_service_secrets_and_the_tenants_own(tmp_path, monkeypatch):
    for k, v in {"AWS_SECRET_ACCESS_KEY": "svc", "AWS_ACCESS_KEY_ID": "svc", "ETRAIN_TOKENS": "[...]",
                 "ETRAIN_STATE_DIR": "/x", "DB_PASSWORD": "p", "SOME_API_TOKEN": "t", "AWS_REGION": "us-east-1",
                 "RAY_AUTH_TOKEN": "cluster"}.items():
        monkeypatch.setenv(k, v)
    settings = ServiceSettings(storage_root=str(tmp_path / "root"), state_dir=str(tmp_path / "state"),
                               ray_dashboard_url="x", tenant_env={"b": {"AWS_ACCESS_KEY_ID": "bs-own"}})
    mgr = JobManager(settings, client=object())

    def record(tenant: str, kind: str = "job", state_key: str | None = None) -> Record:
        return Record(id="s-1", kind=kind, tenant=tenant, name="n", spec={}, spec_uri="x", storage="y",
                      created_at=0.0, updated_at=0.0, state_key=state_key)

    env = mgr.job_env(record("a"))
    assert all(env[k] == "" for k in ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "ETRAIN_TOKENS",
                                      "ETRAIN_STATE_DIR", "DB_PASSWORD", "SOME_API_TOKEN"))
    assert "AWS_REGION" not in env and "RAY_AUTH_TOKEN" not in env  # not secrets of ours: inherited as they are
    assert env["ETRAIN_STORAGE_ROOT"] == str(tmp_path / "root" / "tenants" / "a")
    assert mgr.job_env(record("b"))["AWS_ACCESS_KEY_ID"] == "bs-own"
    assert mgr.job_env(record("b"))["AWS_SECRET_ACCESS_KEY"] == ""
    assert env["ETRAIN_STATE_KEY"] == ""  # a job has no Tune state to sign
    settings.tenant_env["b"]["ETRAIN_STATE_KEY"] = "tenant-chosen"
    assert mgr.job_env(record("b", "sweep", "ab" * 32))["ETRAIN_STATE_KEY"] == "ab" * 32  # its own, not the tenant's


@pytest.mark.parametrize("sweep,trials", [
    ({"space": {"training.learning_rate": {"uniform": [0.1, 1]}}}, 8),
    ({"num_samples": 3, "space": {"training.learning_rate": {"uniform": [0.1, 1]}}}, 3),
    ({"search": "grid", "space": {"training.learning_rate": {"grid": [1, 2, 3]}, "training.seed": {"grid": [1, 2]}}}, 6),
    ({"search": "grid", "num_samples": 2, "space": {"training.seed": {"grid": [1, 2]}}}, 4),
    ({"search": "grid", "space": {"training.seed": {"choice": [1, 2, 3]}, "data.num_workers": {"grid": [0, 1]}}}, 6),
    ({"space": {"training.seed": {"choice": [1, 2, 3]}, "data.num_workers": {"grid": [0, 1]}}}, 16),
])
def test_sweep_trials_count_every_grid(sweep, trials):
    from trainers.sweep import SweepConfig

    assert sweep_trials(SweepConfig.model_validate(sweep)) == trials


def test_the_page_escapes_every_value_a_job_wrote():
    from service import web

    evil = "<img src=x onerror=window.__pwned=1>"
    record = {"id": "j-0123456789ab", "name": evil, "state": "RUNNING"}
    rows = [{"time": 1.0, "step": evil, "world_size": evil, "loss": evil, "samples_per_s": 1.0},
            {"time": 2.0, "step": 2, "world_size": evil, "loss": 0.5, "samples_per_s": 2.0, "goodput": evil}]
    html = web.job_page(record, rows, [{"cause": evil, "interrupted_at": evil, "steps_lost": evil, "recovery_s": evil}],
                        [{"step": evil, "complete": True, "size_bytes": evil, "uri": evil}], evil)
    assert "<img" not in html and html.count("&lt;img src=x onerror=window.__pwned=1&gt;") >= 7
    data = web.job_data(record, rows, [{"cause": evil, "step_reached": 3, "world_size_before": evil}], [], evil)
    assert "<img" not in json.dumps(data["html"])  # the script puts these parts in as HTML: escaped here
    assert data["chart"]["interruptions"][0]["cause"] == evil  # labels are data; the script sets them as text
    listing = web.jobs_page(evil, [{"id": evil, "name": evil, "kind": "job", "state": evil, "created_at": evil,
                                    "progress": {"step": evil, "target_step": 3, "goodput": evil}, "updated_at": evil}])
    assert "<img" not in listing


def test_serve_reads_the_operators_settings_file(tmp_path):
    import argparse

    from service.cli import serve_settings

    config = tmp_path / "service.yaml"
    config.write_text("allowed_factories: ['acme_models:make']\nmax_sweep_trials: {user: 10}\ntenant_quotas: {a: 2}\n")
    args = argparse.Namespace(config=str(config), dashboard_url=None, quota=None, stop_wait_s=None,
                              state_dir=str(tmp_path / "state"))
    settings = serve_settings(args, str(tmp_path / "root"))
    assert settings.allowed_factories == ["acme_models:make"] and settings.tenant_quotas == {"a": 2}
    assert settings.max_sweep_trials == {"user": 10, "code": 256, "admin": 1024}  # the roles not given keep theirs
    args.state_dir = str(tmp_path / "root" / "state")
    with pytest.raises(ValueError, match="state_dir .* is inside the storage root, where jobs write"):
        serve_settings(args, str(tmp_path / "root"))
    config.write_text("max_sweep_trials: {root: 1}\n")
    args.state_dir = None
    with pytest.raises(ValueError, match="unknown roles \\['root'\\]"):
        serve_settings(args, str(tmp_path / "root"))


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
