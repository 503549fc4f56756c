"""Starting, joining and stopping a local Ray, and the knobs that keep it on its own address.

- The GCS port of a local start (``RAY_GCS_SERVER_PORT``, read by ``ray._private.node``): a
  local Ray tells its own processes where it is (:func:`init_local_ray`).
- The session folder of the Ray this process started (``ray._private.worker._global_node``):
  :func:`shutdown_local_ray` stops the workers of that Ray that hang on after it (cluster/leftovers.py).
- Ray's loopback switch (``ray_constants.ENABLE_RAY_CLUSTER``, read from
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when ray is imported): off, Ray keeps 127.0.0.1
  instead of swapping in the machine's address (:func:`keep_on_loopback`, :func:`default_to_loopback`).
- Where `ray start` records the address of the cluster it started (``ray_current_cluster``):
  a Ray that was killed leaves it behind, and Ray's own "auto" lookups inside a new cluster
  (a Ray Jobs driver's ``ray.init()``, `ray status`) then query the dead address until they time
  out (:func:`address_record`); the cluster named by ``RAY_ADDRESS`` (:data:`ADDRESS_ENV`) comes first.
- Ray's temp folder, where that record and the head's Prometheus discovery file
  (:data:`PROMETHEUS_DISCOVERY_FILE`) live (:func:`ray_temp_dir`).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

GCS_PORT_ENV = "RAY_GCS_SERVER_PORT"  # ray._private.ray_constants.GCS_PORT_ENVIRONMENT_VARIABLE
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # ray._private.ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
ADDRESS_ENV = "RAY_ADDRESS"  # ray._private.ray_constants.RAY_ADDRESS_ENVIRONMENT_VARIABLE
PROMETHEUS_DISCOVERY_FILE = "prom_metrics_service_discovery.json"  # ray_constants.PROMETHEUS_SERVICE_DISCOVERY_FILE


def default_to_loopback() -> None:
    """Before ray is imported: a local Ray started in this process stays on loopback. Ray reads
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, at import, and otherwise swaps 127.0.0.1 for the
    machine's outward address (resolve_ip_for_localhost). Remote cluster addresses are not affected;
    a value the user set is kept."""
    os.environ.setdefault(LOOPBACK_ENV, "0")


def ray_temp_dir() -> Path:
    """Ray's temp folder on this node as `ray start` picks it (RAY_TMPDIR, else TMPDIR, else /tmp,
    then ``ray``): the address record and the Prometheus discovery file live there."""
    from ray._common.utils import get_default_ray_temp_dir

    return Path(get_default_ray_temp_dir())


def address_record() -> Path:
    """The file in which `ray start` records its cluster's address for ``address="auto"``
    (in :func:`ray_temp_dir`); `ray stop` removes it."""
    from ray._common.utils import get_ray_address_file

    return Path(get_ray_address_file(str(ray_temp_dir())))


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, not an address
        return False


def keep_on_loopback() -> dict[str, str]:
    """Have Ray keep a loopback address in this process; returns the environment that keeps it
    in the processes a local start launches (GCS, raylet, and through the raylet, the workers).

    Ray swaps 127.0.0.1 for the machine's outward address (``resolve_ip_for_localhost``) unless
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER says off, and reads that once, when ray is imported: a
    script that imported ray before setting it (anything but ``import trainers``, which sets it
    first) would start its local Ray on the outward address. The flag stays off in this process:
    what it does with its Ray later must agree on the node's address. A value the user set that
    turns it on is kept (Ray's own behaviour; :func:`init_local_ray` then says what happened).
    """
    from ray._private import ray_constants

    if os.environ.get(LOOPBACK_ENV, "0").lower() in ("true", "1"):  # read as Ray's env_bool reads it
        return {}
    ray_constants.ENABLE_RAY_CLUSTER = False
    return {LOOPBACK_ENV: os.environ.get(LOOPBACK_ENV, "0")}


LOCAL_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}


def init_local_ray(host: str = "127.0.0.1", **init_kwargs) -> str:
    """Start a local Ray (``ray.init(address="local")``) whose every process knows its address.

    Ray's lookups inside a cluster that are given no address (a Ray Jobs driver's ``ray.init()``,
    the state API's clients) read RAY_ADDRESS, else the record `ray start` leaves, else any GCS
    process on this machine. A local start sets none of them: with a second Ray on the machine (a
    user's own, another job's) such a lookup fails on "Found multiple active Ray instances", and a
    record naming the other Ray has it act on that one (Ray Train's placement-group cleaner, now
    replaced, once removed a live run's placement group so). Ray takes no GCS
    port for a local start but reads ``RAY_GCS_SERVER_PORT`` when it starts a head, and its
    processes inherit this process's environment as they start: with both set around ray.init,
    each of them is pinned to this cluster, and on a loopback ``host`` kept there
    (:func:`keep_on_loopback`). This process's own environment is restored after, so what it
    starts later chooses for itself. Returns the GCS address.

    Ray prestarts idle workers for the first driver, which our jobs never use: every actor of
    a training run (controller, workers) carries a runtime env, so Ray starts a process of its
    own for each. Prestarted, they cost ~1.4 CPU-s each at the start and ~0.5 CPU-s a minute
    idle; :data:`LOCAL_SYSTEM_CONFIG` turns that off (a caller's ``_system_config`` adds to it).
    """
    import ray

    init_kwargs["_system_config"] = {**LOCAL_SYSTEM_CONFIG, **init_kwargs.get("_system_config", {})}

    with socket.socket() as s:  # a free port; the GCS binds it a moment later
        s.bind((host, 0))
        port = s.getsockname()[1]
    address = f"{host}:{port}"
    pinned = {GCS_PORT_ENV: str(port), ADDRESS_ENV: address, **(keep_on_loopback() if is_loopback(host) else {})}
    saved = {k: os.environ.get(k) for k in pinned}
    os.environ.update(pinned)
    try:
        ray.init(address="local", _node_ip_address=host, **init_kwargs)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    started = ray.get_runtime_context().gcs_address
    problem = local_start_problem(started, address)
    if problem:
        ray.shutdown()
        raise RuntimeError(problem)
    return address


def session_folder(started_here: bool = False) -> Path | None:
    """The session folder of the Ray this process is connected to; None when not connected, or,
    with ``started_here``, when this process joined that Ray rather than started it."""
    from ray._private import worker

    node = worker._global_node
    if node is None or (started_here and not node.head):  # only a local start makes this process a head node
        return None
    return Path(node.get_session_dir_path())


def shutdown_local_ray(grace_s: float = 10.0) -> list[int]:
    """``ray.shutdown()`` a Ray this process started, then stop by pid its workers that outlive it
    (a teardown that hangs: cluster/leftovers.py). Returns their pids (none, normally). For a Ray
    this process only joined it is a plain ``ray.shutdown()``: that Ray's workers are running."""
    import ray

    from cluster.leftovers import stop_leftovers

    folder = session_folder(started_here=True)
    ray.shutdown()
    return stop_leftovers(folder, grace_s) if folder is not None else []


def local_start_problem(started: str, address: str) -> str | None:
    """Why a local Ray is not where :func:`init_local_ray` asked for it, or None."""
    if started == address:
        return None
    if started.rpartition(":")[2] == address.rpartition(":")[2] and not is_loopback(started.rpartition(":")[0]):
        return (f"Ray started its GCS at {started}, not at {address}: it swapped the loopback address for the "
                f"machine's because {LOOPBACK_ENV}={os.environ.get(LOOPBACK_ENV)!r}; unset it (or set it to 0) "
                "to keep a local Ray on loopback")
    return (f"Ray started its GCS at {started}, not at {address} ({GCS_PORT_ENV} ignored): "
            "cluster/ray_adapter/local.py needs another way to give a local Ray's processes its address")
