"""Issue 44's front door on a real service (Ray Serve on a local Ray): what an ordinary client
can make the service spend is bounded. Slow bodies and many connections do not take every
slot, a client cannot lift Serve's timeout, sign-ins from another site or too often are
refused, the docs load no third-party script, and a long history costs a listing or a
metrics answer only what it shows. No job runs: the records and their histories are written
into the service's state and storage before it starts, as a service restarted finds them."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
import requests

from bearer import bearer_request
from conftest import free_port

pytestmark = pytest.mark.ray
TOKENS = {"alice": ("team-a", "user"), "bob": ("team-b", "user")}
LONG_STEPS = 50_000  # rows of the long job's history
ROWS_PER_FILE = 1000
LISTED = 55  # alice's short records besides the long one: more than a page of the web list
SLOW_CLIENTS = 220


def token_of(who: str) -> str:
    return f"door-{who}-0123456789abcdef"


def spec(name: str) -> dict:
    return {"name": name, "training": {"batch_size": 32, "max_steps": LONG_STEPS}, "distributed": {"num_workers": 1},
            "model": {"hidden_size": 16}, "checkpoint": {"interval": 5}}


def seed(state_dir, storage) -> str:
    """Alice's records as a restarted service finds them: one finished job with a 50,000-row history
    (50 files, as a run writes them), and more short ones than a page shows."""
    from service.store import Record, Store

    store, now = Store(str(state_dir)), time.time()
    long_id = "j-00000000aaaa"
    for i, record_id in enumerate([long_id, *(f"j-{i:012x}" for i in range(1, LISTED + 1))]):
        store.save(Record(id=record_id, kind="job", tenant="team-a", name=f"run-{i}", state="SUCCEEDED",
                          spec=spec(f"run-{i}"), spec_uri=f"specs/{record_id}.json", storage=record_id,
                          created_at=now - i, updated_at=now - i))
    store.close()
    folder = storage / "tenants" / "team-a" / long_id / "metrics"
    folder.mkdir(parents=True)
    for first in range(0, LONG_STEPS, ROWS_PER_FILE):
        rows = [{"time": 1000.0 + s, "step": s, "target_step": LONG_STEPS, "loss": 1.0 / (s + 1), "world_size": 1}
                for s in range(first, first + ROWS_PER_FILE)]
        name = f"{rows[0]['step']:010d}-{rows[-1]['step']:010d}-{int(rows[-1]['time'] * 1000)}.jsonl"
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return long_id


@pytest.fixture(scope="module")
def service(ray_local, tmp_path_factory):
    from ray import serve
    from ray._private.worker import get_dashboard_url

    from service.deployment import application, http_options
    from service.auth import TokenEntry
    from service.http_limits import HttpLimits
    from service.settings import ServiceSettings

    work = tmp_path_factory.mktemp("front-door")
    settings = ServiceSettings(storage_root=str(work / "root"), state_dir=str(work / "state"),
                               ray_dashboard_url=f"http://{get_dashboard_url()}", reconcile_interval_s=1)
    long_id = seed(work / "state", work / "root")
    tokens = [TokenEntry(tenant=t, role=r, token=token_of(w)).model_dump(exclude={"token"})
              for w, (t, r) in TOKENS.items()]
    limits = HttpLimits(body_deadline_s=4, request_timeout_s=45, login_failures=3)
    port = free_port()
    serve.start(http_options=http_options("127.0.0.1", port, limits))
    serve.run(application(settings.model_dump(), tokens, limits), name="etrain", route_prefix="/")
    yield SimpleNamespace(url=f"http://127.0.0.1:{port}", port=port, long_id=long_id, limits=limits)
    serve.delete("etrain")
    serve.shutdown()


def api(svc, method: str, path: str, who: str | None = "alice", **kw) -> requests.Response:
    return bearer_request(svc.url, who and token_of(who), method, path, **kw)


def signed_in(svc, path: str, who: str = "alice") -> requests.Response:
    return requests.get(svc.url + path, cookies={"etrain_token": token_of(who)}, timeout=60)


# ---------------------------------------------------------------- slow clients


async def slow_client(port: int, started: asyncio.Event) -> bytes:
    """A sign-in whose body trickles: headers, then a byte a second of the 1000 promised, for at
    most 30 s; what the service answered meanwhile."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST /ui/login HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/x-www-form-"
                 "urlencoded\r\nContent-Length: 1000\r\n\r\ntoken=".encode())
    await writer.drain()
    started.set()
    answer = asyncio.ensure_future(reader.read(4096))
    for _ in range(30):
        done, _ = await asyncio.wait([answer], timeout=1.0)
        if done:
            break
        try:
            writer.write(b"x")
            await writer.drain()
        except ConnectionError:  # the service closed it: its answer is already read or on its way
            break
    body = await asyncio.wait_for(answer, 5) if not answer.done() else answer.result()
    try:  # the answer may come in more than one packet (headers, then the body): read to the service's close
        body += await asyncio.wait_for(reader.read(), 5)
    except (ConnectionError, asyncio.TimeoutError):
        pass  # what came is what there is
    writer.close()
    return body


async def slow_clients_and_one_normal(svc) -> tuple[float, requests.Response, list[bytes]]:
    starts = [asyncio.Event() for _ in range(SLOW_CLIENTS)]
    clients = [asyncio.ensure_future(slow_client(svc.port, s)) for s in starts]
    await asyncio.wait_for(asyncio.gather(*(s.wait() for s in starts)), 30)
    await asyncio.sleep(1.5)  # every slow body is being read by the replica by now
    started = time.monotonic()
    normal = await asyncio.to_thread(api, svc, "GET", "/v1/jobs")
    took = time.monotonic() - started
    return took, normal, await asyncio.wait_for(asyncio.gather(*clients), 60)


