"""Submitting: what a spec may name and ask for, where it runs from, the quota, the lock, a job's
environment, and the spec each attempt runs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import fake_jobs_api as fakes
import pytest

from service.auth import Principal
from service.jobs import JobManager
from service.settings import ServiceSettings
from service.store import Record
from service.submit import Forbidden, QuotaExceeded, sweep_trials
from trainers.config.errors import SpecError


def manager(tmp_path, **settings) -> JobManager:
    return JobManager(ServiceSettings(storage_root=str(tmp_path / "root"), state_dir=str(tmp_path / "state"),
                                      ray_dashboard_url="http://127.0.0.1:1", **settings), client=object())


ALICE = Principal(tenant="alice", role="user")


@pytest.mark.parametrize("spec,error,echoed", [
    ({"data": {"source": "../bob/x.parquet"}}, Forbidden, '"../bob/x.parquet": outside your data'),
    ({"sweep": {"space": {"model": {"choice": [{"factory": "os:system"}]}}}}, Forbidden, '"os:system": not allowed'),
    ({"data": {"source": "data/x.csv"}}, SpecError, 'data.source: "data/x.csv": must be a .parquet file'),
    ({"model": {"init_from": "/etc/w.pt"}}, Forbidden, 'model.init_from: "/etc/w.pt": outside your data'),
    ({"model": {"init_from": "gs://b/w.pt"}}, Forbidden, 'model.init_from: "gs://b/w.pt": outside your data'),
])
def test_refusals_echo_the_spec_as_given_never_the_servers_paths(tmp_path, spec, error, echoed):
    mgr = manager(tmp_path)
    kind = "sweep" if "sweep" in spec else "job"
    with pytest.raises(error) as info:
        mgr.submitter.check_spec(kind, {"training": {"max_steps": 5}, **spec}, ALICE, "j-000000000000")
    assert any(echoed in p for p in info.value.problems), info.value.problems
    assert str(tmp_path) not in json.dumps(info.value.problems)


def test_a_relative_source_runs_from_the_tenants_prefix(tmp_path):
    mgr = manager(tmp_path)
    run = mgr.submitter.check_spec("job", {"data": {"source": "data/x.parquet"}}, ALICE, "j-000000000000").run
    assert run["data"]["source"] == str(tmp_path / "root" / "tenants" / "alice" / "data" / "x.parquet")


def test_relative_pretrained_weights_run_from_the_tenants_prefix(tmp_path):
    mgr = manager(tmp_path)
    run = mgr.submitter.check_spec("job", {"model": {"init_from": "jobs/j-1/checkpoints"}}, ALICE, "j-000000000000").run
    assert run["model"]["init_from"] == str(tmp_path / "root" / "tenants" / "alice" / "jobs" / "j-1" / "checkpoints")


def test_a_grid_search_over_choices_counts_every_combination_against_the_trial_cap(tmp_path):
    mgr = manager(tmp_path)
    space = {"training.seed": {"choice": list(range(10))}, "training.learning_rate": {"choice": [0.1, 0.01, 0.001]}}
    with pytest.raises(QuotaExceeded, match="this sweep runs 60 trials, role 'user' may run at most 50 per sweep"):
        manager(tmp_path, max_sweep_trials={"user": 50}).submitter.check_spec(
            "sweep", {"sweep": {"search": "grid", "num_samples": 2, "space": space}}, ALICE, "s-000000000000")
    checked = mgr.submitter.check_spec("sweep", {"sweep": {"search": "grid", "max_concurrent_trials": 4, "space": space}},
                             ALICE, "s-000000000000")
    assert checked.slots == 4
    assert (checked.footprint.cpus, checked.footprint.gpus) == (8, 8)  # 4 trials at once, 2 workers each


def test_a_submit_checks_its_spec_without_holding_the_services_lock(tmp_path):
    import threading

    mgr = manager(tmp_path)
    seen = []

    def check_spec(*args):
        other = threading.Thread(target=lambda: seen.append(mgr.context.lock.acquire(blocking=False)))
        other.start()
        other.join()
        raise QuotaExceeded("stop here")

    mgr.submitter.check_spec = check_spec
    with pytest.raises(QuotaExceeded):
        mgr.submitter.create("job", ALICE, {}, None, "x")
    assert seen == [True]  # another request could take the lock meanwhile


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

    env = mgr.submitter.job_env(record("a"))
    assert all(env[k] == "" for k in ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "ETRAIN_TOKENS",
                                      "ETRAIN_STATE_DIR", "DB_PASSWORD", "SOME_API_TOKEN"))
    assert "AWS_REGION" not in env and "RAY_AUTH_TOKEN" not in env  # not secrets of ours: inherited as they are
    assert env["ETRAIN_STORAGE_ROOT"] == str(tmp_path / "root" / "tenants" / "a")
    assert mgr.submitter.job_env(record("b"))["AWS_ACCESS_KEY_ID"] == "bs-own"
    assert mgr.submitter.job_env(record("b"))["AWS_SECRET_ACCESS_KEY"] == ""
    assert env["ETRAIN_STATE_KEY"] == ""  # a job has no Tune state to sign
    settings.tenant_env["b"]["ETRAIN_STATE_KEY"] = "tenant-chosen"
    assert mgr.submitter.job_env(record("b", "sweep", "ab" * 32))["ETRAIN_STATE_KEY"] == "ab" * 32  # its own, not the tenant's


@pytest.mark.parametrize("sweep,trials", [
    ({"space": {"training.learning_rate": {"uniform": [0.1, 1]}}}, 8),
    ({"num_samples": 3, "space": {"training.learning_rate": {"uniform": [0.1, 1]}}}, 3),
    ({"search": "grid", "space": {"training.learning_rate": {"grid": [1, 2, 3]}, "training.seed": {"grid": [1, 2]}}}, 6),
    ({"search": "grid", "num_samples": 2, "space": {"training.seed": {"grid": [1, 2]}}}, 4),
    ({"search": "grid", "space": {"training.seed": {"choice": [1, 2, 3]}, "data.num_workers": {"grid": [0, 1]}}}, 6),
    ({"space": {"training.seed": {"choice": [1, 2, 3]}, "data.num_workers": {"grid": [0, 1]}}}, 16),
])
def test_sweep_trials_count_every_grid(sweep, trials):
    from trainers.sweep.spec import SweepConfig

    assert sweep_trials(SweepConfig.model_validate(sweep)) == trials


def test_an_absolute_checkpoint_path_over_http_stays_in_the_tenants_folder(tmp_path):
    from trainers.config.loading import validate
    from trainers.job_folder import job_home

    mgr = fakes.manager(tmp_path, fakes.FakeClient())
    from service.auth import Principal

    run = mgr.submitter.check_spec("job", {"checkpoint": {"path": "/srv/service/model_{step}.pt"}},
                         Principal("team-a", "user"), "j-1").run
    home = job_home(validate(run))
    assert home.uri == mgr.context.tenant_root("team-a").uri_of("j-1")
    assert home.run_path.startswith(mgr.context.tenant_root("team-a").path("j-1") + "/")


@pytest.mark.parametrize("kind", ["job", "sweep"])
def test_a_record_from_before_checked_specs_runs_the_services_own_copy(tmp_path, kind):
    """A record made when the checked spec lay in the tenant's own prefix, with no digest and (a sweep)
    no key for its Tune state: its next attempt runs the service's copy, stored apart with its digest,
    never the file its tenant could have rewritten, and a sweep gets a key (Tune's unsigned state is
    then refused on resume rather than unpickled)."""
    import hashlib
    import json

    from service.auth import Principal

    client = fakes.FakeClient()
    sent = []
    client.submit_job = lambda **kw: sent.append(kw)
    mgr = fakes.manager(tmp_path, client)
    rid = f"{kind[0]}-abc"
    spec = {"name": rid, "training": {"max_steps": 5}, **({"sweep": {"space": {"training.seed": {"choice": [1]}}}}
                                                         if kind == "sweep" else {})}
    old_file = tmp_path / "tenants" / "a" / "specs" / f"{rid}.json"
    old_file.parent.mkdir(parents=True)
    old_file.write_text(json.dumps({"name": rid, "model": {"factory": "subprocess:getoutput"}}))  # rewritten
    now = time.time()
    record = Record(id=rid, kind=kind, tenant="a", name="n", spec=spec, spec_uri=str(old_file), storage="/x",
                    created_at=now, updated_at=now, submissions=[f"etrain-{rid}-0"])
    record.move("STOPPED", "test")
    mgr.store.save(record)
    mgr.submitter.resume(record, Principal("a", "user"))
    words = sent[-1]["entrypoint"].split()
    uri = words[words.index("-m") + 2]
    assert uri == str(tmp_path / "checked-specs" / "a" / f"{rid}.json")
    stored = Path(uri).read_bytes()
    assert json.loads(stored) == spec and words[words.index("--spec-sha256") + 1] == hashlib.sha256(stored).hexdigest()
    key = sent[-1]["runtime_env"]["env_vars"]["ETRAIN_STATE_KEY"]
    assert (len(key) == 64) if kind == "sweep" else key == ""
