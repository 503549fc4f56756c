"""Spot notices -> Ray node drain: the per-node daemon behind `etrain spot-watch`.

Ray never turns a cloud's interruption notice into a node drain; this does. It polls the
instance metadata service the way AWS documents it (an IMDSv2 session token, then
``spot/instance-action`` and the rebalance recommendation) and, on a notice, drains its
own Ray node with reason PREEMPTION and the notice's deadline. Ray Train then tells every
rank through ``ray.train.get_preemption_info()``, the loop takes a just-in-time
checkpoint, and at the deadline the run restarts on the nodes left. A SIGTERM to the
daemon (Kubernetes, GCE) drains the same way.

The metadata URL, poll interval and the clock are arguments, so tests serve notices from
a local HTTP server: the only fake is the cloud's endpoint.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

log = logging.getLogger(__name__)

AWS_IMDS_URL = "http://169.254.169.254"
TOKEN_TTL_S = 21600
SPOT_NOTICE_S = 120  # AWS gives two minutes


@dataclass(frozen=True)
class Notice:
    kind: str  # "spot-interruption" | "rebalance" | "sigterm"
    deadline_s: int  # seconds left until the node goes
    detail: str


def parse_instance_action(body: str, now: datetime) -> Notice | None:
    """``{"action": "terminate", "time": "2026-11-30T10:00:00Z"}`` -> a Notice with seconds left."""
    try:
        doc = json.loads(body)
        when = datetime.strptime(doc["time"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    except (ValueError, KeyError, TypeError):
        return None
    left = max(0, int((when - now).total_seconds()))
    return Notice("spot-interruption", left, f"{doc.get('action', 'terminate')} at {doc['time']}")


def decide(notice: Notice | None, on_rebalance: str, rebalance_deadline_s: int) -> Notice | None:
    """The notice to drain for, or None. Pure: an interruption always, a rebalance per policy."""
    if notice is None:
        return None
    if notice.kind == "rebalance":
        if on_rebalance != "drain":
            return None
        return Notice("rebalance", rebalance_deadline_s, notice.detail)
    return notice


class IMDS:
    """The AWS instance metadata service, IMDSv2 (session token on every request)."""

    def __init__(self, base_url: str = AWS_IMDS_URL, timeout_s: float = 1.0):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._token: str | None = None
        self._token_at = 0.0

    def _request(self, method: str, path: str, headers: dict) -> tuple[int, str]:
        req = urllib.request.Request(self.base_url + path, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, ""

    def token(self) -> str:
        if self._token is None or time.monotonic() - self._token_at > TOKEN_TTL_S / 2:
            status, body = self._request("PUT", "/latest/api/token",
                                         {"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
            if status != 200:
                raise ConnectionError(f"IMDSv2 token request answered {status}")
            self._token, self._token_at = body, time.monotonic()
        return self._token

    def get(self, path: str) -> str | None:
        """The document at ``path``, or None when the service says 404 (no notice)."""
        status, body = self._request("GET", path, {"X-aws-ec2-metadata-token": self.token()})
        if status == 401:  # token expired early: get a new one once
            self._token = None
            status, body = self._request("GET", path, {"X-aws-ec2-metadata-token": self.token()})
        return body if status == 200 else None

    def poll(self, now: datetime) -> Notice | None:
        action = self.get("/latest/meta-data/spot/instance-action")
        if action:
            return parse_instance_action(action, now)
        rebalance = self.get("/latest/meta-data/events/recommendations/rebalance")
        if rebalance:
            return Notice("rebalance", 0, rebalance.strip())
        return None


class OwnNodeError(RuntimeError):
    """This machine's Ray node cannot be told apart from the others: pass --node-id."""


