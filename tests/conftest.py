"""Shared fixtures. Ray-using tests get one local Ray per session, bound to loopback."""

from __future__ import annotations

import os
import random
import socket
import sys
from pathlib import Path

import pytest

# Everything binds to loopback. Ray otherwise turns 127.0.0.1 in an address into the machine's
# outward IP when connecting (resolve_ip_for_localhost), so joining a loopback cluster hangs.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "fixtures"))  # user-code packages the specs import
# What Ray's workers import, ahead of the caller's own PYTHONPATH (kept: where packages come from it, as on
# the lent GPU machine, Ray's own agent and workers import Ray through it).
WORKER_PYTHONPATH = os.pathsep.join(
    [str(REPO), str(REPO / "tests" / "fixtures"), *filter(None, [os.environ.get("PYTHONPATH")])])


_HANDED_OUT: set[int] = set()


def pytest_configure(config):
    import cpu_profile
    import exit_status

    exit_status.install()  # the run ends with pytest's status, whatever the interpreter's teardown does
    cpu_profile.install(config)  # with ETRAIN_CPU_PROFILE set (make test-profile): CPU seconds per test


def ephemeral_ports() -> range:
    """The kernel's range for the local ports of outgoing connections (Linux's default elsewhere)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


PORTS_FROM = 20000  # above Ray's worker ports (10002-19999 by default)


def free_port() -> int:
    """A port free now, outside the kernel's ephemeral range, and not handed out before in this
    process. Outside the range: an outgoing connection of any process may take an ephemeral port
    between this probe and the server's own bind (a multi-node Ray's dashboard lost its port so in
    a full run). Not handed out before: a test that asks for several at once (one per Ray
    component) gets distinct ones, which probes closed one after another do not promise."""
    ephemeral = ephemeral_ports()
    candidates = range(PORTS_FROM, ephemeral.start) if ephemeral.start - PORTS_FROM >= 1000 else None
    while True:
        wanted = random.choice(candidates) if candidates else 0  # 0: the kernel's choice, where no room is left
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", wanted))
            except OSError:  # in use (or in TIME_WAIT): another
                continue
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


@pytest.fixture(scope="session", autouse=True)
def service_state_outside_home(tmp_path_factory):
    """A service made by a test without a state_dir keeps its records in a session folder,
    never in this machine's ~/.etrain/service (runs would pile up records and quotas there)."""
    saved = os.environ.get("ETRAIN_STATE_DIR")
    os.environ["ETRAIN_STATE_DIR"] = str(tmp_path_factory.mktemp("service-state"))
    yield
    if saved is None:
        os.environ.pop("ETRAIN_STATE_DIR", None)
    else:
        os.environ["ETRAIN_STATE_DIR"] = saved


@pytest.fixture(autouse=True)
def ray_address_record_kept(request):
    """A test that runs `ray start` and stops it by pid leaves Ray's address record naming a dead
    cluster; every later Ray on this machine would look it up (a Ray Jobs driver's ``ray.init()``
    then waits for the dead address). Each Ray test leaves the record as it found it."""
    if not any(request.node.get_closest_marker(m) for m in ("ray", "e2e")):
        yield  # the unit tier starts no Ray: it leaves the machine's record alone
        return
    from cluster.ray_adapter.local import address_record

    record = address_record()
    before = record.read_text() if record.exists() else None
    yield
    after = record.read_text() if record.exists() else None
    if after != before:
        if before is None:
            record.unlink(missing_ok=True)
        else:
            record.write_text(before)
            from cluster.ray_session import running_cluster_address

            running_cluster_address()  # and gone if its Ray stopped meanwhile (a multi-node test stops the shared one)


@pytest.fixture(autouse=True)
def unit_tests_start_no_ray(request):
    """The unit tier runs without Ray (make test-fast); a test that starts one (a Ray Data call
    does so by itself) would also hand the next module a Ray without the tests' settings."""
    yield
    if Path(str(request.node.fspath)).relative_to(REPO).as_posix().startswith("tests/unit/"):
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()
            pytest.fail("this unit test started Ray: the unit tier must not (use a fake, or move it to integration)")


@pytest.fixture(autouse=True)
def our_loggers_restored():
    """Our package loggers as they were: a test that runs a front end or a worker's logger set-up
    (cluster.log_lines, trainers.worker_log) must not route the next test's lines."""
    import logging

    from cluster.log_lines import OUR_LOGGERS

    loggers = [logging.getLogger(name) for name in (*OUR_LOGGERS, "etrain.worker")]
    before = [(log, list(log.handlers), log.level, log.propagate) for log in loggers]
    yield
    for log, handlers, level, propagate in before:
        log.handlers[:] = handlers
        log.setLevel(level)
        log.propagate = propagate


