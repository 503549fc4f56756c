"""The Ray internals cluster/ray_adapter.py relies on are still where it reaches for them.

These run against the installed (pinned) Ray without starting it: an upgrade that moves or
changes one fails here, by name, before a job meets it.
"""

from __future__ import annotations

import ast
import inspect
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster import ray_adapter

REPO = Path(__file__).resolve().parents[2]
INTERNAL = ("ray._private", "ray._raylet", "ray.experimental.internal_kv", "ray.train.v2._internal", "ray.serve._private")


def test_the_kv_store_functions_exist():
    from ray.experimental import internal_kv

    for name in ("_internal_kv_get", "_internal_kv_put", "_internal_kv_exists", "_internal_kv_del"):
        assert callable(getattr(internal_kv, name)), name


def test_worker_death_errors_are_exceptions():
    errors = ray_adapter.worker_death_errors()
    assert len(errors) == 2 and all(issubclass(e, BaseException) for e in errors)


def test_the_coordinator_still_ticks_on_request_and_ray_train_still_reads_it():
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as coordinator
    from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy

    ray_adapter._coordinator_refresh_supported()
    assert callable(coordinator.get_or_create_autoscaling_coordinator)
    actor = coordinator._AutoscalingCoordinatorActor
    assert actor.TICK_INTERVAL_S >= 5, "a fast tick would make the refresh unneeded: drop it from the adapter"
    assert "_update_cluster_node_resources" in inspect.getsource(actor._tick)
    assert "get_reserved_resources" in inspect.getsource(ElasticScalingPolicy._get_reserved_resources)


def test_the_dashboard_getter_exists():
    from ray._private.worker import get_dashboard_url

    assert callable(get_dashboard_url)


def test_cluster_config_reader_exists_and_sums_node_groups():
    import ray._private.state as state
    from ray.core.generated import autoscaler_pb2

    assert callable(state.state.get_max_resources_from_cluster_config)
    config = autoscaler_pb2.ClusterConfig()
    group = config.node_group_configs.add()
    group.resources["GPU"] = 1
    group.max_count = 8
    assert state.GlobalState._calculate_max_resource_from_cluster_config(config, "GPU") == 8


def test_no_module_but_the_adapter_imports_ray_internals():
    offenders = []
    for path in [*REPO.glob("trainers/**/*.py"), *REPO.glob("service/**/*.py"), *REPO.glob("cluster/**/*.py")]:
        if path.name == "ray_adapter.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n.startswith(INTERNAL) for n in names):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, f"Ray internals outside cluster/ray_adapter.py: {offenders}"
def test_worker_log_routing_replaces_rays_printer_until_shutdown():
    from ray._private import worker
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    from cluster.ray_adapter import WORKER_LOG_HANDLER, route_worker_logs

    assert callable(worker.print_to_stdstream)  # what connect() registers under the name we replace
    seen = []
    dispatcher.add_handler(WORKER_LOG_HANDLER, lambda data: seen.append(("ray", data)))
    try:
        route_worker_logs(lambda data: seen.append(("ours", data)))
        dispatcher.emit({"lines": ["x"], "is_err": False, "pid": 1})
        assert seen == [("ours", {"lines": ["x"], "is_err": False, "pid": 1})]  # Ray's printer no longer prints
        dispatcher.remove_handler(WORKER_LOG_HANDLER)  # what ray.shutdown() does: ours goes with it
        assert WORKER_LOG_HANDLER not in [name for name, _ in dispatcher.handlers]
    finally:
        dispatcher.remove_handler(WORKER_LOG_HANDLER)


def test_rays_autoscaler_event_filter_takes_the_lines():
    from ray._private.worker import filter_autoscaler_events

    assert list(inspect.signature(filter_autoscaler_events).parameters) == ["lines"]  # it needs a connected Ray


