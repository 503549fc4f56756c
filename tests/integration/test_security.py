"""Issue 13's attacks on a real service (Ray Serve on a local Ray, real jobs, headless Chromium):
a `user` tenant cannot run code or read another tenant's data, the page escapes everything,
hostile bodies get a quick 4xx, sweeps stay inside the quota. One service for the whole module,
and one real job (alice's, on her own data): the tests that need a job share it.
A `code` tenant's job against the service's state: tests/integration/test_code_tenant.py."""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import requests
from waiting import wait_for

from bearer import bearer_request
from conftest import free_port

pytestmark = pytest.mark.ray
TOKENS = {"alice": ("team-a", "user"), "bob": ("team-b", "user"), "root": ("ops", "admin")}
PAYLOAD = "<img src=x onerror=window.__pwned=1>"
REPO = Path(__file__).resolve().parents[2]
CODE_PATH = f"{REPO}:{REPO / 'tests' / 'fixtures'}"


def token_of(who: str) -> str:
    return f"sec-{who}-0123456789abcdef"


def deploy(svc) -> None:
    from ray import serve

    from service.deployment import JobService

    serve.run(JobService.bind(svc.settings.model_dump(), svc.tokens), name="etrain", route_prefix="/")


@pytest.fixture(scope="module")
def service(ray_local, tmp_path_factory):
    from ray import serve
    from ray._private.worker import get_dashboard_url

    from service.auth import TokenEntry
    from service.settings import ServiceSettings

    work = tmp_path_factory.mktemp("security")
    settings = ServiceSettings(
        storage_root=str(work / "root"), state_dir=str(work / "state"),
        ray_dashboard_url=f"http://{get_dashboard_url()}", reconcile_interval_s=1, stop_wait_s=30,
        allowed_factories=["userpkg:make_data", "userpkg:make_model"], tenant_quotas={"team-a": 3},
        # Where the operator's allowed modules (tests/fixtures here) are installed, for the tenants that use them.
        tenant_env={"team-a": {"PYTHONPATH": CODE_PATH}})
    tokens = [TokenEntry(tenant=t, role=r, token=token_of(w)).model_dump(exclude={"token"})
              for w, (t, r) in TOKENS.items()]
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    svc = SimpleNamespace(url=f"http://127.0.0.1:{port}", root=work / "root", state=work / "state", work=work,
                          settings=settings, tokens=tokens)
    deploy(svc)
    yield svc
    serve.delete("etrain")
    serve.shutdown()


def api(svc, method: str, path: str, who: str | None = "alice", **kw) -> requests.Response:
    return bearer_request(svc.url, who and token_of(who), method, path, **kw)


def quick_job(name: str, **extra) -> dict:
    return {"name": name, "training": {"batch_size": 32, "max_steps": 5, "log_interval_steps": 5},
            "distributed": {"num_workers": 1}, "model": {"hidden_size": 16}, "checkpoint": {"interval": 5}, **extra}


def wait_done(svc, job_id: str, who: str, plural: str = "jobs") -> dict:
    def done():
        r = api(svc, "GET", f"/v1/{plural}/{job_id}", who).json()
        return r if r["state"] in ("SUCCEEDED", "FAILED", "STOPPED") else None
    return wait_for(done, 300, f"job {job_id} to finish", poll_s=0.5)


@pytest.fixture(scope="module")
def alices_job(service):
    """Alice's one real job: it reads her own data (named relative to her prefix) with a model from
    the operator's allowed modules. Submitted when first asked for, so the quota test sees it hold
    its slot; the tests after it wait for it to succeed. Nothing is left running after the module."""
    mine = service.root / "tenants" / "team-a" / "data"
    mine.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"features": [[float(i % 3), 1.0, 0.0, 0.5] for i in range(96)],
                             "label": [i % 3 for i in range(96)]}), mine / "blobs.parquet")
    submitted = api(service, "POST", "/v1/jobs", json=quick_job("mine", data={"source": "data/blobs.parquet"},
                                                                 model={"factory": "userpkg:make_model"}))
    yield submitted
    if submitted.status_code == 201:
        wait_done(service, submitted.json()["id"], "alice")


