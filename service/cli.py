"""`etrain`: the training commands (trainers.cli) plus the service: serve, submit, jobs, sweeps."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
import uuid

from cluster.log_lines import send_to
from service.states import JobState
from trainers.api import SpecError, apply_overrides, read_spec_file
from trainers.cli import build_parser

DEFAULT_SERVER = "http://127.0.0.1:8000"
CLIENT_EXAMPLES = f"""examples:
  etrain serve                                   # prints an admin token once
  export ETRAIN_SERVER=http://127.0.0.1:8000 ETRAIN_TOKEN=et_...
  etrain submit configs/quickstart.yaml          # a spec with a 'sweep' section goes to /v1/sweeps
  etrain jobs list --state {JobState.RUNNING}
  etrain jobs logs j-0123456789ab --follow
  etrain jobs stop j-0123456789ab                # final checkpoint, then stop
  etrain jobs resume j-0123456789ab
"""


# ---------------------------------------------------------------- serve


def cmd_serve(args: argparse.Namespace) -> int:
    from ray import serve

    from cluster.storage import default_root
    from service.auth import TokenConfigError, bootstrap_admin, load_tokens
    from service.deployment import application, http_options
    from service.isolation import IsolationError, check_code_tenants
    from service.settings import jobs_headers
    from service.store import Store
    from trainers.api import release_local_ray, start_local_ray

    storage_root = args.storage_root or default_root()
    try:
        entries = load_tokens(args.tokens)
        settings = serve_settings(args, storage_root)
        http = http_limits(args)
    except (TokenConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    started_ray = start_local_ray(args.cpus)
    if started_ray and args.detach:
        print("error: --detach needs a running cluster (ray start / ray up): this Ray would stop with this "
              "process", file=sys.stderr)
        release_local_ray(started_ray)
        return 2
    printed = None
    if not entries:
        state = Store(settings.state_dir)
        entries, printed = bootstrap_admin(state)
        state.close()
    settings.ray_dashboard_url = settings.ray_dashboard_url or _dashboard_url()
    try:
        check_code_tenants({e.tenant for e in entries if e.role == "code"}, settings.ray_dashboard_url,
                           jobs_headers(settings), own_url=_dashboard_url())
    except (IsolationError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        release_local_ray(started_ray)
        return 2
    serve.start(http_options=http_options(args.host, args.port, http))
    serve.run(application(settings.model_dump(), [e.model_dump(exclude={"token"}) for e in entries], http),
              name="etrain", route_prefix="/", blocking=False)
    url = f"http://{args.host}:{args.port}"
    print(f"[etrain] service at {url} (API under /v1, docs at {url}/docs); storage {storage_root}, "
          f"state {settings.state_dir}")
    if printed:
        print(f"[etrain] admin token (shown once; only its hash is kept): {printed}")
        print(f"[etrain]   export ETRAIN_SERVER={url} ETRAIN_TOKEN={printed}")
    if args.detach:
        return 0
    stop = {"now": False}
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.update(now=True))
    while not stop["now"]:
        time.sleep(0.5)
    serve.shutdown()
    release_local_ray(started_ray)
    return 0


def serve_settings(args: argparse.Namespace, storage_root: str):
    """The service's settings: the --config file (YAML or JSON), then the flags given over it."""
    import yaml
    from pydantic import ValidationError

    from service.settings import ServiceSettings

    data: dict = {}
    if args.config:
        try:
            with open(args.config) as f:
                data = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"--config {args.config}: cannot read: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"--config {args.config}: expected a mapping of settings (see `etrain serve --help`)")
    data["storage_root"] = storage_root
    data.setdefault("ray_dashboard_url", args.dashboard_url or "")
    for flag, key in (("quota", "max_active_per_tenant"), ("stop_wait_s", "stop_wait_s"), ("state_dir", "state_dir")):
        if getattr(args, flag) is not None:
            data[key] = getattr(args, flag)
    try:
        return ServiceSettings.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "settings"
        raise ValueError(f"--config {args.config or '(flags)'}: {where}: {first['msg']}") from None