def test_the_local_preemption_notice_is_what_get_preemption_info_agrees_on():
    """The loop reads each worker's own notice (no barrier) and agrees in its all-reduce: that
    value must still be the one Ray's barrier broadcasts, and the context must be process-wide
    (the checkpointer reports from a background thread)."""
    from ray.train.v2._internal.execution import context, train_fn_utils
    from ray.train.v2._internal.execution.context import PreemptionContext

    assert "preemption_context.preemption_info" in inspect.getsource(
        train_fn_utils.DistributedTrainFnUtils.get_preemption_info)
    assert PreemptionContext().preemption_info is None
    assert "_train_context" in vars(context) and "global _train_context" in inspect.getsource(context.set_train_context)
    assert "preemption_context" in inspect.getsource(ray_adapter.local_preemption_info)


def test_a_trainer_without_datasets_leaves_out_only_the_dataset_shard_callback():
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    def names(trainer) -> list[str]:
        return [type(c).__name__ for c in trainer._create_default_callbacks()]

    stock = names(TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1)))
    assert "DatasetsCallback" in stock, "Ray no longer adds it without datasets: drop torch_trainer from the adapter"
    assert "PlacementGroupCleanerCallback" in stock, "Ray renamed or dropped its cleaner: see PlacementGroupRecorder"
    lean = names(ray_adapter.torch_trainer(lambda: None, scaling_config=ScalingConfig(num_workers=1)))
    replaced = ("DatasetsCallback", "PlacementGroupCleanerCallback")
    assert lean == [n for n in stock if n not in replaced] + ["PlacementGroupRecorder", "InProcessPreemptionCallback",
                                                               "CheckpointBeforeResize"]
    with_data = ray_adapter.torch_trainer(lambda: None, scaling_config=ScalingConfig(num_workers=1),
                                          datasets={"train": lambda: None})  # a dataset factory; no Ray started
    assert names(with_data).count("DatasetsCallback") == 1


def test_the_lean_trainer_is_what_torch_trainer_makes_of_its_arguments():
    """torch_trainer subclasses DataParallelTrainer, as TorchTrainer does, so that a driver never
    imports ray.train.torch (and torch): TorchTrainer must still only turn ``torch_config`` into
    the backend config, and its loop context must still be the one WorkerDeviceContext enters."""
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.train.torch.config import TorchConfigContextManager
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    assert TorchTrainer.__mro__[1] is DataParallelTrainer
    assert "backend_config=torch_config" in inspect.getsource(TorchTrainer.__init__)
    ours = set(inspect.signature(TorchTrainer.__init__).parameters) - {"torch_config"}
    assert ours == set(inspect.signature(DataParallelTrainer.__init__).parameters) - {"backend_config"}
    assert TorchConfig().train_func_context is TorchConfigContextManager
    trainer = ray_adapter.torch_trainer(lambda: None, scaling_config=ScalingConfig(num_workers=1))
    assert isinstance(trainer, DataParallelTrainer)
    assert type(trainer.backend_config).__name__ == "LeanTorchConfig" and trainer.backend_config.backend is None
    assert trainer.backend_config.train_func_context is ray_adapter.WorkerDeviceContext
    with ray_adapter.WorkerDeviceContext():  # on a CPU worker: Ray's context, which sets no device
        pass


def test_rays_own_preemption_watcher_is_turned_off_by_the_variable_its_controller_reads():
    from ray.train.v2._internal import constants
    from ray.train.v2._internal.execution.controller.controller import TrainController

    assert constants.ENABLE_PREEMPTION_WATCHER_ENV_VAR == ray_adapter.PREEMPTION_WATCHER_ENV
    assert ray_adapter.PREEMPTION_WATCHER_ENV in constants.ENV_VARS_TO_PROPAGATE, "the driver's setting reaches the controller"
    source = inspect.getsource(TrainController.__init__)
    assert "ENABLE_PREEMPTION_WATCHER_ENV_VAR" in source and "PreemptionCallback()" in source, \
        "Ray's controller starts its watcher another way: see InProcessPreemptionCallback"


class FakeActor:
    def __init__(self):
        self.marks = []
        self.mark_preempt = SimpleNamespace(remote=self.marks.append)