def succeeded(svc, job) -> dict:
    """The shared job, once it has ended: it must have succeeded (else its log says why)."""
    assert job.status_code == 201, job.text
    done = wait_done(svc, job.json()["id"], "alice")
    assert done["state"] == "SUCCEEDED", (done["error"], done["history"], api(svc, "GET", f"/v1/jobs/{done['id']}/logs").text[-3000:])
    return done


def replica_pid() -> int:
    from ray._private.worker import get_dashboard_url
    from ray.util.state import list_actors

    actors = [a for a in list_actors(address=f"http://{get_dashboard_url()}", filters=[("state", "=", "ALIVE")])
              if a.class_name.startswith("ServeReplica:etrain:JobService")]
    return actors[0].pid


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# ---------------------------------------------------------------- a user tenant runs no code


def test_a_user_tenant_cannot_run_a_command_and_nothing_runs(service):
    marker = service.work / "pwned-marker"
    before = api(service, "GET", "/v1/jobs", "root").json()["total"]
    sweeps_before = api(service, "GET", "/v1/sweeps", "root").json()["total"]
    attacks = [
        ("data.factory", {"data": {"factory": "subprocess:run", "options": {"args": ["touch", str(marker)]}}}),
        ("model.factory", {"model": {"factory": "os:system", "options": {"command": f"touch {marker}"}},
                           "data": {"factory": "userpkg:make_data"}}),
        ("train_loop", {"train_loop": "attacker:tamper"}),
    ]
    for field, body in attacks:
        r = api(service, "POST", "/v1/jobs", json={"name": "x", **body})
        assert r.status_code == 403, (field, r.text)
        assert any(p.startswith(field) and "not allowed for role 'user'" in p for p in r.json()["problems"]), r.json()
    # A sweep over a whole section would set the same fields in its trials: refused the same way.
    for section, message in (("data", "sweep.space.data: not searchable"),
                             ("model", 'sweep.space.model: {"factory": "subprocess:run"')):
        body = {"training": {"max_steps": 5}, "sweep": {"space": {section: {"choice": [
            {"factory": "subprocess:run", "options": {"args": ["touch", str(marker)]}}]}}}}
        r = api(service, "POST", "/v1/sweeps", json=body)
        assert r.status_code == 403 and any(p.startswith(message) for p in r.json()["problems"]), (section, r.text)
    # The refusal reads the name only: a module that exists and one that does not get the same answer.
    real = api(service, "POST", "/v1/jobs", json={"data": {"factory": "subprocess:run"}}).json()["problems"]
    fake = api(service, "POST", "/v1/jobs", json={"data": {"factory": "no_such_mod_zz:run"}}).json()["problems"]
    assert real[0].replace("subprocess:run", "M") == fake[0].replace("no_such_mod_zz:run", "M")
    # A malformed ref is not on the exact list: a 403 from the names alone, never an import error; for a
    # role that may name any factory, a plain 422 about its shape.
    shape = api(service, "POST", "/v1/jobs", json={"data": {"factory": "userpkg.make data"}})
    assert shape.status_code == 403 and "not allowed for role 'user'" in shape.text, shape.text
    shape = api(service, "POST", "/v1/jobs", "root", json={"data": {"factory": "userpkg.make data"}})
    assert shape.status_code == 422 and "must look like 'package.module:function'" in shape.text, shape.text
    time.sleep(2)
    assert not marker.exists()
    assert api(service, "GET", "/v1/jobs", "root").json()["total"] == before  # nothing stored, nothing submitted
    assert api(service, "GET", "/v1/sweeps", "root").json()["total"] == sweeps_before