HTTP_FLAGS = {  # flag -> (HttpLimits field, type, help); defaults are HttpLimits'
    "--body-deadline-s": ("body_deadline_s", float, "a request body must arrive whole within this, else 408"),
    "--request-timeout-s": ("request_timeout_s", float, "Ray Serve ends any request after this, a followed log "
                                                        "stream too"),
    "--max-ongoing-requests": ("max_ongoing_requests", int, "requests served at once; a slow client holds one while "
                                                            "its body trickles in"),
    "--max-queued-requests": ("max_queued_requests", int, "requests waiting for the replica to take "
                              "them (a burst of new ones too); more get 503"),
    "--login-failures": ("login_failures", int, "failed sign-ins a client address may make per --login-window-s, "
                                                "then 429"),
    "--login-window-s": ("login_window_s", float, "the window of --login-failures"),
    "--max-metrics-points": ("max_metrics_points", int, "most rows a metrics answer or chart carries, evenly spaced"),
    "--jobs-page-rows": ("jobs_page_rows", int, "jobs per page of the web list"),
    "--login-addresses": ("login_addresses", int, "client addresses whose failed sign-ins are remembered, the "
                                                  "oldest forgotten first"),
    "--read-cache-s": ("read_cache_s", float, "a record's Ray log and metrics are read at most once per this"),
    "--follow-streams-per-tenant": ("follow_streams_per_tenant", int, "logs one tenant may follow at once (each "
                                                                      "holds a request slot); more get 429"),
}


def http_limits(args: argparse.Namespace):
    """The front door's limits (service.http_limits) from the flags given."""
    from pydantic import ValidationError

    from service.http_limits import HttpLimits

    given = {field: getattr(args, field) for field, _, _ in HTTP_FLAGS.values() if getattr(args, field) is not None}
    try:
        return HttpLimits.model_validate(given)
    except ValidationError as exc:
        first = exc.errors()[0]
        flag = next(f for f, (field, _, _) in HTTP_FLAGS.items() if field == first["loc"][0])
        raise ValueError(f"{flag} {first['input']}: {first['msg']}") from None


def _dashboard_url() -> str:
    """The Jobs API address of the Ray this process is connected to."""
    from cluster.ray_adapter.dashboard import dashboard_url

    return dashboard_url()


# ---------------------------------------------------------------- client


class ApiError(Exception):
    def __init__(self, status: int, body: dict):
        self.status, self.body = status, body
        super().__init__(f"{status}: {body.get('detail')}")

    def render(self) -> str:
        lines = [f"error {self.status}: {self.body.get('detail')}"]
        lines += [f"  - {p}" for p in self.body.get("problems") or []]
        return terminal_safe("\n".join(lines))  # problems echo a tenant's values


class Client:
    """The service over HTTP, retrying connection errors and 5xx (submits keep one Idempotency-Key)."""

    def __init__(self, server: str, token: str | None, retries: int = 4):
        self.server, self.token, self.retries = server.rstrip("/"), token, retries

    def call(self, method: str, path: str, body: dict | None = None, headers: dict | None = None,
             params: dict | None = None, stream: bool = False):
        import requests

        hdrs = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        hdrs.update(headers or {})
        for attempt in range(self.retries + 1):
            try:
                resp = requests.request(method, self.server + path, json=body, headers=hdrs, params=params,
                                        timeout=60, stream=stream)
            except requests.ConnectionError:
                if attempt == self.retries:
                    raise
                time.sleep(0.5 * 2 ** attempt)
                continue
            if resp.status_code >= 500 and attempt < self.retries:
                time.sleep(0.5 * 2 ** attempt)
                continue
            if resp.status_code >= 400:
                try:
                    raise ApiError(resp.status_code, resp.json())
                except ValueError:
                    raise ApiError(resp.status_code, {"detail": resp.text[:500]}) from None
            return resp
        raise AssertionError("unreachable")


def client_of(args: argparse.Namespace) -> Client:
    return Client(args.server or os.environ.get("ETRAIN_SERVER", DEFAULT_SERVER),
                  args.token or os.environ.get("ETRAIN_TOKEN"))