def test_the_in_process_watcher_marks_every_rank_of_a_drained_node_and_stops_with_its_group(monkeypatch):
    """Ray's watcher, run in the controller: a drain of one of the group's nodes marks every rank
    (as Ray's actor does: every rank stops at the same step), a drain elsewhere none; the
    group's shutdown ends the thread. Ray not started: the drain source is a fake."""
    import threading
    import time

    from ray.train.v2._internal.execution import preemption

    drained: dict[str, int] = {}
    monkeypatch.setattr(preemption, "_get_draining_nodes", lambda: dict(drained))
    monkeypatch.setenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.05")
    actors = [FakeActor() for _ in range(3)]
    group = SimpleNamespace(get_workers=lambda: [
        SimpleNamespace(distributed_context=SimpleNamespace(world_rank=rank), metadata=SimpleNamespace(node_id=node),
                        actor=actors[rank]) for rank, node in enumerate(["a", "a", "b"])])
    callback = ray_adapter._preemption_callback_class()()
    before = set(threading.enumerate())
    callback.after_worker_group_start(group)
    (thread,) = set(threading.enumerate()) - before
    drained["elsewhere"] = 1
    time.sleep(0.3)
    assert [a.marks for a in actors] == [[], [], []], "a drain of a node the group does not use marks no rank"
    drained["b"] = 1234
    deadline = time.monotonic() + 5
    while not all(a.marks for a in actors) and time.monotonic() < deadline:
        time.sleep(0.05)
    (info,) = {id(a.marks[0]): a.marks[0] for a in actors}.values()  # one notice, sent to every rank
    assert info.preempted_node_ids == ["b"] and info.preempted_ranks == [2] and info.deadline_ms == 1234
    callback.before_worker_group_shutdown(group)
    thread.join(timeout=2)
    assert not thread.is_alive(), "the group's shutdown stops its watcher"


def test_rays_controller_asks_before_it_shuts_down_a_group_it_resizes_and_a_worker_runs_what_it_is_handed():
    """CheckpointBeforeResize relies on: a running group the scaling policy resizes goes through
    ResizingState (a restart after a failure does not), the resize hook runs before the old group
    is shut down, and a worker's ``execute_async`` runs a function in the worker."""
    from ray.train.v2._internal.execution.controller.controller import TrainController
    from ray.train.v2._internal.execution.worker_group.worker import RayTrainWorker, Worker

    step = inspect.getsource(TrainController._step)
    running = step[step.index("isinstance(controller_state, RunningState)"):step.index("PreemptingState)")]
    assert "ResizingState(" in running and step.count("ResizingState(") == 1, "resizes of running groups only"
    resize = inspect.getsource(TrainController._execute_resize_decision)
    assert resize.index('"before_controller_execute_resize_decision"') < resize.index("self._shutdown_worker_group()")
    assert '"after_controller_state_update", previous_state, state' in inspect.getsource(TrainController._set_state)
    assert "self.actor.execute" in inspect.getsource(Worker.execute_async)
    assert RayTrainWorker.execute(None, lambda a, b: a + b, 2, 3) == 5


def test_a_resize_of_a_running_group_waits_for_every_ranks_checkpoint_and_a_restart_after_a_failure_does_not(
        monkeypatch):
    """The controller's side, Ray not started: each worker's execute_async runs the function here
    (what it would run in the worker), and ray.wait/get hand back its value."""
    import ray
    from ray.train.v2._internal.execution.controller.state import ResizingState, RestartingState, SchedulingState

    asked = []
    ray_adapter.on_resize_request(lambda timeout_s: asked.append(timeout_s) or 40)
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: (list(refs), []))
    monkeypatch.setattr(ray, "get", lambda refs: list(refs))
    worker = SimpleNamespace(execute_async=lambda fn, *args: fn(*args))
    group = SimpleNamespace(get_workers=lambda: [worker, worker])
    callback = ray_adapter._resize_checkpoint_callback_class()(timeout_s=7.0)
    decision = SimpleNamespace(num_workers=3)
    try:
        callback.after_worker_group_start(group)
        callback.after_controller_state_update(None, RestartingState(training_failed_error=None))
        callback.after_controller_state_update(None, SchedulingState(scaling_decision=decision))
        callback.before_controller_execute_resize_decision(decision)
        assert asked == [], "a restart after a failure asks nobody: its workers may be gone"
        callback.after_controller_state_update(None, ResizingState(scaling_decision=decision))
        callback.before_controller_execute_resize_decision(decision)
        assert asked == [7.0, 7.0], "every rank, with the callback's timeout"
        callback.before_controller_execute_resize_decision(decision)
        assert asked == [7.0, 7.0], "asked once per resize"
        callback.after_controller_state_update(None, ResizingState(scaling_decision=decision))
        callback.after_worker_group_shutdown(None)
        callback.before_controller_execute_resize_decision(decision)
        assert asked == [7.0, 7.0], "no group, nobody to ask"
        never = ray_adapter._resize_checkpoint_callback_class()(timeout_s=0.0)
        never.after_worker_group_start(group)
        never.after_controller_state_update(None, ResizingState(scaling_decision=decision))
        never.before_controller_execute_resize_decision(decision)
        assert asked == [7.0, 7.0], "distributed.resize_checkpoint_timeout_s 0: never wait"
    finally:
        ray_adapter.on_resize_request(None)
    assert ray_adapter.checkpoint_before_resize(1.0) is None, "no training on this worker: nothing to wait for"