def test_no_sweep_value_reaches_tune_as_code_or_as_more_trials(service):
    """Ray Tune's variant generator eval()s a one-key {"eval": ...} mapping and expands a
    {"grid_search": [...]} one, at any depth of a sampled value: both are refused, naming the value's
    place, and nothing runs or is stored."""
    marker = service.work / "tune-eval-marker"
    sweeps_before = api(service, "GET", "/v1/sweeps", "root").json()["total"]
    evil = {"eval": f"open({str(marker)!r}, 'w').write('pwned')"}
    for value, where, reads_as in (
            (evil, "sweep.space.model.options.x.choice[0]", "Python to run"),
            ({"deep": [{"grid_search": list(range(500))}]}, "sweep.space.model.options.x.choice[0].deep[0]",
             "more trials")):
        body = {**quick_job("tune"), "sweep": {"space": {"model.options.x": {"choice": [value]}}}}
        r = api(service, "POST", "/v1/sweeps", json=body)
        assert r.status_code == 422, r.text
        assert any(p.startswith(f"{where}: a mapping with the key") and reads_as in p for p in r.json()["problems"]), r.text
    time.sleep(2)
    assert not marker.exists()
    assert api(service, "GET", "/v1/sweeps", "root").json()["total"] == sweeps_before


def test_only_the_exact_allowed_factories_run(service):
    """userpkg:make_model and userpkg:make_data are allowed; another function of the same module is not."""
    for ref in ("userpkg:flaky_model", "userpkg:own_loop", "userpkg.sub:make_model"):
        r = api(service, "POST", "/v1/jobs", json=quick_job("other", model={"factory": ref},
                                                            data={"factory": "userpkg:make_data"}))
        assert r.status_code == 403, (ref, r.text)
        assert r.json()["problems"] == [
            f'model.factory: "{ref}": not allowed for role \'user\': the factories allowed are exactly: '
            "userpkg:make_data, userpkg:make_model (your operator sets the list)"], r.text


def test_a_stored_spec_changed_after_its_check_does_not_run(service):
    """A job fails (its data is not there); its stored spec is then changed, as a tenant's keys could,
    to run a command; the resumed attempt runs the service's own copy, written anew (and, were the file
    changed again between that write and the job's read, the digest in the entrypoint refuses it:
    tests/unit/test_config_loading.py), and nothing runs."""
    marker = service.work / "tampered-spec-marker"
    r = api(service, "POST", "/v1/jobs", "bob", json=quick_job("gone", data={"source": "data/none.parquet"}))
    assert r.status_code == 201, r.text
    job = wait_done(service, r.json()["id"], "bob")
    assert job["state"] == "FAILED", job
    stored = service.root / "checked-specs" / "team-b" / f"{job['id']}.json"
    checked = stored.read_bytes()
    spec = json.loads(checked)
    spec["model"] = {"factory": "os:system", "options": {"command": f"touch {marker}"}}
    spec["data"] = {"factory": "userpkg:make_data"}
    stored.write_text(json.dumps(spec))
    assert api(service, "POST", f"/v1/jobs/{job['id']}/resume", "bob").status_code == 202
    again = wait_done(service, job["id"], "bob")
    log = api(service, "GET", f"/v1/jobs/{job['id']}/logs", "bob").text
    assert again["state"] == "FAILED" and len(again["submissions"]) == 2, again
    assert "data.source: 'data/none.parquet': not found" in log and "--spec-sha256" in log, log[-2000:]
    assert stored.read_bytes() == checked  # the service's copy again
    assert not marker.exists()


class Planted:
    """What a tenant would plant as Tune's state: unpickling it creates the marker."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_sweeps_tune_state_changed_in_storage_is_not_unpickled(service):
    """Tune unpickles a sweep's state (tuner.pkl, ...) on resume, from the tenant's own prefix, which
    the tenant's keys can write: the driver signs what Tune writes and checks it before Tune reads."""
    import pickle

    marker = service.work / "tune-pickle-marker"
    body = {**quick_job("tuned", training={"batch_size": 32, "max_steps": 100000, "log_interval_steps": 50}),
            "sweep": {"space": {"training.seed": {"choice": [1]}}, "max_concurrent_trials": 1}}
    r = api(service, "POST", "/v1/sweeps", "bob", json=body)
    assert r.status_code == 201, r.text
    sweep_id = r.json()["id"]
    state = service.root / "tenants" / "team-b" / "sweeps" / sweep_id / "tune"
    wait_for(lambda: (state / "tuner.pkl").exists(), 240, "the sweep's Tune state")
    wait_for(lambda: (state / "tuner.pkl.etrain-sig").exists(), 30, "its signature: the driver signs what Tune writes")
    assert api(service, "POST", f"/v1/sweeps/{sweep_id}/stop", "bob").status_code == 202
    assert wait_done(service, sweep_id, "bob", "sweeps")["state"] == "STOPPED"
    assert b"ETRAIN_STATE_KEY" not in (state / "tuner.pkl").read_bytes()
    (state / "tuner.pkl").write_bytes(pickle.dumps(Planted(marker)))
    assert api(service, "POST", f"/v1/sweeps/{sweep_id}/resume", "bob").status_code == 202
    again = wait_done(service, sweep_id, "bob", "sweeps")
    log = api(service, "GET", f"/v1/sweeps/{sweep_id}/logs", "bob").text
    assert again["state"] == "FAILED", again
    assert "the sweep's saved state does not verify" in log and "tuner.pkl" in log, log[-3000:]
    assert not marker.exists()


