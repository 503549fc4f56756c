"""The job service: a FastAPI app behind Ray Serve. Routes under /v1; OpenAPI at /docs.

Every route but ``/healthz`` needs ``Authorization: Bearer <token>``. A tenant sees only
its own jobs and sweeps (another tenant's is a 404); an admin sees all; what a spec may
name depends on the tenant's role (403, service.auth). Limits: body size, counted while
the body streams in (413); spec shape (depth, size, no YAML aliases: 422); quota slots per
tenant and trials per sweep (429); ``Idempotency-Key`` so a retried submit never makes a
second job. Answers carry storage-relative locations, never the server's paths.

What one client may cost is bounded too (service.http_limits): a body must arrive within a
deadline (408), Serve's own timeout and queue are set and a client may not lift them, failed
sign-ins are limited per address (429), a sign-in from another site is refused (403),
listings read only each record's latest metrics, metrics answers are downsampled, and a
record's Ray log and history are read once per moment however many pages refresh. The API's
docs at /docs are a page of our own: no third-party script on the service's origin.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import re
import threading
import time
from urllib.parse import parse_qs

from fastapi import Depends, FastAPI, Header, HTTPException
from fastapi import Path as PathParam
from fastapi import Query, Request
from fastapi.responses import (HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response,
                               StreamingResponse)
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from cluster.ray_adapter.serve import serve_client_override_headers
from service import web
from service.auth import Principal, Tokens
from service.front_door import LoginLimiter, SharedRead, cross_site_refusal, downsample
from service.http_limits import HttpLimits
from service.isolation import check_code_tenants
from service.jobs import JobManager
from service.ray_failures import RayUnavailable
from service.schemas import CheckpointOut, Health, MetricsOut, Problem, RecordList, RecordOut
from service.settings import ServiceSettings, jobs_headers
from service.states import STATE_PATTERN, JobState
from service.store import ID_PATTERN, Record
from service.submit import Conflict, Forbidden, QuotaExceeded
from service.views import Views
from trainers.api import SpecError, parse_text, read_history_tail

# FastAPI's own /docs and /redoc load scripts from a CDN on this origin: ours (below) loads none.
app = FastAPI(title="elastic-train", version="1", docs_url=None, redoc_url=None,
              description="Submit, watch, stop and resume elastic PyTorch training jobs and sweeps on Ray.")
bearer = HTTPBearer(auto_error=False, description="a token from `etrain serve` (or your admin)")
COOKIE = "etrain_token"
_state: dict = {}  # this replica's manager and tokens, set when Serve constructs the deployment

ERRORS = {code: {"model": Problem} for code in (401, 403, 404, 409, 413, 422, 429)}
LOGIN_BODY_BYTES = 4096
RecordId = PathParam(pattern=ID_PATTERN, description="j-<12 hex> for a job, s-<12 hex> for a sweep")
# A text route's errors are still JSON problems; say so, or OpenAPI would list them as text/plain.
TEXT_ROUTE_ERRORS = {code: {"description": "a problem", "content": {
    "application/json": {"schema": {"$ref": "#/components/schemas/Problem"}}}} for code in ERRORS}
SPEC_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"type": "object", "description": "a job spec (see configs/)"}},
    "application/yaml": {"schema": {"type": "string", "description": "the same spec as YAML"}}}}}


@app.exception_handler(HTTPException)
async def _problem(request: Request, exc: HTTPException) -> JSONResponse:
    body = exc.detail if isinstance(exc.detail, dict) else {"detail": exc.detail}
    return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))


def manager() -> JobManager:
    return _state["manager"]


def views() -> Views:
    return _state["manager"].views


def follows() -> collections.Counter:
    """Tenant -> the logs it follows now. Read through this function, never as ``_state`` from a
    route made in a function: Serve pickles the app, and such a route by value with its globals."""
    return _state["following"]


def limits() -> HttpLimits:
    return _state["limits"]


def principal(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> Principal:
    who = _state["tokens"].authenticate(creds.credentials if creds else None)
    if who is None:
        raise HTTPException(401, "missing or unknown bearer token: send 'Authorization: Bearer <token>'",
                            headers={"WWW-Authenticate": "Bearer"})
    return who


def visible(record_id: str, who: Principal, kind: str) -> Record:
    record = views().visible(record_id, who.tenant, who.is_admin)
    if record is None or record.kind != kind:
        raise HTTPException(404, f"no {kind} {record_id!r}")  # another tenant's looks the same as none
    return record


@app.get("/healthz", response_model=Health, tags=["service"])
def healthz() -> dict:
    return {"status": "ok"}  # nothing else: it answers anyone


async def read_body(request: Request, limit: int, what: str) -> bytes:
    """The body, refused (413) as soon as it passes ``limit``: a declared length is checked first,
    and a chunked or lying body is counted as it streams in, never held whole beyond the limit.
    The whole body must arrive within the body deadline (408): a client trickling it holds a
    slot of the replica only that long."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"body of {declared} bytes is over the {limit}-byte limit: send a smaller {what}")
    chunks, size = [], 0
    deadline_s = limits().body_deadline_s
    try:
        async with asyncio.timeout(deadline_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise HTTPException(413, f"body of more than {limit} bytes is over the limit: send a smaller {what}")
                chunks.append(chunk)
    except TimeoutError:
        raise HTTPException(408, f"the {what} did not arrive within the {deadline_s:g} s limit for a whole body "
                                 f"({size} bytes came): send it at once", headers={"Connection": "close"}) from None
    return b"".join(chunks)


def parse_spec_body(raw: bytes, content_type: str) -> dict:
    """Bytes to a spec mapping (in a worker thread: parsing must not stall the event loop)."""
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise SpecError(["body: not UTF-8 text: send JSON or YAML"]) from None
    return parse_text(text, "body", "json" if "json" in content_type else "auto")


async def read_spec_body(request: Request) -> tuple[dict, str]:
    raw = await read_body(request, manager().settings.max_body_bytes, "spec")
    try:
        data = await run_in_threadpool(parse_spec_body, raw, request.headers.get("content-type", ""))
    except SpecError as exc:
        raise HTTPException(422, {"detail": "invalid spec", "problems": exc.problems}) from None
    return data, hashlib.sha256(raw).hexdigest()


def add_routes(kind: str) -> None:
    """The same routes for jobs and sweeps."""
    plural = f"{kind}s"
    base = f"/v1/{plural}"

    @app.post(base, response_model=RecordOut, status_code=201, openapi_extra=SPEC_BODY, tags=[plural],
              responses={**ERRORS, 200: {"model": RecordOut, "description": "made before by this Idempotency-Key"}},
              operation_id=f"submit_{kind}", summary=f"Submit a {kind} spec (JSON or YAML)")
    async def submit(request: Request, who: Principal = Depends(principal),
                     idempotency_key: str | None = Header(None, max_length=200,
                                                          description="retry with the same key: never a second job")):
        data, digest = await read_spec_body(request)
        key = idempotency_key or None
        try:
            record, created = await run_in_threadpool(manager().submitter.create, kind, who, data, key, digest)
        except Forbidden as exc:
            raise HTTPException(403, {"detail": f"this {kind} spec names what role {who.role!r} may not use",
                                      "problems": exc.problems}) from None
        except SpecError as exc:
            raise HTTPException(422, {"detail": f"invalid {kind} spec", "problems": exc.problems}) from None
        except QuotaExceeded as exc:
            raise HTTPException(429, str(exc)) from None
        except Conflict as exc:
            raise HTTPException(409, str(exc)) from None
        return JSONResponse(views().public(record), status_code=201 if created else 200)

    @app.get(base, response_model=RecordList, responses=ERRORS, tags=[plural], operation_id=f"list_{plural}")
    def list_records(state: str | None = Query(None, pattern=STATE_PATTERN),
                     offset: int = Query(0, ge=0), limit: int = Query(50, ge=1, le=500),
                     who: Principal = Depends(principal)):
        records = views().list(kind, who.tenant, who.is_admin, state)
        return {"items": [with_progress(r) for r in records[offset:offset + limit]], "total": len(records),
                "offset": offset, "limit": limit}

    @app.get(base + "/{record_id}", response_model=RecordOut, responses=ERRORS, tags=[plural],
             operation_id=f"get_{kind}")
    def get_record(record_id: str = RecordId, who: Principal = Depends(principal)):
        return with_progress(visible(record_id, who, kind))

    @app.get(base + "/{record_id}/logs", response_class=PlainTextResponse, tags=[plural],
             responses={**TEXT_ROUTE_ERRORS, 503: TEXT_ROUTE_ERRORS[404]},
             operation_id=f"logs_{kind}", summary="The latest attempt's log: the tail, or follow it live")
    async def logs(record_id: str = RecordId, tail: int = Query(200, ge=0, le=100000), follow: bool = False,
                   who: Principal = Depends(principal)):
        record = visible(record_id, who, kind)
        if not follow:
            try:
                return PlainTextResponse(await run_in_threadpool(ray_log, record, tail))
            except RayUnavailable as exc:
                raise HTTPException(404 if exc.missing else 503, str(exc)) from None

        following = follows()
        cap = limits().follow_streams_per_tenant
        if following[who.tenant] >= cap:
            raise HTTPException(429, f"tenant {who.tenant!r} follows {following[who.tenant]} logs at once, the most "
                                     f"it may ({cap}): stop following one, or read the tail without follow")

        async def stream():
            following[who.tenant] += 1  # counted while it runs: an answer never started holds nothing
            try:
                if not record.submissions:
                    return
                async for chunk in manager().client.tail_job_logs(record.submissions[-1]):
                    yield views().relative(record.tenant, chunk)
            finally:
                following[who.tenant] -= 1
        return StreamingResponse(stream(), media_type="text/plain")

    @app.post(base + "/{record_id}/stop", response_model=RecordOut, status_code=202, responses=ERRORS,
              tags=[plural], operation_id=f"stop_{kind}", summary="Stop gracefully: a final checkpoint, then stop")
    def stop(record_id: str = RecordId, who: Principal = Depends(principal)):
        try:
            return views().public(manager().reconciler.stop(visible(record_id, who, kind)))
        except Conflict as exc:
            raise HTTPException(409, str(exc)) from None

    @app.post(base + "/{record_id}/resume", response_model=RecordOut, status_code=202, responses=ERRORS,
              tags=[plural], operation_id=f"resume_{kind}", summary="Resume from the newest checkpoint")
    def resume(record_id: str = RecordId, who: Principal = Depends(principal)):
        try:
            return views().public(manager().submitter.resume(visible(record_id, who, kind), who))
        except Forbidden as exc:
            raise HTTPException(403, {"detail": f"this {kind}'s spec names what role {who.role!r} may not use now",
                                      "problems": exc.problems}) from None
        except Conflict as exc:
            raise HTTPException(409, str(exc)) from None
        except QuotaExceeded as exc:
            raise HTTPException(429, str(exc)) from None

    @app.get(base + "/{record_id}/checkpoints", response_model=list[CheckpointOut], responses=ERRORS,
             tags=[plural], operation_id=f"checkpoints_{kind}")
    def checkpoints(record_id: str = RecordId, who: Principal = Depends(principal)):
        return views().checkpoints(visible(record_id, who, kind))

    @app.get(base + "/{record_id}/profiles", response_model=list[str], responses=ERRORS, tags=[plural],
             operation_id=f"profiles_{kind}", summary="URIs of profiler traces (training.profile)")
    def profiles(record_id: str = RecordId, who: Principal = Depends(principal)):
        return views().profiles(visible(record_id, who, kind))

    @app.get(base + "/{record_id}/metrics", response_model=MetricsOut, responses=ERRORS, tags=[plural],
             operation_id=f"metrics_{kind}", summary="Step metrics over time (loss, throughput, world size)")
    def metrics(record_id: str = RecordId, who: Principal = Depends(principal),
                max_points: int | None = Query(None, ge=2, description="at most this many rows, evenly spaced with "
                                                                       "the first and last (capped by the service)")):
        record = visible(record_id, who, kind)
        cap = limits().max_metrics_points
        return {"id": record.id, "rows": downsample(history(record), min(max_points or cap, cap))}


def with_progress(record: Record) -> dict:
    """The record as the API shows it, its progress from the latest metrics row (a running job's too)."""
    data = views().public(record)
    data["progress"] = {**data["progress"], **{k: v for k, v in progress(record).items() if v is not None}}
    return data


add_routes("job")
add_routes("sweep")


# ---------------------------------------------------------------- request metrics and the web page


CLIENT_OVERRIDE_HEADERS = serve_client_override_headers()


@app.middleware("http")
async def _no_client_overrides(request: Request, call_next):
    """Ray Serve's proxy lets a request lift its own timeout by a header: refuse such a request
    at once (the proxy has read the header before we see it), so it holds nothing."""
    for name in CLIENT_OVERRIDE_HEADERS:  # Ray Serve's names for them, read through the adapter
        if name in request.headers:
            return JSONResponse({"detail": f"header {name!r} is not accepted: the service sets request timeouts "
                                           "itself"}, status_code=400)
    return await call_next(request)


@app.middleware("http")
async def _measure(request: Request, call_next):
    started = time.perf_counter()
    response = await call_next(request)
    metrics = _state.get("metrics")
    if metrics is not None:
        route = request.scope.get("route")
        metrics.request(getattr(route, "path", "(unmatched)"), request.method, response.status_code,
                        time.perf_counter() - started)
    return response


def web_principal(request: Request) -> Principal | None:
    """Who the page's cookie signs in; a token in the URL is never read (it would end up in logs)."""
    return _state["tokens"].authenticate(request.cookies.get(COOKIE))


def page(text: str, status_code: int = 200, headers: dict | None = None) -> HTMLResponse:
    return HTMLResponse(text, status_code=status_code, headers={**web.HEADERS, **(headers or {})})


@app.get("/docs", response_class=HTMLResponse, include_in_schema=False)
def docs() -> HTMLResponse:
    """The API's routes, methods and summaries from its OpenAPI schema, escaped, with no script."""
    return page(web.docs_page(app.openapi()))


@app.get("/ui/static/{name:path}", include_in_schema=False)
def ui_static(name: str) -> Response:
    found = web.static_file(name)
    if found is None:
        return Response("not found", status_code=404, media_type="text/plain")
    body, media_type = found
    return Response(body, media_type=media_type, headers={"Cache-Control": "max-age=3600",
                                                          "X-Content-Type-Options": "nosniff"})


def ui_rows(who: Principal) -> list[dict]:
    """The tenant's jobs and sweeps, newest first, as the list shows them; their progress is read
    (``progress``) only for the rows of the page shown."""
    rows = []
    for kind in ("job", "sweep"):
        for r in views().list(kind, who.tenant, who.is_admin):
            rows.append({"id": r.id, "name": r.name, "kind": r.kind, "state": r.state, "created_at": r.created_at,
                         "updated_at": r.updated_at, "record": r})
    return sorted(rows, key=lambda row: -row["created_at"])


def ui_paging(page_number: int) -> dict:
    return {"page": page_number, "page_rows": limits().jobs_page_rows, "progress": lambda row: progress(row["record"])}


PROGRESS_ROWS = 16  # the latest rows a progress reading needs: the last, and the ETA's window


def progress(record: Record) -> dict:
    """Where a record stands now (its latest metrics rows), not only where its last run ended:
    a few files' ends, never the whole history, for each row of a listing."""
    troot = manager().context.tenant_root(record.tenant)
    rows = [] if record.kind == "sweep" else read_history_tail(troot, record.id, PROGRESS_ROWS)
    return web.progress_of(record.model_dump(mode="json"), rows, views().interruptions(record))


def history(record: Record) -> list[dict]:
    """A record's whole metrics history, read once per moment however many ask."""
    return _state["histories"].get(record.id, lambda: views().metrics(record))


def ray_log(record: Record, tail_lines: int) -> str:
    """The last lines of a record's latest Ray log; the log is fetched once per moment per submission."""
    if not record.submissions:
        return ""
    text = _state["logs"].get(record.submissions[-1], lambda: views().logs(record, None))
    return "".join(text.splitlines(keepends=True)[-tail_lines:]) if tail_lines > 0 else ""


UI_STATE = Query(None, pattern=STATE_PATTERN)
UI_PAGE = Query(1, ge=1, le=1_000_000, alias="page")


@app.get("/", response_class=HTMLResponse, include_in_schema=False)
def ui_jobs(request: Request, state: str | None = UI_STATE, page_number: int = UI_PAGE):
    who = web_principal(request)
    if who is None:
        return page(web.login_page(), 401)
    return page(web.jobs_page(who.tenant, ui_rows(who), state, **ui_paging(page_number)))


@app.get("/ui/jobs-table", response_class=HTMLResponse, include_in_schema=False)
def ui_jobs_table(request: Request, state: str | None = UI_STATE, page_number: int = UI_PAGE):
    who = web_principal(request)
    if who is None:
        return page("", 401)
    return page(web.jobs_table(ui_rows(who), state, **ui_paging(page_number)))


@app.post("/ui/login", response_class=HTMLResponse, include_in_schema=False)
async def ui_login(request: Request):
    """Sign in from this service's own page only, and a client address only so often after failing."""
    refusal = cross_site_refusal(request.headers)
    if refusal is not None:
        return page(web.login_page(refusal), 403)
    address = request.client.host if request.client else "(unknown)"
    limiter: LoginLimiter = _state["login_limiter"]
    raw = await read_body(request, LOGIN_BODY_BYTES, "form")
    token = (parse_qs(raw.decode(errors="replace")).get("token") or [""])[0]
    # A right token always signs in: guesses from one address (a NAT, a proxy) must not lock out the
    # people behind it. Guesses past the limit are told to wait.
    if _state["tokens"].authenticate(token) is None:
        wait_s = limiter.retry_after_s(address)
        if wait_s is not None:
            return page(web.login_page(f"too many failed sign-ins from {address}: try again in {wait_s} s"), 429,
                        {"Retry-After": str(wait_s)})
        limiter.failed(address)
        return page(web.login_page("unknown token"), 401)
    response = RedirectResponse("/", status_code=303, headers=web.HEADERS)
    response.set_cookie(COOKIE, token, httponly=True, secure=True, samesite="strict", path="/")
    return response


LOG_LINES = 400  # the page's log: enough to scroll back through, small enough to send every refresh


def ui_record(record_id: str, who: Principal) -> Record | None:
    if not re.fullmatch(ID_PATTERN, record_id):
        return None
    return views().visible(record_id, who.tenant, who.is_admin)


def ui_parts(record: Record) -> tuple:
    shown = views()
    try:
        logs = ray_log(record, LOG_LINES)
    except RayUnavailable as exc:  # the page still shows the rest, and says why the log is missing
        logs = f"[logs unavailable: {exc}]"
    return shown.public(record), history(record), shown.interruptions(record), shown.checkpoints(record), logs


@app.get("/ui/jobs/{record_id}", response_class=HTMLResponse, include_in_schema=False)
def ui_job(record_id: str, request: Request):
    who = web_principal(request)
    if who is None:
        return page(web.login_page(), 401)
    record = ui_record(record_id, who)
    if record is None:
        return page(web.not_found_page(f"no job {record_id!r}"), 404)
    return page(web.job_page(*ui_parts(record), max_points=limits().max_metrics_points))


@app.get("/ui/jobs/{record_id}/data", include_in_schema=False)
def ui_job_data(record_id: str, request: Request) -> JSONResponse:
    """What the page's script refreshes: chart series and the page's parts, escaped here."""
    who = web_principal(request)
    if who is None:
        return JSONResponse({"detail": "sign in again"}, status_code=401, headers=web.HEADERS)
    record = ui_record(record_id, who)
    if record is None:
        return JSONResponse({"detail": f"no job {record_id!r}"}, status_code=404, headers=web.HEADERS)
    return JSONResponse(web.job_data(*ui_parts(record), max_points=limits().max_metrics_points), headers=web.HEADERS)


def own_dashboard_url() -> str | None:
    """The dashboard of the Ray this replica runs in; None when Ray does not say."""
    from cluster.ray_adapter.dashboard import dashboard_url

    try:
        return dashboard_url()
    except Exception:  # boundary: Ray's internals; the node-id comparison still decides
        return None


def configure(settings: ServiceSettings, tokens: Tokens, client=None, http: HttpLimits | None = None) -> threading.Event:
    """Set this process's manager and limits and start the reconciler (at once, then every interval)."""
    from cluster.metrics import ServiceMetrics

    if client is None:  # the real Jobs API: `code` tenants only where their jobs cannot reach the service
        check_code_tenants(tokens.tenants_with_role("code"), settings.ray_dashboard_url, jobs_headers(settings),
                           own_url=own_dashboard_url())
    _state["manager"] = mgr = JobManager(settings, client)
    _state["tokens"] = tokens
    _state["limits"] = http = http or HttpLimits()
    _state["following"] = collections.Counter()  # tenant -> logs it follows now (one event loop: no lock)
    _state["login_limiter"] = LoginLimiter(http.login_failures, http.login_window_s, http.login_addresses)
    _state["logs"], _state["histories"] = SharedRead(http.read_cache_s), SharedRead(http.read_cache_s)
    _state["metrics"] = metrics = ServiceMetrics()

    def count(records: list[Record]) -> None:
        counts = {(k, s.value): 0 for k in ("job", "sweep") for s in JobState}  # plain names: Ray's tags
        for r in records:
            counts[(r.kind, r.state)] += 1
        metrics.states(counts)
    mgr.reconciler.on_reconciled = count
    mgr.context.failures.on_error = metrics.reconcile_error
    stop = threading.Event()
    threading.Thread(target=mgr.reconciler.run, args=(stop,), name="etrain-reconciler", daemon=True).start()
    return stop