def test_a_head_started_here_still_reads_its_gcs_port_from_the_environment():
    from ray._private import node, ray_constants

    assert ray_constants.GCS_PORT_ENVIRONMENT_VARIABLE == ray_adapter.GCS_PORT_ENV
    assert "os.getenv(ray_constants.GCS_PORT_ENVIRONMENT_VARIABLE)" in inspect.getsource(node.Node.__init__)


def test_a_local_ray_keeps_loopback_whatever_was_imported_first(monkeypatch):
    """Ray read RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at its import; keep_on_loopback sets what it read."""
    from ray._private import ray_constants, services

    assert ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR == ray_adapter.LOOPBACK_ENV
    monkeypatch.delenv(ray_adapter.LOOPBACK_ENV, raising=False)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)  # as a script that imported ray first has it
    assert ray_adapter.keep_on_loopback() == {ray_adapter.LOOPBACK_ENV: "0"}  # for the processes it starts
    assert ray_constants.ENABLE_RAY_CLUSTER is False
    assert services.resolve_ip_for_localhost("127.0.0.1") == "127.0.0.1"
    assert ray_adapter.LOOPBACK_ENV not in os.environ, "this process's environment is left as it was"


@pytest.mark.parametrize("value, kept_on", [("1", True), ("TRUE", True), ("false", False), ("0", False)])
def test_a_users_own_setting_is_read_as_ray_reads_it(monkeypatch, value, kept_on):
    from ray._private import ray_constants

    monkeypatch.setenv(ray_adapter.LOOPBACK_ENV, value)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    pinned = ray_adapter.keep_on_loopback()
    assert ray_constants.ENABLE_RAY_CLUSTER is kept_on and pinned == ({} if kept_on else {ray_adapter.LOOPBACK_ENV: value})


def test_a_local_start_off_its_address_says_why():
    said = ray_adapter.local_start_problem("192.0.2.2:4321", "127.0.0.1:4321")
    assert "swapped the loopback address" in said and "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" in said, said
    assert "RAY_GCS_SERVER_PORT ignored" in ray_adapter.local_start_problem("127.0.0.1:9", "127.0.0.1:4321")
    assert "RAY_GCS_SERVER_PORT ignored" in ray_adapter.local_start_problem("127.0.0.2:4321", "127.0.0.1:4321")
    assert ray_adapter.local_start_problem("127.0.0.1:4321", "127.0.0.1:4321") is None
    assert [ray_adapter.is_loopback(h) for h in ("127.0.0.1", "::1", "192.0.2.2", "localhost")] == [True, True, False, False]