def test_a_job_over_a_role_maximum_or_over_the_cpu_quota_is_refused_with_the_limit(service):
    jobs_before = api(service, "GET", "/v1/jobs", "root").json()["total"]
    wide = quick_job("wide", training={"batch_size": 128, "max_steps": 5},
                     distributed={"num_workers": {"min": 1, "max": 64}})
    r = api(service, "POST", "/v1/jobs", "bob", json=wide)
    assert r.status_code == 403 and r.json()["problems"] == [
        "distributed.num_workers: 64: over role 'user''s maximum of 16: ask for fewer workers (your operator sets "
        "role_limits)"], r.text
    forever = quick_job("forever", fault_tolerance={"max_failures": -1}, data={"num_workers": 500})
    problems = api(service, "POST", "/v1/jobs", "bob", json=forever).json()["problems"]
    assert [p.split(":")[0] for p in problems] == ["data.num_workers", "fault_tolerance.max_failures"], problems
    fleet = quick_job("fleet", training={"batch_size": 128, "max_steps": 5},
                      distributed={"num_workers": 16, "use_gpu": False, "resources_per_worker": {"CPU": 8}})
    r = api(service, "POST", "/v1/jobs", "bob", json=fleet)
    assert r.status_code == 429, r.text
    assert "its quota of 64 CPUs and this asks for 128" in r.json()["detail"], r.text
    gpus = quick_job("gpus", training={"batch_size": 128, "max_steps": 5}, distributed={"num_workers": 16},
                     sweep={"space": {"training.seed": {"choice": [1, 2]}}, "max_concurrent_trials": 2})
    r = api(service, "POST", "/v1/sweeps", "bob", json=gpus)  # 2 trials at once x 16 workers, each may take a GPU
    assert r.status_code == 429 and "its quota of 16 GPUs and this asks for 32" in r.json()["detail"], r.text
    assert api(service, "GET", "/v1/jobs", "root").json()["total"] == jobs_before


# ---------------------------------------------------------------- sweeps and the quota


def sweep_body(**sweep) -> dict:
    return {**quick_job("sw"), "sweep": {"space": {"training.learning_rate": {"choice": [0.01, 0.02]}}, **sweep}}


def test_sweeps_count_against_the_quota_and_cannot_sweep_ownership(service, alices_job):
    # Alice's job was just submitted: it holds 1 of her 3 slots until it ends (seconds from now).
    assert alices_job.status_code == 201, alices_job.text
    sweeps_before = api(service, "GET", "/v1/sweeps", "root").json()["total"]
    many = api(service, "POST", "/v1/sweeps", json=sweep_body(num_samples=10000))
    assert many.status_code == 429 and "runs 10000 trials, role 'user' may run at most 64" in many.json()["detail"]
    wide = api(service, "POST", "/v1/sweeps", json=sweep_body(num_samples=8, max_concurrent_trials=1000))
    assert wide.status_code == 429 and "quota of 3 slots" in wide.json()["detail"] and "needs 8" in wide.json()["detail"]
    grid = api(service, "POST", "/v1/sweeps", json={**quick_job("sw"), "sweep": {
        "search": "grid", "space": {"training.seed": {"choice": list(range(10))},
                                    "training.learning_rate": {"choice": [0.1, 0.01, 0.001, 0.0001, 0.00001, 0.2, 0.3]}}}})
    assert grid.status_code == 429 and "runs 70 trials" in grid.json()["detail"]  # search: grid enumerates choices
    owner = api(service, "POST", "/v1/sweeps",
                json={**quick_job("sw"), "sweep": {"space": {"labels.tenant": {"choice": ["team-a", "team-b"]}}}})
    assert owner.status_code == 403 and "sweep.space.labels.tenant: not searchable" in owner.text
    full = api(service, "POST", "/v1/sweeps", json=sweep_body(num_samples=3, max_concurrent_trials=3))
    assert full.status_code == 429 and "holds 1 of its quota of 3" in full.json()["detail"], full.text
    assert api(service, "GET", "/v1/sweeps", "root").json()["total"] == sweeps_before  # none of them started