def cmd_submit(args: argparse.Namespace) -> int:
    try:
        data = apply_overrides(read_spec_file(args.spec), args.overrides)
    except SpecError as exc:
        print(exc.render(f"spec {args.spec}"), file=sys.stderr)
        return 2
    data.setdefault("name", os.path.splitext(os.path.basename(args.spec))[0])
    plural = "sweeps" if "sweep" in data else "jobs"
    key = args.idempotency_key or uuid.uuid4().hex
    try:
        record = client_of(args).call("POST", f"/v1/{plural}", data, {"Idempotency-Key": key}).json()
    except ApiError as exc:
        print(exc.render(), file=sys.stderr)
        return 2 if exc.status == 422 else 1
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        print(terminal_safe(f"[etrain] {record['kind']} {record['id']} ({record['name']}): {record['state']}"))
        print(f"[etrain] follow it: etrain {plural} logs {record['id']} --follow")
    return 0


def cmd_records(args: argparse.Namespace) -> int:
    c, plural = client_of(args), args.plural
    try:
        if args.action == "list":
            params = {"state": args.state} if args.state else None
            out = c.call("GET", f"/v1/{plural}", params=params).json()
            return _show(args, out, lambda: table(out["items"]))
        if args.action == "logs":
            resp = c.call("GET", f"/v1/{plural}/{args.id}/logs", params={"tail": args.tail, "follow": args.follow},
                          stream=args.follow)
            for chunk in resp.iter_content(chunk_size=None, decode_unicode=True):
                print(terminal_safe(chunk), end="", flush=True)
            return 0
        if args.action in ("stop", "resume"):
            out = c.call("POST", f"/v1/{plural}/{args.id}/{args.action}").json()
            return _show(args, out, lambda: f"[etrain] {out['kind']} {out['id']}: {out['state']}")
        if args.action == "checkpoints":
            out = c.call("GET", f"/v1/{plural}/{args.id}/checkpoints").json()
            return _show(args, out, lambda: "\n".join(
                f"{c_['step']:>8}  {'ok ' if c_['complete'] else 'partial'}  {c_['size_bytes']:>10}  {c_['uri']}"
                for c_ in out) or "(no checkpoints yet)")
        if args.action == "metrics":
            out = c.call("GET", f"/v1/{plural}/{args.id}/metrics").json()
            return _show(args, out, lambda: "\n".join(
                f"step {r['step']!s:>7}  loss {number(r.get('loss'), '.4f')}  {number(r.get('samples_per_s'), '.0f')} "
                "samples/s"
                for r in out["rows"]) or "(no metrics yet)")
        out = c.call("GET", f"/v1/{plural}/{args.id}").json()
        return _show(args, out, lambda: details(out))
    except ApiError as exc:
        print(exc.render(), file=sys.stderr)
        return 1


def number(value, spec: str) -> str:
    """A metric as written, or '-': a job writes its history, so a row may hold anything."""
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def _show(args: argparse.Namespace, out, render) -> int:
    print(json.dumps(out, indent=2) if args.json else terminal_safe(render()))
    return 0


# Control characters but newline and tab: a tenant's text (a job's name, its log) must not move an
# admin's cursor, retitle the window or write to the clipboard (ESC, CSI, OSC sequences).
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def terminal_safe(text: str) -> str:
    """``text`` with every control character shown as a visible escape (\\x1b), so it prints as text."""
    return CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


WIDTH = 80  # a terminal's width: tables fit it, the name column gives way