def test_rays_temp_folder_follows_ray_tmpdir_and_holds_the_prometheus_discovery_file(monkeypatch, tmp_path):
    """`ray start` on a node with RAY_TMPDIR set writes its address record and the Prometheus
    discovery file under it; `etrain prometheus-config` must look there, not in /tmp."""
    import ray._private.ray_constants

    from cluster.ray_adapter import address_record, ray_temp_dir
    from trainers.cli import PROMETHEUS_DISCOVERY_FILE, prometheus_discovery_file

    assert PROMETHEUS_DISCOVERY_FILE == ray._private.ray_constants.PROMETHEUS_SERVICE_DISCOVERY_FILE
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert ray_temp_dir() == tmp_path / "ray"
    assert address_record().parent == tmp_path / "ray"
    assert prometheus_discovery_file() is None  # none yet: the scrape config then lists the live nodes only
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / PROMETHEUS_DISCOVERY_FILE).write_text("[]")
    assert prometheus_discovery_file() == str(tmp_path / "ray" / PROMETHEUS_DISCOVERY_FILE)


def test_the_session_folder_is_still_where_the_adapter_reads_it():
    from ray._private import worker
    from ray._private.node import Node

    assert hasattr(worker, "_global_node"), "ray._private.worker._global_node is gone: session_folder needs another way"
    assert callable(Node.get_session_dir_path)
    # a local start makes the driver's node the head: shutdown_local_ray tells started from joined by it
    assert "self.head = head" in inspect.getsource(Node.__init__), "Node.head is gone: session_folder needs another way"
    assert ray_adapter.session_folder() is None  # not connected: nothing to clean up after


def test_rays_sigint_handler_is_still_registered_where_torch_trainer_chains_ours():
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    assert list(inspect.signature(DataParallelTrainer._register_sigint_handler).parameters) == ["self", "controller"]
    assert "self._register_sigint_handler(controller)" in inspect.getsource(DataParallelTrainer), \
        "fit() no longer registers Ray Train's SIGINT handler there: ray_adapter.torch_trainer's Ctrl-C chain is dead"


def test_a_graceful_ctrl_c_stays_in_front_of_ray_trains_abort_across_retries():
    import signal

    from ray.train import ScalingConfig

    seen = []

    def ours(signum, frame):
        seen.append("graceful stop")

    ours.graceful_stop = True
    trainer = ray_adapter.torch_trainer(lambda: None, scaling_config=ScalingConfig(num_workers=1))
    aborts = []

    class Controller:
        def __init__(self, name):
            self.abort = SimpleNamespace(remote=lambda: aborts.append(name))

    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, ours)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("ray.get", lambda ref: ref)
            for attempt in ("first attempt", "retry"):  # each fit registers Ray's handler anew
                trainer._register_sigint_handler(Controller(attempt))
            handler = signal.getsignal(signal.SIGINT)
            handler(signal.SIGINT, None)
            assert seen == ["graceful stop"] and aborts == [], "the first Ctrl-C stops gracefully"
            handler(signal.SIGINT, None)
            assert aborts == ["retry"], "the second is Ray Train's: it aborts the running attempt's controller"
    finally:
        signal.signal(signal.SIGINT, before)


def test_without_a_graceful_handler_ray_trains_own_stays():
    import signal

    from ray.train import ScalingConfig

    trainer = ray_adapter.torch_trainer(lambda: None, scaling_config=ScalingConfig(num_workers=1))
    before = signal.getsignal(signal.SIGINT)
    try:
        trainer._register_sigint_handler(SimpleNamespace())
        assert getattr(signal.getsignal(signal.SIGINT), "__qualname__", "").endswith("sigint_handler")
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("count, expected", [(1, ["first"]), (2, ["first", "later"]), (3, ["first", "later", "later"])])
def test_first_then_runs_the_first_handler_once(count, expected):
    calls = []
    handler = ray_adapter.first_then(lambda s, f: calls.append("first"), lambda s, f: calls.append("later"))
    for _ in range(count):
        handler(2, None)
    assert calls == expected


