"""Where a `code` tenant's jobs may run: never on the Ray cluster that runs the service.

Ray does not isolate one job from another: any task can ask for any node
(``resources={"node:<ip>": 0.01}``) and runs as the user that started Ray there. On the
cluster that runs the service's replica, a tenant's own code would run as the service and
could read or change its records and token hashes, whatever folder they live in. So a
tenant with role `code` is served only when ``ray_dashboard_url`` names a jobs cluster
apart from the service's own (other nodes, or another Unix user on one box, with a Ray
token of its own: ``jobs_token_file``). The service checks this when it starts, by the
node ids of the two clusters, not by their addresses (one cluster has many names).
"""

from __future__ import annotations

from collections.abc import Iterable

from cluster.ray_adapter.dashboard import dashboard_client


class IsolationError(Exception):
    pass


def code_tenants_problem(code_tenants: Iterable[str], own_node_id: str, jobs_node_ids: Iterable[str] | None,
                         jobs_url: str) -> str | None:
    """Why the service must not start with these `code` tenants, or None when it may.

    ``jobs_node_ids`` is None when the jobs cluster did not list its nodes.
    """
    tenants = sorted(set(code_tenants))
    if not tenants:
        return None
    who = f"tenant(s) {', '.join(tenants)} have role 'code' (their jobs run their own code)"
    fix = ("point ray_dashboard_url (--dashboard-url) at a jobs cluster apart from the service's: other nodes, or "
           "a Ray started by another Unix user, with its own token in jobs_token_file (README: 'Threat model'); "
           "or give those tenants role 'user'")
    if jobs_node_ids is None:
        return f"{who}, and the jobs cluster at {jobs_url} did not list its nodes, so the service cannot tell " \
               f"it apart from its own: {fix}"
    if own_node_id in set(jobs_node_ids):
        return f"{who}, but the jobs cluster at {jobs_url} is the service's own Ray: that code could read and " \
               f"change the service's records and tokens: {fix}"
    return None


def jobs_node_ids(url: str, headers: dict[str, str], timeout_s: float = 30.0) -> list[str] | None:
    """The node ids of the Ray cluster behind a dashboard URL; None when it does not answer."""
    from ray.util.state.api import StateApiClient
    from ray.util.state.common import ListApiOptions, StateResource

    try:
        client = dashboard_client(StateApiClient, url, {"Content-Type": "application/json", **headers})
        nodes = client.list(StateResource.NODES, options=ListApiOptions(limit=10000, timeout=int(timeout_s)),
                            raise_on_missing_output=False)
    except Exception:  # boundary: the jobs cluster's HTTP API; the caller says what it could not check
        return None
    return [n.node_id for n in nodes]


def same_address(a: str, b: str) -> bool:
    """Whether two dashboard URLs name the same host and port (loopback names alike)."""
    def norm(url: str) -> tuple[str, str]:
        host, _, port = url.split("://", 1)[-1].rstrip("/").rpartition(":")
        return ("127.0.0.1" if host in ("localhost", "0.0.0.0") else host), port
    return norm(a) == norm(b)


def check_code_tenants(code_tenants: Iterable[str], jobs_url: str, headers: dict[str, str],
                       own_url: str | None = None) -> None:
    """Raise IsolationError when `code` tenants would run on the service's own cluster.

    ``own_url`` is the service's own dashboard: the same address needs no listing (the jobs
    cluster's token would not list the service's own nodes anyway).
    """
    tenants = list(code_tenants)
    if not tenants:
        return
    import ray

    own_node = ray.get_runtime_context().get_node_id()
    nodes = [own_node] if own_url and same_address(own_url, jobs_url) else jobs_node_ids(jobs_url, headers)
    problem = code_tenants_problem(tenants, own_node, nodes, jobs_url)
    if problem:
        raise IsolationError(problem)