def short_age(seconds: float | None) -> str:
    if seconds is None or seconds < 0:
        return "-"
    for size, unit, small, small_unit in ((86400, "d", 3600, "h"), (3600, "h", 60, "m"), (60, "m", 1, "s")):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit}{seconds % size // small:02.0f}{small_unit}"
    return f"{seconds:.0f}s"


def steps(n: float) -> str:
    return f"{n:.0f}" if n < 10000 else f"{n / 1000:.0f}k" if n < 10_000_000 else f"{n / 1e6:.0f}M"


def progress_text(p: dict) -> str:
    step, target = p.get("step"), p.get("target_step")
    if step is None:
        return "-"
    if not target:
        return steps(step)
    return f"{steps(step)}/{steps(target)} {100 * min(1.0, step / target):.0f}%"


def table(records: list[dict], now: float | None = None) -> str:
    """Records as columns that fit an 80-column terminal (a long name is cut, with an ellipsis)."""
    if not records:
        return "(none)"
    now = time.time() if now is None else now
    tenants = len({r["tenant"] for r in records}) > 1
    head = ("ID", "NAME", *(("TENANT",) if tenants else ()), "STATE", "PROGRESS", "GOODPUT", "COST", "AGE")
    rows = [head]
    for r in records:
        p = r.get("progress") or {}
        goodput = f"{100 * p['goodput']:.0f}%" if p.get("goodput") is not None else "-"
        cost = f"${p['cost_usd']:.2f}" if p.get("cost_usd") is not None else "-"
        rows.append((r["id"], r["name"], *((r["tenant"],) if tenants else ()), r["state"], progress_text(p), goodput,
                     cost, short_age(now - r["created_at"])))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    # Free text gives way, the name first: down to 8, then a tenant to 6, then the name to 4.
    for column, least in ((1, 8), *(((2, 6),) if tenants else ()), (1, 4)):
        over = sum(widths) + 2 * (len(widths) - 1) - WIDTH
        if over > 0:
            widths[column] = max(min(least, widths[column]), widths[column] - over)

    def cell(value, width: int) -> str:
        text = str(value)
        return (text if len(text) <= width else text[:width - 1] + "\u2026").ljust(width)
    return "\n".join("  ".join(cell(c, w) for c, w in zip(row, widths)).rstrip() for row in rows)


def details(r: dict, now: float | None = None) -> str:
    """One record, a field a line, for `jobs get`."""
    now = time.time() if now is None else now
    p = r.get("progress") or {}

    def when(t: float) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    fields = [("id", r["id"]), ("name", r["name"]), ("tenant", r["tenant"]), ("state", r["state"]),
              ("progress", progress_text(p))]
    if p.get("eta_s") is not None:
        fields.append(("eta", short_age(p["eta_s"])))
    for key, label, fmt in (("loss", "loss", "{:.4f}"), ("samples_per_s", "samples/s", "{:.0f}"),
                            ("world_size", "world size", "{:.0f}"), ("goodput", "goodput", "{:.0%}"),
                            ("cost_usd", "cost", "${:.4f}")):
        if p.get(key) is not None:
            fields.append((label, fmt.format(p[key])))
    fields += [("created", f"{when(r['created_at'])} ({short_age(now - r['created_at'])} ago)"),
               ("updated", when(r["updated_at"])), ("storage", r["storage"]),
               ("attempts", str(len(r.get("submissions") or [])))]
    if r.get("error"):
        fields.append(("error", r["error"]))
    lines = [f"{k + ':':<12}{v}" for k, v in fields]
    history = r.get("history") or []
    if history:
        lines.append("history:")
        lines += [f"  {when(h['at'])}  {h['state']:<9}  {h['reason']}"[:WIDTH] for h in history[-8:]]
    return "\n".join(lines)


def add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", help=f"service URL (default: $ETRAIN_SERVER or {DEFAULT_SERVER})")
    p.add_argument("--token", help="bearer token (default: $ETRAIN_TOKEN)")
    p.add_argument("--json", action="store_true", help="print the API's JSON (for scripts)")


def main(argv: list[str] | None = None) -> int:
    parser, sub = build_parser()
    serve_p = sub.add_parser(
        "serve", help="run the job service (Ray Serve + FastAPI) on the current Ray cluster",
        description="Deploys the HTTP service. Tokens: --tokens FILE or $ETRAIN_TOKENS, a JSON/YAML list of "
                    "{tenant, role: admin|user|code, sha256: <hex of the token>}; with none, an admin token is "
                    "made and printed once. Roles: admin (everything, every tenant), code (its own code: "
                    "train_loop, any factory; trusted within the jobs cluster, and served only when --dashboard-url "
                    "names a jobs cluster apart from the service's own Ray), user (built-in workloads, exactly "
                    "the factories in --config's allowed_factories, data under its own storage prefix or "
                    "tenant_data_uris, within role_limits). --config FILE sets the rest (YAML): allowed_factories, "
                    "tenant_data_uris, tenant_env, tenant_quotas, cpu_quota, gpu_quota, tenant_cpu_quotas, "
                    "tenant_gpu_quotas, role_limits, max_sweep_trials, entrypoint_resources, max_body_bytes, jobs_token_file (the jobs "
                    "cluster's own Ray token).", epilog=CLIENT_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve_p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve_p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve_p.add_argument("--storage-root", help="where records, specs and jobs live (default: $ETRAIN_STORAGE_ROOT "
                                                "or ~/etrain-storage)")
    serve_p.add_argument("--tokens", help="token file (see above)")
    serve_p.add_argument("--config", help="settings file, YAML (see above)")
    serve_p.add_argument("--state-dir", help="the service's own state (records, keys, token hashes): a local folder "
                                             "outside the storage root (default: $ETRAIN_STATE_DIR or "
                                             "~/.etrain/service)")
    serve_p.add_argument("--quota", type=int, help="quota slots per tenant: a job takes 1, a sweep its "
                                                   "max_concurrent_trials (default 4)")
    serve_p.add_argument("--stop-wait-s", type=float,
                         help="graceful stop: seconds to wait for the final checkpoint before Ray's stop (default 120)")
    serve_p.add_argument("--dashboard-url", help="Ray Jobs API URL of the cluster jobs run on (default: the connected cluster's "
                                                  "dashboard; `code` tenants need a cluster apart from the service's)")
    serve_p.add_argument("--cpus", type=int, default=4, help="logical CPUs of a local Ray this starts (default 4)")
    serve_p.add_argument("--detach", action="store_true", help="deploy and exit (needs a running cluster)")
    from service.http_limits import HttpLimits

    for flag, (field, kind, text) in HTTP_FLAGS.items():
        serve_p.add_argument(flag, dest=field, type=kind,
                             help=f"{text} (default {HttpLimits.model_fields[field].default:g})")
    serve_p.set_defaults(fn=cmd_serve)

    submit = sub.add_parser("submit", help="submit a job or sweep spec to the service",
                            epilog=CLIENT_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    submit.add_argument("spec", help="job or sweep spec file (JSON or YAML)")
    submit.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec field (repeatable; values read as YAML)")
    submit.add_argument("--idempotency-key", help="reuse to make a retried submit safe (default: a new one)")
    add_client_args(submit)
    submit.set_defaults(fn=cmd_submit)

    for plural in ("jobs", "sweeps"):
        p = sub.add_parser(plural, help=f"list, inspect, stop and resume {plural} on the service",
                           epilog=CLIENT_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
        actions = p.add_subparsers(dest="action", required=True)
        lst = actions.add_parser("list", help=f"your {plural} (an admin sees every tenant's)")
        lst.add_argument("--state", choices=[s.value for s in JobState])
        add_client_args(lst)
        for action, text in (("get", "one record: state history, attempts, summary"),
                             ("logs", "the latest attempt's log"), ("stop", "final checkpoint, then stop"),
                             ("resume", "continue from the newest checkpoint"),
                             ("checkpoints", "checkpoints in storage"), ("metrics", "step metrics over time")):
            a = actions.add_parser(action, help=text)
            a.add_argument("id")
            if action == "logs":
                a.add_argument("--tail", type=int, default=200, help="last N lines (default 200)")
                a.add_argument("--follow", action="store_true", help="keep streaming new lines")
            add_client_args(a)
        p.set_defaults(fn=cmd_records, plural=plural)
    args = parser.parse_args(argv)
    send_to(sys.stderr)  # our lines on stderr: stdout holds what a command answers (a summary, JSON)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