def test_a_user_reads_only_its_own_data_and_runs_allowed_factories(service, alices_job):
    team_b = service.root / "tenants" / "team-b" / "data"
    team_b.mkdir(parents=True)
    pq.write_table(pa.table({"features": [[0.0, 1.0, 2.0, 3.0]] * 64, "label": [1] * 64}), team_b / "secret.parquet")
    mine_uri = f"file://{service.root}/tenants/team-a"
    for source in (str(team_b / "secret.parquet"), "../team-b/data/secret.parquet",
                   f"{mine_uri}/%2e%2e/team-b/data/secret.parquet", f"{mine_uri}/..%2fteam-b/data/secret.parquet",
                   str(service.state / "service.sqlite3"), str(service.state) + "/", "s3://elsewhere/x.parquet"):
        r = api(service, "POST", "/v1/jobs", json=quick_job("steal", data={"source": source},
                                                             model={"factory": "userpkg:make_model"}))
        assert r.status_code == 403, (source, r.text)
        assert r.json()["problems"][0].startswith(f"data.source: {json.dumps(source)}: outside your data"), r.text
        assert "service.sqlite3" not in r.text.replace(source, "") and "records" not in r.text  # lists nothing
        assert str(service.root) not in r.text.replace(source, "")  # the value as given, no server path added

    # Its own prefix, given relative to it, with factories from the operator's list: alice's job runs.
    assert alices_job.status_code == 201, alices_job.text
    assert alices_job.json()["spec"]["data"]["source"] == "data/blobs.parquet"  # shown relative, as given
    succeeded(service, alices_job)


# ---------------------------------------------------------------- what answers reveal


def test_answers_carry_no_server_paths_and_healthz_says_only_ok(service, alices_job):
    assert requests.get(service.url + "/healthz", timeout=30).json() == {"status": "ok"}
    done = succeeded(service, alices_job)
    jobs = api(service, "GET", "/v1/jobs", "alice").json()["items"]
    texts = [json.dumps(jobs), api(service, "GET", f"/v1/jobs/{done['id']}/checkpoints").text,
             api(service, "GET", f"/v1/jobs/{done['id']}/logs").text, json.dumps(api(service, "GET", "/v1/jobs",
                                                                                     "root").json())]
    for text in texts:
        assert str(service.root) not in text and str(service.state) not in text
    assert done["spec_uri"] == f"checked-specs/team-a/{done['id']}.json" and done["storage"] == done["id"]
    checkpoints = api(service, "GET", f"/v1/jobs/{done['id']}/checkpoints").json()
    assert checkpoints[-1]["uri"].startswith(f"{done['id']}/checkpoints/")


# ---------------------------------------------------------------- the page, in Chromium


