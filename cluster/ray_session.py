"""Ray's lifecycle for this process: find the cluster to join, else start a local Ray; release what
was started; watch the nodes and keep Ray Train's view of them current.

Not about running a job (trainers.launch does that): `etrain run`, a sweep, `etrain serve` and
`etrain metrics prometheus-config` all find or start their Ray here. Ray's internals it needs
(the address record, a local start, the planner's node list) are in cluster.ray_adapter.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import ray

from cluster.ray_adapter import cluster_view
from cluster.ray_adapter.local import ADDRESS_ENV, address_record, init_local_ray, shutdown_local_ray

log = logging.getLogger(__name__)


def running_cluster_address() -> str | None:
    """RAY_ADDRESS, or the cluster `ray start` left on record if its GCS answers.

    A Ray that was killed without `ray stop` leaves its address record behind. Joining that
    address hangs, and so do Ray's own "auto" lookups inside the local Ray started instead (a
    Ray Jobs driver's ``ray.init()``, `ray status`). A one-second TCP probe
    tells a live cluster from a stale record. The record is removed, as `ray stop` would have
    done, only when it is surely dead: this user's own file, naming this machine, whose GCS
    port refuses the connection (not a timeout: a busy or distant GCS), and unchanged meanwhile.
    """
    if os.environ.get(ADDRESS_ENV):
        return os.environ[ADDRESS_ENV]
    record = address_record()
    try:
        address = record.read_text().strip()
    except OSError:
        return None
    host, port = split_address(address)
    if host is None:
        return None  # empty or being written: leave it
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return address
    except ConnectionRefusedError:
        refused = True
    except OSError:
        refused = False
    if refused and is_local_host(host) and owned_by_me(record):
        try:
            if record.read_text().strip() == address:
                record.unlink()
                log.warning("removed %s: it named %s, where no Ray answers (a Ray stopped without `ray stop`)",
                            record, address)
        except OSError:
            pass
    return None


def split_address(address: str) -> tuple[str | None, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); (None, 0) when it is neither."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None, 0
    return host.strip("[]"), int(port)


def is_local_host(host: str) -> bool:
    """An address of this machine: loopback, or one of its own interfaces."""
    import ipaddress

    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        return host == "localhost"
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((host, 0))  # only an address of this machine can be bound
        return True
    except OSError:
        return False


def owned_by_me(path) -> bool:
    try:
        return path.stat().st_uid == os.getuid()
    except OSError:
        return False


def usable_cpus() -> int:
    """The CPUs this process may run on: fewer than the machine's under taskset or a container's
    cpuset, where a local Ray sized by the machine would start more workers than it has cores."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def ensure_ray(num_workers: int) -> bool:
    """Join the running cluster (RAY_ADDRESS or `ray start`), else start a local Ray on loopback.

    Returns True when this process started Ray (and so must shut it down).
    """
    if ray.is_initialized():
        return False
    address = running_cluster_address()
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    num_cpus = max(usable_cpus(), num_workers + 2)
    # Ray's dashboard (its Train pages, its state API for `ray list`): for the user to look at the run.
    init_local_ray(num_cpus=num_cpus, include_dashboard=True, dashboard_host="127.0.0.1",
                   configure_logging=True, logging_level="WARNING")
    return True


def release_ray(started_ray: bool) -> None:
    """Shut down a Ray this process started (:func:`ensure_ray`), with any of its workers that
    hang on after it (Ray's teardown can deadlock: cluster.ray_adapter.local.shutdown_local_ray); a cluster
    this process joined stays up."""
    if not started_ray:
        return
    killed = shutdown_local_ray()
    if killed:
        log.warning("stopped %d Ray worker process(es) that hung on after the local Ray stopped (pids %s)",
                    len(killed), ", ".join(map(str, killed)))


def node_liveness() -> dict[str, bool]:
    """Every node Ray knows, alive or dead (its list keeps dead nodes for a while)."""
    return {n["NodeID"]: bool(n["Alive"]) for n in ray.nodes()}


def alive_node_ids() -> frozenset[str]:
    return frozenset(n for n, alive in node_liveness().items() if alive)


class NodeWatch:
    """While an elastic job runs: when Ray's set of live nodes changes, have Ray Train's planner
    read it at once (cluster.ray_adapter.cluster_view), so a node that joins is used within
    ``distributed.resize_check_interval_s`` plus start-up, not after the planner's own 20 s refresh.
    """

    def __init__(self, interval_s: float, enabled: bool = True):
        self.interval_s, self.enabled = max(0.5, min(interval_s, 5.0)), enabled
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        seen = alive_node_ids()
        while not self._stop.wait(self.interval_s):
            try:
                now = alive_node_ids()
                if now != seen:
                    cluster_view.refresh_cluster_view()
                    seen = now
            except Exception as exc:  # boundary: a missed refresh only delays a resize; try again next tick
                log.warning("node watch: %s: %s", type(exc).__name__, exc)

    def __enter__(self) -> "NodeWatch":
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="etrain-node-watch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 1)


def settle_cluster_view(error: BaseException, gone_timeout_s: float = 60.0) -> None:
    """Before the next attempt is planned: wait (bounded) until preempted nodes have left Ray's
    node list, then make Ray Train's planner read the list now. Otherwise the restart is planned
    for the drained node and waits out fault_tolerance.worker_start_timeout_s (bench/preemption.py)."""
    from ray.train.v2.api.exceptions import PreemptionError

    leaving = set(error.preemption_info.preempted_node_ids) if isinstance(error, PreemptionError) else set()
    deadline = time.monotonic() + gone_timeout_s
    while leaving and time.monotonic() < deadline and any(n["Alive"] and n["NodeID"] in leaving for n in ray.nodes()):
        time.sleep(0.2)
    try:
        cluster_view.refresh_cluster_view()
    except Exception as exc:  # boundary: a stale plan only costs time; say so and go on
        log.warning(f"could not refresh Ray Train's view of the nodes ({type(exc).__name__}: {exc}); "
                    "the restart may wait out fault_tolerance.worker_start_timeout_s")