def test_the_lean_torch_config_runs_the_steps_of_rays_own_torch_backend():
    """ray_adapter.torch_config stands in for TorchConfig so that the controller never imports
    torch: it must configure what TorchConfig does and run every step Ray's backend runs on start."""
    import dataclasses
    import re

    from ray.train.torch import config as torch_config_module
    from ray.train.torch.config import TorchConfig, _TorchBackend

    assert [f.name for f in dataclasses.fields(TorchConfig)] == ["backend", "init_method", "timeout_s"], \
        "TorchConfig gained or lost a setting: mirror it in ray_adapter.torch_config"
    lean, stock = ray_adapter.torch_config(backend="gloo", timeout_s=77), TorchConfig(backend="gloo", timeout_s=77)
    assert lean.to_dict() == stock.to_dict() and lean.framework == stock.framework
    assert lean.train_func_context is ray_adapter.WorkerDeviceContext  # which enters stock.train_func_context on the worker
    assert lean.backend_cls.share_cuda_visible_devices == _TorchBackend.share_cuda_visible_devices
    steps = set(re.findall(r"worker_group\.execute\w*\(\s*(?:\d+,\s*|i,\s*)?(\w+)", inspect.getsource(_TorchBackend.on_start)))
    assert steps == {"get_address_and_port", "set_env_vars", "_set_torch_distributed_env_vars",
                     "_setup_torch_process_group"}, f"Ray's torch backend now runs {steps} on start: mirror it"
    assert list(inspect.signature(torch_config_module._setup_torch_process_group).parameters) == [
        "backend", "world_rank", "world_size", "init_method", "timeout_s"]
    assert list(inspect.signature(torch_config_module._shutdown_torch).parameters) == ["destroy_process_group"]
    assert "_shutdown_torch" in inspect.getsource(_TorchBackend.on_shutdown)


class FakeWorkerGroup:
    """What the backend calls on Ray Train's worker group, recorded."""

    def __init__(self, size: int, gpus: float):
        self.size, self.gpus, self.calls = size, gpus, []

    def __len__(self) -> int:
        return self.size

    def get_resources_per_worker(self) -> dict:
        return {"CPU": 1, "GPU": self.gpus}

    def execute_single(self, rank, fn, *args, **kwargs):
        self.calls.append((rank, fn.__name__, kwargs))
        return ("10.0.0.7", 29511)

    def execute(self, fn, *args, **kwargs):
        self.calls.append(("all", fn.__name__, kwargs))

    def execute_single_async(self, rank, fn, *args, **kwargs):
        self.calls.append((rank, fn.__name__, kwargs))
        return rank

    def execute_async(self, fn, *args, **kwargs):
        self.calls.append(("all", fn.__name__, kwargs))
        return []


@pytest.mark.parametrize("backend,gpus,expected", [(None, 0, "gloo"), (None, 1, "nccl"), ("gloo", 1, "gloo")])
def test_the_lean_torch_backend_sets_up_every_rank_as_rays_does(monkeypatch, backend, gpus, expected):
    import ray

    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: refs)  # the fake's "futures" are the ranks
    group, config = FakeWorkerGroup(3, gpus), ray_adapter.torch_config(backend=backend, timeout_s=42)
    config.backend_cls().on_start(group, config)
    assert group.calls == [
        (0, "get_address_and_port", {}),
        ("all", "_set_master_address", {"addr": "10.0.0.7", "port": 29511}),
        ("all", "_set_torch_env_vars", {}),
        *[(rank, "_setup_process_group", {"backend": expected, "world_rank": rank, "world_size": 3,
                                          "init_method": "env://", "timeout_s": 42}) for rank in range(3)]]
    group.calls.clear()
    config.backend_cls().on_shutdown(group, config)
    assert group.calls == [("all", "_shutdown_process_group", {"destroy_process_group": True})]


def test_ray_train_runs_the_training_function_in_a_thread_beside_rays_main_loop():
    """batch_schedule_worker leans on this: the training function off the main thread, which Ray's
    core worker keeps in its task-execution loop (the 10 ms signal check)."""
    from ray._private.worker import Worker
    from ray.train.v2._internal.execution.worker_group.thread_runner import ThreadRunner
    from ray.train.v2._internal.execution.worker_group.worker import RayTrainWorker

    assert "threading.Thread(" in inspect.getsource(ThreadRunner.run)
    assert "ThreadRunner" in inspect.getsource(RayTrainWorker)
    assert "run_task_loop" in inspect.getsource(Worker.main_loop)