def test_xss_payloads_come_back_escaped_and_no_script_runs(service, alices_job, tmp_path):
    from browser import Browser

    job = succeeded(service, alices_job)["id"]
    folder = service.root / "tenants" / "team-a" / job  # what a job writes, as a hostile one would
    (folder / "interruptions.json").write_text(json.dumps([{"cause": PAYLOAD, "interrupted_at": PAYLOAD,
                                                            "steps_lost": PAYLOAD, "recovery_s": PAYLOAD}]))
    (folder / "metrics").mkdir(exist_ok=True)
    (folder / "metrics" / "9999999999-9999999999-1.jsonl").write_text("\n".join(json.dumps(row) for row in (
        {"time": 9e9, "step": 999999, "world_size": PAYLOAD, "loss": PAYLOAD, "goodput": PAYLOAD},
        {"time": PAYLOAD, "step": PAYLOAD}, [PAYLOAD])) + "\nnot json\n")  # hostile and broken rows

    browser = Browser(tmp_path / "profile")
    try:
        browser.goto(f"{service.url}/ui/jobs/{job}?token={token_of('alice')}")  # a token in the URL is ignored
        assert "Sign in" in browser.eval("document.body.innerText")
        browser.sign_in(service.url, token_of("root"))  # an admin, following the attacker's links
        cookie = [c for c in browser.cookies() if c["name"] == "etrain_token"][0]
        assert cookie["httpOnly"] and cookie["secure"] and cookie["sameSite"] == "Strict"
        for url in (f"{service.url}/ui/jobs/{PAYLOAD}", f"{service.url}/ui/jobs/{job}", f"{service.url}/"):
            browser.goto(url)
            text = browser.eval("document.body.innerText")
            assert browser.eval("typeof window.__pwned") == "undefined", url
            assert browser.eval("document.querySelectorAll('img').length") == 0, url  # text, not an element
            if "/ui/jobs/" in url:
                assert PAYLOAD in text, (url, text[:500])
    finally:
        browser.close()
    page = requests.get(f"{service.url}/ui/jobs/{job}", cookies={"etrain_token": token_of("root")}, timeout=30)
    policy = dict(d.strip().split(" ", 1) for d in page.headers["Content-Security-Policy"].split(";"))
    assert policy["script-src"] == "'self'" and policy["default-src"] == "'none'"  # the service's own script only
    assert "unsafe" not in page.headers["Content-Security-Policy"]
    assert "&lt;img src=x onerror=window.__pwned=1&gt;" in page.text and PAYLOAD not in page.text


# ---------------------------------------------------------------- hostile bodies


BOMB = ("name: bomb\ndata:\n  options:\n    a: &a [x,x,x,x,x,x,x,x,x]\n    b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n"
        "    c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n    d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\n"
        "    e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n    f: [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n")
DOS = [
    ("format spec", "application/json", json.dumps({"checkpoint": {"path": "m_{step:>2000000000}.pt"}}), 422,
     "checkpoint.path"),
    ("alias bomb", "application/yaml", BOMB, 422, "anchors and aliases"),
    ("deep JSON", "application/json", '{"data": {"options": {"a": ' + "[" * 200000 + "]" * 200000 + "}}}", 422,
     "nested deeper"),
    ("huge int", "application/json", '{"training": {"seed": ' + "9" * 5000 + "}}", 422, "5000 digits"),
    ("huge YAML int", "application/yaml", "training: {seed: " + "9" * 5000 + "}", 422, "5000 digits"),
    ("not UTF-8", "application/json", b"\xff\xfe{}", 422, "not UTF-8"),
    ("over the limit", "application/yaml", "a: " + "x" * (2 << 20), 413, "over the"),
]


@pytest.mark.parametrize("what,content_type,body,status,message", DOS, ids=[d[0] for d in DOS])
def test_hostile_bodies_get_a_quick_4xx_and_cost_no_memory(service, what, content_type, body, status, message):
    pid = replica_pid()
    peak, stop = [rss_bytes(pid)], threading.Event()
    base = peak[0]

    def sample():
        while not stop.is_set():
            peak.append(rss_bytes(pid))
            time.sleep(0.01)
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        started = time.perf_counter()
        r = api(service, "POST", "/v1/jobs", data=body if isinstance(body, bytes) else body.encode(),
                headers={"Content-Type": content_type})
        took = time.perf_counter() - started
    finally:
        stop.set()
        sampler.join()
    assert r.status_code == status and message in r.text, r.text[:500]
    assert took < 1.0, f"{what}: {took:.2f} s"
    assert max(peak) - base < 100 << 20, f"{what}: the replica grew {(max(peak) - base) >> 20} MB"