def pick_own_node(nodes: list[dict], local_ip: str, attached_node_id: str | None = None) -> str:
    """The id of the alive Ray node at ``local_ip`` (``ray.nodes()`` rows). Pure.

    One raylet per machine is the cloud's case. Several at one address (a test cluster on
    one box) are told apart by the raylet this process attached to, if it is among them.
    """
    alive = [n for n in nodes if n.get("Alive")]
    here = [n["NodeID"] for n in alive if n.get("NodeManagerAddress") == local_ip]
    if len(here) == 1:
        return here[0]
    if attached_node_id in here:
        return attached_node_id
    seen = ", ".join(sorted({str(n.get("NodeManagerAddress")) for n in alive})) or "none"
    if not here:
        raise OwnNodeError(f"no alive Ray node has this machine's address {local_ip} (nodes at: {seen}): "
                           "start spot-watch after `ray start` on this node, or pass --node-id")
    raise OwnNodeError(f"{len(here)} Ray nodes share this machine's address {local_ip}: pass --node-id")


def find_own_node(address: str | None, timeout_s: float = 60.0) -> str:
    """This machine's node id, asked of the cluster at ``address`` (retried while Ray starts).

    Connects as a short-lived driver (token auth as the environment says), reads the node
    table, and disconnects, so the daemon holds no connection while it waits for a notice.
    """
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.init(address=address or "auto", logging_level="ERROR", log_to_driver=False,
                     namespace="etrain-spot-watch")
            try:
                return pick_own_node(ray.nodes(), ray.util.get_node_ip_address(),
                                     ray.get_runtime_context().get_node_id())
            finally:
                ray.shutdown()
        except OwnNodeError:
            if time.monotonic() > deadline:
                raise
        except (ConnectionError, RuntimeError, ray.exceptions.RayError) as exc:  # starting, wrong address or token
            if time.monotonic() > deadline:
                raise OwnNodeError(f"cannot reach the Ray cluster at {address or 'auto'}: {exc}") from exc
            log.info(f"Ray not reachable yet ({str(exc).splitlines()[0][:160]}); retrying")
        time.sleep(2.0)


def drain_node(address: str | None, node_id: str | None, notice: Notice) -> subprocess.CompletedProcess:
    """Ask Ray's GCS to drain a node for preemption with the notice's deadline."""
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "drain-node",
           "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", f"{notice.kind}: {notice.detail}",
           "--deadline-remaining-seconds", str(max(1, notice.deadline_s))]
    if address:
        cmd += ["--address", address]
    if node_id:
        cmd += ["--node-id", node_id]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def watch(imds: IMDS, drain: Callable[[Notice], bool], interval_s: float = 5.0, on_rebalance: str = "drain",
          rebalance_deadline_s: int = SPOT_NOTICE_S, sigterm_deadline_s: int = 25, max_polls: int | None = None,
          clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc)) -> Notice | None:
    """Poll until a notice is drained (returned) or ``max_polls`` run out; SIGTERM drains too."""
    stop = threading.Event()
    sigterm = threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: (sigterm.set(), stop.set()))
    try:
        return _poll_loop(imds, drain, interval_s, on_rebalance, rebalance_deadline_s, sigterm_deadline_s,
                          max_polls, clock, stop, sigterm)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _poll_loop(imds, drain, interval_s, on_rebalance, rebalance_deadline_s, sigterm_deadline_s, max_polls,
               clock, stop: threading.Event, sigterm: threading.Event) -> Notice | None:
    polls = 0
    while max_polls is None or polls < max_polls:
        polls += 1
        if sigterm.is_set():
            notice = Notice("sigterm", sigterm_deadline_s, "SIGTERM to the node")
        else:
            try:
                notice = decide(imds.poll(clock()), on_rebalance, rebalance_deadline_s)
            except (OSError, ConnectionError) as exc:  # metadata service hiccup: log, poll again
                log.info(f"metadata service unreachable ({exc}); retrying in {interval_s}s")
                notice = None
        if notice is not None:
            log.info(f"{notice.kind}: {notice.detail}; draining this node, deadline {notice.deadline_s}s")
            if drain(notice):
                return notice
            log.info("drain failed; will retry")
        stop.wait(interval_s)
    return None