LINUX_ONLY = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="scheduling policies are Linux's")
POLICIES_SCRIPT = """
import json, os, sys, threading
from cluster.ray_adapter import batch_schedule_worker
helper_ready, done = threading.Event(), threading.Event()
helper = threading.Thread(target=lambda: (helper_ready.set(), done.wait()), daemon=True)
helper.start(); helper_ready.wait()
said = {}
if sys.argv[1] == "main":
    said["text"] = batch_schedule_worker(whole_process=True)
else:
    worker = threading.Thread(target=lambda: said.update(text=batch_schedule_worker(whole_process=sys.argv[1] == "all"),
                                                         tid=threading.get_native_id()))
    worker.start(); worker.join()
later = threading.Thread(target=lambda: said.update(later=os.sched_getscheduler(0)))  # started by the main thread
later.start(); later.join()
said["main"] = os.sched_getscheduler(os.getpid())
said["helper"] = os.sched_getscheduler(helper.native_id)
print(json.dumps(said))
"""


@LINUX_ONLY
@pytest.mark.parametrize("how", ["all", "main-thread", "main"])
def test_batch_scheduling_moves_every_thread_on_cpu_and_rays_main_thread_only_on_gpu(how):
    """In a process of its own (the policy of a thread sticks): a helper started before the call and a
    thread the main thread starts after it show which threads moved."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", POLICIES_SCRIPT, how], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60, check=True).stdout
    said = json.loads(out)
    batch, other = os.SCHED_BATCH, os.SCHED_OTHER
    if how == "all":
        assert said["text"] == "SCHED_BATCH, every thread"
        assert (said["main"], said["helper"], said["later"]) == (batch, batch, batch)
    elif how == "main-thread":
        assert said["text"] == "SCHED_BATCH, Ray's main thread"
        assert (said["main"], said["helper"], said["later"]) == (batch, other, batch)
    else:
        assert said["text"] == "default scheduling (the training function runs on Ray's main thread)"
        assert (said["main"], said["helper"], said["later"]) == (other, other, other)


@LINUX_ONLY
@pytest.mark.parametrize("refusal", ["part way", "no /proc"])
def test_a_refused_batch_policy_leaves_every_thread_as_it_was(monkeypatch, refusal):
    """A sandbox that refuses the call part way, or has no /proc: the threads already moved go back to
    their own policy and priority, and the text says why. Only the OS calls are faked."""
    import errno
    import threading

    policies = {11: (os.SCHED_IDLE, 0), 12: (os.SCHED_OTHER, 0), 13: (os.SCHED_OTHER, 0)}
    refused_at = 13

    def setscheduler(tid, policy, param):
        if tid == refused_at:
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))
        policies[tid] = (policy, param.sched_priority)

    def listdir(path):
        if refusal == "no /proc":
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        return ["12", "11", "13"]

    monkeypatch.setattr(os, "sched_getscheduler", lambda tid: policies[tid][0])
    monkeypatch.setattr(os, "sched_getparam", lambda tid: os.sched_param(policies[tid][1]))
    monkeypatch.setattr(os, "sched_setscheduler", setscheduler)
    monkeypatch.setattr(os, "listdir", listdir)
    said = {}
    worker = threading.Thread(target=lambda: said.update(text=ray_adapter.batch_schedule_worker(whole_process=True)))
    worker.start()
    worker.join()
    why = "Operation not permitted" if refusal == "part way" else "No such file or directory"
    assert said["text"] == f"default scheduling (SCHED_BATCH refused: {why})"
    assert policies == {11: (os.SCHED_IDLE, 0), 12: (os.SCHED_OTHER, 0), 13: (os.SCHED_OTHER, 0)}


def test_without_scheduling_policies_a_laptop_trains_as_before(monkeypatch):
    """macOS and Windows have no SCHED_BATCH: nothing is called, and the text says why."""
    import threading

    monkeypatch.delattr(os, "SCHED_BATCH", raising=False)
    monkeypatch.setattr(os, "sched_setscheduler", lambda *a: pytest.fail("no policy to set"), raising=False)
    said = {}
    worker = threading.Thread(target=lambda: said.update(text=ray_adapter.batch_schedule_worker(whole_process=True)))
    worker.start()
    worker.join()
    assert said["text"] == "default scheduling (SCHED_BATCH is Linux's)"


def test_a_checkpoint_written_in_place_is_one_ray_takes_without_an_upload(tmp_path):
    """trainers/checkpoint_writer.py writes checkpoints straight into the run folder and reports them
    without an upload (and with ``delete_local_checkpoint_after_upload=False``, since Ray's ASYNC
    default would delete them): Ray accepts that only on the storage context's own filesystem
    object, under the run's folder, which ``run_storage_filesystem`` hands out."""
    import pyarrow.fs as pafs
    from ray.train import Checkpoint, CheckpointUploadMode
    from ray.train.v2._internal.execution.context import is_managed_checkpoint
    from ray.train.v2._internal.execution.storage import StorageContext
    from ray.train.v2.api.context import DistributedTrainContext

    storage = StorageContext(storage_path=str(tmp_path), experiment_dir_name="job/checkpoints",
                             storage_filesystem=pafs.LocalFileSystem())
    inside = f"{storage.experiment_fs_path}/checkpoint_000000100"
    assert is_managed_checkpoint(storage, Checkpoint(inside, filesystem=storage.storage_filesystem))
    assert not is_managed_checkpoint(storage, Checkpoint(str(tmp_path / "elsewhere"), filesystem=storage.storage_filesystem))
    assert "get_storage()" in inspect.getsource(DistributedTrainContext.get_storage)
    assert CheckpointUploadMode.ASYNC.default_delete_local_checkpoint_after_upload() is True