def chunks(total_bytes: int, chunk_bytes: int = 64 << 10, pause_s: float = 0.0):
    """A chunked body (no Content-Length): a YAML list, fed slowly."""
    line = b"- 1\n"
    sent = 0
    while sent < total_bytes:
        yield line * (chunk_bytes // len(line))
        sent += chunk_bytes
        time.sleep(pause_s)


def test_bodies_are_limited_while_they_stream_on_every_route(service):
    over = api(service, "POST", "/v1/jobs", data=chunks(3 << 20), headers={"Content-Type": "application/yaml"})
    assert over.status_code == 413 and "over the limit" in over.json()["detail"]
    login = requests.post(service.url + "/ui/login", data=chunks(1 << 20), timeout=60,
                          headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert login.status_code == 413
    sweep = api(service, "POST", "/v1/sweeps", data=chunks(3 << 20), headers={"Content-Type": "application/yaml"})
    assert sweep.status_code == 413


def test_healthz_stays_fast_while_a_1mb_yaml_body_is_refused(service):
    result = {}

    def submit():
        result["r"] = api(service, "POST", "/v1/jobs", data=chunks(1_000_000, pause_s=0.05),
                          headers={"Content-Type": "application/yaml"})
    sender = threading.Thread(target=submit)
    sender.start()
    latencies = []
    while sender.is_alive() or len(latencies) < 10:
        started = time.perf_counter()
        h = requests.get(service.url + "/healthz", timeout=30)
        latencies.append(time.perf_counter() - started)
        assert h.json() == {"status": "ok"}  # and nothing else about the service
    sender.join()
    assert result["r"].status_code == 422 and "more than 20000 values" in result["r"].text
    assert statistics.median(latencies) < 0.1 and max(latencies) < 1.0, latencies


def test_healthz_stays_fast_while_a_200k_character_spec_and_page_views_are_in_flight(service, alices_job):
    """A 200,000-character factory name was accepted, failed its job with itself in the log, and each
    page view's log classifier then spent a minute on it (quadratic in a run of word characters),
    stalling every route. Now the text is refused at once and the page's classifier is linear."""
    job = succeeded(service, alices_job)["id"]
    long_ref = "userpkg:" + "a" * 200_000
    results: dict = {"pages": []}

    def attack():
        results["submit"] = api(service, "POST", "/v1/jobs", json=quick_job(
            "long", model={"factory": long_ref}, data={"factory": "userpkg:make_data"}))
        for _ in range(3):
            results["pages"].append(requests.get(f"{service.url}/ui/jobs/{job}", timeout=60,
                                                 cookies={"etrain_token": token_of("alice")}).status_code)
    attacker = threading.Thread(target=attack)
    attacker.start()
    latencies = []
    while attacker.is_alive() or len(latencies) < 10:
        started = time.perf_counter()
        assert requests.get(service.url + "/healthz", timeout=60).status_code == 200
        latencies.append(time.perf_counter() - started)
    attacker.join()
    r = results["submit"]
    assert r.status_code == 422 and "a text of 200008 characters" in r.text and len(r.text) < 2000, r.text[:500]
    assert results["pages"] == [200, 200, 200]
    assert statistics.median(latencies) < 0.2 and max(latencies) < 2.0, latencies


def test_malformed_requests_are_4xx_and_ids_are_checked(service):
    assert api(service, "GET", "/v1/jobs/not-an-id").status_code == 422
    assert api(service, "GET", "/v1/jobs/j-000000000000").status_code == 404
    for body in (b"", b"   ", b"[1]", b"{", b"null", b"a: [1, 2"):
        r = api(service, "POST", "/v1/jobs", data=body, headers={"Content-Type": "application/yaml"})
        assert r.status_code == 422, (body, r.text)
    for body, field in ((b"data: {options: {x: !!binary AAAA/w==}}", "body: data.options.x: binary data"),
                        (b"model: {options: {x: !!set {a, b}}}", "body: model.options.x: a set")):
        r = api(service, "POST", "/v1/jobs", data=body, headers={"Content-Type": "application/yaml"})
        assert r.status_code == 422 and field in r.text, (body, r.text)  # JSON cannot hold it: never a 500
    login = requests.post(service.url + "/ui/login", data=b"\xff\xfe=%%%", timeout=30)
    assert login.status_code == 401
