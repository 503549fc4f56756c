"""The job service: a FastAPI app behind Ray Serve. Routes under /v1; OpenAPI at /docs.

Every route but ``/healthz`` needs ``Authorization: Bearer <token>``. A tenant sees only
its own jobs and sweeps (another tenant's is a 404); an admin sees all. Limits: body size
(413), unfinished jobs per tenant (429), and ``Idempotency-Key`` so a retried submit never
makes a second job.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from urllib.parse import parse_qs

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from ray import serve
from starlette.concurrency import run_in_threadpool

from service import web
from service.auth import Principal, TokenEntry, Tokens
from service.jobs import Conflict, JobManager, QuotaExceeded, RayUnavailable, ServiceSettings, public
from service.schemas import CheckpointOut, Health, MetricsOut, Problem, RecordList, RecordOut
from service.store import Record
from trainers.config import SpecError, parse_text

app = FastAPI(title="elastic-train", version="1",
              description="Submit, watch, stop and resume elastic PyTorch training jobs and sweeps on Ray.")
bearer = HTTPBearer(auto_error=False, description="a token from `etrain serve` (or your admin)")
COOKIE = "etrain_token"
_state: dict = {}  # this replica's manager and tokens, set when Serve constructs the deployment

ERRORS = {code: {"model": Problem} for code in (401, 404, 409, 413, 422, 429)}
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


def principal(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> Principal:
    who = _state["tokens"].authenticate(creds.credentials if creds else None)
    if who is None:
        raise HTTPException(401, "missing or unknown bearer token: send 'Authorization: Bearer <token>'",
                            headers={"WWW-Authenticate": "Bearer"})
    return who


def visible(record_id: str, who: Principal, kind: str) -> Record:
    record = manager().visible(record_id, who.tenant, who.is_admin)
    if record is None or record.kind != kind:
        raise HTTPException(404, f"no {kind} {record_id!r}")  # another tenant's looks the same as none
    return record


@app.get("/healthz", response_model=Health, tags=["service"])
def healthz() -> dict:
    return {"status": "ok", "records": len(manager().store.all())}


async def read_spec_body(request: Request) -> tuple[dict, str]:
    limit = manager().settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"body of {declared} bytes is over the {limit}-byte limit: send a smaller spec")
    raw = await request.body()
    if len(raw) > limit:
        raise HTTPException(413, f"body of {len(raw)} bytes is over the {limit}-byte limit: send a smaller spec")
    try:
        text = raw.decode()
        kind = request.headers.get("content-type", "")
        data = json.loads(text) if "json" in kind else parse_text(text, "body")
    except UnicodeDecodeError:
        raise HTTPException(422, {"detail": "invalid spec", "problems": ["body: not UTF-8 text"]}) from None
    except json.JSONDecodeError as exc:
        raise HTTPException(422, {"detail": "invalid spec", "problems": [
            f"body: line {exc.lineno}, column {exc.colno}: {exc.msg}: fix the JSON syntax"]}) from None
    except SpecError as exc:
        raise HTTPException(422, {"detail": "invalid spec", "problems": exc.problems}) from None
    if not isinstance(data, dict):
        raise HTTPException(422, {"detail": "invalid spec", "problems": [
            f"body: top level is {type(data).__name__}: a spec is a mapping of sections"]})
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
            record, created = await run_in_threadpool(manager().create, kind, who.tenant, data, key, digest)
        except SpecError as exc:
            raise HTTPException(422, {"detail": f"invalid {kind} spec", "problems": exc.problems}) from None
        except QuotaExceeded as exc:
            raise HTTPException(429, str(exc)) from None
        except Conflict as exc:
            raise HTTPException(409, str(exc)) from None
        return JSONResponse(public(record), status_code=201 if created else 200)

    @app.get(base, response_model=RecordList, responses=ERRORS, tags=[plural], operation_id=f"list_{plural}")
    def list_records(state: str | None = Query(None, pattern="^(PENDING|RUNNING|STOPPING|STOPPED|SUCCEEDED|FAILED)$"),
                     offset: int = Query(0, ge=0), limit: int = Query(50, ge=1, le=500),
                     who: Principal = Depends(principal)):
        records = manager().list(kind, who.tenant, who.is_admin, state)
        return {"items": [public(r) for r in records[offset:offset + limit]], "total": len(records),
                "offset": offset, "limit": limit}

    @app.get(base + "/{record_id}", response_model=RecordOut, responses=ERRORS, tags=[plural],
             operation_id=f"get_{kind}")
    def get_record(record_id: str, who: Principal = Depends(principal)):
        return public(visible(record_id, who, kind))

    @app.get(base + "/{record_id}/logs", response_class=PlainTextResponse, tags=[plural],
             responses={**TEXT_ROUTE_ERRORS, 503: TEXT_ROUTE_ERRORS[404]},
             operation_id=f"logs_{kind}", summary="The latest attempt's log: the tail, or follow it live")
    async def logs(record_id: str, tail: int = Query(200, ge=0, le=100000), follow: bool = False,
                   who: Principal = Depends(principal)):
        record = visible(record_id, who, kind)
        if not follow:
            try:
                return PlainTextResponse(await run_in_threadpool(manager().logs, record, tail))
            except RayUnavailable as exc:
                raise HTTPException(404 if exc.missing else 503, str(exc)) from None

        async def stream():
            if not record.submissions:
                return
            async for chunk in manager().client.tail_job_logs(record.submissions[-1]):
                yield chunk
        return StreamingResponse(stream(), media_type="text/plain")

    @app.post(base + "/{record_id}/stop", response_model=RecordOut, status_code=202, responses=ERRORS,
              tags=[plural], operation_id=f"stop_{kind}", summary="Stop gracefully: a final checkpoint, then stop")
    def stop(record_id: str, who: Principal = Depends(principal)):
        try:
            return public(manager().stop(visible(record_id, who, kind)))
        except Conflict as exc:
            raise HTTPException(409, str(exc)) from None

    @app.post(base + "/{record_id}/resume", response_model=RecordOut, status_code=202, responses=ERRORS,
              tags=[plural], operation_id=f"resume_{kind}", summary="Resume from the newest checkpoint")
    def resume(record_id: str, who: Principal = Depends(principal)):
        try:
            return public(manager().resume(visible(record_id, who, kind)))
        except Conflict as exc:
            raise HTTPException(409, str(exc)) from None
        except QuotaExceeded as exc:
            raise HTTPException(429, str(exc)) from None

    @app.get(base + "/{record_id}/checkpoints", response_model=list[CheckpointOut], responses=ERRORS,
             tags=[plural], operation_id=f"checkpoints_{kind}")
    def checkpoints(record_id: str, who: Principal = Depends(principal)):
        return manager().checkpoints(visible(record_id, who, kind))

    @app.get(base + "/{record_id}/profiles", response_model=list[str], responses=ERRORS, tags=[plural],
             operation_id=f"profiles_{kind}", summary="URIs of profiler traces (training.profile)")
    def profiles(record_id: str, who: Principal = Depends(principal)):
        return manager().profiles(visible(record_id, who, kind))

    @app.get(base + "/{record_id}/metrics", response_model=MetricsOut, responses=ERRORS, tags=[plural],
             operation_id=f"metrics_{kind}", summary="Step metrics over time (loss, throughput, world size)")
    def metrics(record_id: str, who: Principal = Depends(principal)):
        record = visible(record_id, who, kind)
        return {"id": record.id, "rows": manager().metrics(record)}


add_routes("job")
add_routes("sweep")


# ---------------------------------------------------------------- request metrics and the web page


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
    token = request.query_params.get("token") or request.cookies.get(COOKIE)
    return _state["tokens"].authenticate(token)


def with_cookie(response: HTMLResponse, request: Request) -> HTMLResponse:
    if request.query_params.get("token"):
        response.set_cookie(COOKIE, request.query_params["token"], httponly=True, samesite="strict")
    return response


@app.get("/", response_class=HTMLResponse, include_in_schema=False)
def ui_jobs(request: Request):
    who = web_principal(request)
    if who is None:
        return HTMLResponse(web.login_page(), status_code=401)
    mgr, rows = manager(), []
    for kind in ("job", "sweep"):
        for r in mgr.list(kind, who.tenant, who.is_admin):
            history = mgr.metrics(r)
            last = history[-1] if history else {}
            summary = r.summary or {}
            rows.append({"id": r.id, "name": r.name, "kind": r.kind, "state": r.state,
                         "step": last.get("step", summary.get("final_step")),
                         "target_step": summary.get("target_step") or (r.spec.get("training") or {}).get("max_steps"),
                         "goodput": last.get("goodput"), "updated_at": r.updated_at})
    return with_cookie(HTMLResponse(web.jobs_page(who.tenant, rows)), request)


@app.post("/ui/login", response_class=HTMLResponse, include_in_schema=False)
async def ui_login(request: Request):
    form = parse_qs((await request.body()).decode())
    token = (form.get("token") or [""])[0]
    if _state["tokens"].authenticate(token) is None:
        return HTMLResponse(web.login_page("unknown token"), status_code=401)
    response = RedirectResponse("/", status_code=303)
    response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
    return response


@app.get("/ui/jobs/{record_id}", response_class=HTMLResponse, include_in_schema=False)
def ui_job(record_id: str, request: Request):
    who = web_principal(request)
    if who is None:
        return HTMLResponse(web.login_page(), status_code=401)
    mgr = manager()
    record = mgr.visible(record_id, who.tenant, who.is_admin)
    if record is None:
        return HTMLResponse(web.page("not found", f"<p>no job {record_id!r}</p>"), status_code=404)
    try:
        logs = mgr.logs(record, 80)
    except RayUnavailable as exc:
        logs = f"[logs unavailable: {exc}]"
    html_text = web.job_page(public(record), mgr.metrics(record), mgr.interruptions(record),
                             mgr.checkpoints(record), logs)
    return with_cookie(HTMLResponse(html_text), request)


def configure(settings: ServiceSettings, tokens: Tokens, client=None) -> threading.Event:
    """Set this process's manager and start the reconciler (at once, then every interval)."""
    from cluster.metrics import ServiceMetrics

    _state["manager"] = mgr = JobManager(settings, client)
    _state["tokens"] = tokens
    _state["metrics"] = metrics = ServiceMetrics()

    def count(records: list[Record]) -> None:
        counts = {(k, s): 0 for k in ("job", "sweep") for s in ("PENDING", "RUNNING", "STOPPING", "STOPPED",
                                                                   "SUCCEEDED", "FAILED")}
        for r in records:
            counts[(r.kind, r.state)] += 1
        metrics.states(counts)
    mgr.on_reconciled = count
    mgr.on_reconcile_error = metrics.reconcile_error
    stop = threading.Event()
    threading.Thread(target=mgr.run_reconciler, args=(stop,), name="etrain-reconciler", daemon=True).start()
    return stop


@serve.deployment(num_replicas=1, max_ongoing_requests=200, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class JobService:
    """One replica holds the records in memory and writes them through to storage."""

    def __init__(self, settings: dict, tokens: list[dict]):
        self._stop = configure(ServiceSettings.model_validate(settings),
                               Tokens([TokenEntry.model_validate(t) for t in tokens]))

    def __del__(self):
        self._stop.set()