def test_tune_reads_exactly_these_one_key_mappings_in_a_space():
    """The keys a sweep refuses in its listed values are every key Tune's variant generator acts on:
    a Ray that adds one fails here, and the refusal (trainers.sweep) must learn it."""
    import re

    from ray.tune.search import variant_generator

    from cluster.ray_adapter import TUNE_EXPRESSION_KEYS

    source = inspect.getsource(variant_generator)
    acted_on = set(re.findall(r'"(\w+)" in (?:v|domain)\b', source))
    assert acted_on == set(TUNE_EXPRESSION_KEYS), acted_on
    resolved = list(variant_generator.generate_variants({"a": {"grid_search": [1, 2]}, "b": {"eval": "3 * 2"}}))
    assert [config for _, config in resolved] == [{"a": 1, "b": 6}, {"a": 2, "b": 6}]


def test_serve_reads_exactly_these_client_override_headers():
    """Every header with which a client sets Ray Serve's proxy behaviour for its own request is one
    the service refuses: a Ray that adds one fails here."""
    from ray.serve._private import constants

    from cluster.ray_adapter import serve_client_override_headers

    headers = {k: v for k, v in vars(constants).items() if "HEADER" in k}
    assert headers == {  # a new one: decide whether a client may send it, and refuse it here if not
        "SERVE_HTTP_REQUEST_ID_HEADER": "x-request-id",  # a label for the request's log lines only
        "SERVE_INGRESS_ROUTER_HEADER_PREFIX": "x-serve-router-",  # custom request routers' (we use none)
        "RAY_SERVE_INGRESS_REQUEST_ROUTER_OPT_HEADERS_FIELD": "request_headers",
        "SERVE_HTTP_REQUEST_TIMEOUT_S_HEADER": "x-request-timeout-seconds",
        "SERVE_HTTP_REQUEST_DISCONNECT_DISABLED_HEADER": "x-request-disconnect-disabled"}, headers
    assert serve_client_override_headers() == ("x-request-timeout-seconds", "x-request-disconnect-disabled")


def test_a_tune_trial_keeps_its_actor_where_the_adapter_reads_it():
    """A sweep waits for an ended trial's actor before it removes the trial's placement group
    (trainers.sweep.trials): a Ray that moves ``Trial.temporary_state.ray_actor`` fails here."""
    from ray.tune.experiment import Trial

    from cluster.ray_adapter import trial_actor

    trial = Trial("__fake", config={}, stub=True)
    assert trial_actor(trial) is None  # no actor yet
    assert "self.temporary_state.ray_actor = ray_actor" in inspect.getsource(Trial.set_ray_actor)
    trial.temporary_state.ray_actor = actor = object()
    assert trial_actor(trial) is actor