def test_slow_clients_do_not_stop_a_normal_request_and_get_408_at_the_deadline(service):
    took, normal, answers = asyncio.run(slow_clients_and_one_normal(service))
    assert normal.status_code == 200, normal.text
    assert took < 2.0, f"GET /v1/jobs took {took:.1f} s beside {SLOW_CLIENTS} slow clients"
    timed_out = [a for a in answers if a.startswith(b"HTTP/1.1 408")]
    assert len(timed_out) == SLOW_CLIENTS, answers[:3]
    assert b"did not arrive within the 4 s limit for a whole body" in timed_out[0]


def test_a_client_cannot_lift_the_request_timeout(service):
    from ray.serve.context import _get_global_client

    for header, value in (("X-Request-Timeout-Seconds", "0"), ("X-Request-Disconnect-Disabled", "?1")):
        r = api(service, "GET", "/v1/jobs", headers={header: value})
        assert r.status_code == 400
        assert r.json()["detail"] == (f"header {header.lower()!r} is not accepted: the service sets request "
                                      "timeouts itself")
    proxy = _get_global_client().get_serve_details()["http_options"]
    assert proxy["request_timeout_s"] == 45


# ---------------------------------------------------------------- the docs


def test_the_docs_load_no_third_party_script(service):
    r = requests.get(service.url + "/docs", timeout=30)
    assert r.status_code == 200 and "<script" not in r.text and "cdn." not in r.text
    assert r.headers["Content-Security-Policy"].startswith("default-src 'none'; script-src 'self'")
    assert "<code>/v1/jobs/{record_id}/metrics</code>" in r.text
    assert requests.get(service.url + "/redoc", timeout=30).status_code == 404
    assert "/v1/jobs" in requests.get(service.url + "/openapi.json", timeout=30).json()["paths"]


# ---------------------------------------------------------------- long histories


def test_metrics_answers_are_downsampled_first_and_last_kept(service):
    rows = api(service, "GET", f"/v1/jobs/{service.long_id}/metrics").json()["rows"]
    assert len(rows) == 2000 and rows[0]["step"] == 0 and rows[-1]["step"] == LONG_STEPS - 1
    few = api(service, "GET", f"/v1/jobs/{service.long_id}/metrics", params={"max_points": 100}).json()["rows"]
    assert len(few) == 100 and (few[0]["step"], few[-1]["step"]) == (0, LONG_STEPS - 1)
    more = api(service, "GET", f"/v1/jobs/{service.long_id}/metrics", params={"max_points": 10**6}).json()["rows"]
    assert len(more) == 2000  # the service's cap
    bad = api(service, "GET", f"/v1/jobs/{service.long_id}/metrics", params={"max_points": 1})
    assert bad.status_code == 422 and "greater than or equal to 2" in json.dumps(bad.json())
    chart = signed_in(service, f"/ui/jobs/{service.long_id}/data").json()["chart"]["series"]
    assert len(chart["step"]) == 2000 and chart["step"][-1] == LONG_STEPS - 1


def test_listings_show_the_latest_step_and_the_web_list_is_paged(service):
    listed = api(service, "GET", "/v1/jobs", params={"limit": 500}).json()
    assert listed["total"] == LISTED + 1
    long = next(r for r in listed["items"] if r["id"] == service.long_id)
    assert long["progress"]["step"] == LONG_STEPS - 1 and long["progress"]["target_step"] == LONG_STEPS
    first = signed_in(service, "/ui/jobs-table")
    assert first.status_code == 200 and "page 1 of 2" in first.text and first.text.count('<tr class="job">') == 50
    second = signed_in(service, "/ui/jobs-table?page=2")
    assert "page 2 of 2" in second.text and second.text.count('<tr class="job">') == LISTED + 1 - 50
    assert "page 2 of 2" in signed_in(service, "/?page=2").text


# ---------------------------------------------------------------- sign-in


def login(svc, token: str, **headers) -> requests.Response:
    return requests.post(svc.url + "/ui/login", data={"token": token}, headers=headers, allow_redirects=False,
                         timeout=30)


def test_a_sign_in_from_another_site_is_refused(service):
    evil = login(service, token_of("alice"), Origin="http://evil.example")
    assert evil.status_code == 403 and "set-cookie" not in evil.headers
    assert "origin &#39;http://evil.example&#39; is refused: only this service&#39;s own page" in evil.text
    cross = login(service, token_of("alice"), **{"Sec-Fetch-Site": "cross-site"})
    assert cross.status_code == 403 and "Sec-Fetch-Site: cross-site" in cross.text
    own = login(service, token_of("alice"), Origin=service.url, **{"Sec-Fetch-Site": "same-origin"})
    assert own.status_code == 303 and "etrain_token=" in own.headers["set-cookie"]


def test_failed_sign_ins_are_limited_per_address(service):
    """Last in the module: it leaves 127.0.0.1 unable to sign in for the window."""
    for _ in range(service.limits.login_failures):
        assert login(service, "guess").status_code == 401
    refused = login(service, "guess")
    assert refused.status_code == 429 and "set-cookie" not in refused.headers
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    assert f"too many failed sign-ins from 127.0.0.1: try again in {refused.headers['Retry-After']} s" in refused.text
    # The right token still signs in: guesses from a shared address (a NAT) lock nobody out.
    assert login(service, token_of("alice")).status_code == 303
    assert api(service, "GET", "/v1/jobs").status_code == 200  # the API's bearer tokens are another door