@pytest.fixture
def said():
    """Our lines (cluster.log_lines' format), as a list, while the test runs: what a front end shows."""
    from cluster.log_lines import lines_to

    lines: list[str] = []
    with lines_to(lines.append):
        yield lines


@pytest.fixture
def storage(tmp_path: Path) -> Path:
    root = tmp_path / "storage"
    return root


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on loopback; AWS settings point at it for this process and its Ray."""
    from moto.server import ThreadedMotoServer
    from moto_ranges import serve_ranges_lazily

    serve_ranges_lazily()  # a ranged GET reads only its range (moto copies the whole object twice)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env["AWS_ENDPOINT_URL"]
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


RAY_AGENT_DEFAULT_PORT = 52365  # the node agent's HTTP port (Jobs API) when a start names none


def port_free(port: int) -> bool:
    """Whether ``port`` can be bound on loopback as a listener binds it (SO_REUSEADDR: a closed
    connection's TIME_WAIT does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


SHARED_RAY = {"dashboard": True}  # whether the shared Ray has a dashboard: set at collection


def start_local_ray():
    """The tests' shared Ray, as `ray start` would leave it: its address on record.

    With another Ray on the machine (the rehearsal's cloud runs beside the other tests), Ray's
    own "auto" lookups pick the recorded cluster; without a record, any. Ray Jobs' supervisor
    resolves "auto" that way for each job's driver, so the service tests' jobs need it.
    """
    from waiting import wait_for

    from cluster.ray_adapter.local import address_record, init_local_ray
    from cluster.ray_session import running_cluster_address

    running_cluster_address()  # removes a record left by a killed Ray, which Ray's own lookups would use
    # ray.init takes no agent port: Ray's default must be free, or the agent serves no HTTP and every
    # job submission fails ("Agent info not found"). A Ray stopped just before may still hold it (its
    # node agent exits a moment after its raylet), or one left running (a `ray up` head that leaked did).
    wait_for(lambda: port_free(RAY_AGENT_DEFAULT_PORT), 60, f"port {RAY_AGENT_DEFAULT_PORT} to be free for the shared "
             f"Ray's node agent (the Jobs API); stop the Ray that holds it (`ss -ltnp 'sport = {RAY_AGENT_DEFAULT_PORT}'`)",
             poll_s=0.2)
    # PYTHONPATH through the raylet's environment, which every worker it starts inherits (a job-level
    # runtime_env would start each worker through runtime_env's setup process: a second Python start,
    # ~0.3 CPU-s, several per training run). This process's own environment is restored after, so
    # the subprocesses tests start later see what a user's would.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", WORKER_PYTHONPATH)
        # Workers hand custom metrics to the node's agent every second (10 s by default), so a short
        # test run shows up in Prometheus: where tests read the dashboard (and metrics) only.
        dashboard = {"dashboard_host": "127.0.0.1", "dashboard_port": free_port(),
                     "_system_config": {"metrics_report_interval_ms": 1000}} if SHARED_RAY["dashboard"] else {}
        address = init_local_ray(num_cpus=4, include_dashboard=SHARED_RAY["dashboard"], **dashboard,
                                 configure_logging=True, logging_level="WARNING")
    address_record().parent.mkdir(parents=True, exist_ok=True)
    address_record().write_text(address)


@pytest.fixture(scope="module")
def ray_local(s3_server):
    """One local Ray, shared by modules (started after the S3 settings so workers inherit them).

    Module-scoped and started on demand: a multi-node test shuts it down for its own cluster,
    and the next module that needs it starts it again. The session's end shuts it down.
    """
    import ray

    if not ray.is_initialized():
        start_local_ray()
    yield ray


def pytest_sessionfinish(session, exitstatus):
    import sys as _sys

    import exit_status

    exit_status.remember(session)

    stop_multi_node()
    ray = _sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        from cluster.ray_adapter.local import address_record, shutdown_local_ray

        address = ray.get_runtime_context().gcs_address
        shutdown_local_ray()  # with any worker whose teardown hung (it would outlive the suite)

        record = address_record()
        if record.exists() and record.read_text().strip() == address:
            record.unlink()  # as `ray stop` would: it names the Ray just stopped


_MULTI_NODE: list = []  # the multi-node tests' Cluster, kept from one such test to the next


def stop_multi_node() -> None:
    """Shut the multi-node cluster down, and any of its workers that hang on after it
    (cluster/leftovers.py). Ray's ``Cluster.shutdown`` deletes the machine's address
    record whichever Ray it names: one naming another Ray (a user's `ray start`) is put back."""
    import ray

    from cluster.leftovers import stop_leftovers
    from cluster.ray_adapter.local import address_record

    record = address_record()
    while _MULTI_NODE:
        before = record.read_text() if record.exists() else None
        cluster = _MULTI_NODE.pop()
        folder = Path(cluster.head_node.get_session_dir_path())
        ray.shutdown()
        cluster.shutdown()
        stop_leftovers(folder)  # a worker whose teardown hung would outlive its cluster
        if before is not None and before.strip() != cluster.address:
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(before)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    """The multi-node cluster goes as soon as the next test does not use it (before this test's
    fixtures end, so the address-record fixture finds it gone): no later test (the code tenant's
    attacker joins every Ray it sees) meets it, whichever modules run."""
    if _MULTI_NODE and (nextitem is None or "multi_node" not in nextitem.fixturenames):
        stop_multi_node()


@pytest.fixture
def multi_node(request):
    """A head that runs no training workers plus two 1-CPU 'spot' worker nodes, all on loopback.

    Its modules run one after another (MODULE_ORDER), and the cluster is kept between their
    tests (a start is ~10 s of a busy machine): each test gets two live worker nodes, the
    ones it killed or removed replaced. After a failed test, or a failed set-up, it is stopped
    (a job left running would take the next test's nodes).
    """
    import ray
    from ray.cluster_utils import Cluster

    node_args = {"num_cpus": 1, "resources": {"spot": 1}, "node_ip_address": "127.0.0.1"}
    with pytest.MonkeyPatch.context() as patch:
        # Every process of the cluster, and every node the test adds (a killed node's replacement),
        # imports the repo and knows the cluster's address: Ray's own lookups given no address (a Ray
        # Jobs driver's, the state API's) read RAY_ADDRESS before the machine's address record,
        # which names this cluster only until the first test's end.
        patch.setenv("PYTHONPATH", WORKER_PYTHONPATH)
        try:
            if not _MULTI_NODE:
                if ray.is_initialized():
                    ray.shutdown()  # these tests need their own multi-node Ray
                port = free_port()
                patch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
                # A dead node is noticed in ~2 s instead of ~15 s, so a restart does not wait for its ghost.
                _MULTI_NODE.append(Cluster(initialize_head=True, head_node_args={
                    "num_cpus": 0, "node_ip_address": "127.0.0.1", "gcs_server_port": port,
                    "include_dashboard": True, "dashboard_host": "127.0.0.1",
                    "dashboard_port": free_port(),  # 8265 may be another Ray's on a shared machine
                    # and Ray's default agent port (52365) the shared Ray's, started right after this one stops
                    "dashboard_agent_listen_port": free_port(),
                    "_system_config": {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                                       "health_check_failure_threshold": 4}}))
                ray.init(address=_MULTI_NODE[0].address)
            cluster = _MULTI_NODE[0]
            patch.setenv("RAY_ADDRESS", cluster.address)
            live = [n for n in cluster.worker_nodes if not n.dead_processes()][:2]
            for node in set(cluster.worker_nodes) - set(live):
                cluster.remove_node(node, allow_graceful=False)
            nodes = live + [cluster.add_node(**node_args) for _ in range(2 - len(live))]
            cluster.wait_for_nodes()
        except BaseException:
            stop_multi_node()
            raise
        failed_before = request.session.testsfailed
        yield cluster, nodes
        if request.session.testsfailed > failed_before:
            stop_multi_node()


# Modules in the order that starts the shared local Ray once: those that bring up Rays of their own
# (and stop the shared one) first, then every module on the shared Ray. The unit tier leads: it fails
# fastest. A module not named here runs last, in pytest's order.
MODULE_ORDER = [
    "tests/unit/",
    "tests/e2e/test_ray_up.py", "tests/integration/test_spot_fallback.py", "tests/e2e/test_chaos.py",
    "tests/integration/test_elastic.py", "tests/integration/test_spot_elastic.py",
    "tests/integration/test_console.py", "tests/integration/test_data_scale.py", "tests/integration/test_job_page.py",
    "tests/integration/test_loss_golden.py", "tests/integration/test_observability.py",
    "tests/integration/test_security.py", "tests/integration/test_service.py", "tests/integration/test_sweep.py",
    "tests/integration/test_training.py",
    # Last: its attacker job reads every folder and joins every Ray it can see (`make test` runs it
    # in namespaces of its own, beside the others: tests/lanes.py; a plain `pytest tests` last).
    "tests/integration/test_code_tenant.py",
]


def pytest_collection_modifyitems(session, config, items):
    def rank(item) -> int:
        path = Path(str(item.fspath)).relative_to(REPO).as_posix()
        return next((i for i, prefix in enumerate(MODULE_ORDER) if path.startswith(prefix)), len(MODULE_ORDER))

    items.sort(key=rank)  # stable: pytest's order within a module stays
    # The beside lane runs such modules each in a pytest of its own: a dashboard there (and metrics
    # every second) is ~4.5 CPU-s to start and ~2 CPU-s a minute for nothing. Unmarked tests get one.
    SHARED_RAY["dashboard"] = not all(item.get_closest_marker("no_dashboard") for item in items)
