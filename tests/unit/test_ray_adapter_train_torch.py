"""The Ray internals cluster/ray_adapter/train_torch.py relies on are still where it reaches for them.

These run against the installed (pinned) Ray without starting it: an upgrade that moves or
changes one fails here, by name, before a job meets it.
"""

from __future__ import annotations

import inspect
import os
from types import SimpleNamespace

import pytest

from cluster.ray_adapter import train_torch


def test_worker_death_errors_are_exceptions():
    errors = train_torch.worker_death_errors()
    assert len(errors) == 2 and all(issubclass(e, BaseException) for e in errors)


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
    trainer = train_torch.torch_trainer(lambda: None, scaling_config=ScalingConfig(num_workers=1))
    assert isinstance(trainer, DataParallelTrainer)
    assert type(trainer.backend_config).__name__ == "LeanTorchConfig" and trainer.backend_config.backend is None
    assert trainer.backend_config.train_func_context is train_torch.WorkerDeviceContext
    with train_torch.WorkerDeviceContext():  # on a CPU worker: Ray's context, which sets no device
        pass


def test_rays_own_preemption_watcher_is_turned_off_by_the_variable_its_controller_reads():
    from ray.train.v2._internal import constants
    from ray.train.v2._internal.execution.controller.controller import TrainController

    assert constants.ENABLE_PREEMPTION_WATCHER_ENV_VAR == train_torch.PREEMPTION_WATCHER_ENV
    assert train_torch.PREEMPTION_WATCHER_ENV in constants.ENV_VARS_TO_PROPAGATE, "the driver's setting reaches the controller"
    source = inspect.getsource(TrainController.__init__)
    assert "ENABLE_PREEMPTION_WATCHER_ENV_VAR" in source and "PreemptionCallback()" in source, \
        "Ray's controller starts its watcher another way: see InProcessPreemptionCallback"


def test_rays_sigint_handler_is_still_registered_where_torch_trainer_chains_ours():
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    assert list(inspect.signature(DataParallelTrainer._register_sigint_handler).parameters) == ["self", "controller"]
    assert "self._register_sigint_handler(controller)" in inspect.getsource(DataParallelTrainer), \
        "fit() no longer registers Ray Train's SIGINT handler there: train_torch.torch_trainer's Ctrl-C chain is dead"


def test_a_graceful_ctrl_c_stays_in_front_of_ray_trains_abort_across_retries():
    import signal

    from ray.train import ScalingConfig

    seen = []

    def ours(signum, frame):
        seen.append("graceful stop")

    ours.graceful_stop = True
    trainer = train_torch.torch_trainer(lambda: None, scaling_config=ScalingConfig(num_workers=1))
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

    trainer = train_torch.torch_trainer(lambda: None, scaling_config=ScalingConfig(num_workers=1))
    before = signal.getsignal(signal.SIGINT)
    try:
        trainer._register_sigint_handler(SimpleNamespace())
        assert getattr(signal.getsignal(signal.SIGINT), "__qualname__", "").endswith("sigint_handler")
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("count, expected", [(1, ["first"]), (2, ["first", "later"]), (3, ["first", "later", "later"])])
def test_first_then_runs_the_first_handler_once(count, expected):
    calls = []
    handler = train_torch.first_then(lambda s, f: calls.append("first"), lambda s, f: calls.append("later"))
    for _ in range(count):
        handler(2, None)
    assert calls == expected


def test_the_lean_torch_config_runs_the_steps_of_rays_own_torch_backend():
    """train_torch.torch_config stands in for TorchConfig so that the controller never imports
    torch: it must configure what TorchConfig does and run every step Ray's backend runs on start."""
    import dataclasses
    import re

    from ray.train.torch import config as torch_config_module
    from ray.train.torch.config import TorchConfig, _TorchBackend

    assert [f.name for f in dataclasses.fields(TorchConfig)] == ["backend", "init_method", "timeout_s"], \
        "TorchConfig gained or lost a setting: mirror it in train_torch.torch_config"
    lean, stock = train_torch.torch_config(backend="gloo", timeout_s=77), TorchConfig(backend="gloo", timeout_s=77)
    assert lean.to_dict() == stock.to_dict() and lean.framework == stock.framework
    assert lean.train_func_context is train_torch.WorkerDeviceContext  # which enters stock.train_func_context on the worker
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
    group, config = FakeWorkerGroup(3, gpus), train_torch.torch_config(backend=backend, timeout_s=42)
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


def test_the_controllers_knobs_are_rays_and_reach_the_controller(monkeypatch):
    """set_controller_knobs sets them in the driver's environment: Ray Train passes them on to its
    controller at fit(), and a value the user set stays."""
    from ray.train.v2._internal import constants

    assert constants.WORKER_GROUP_START_TIMEOUT_S_ENV_VAR == train_torch.WORKER_GROUP_START_TIMEOUT_ENV
    assert constants.HEALTH_CHECK_INTERVAL_S_ENV_VAR == train_torch.HEALTH_CHECK_INTERVAL_ENV
    knobs = {train_torch.WORKER_GROUP_START_TIMEOUT_ENV, train_torch.HEALTH_CHECK_INTERVAL_ENV}
    assert knobs <= constants.ENV_VARS_TO_PROPAGATE, "Ray Train no longer passes them from the driver to the controller"
    monkeypatch.delenv(train_torch.WORKER_GROUP_START_TIMEOUT_ENV, raising=False)
    monkeypatch.setenv(train_torch.HEALTH_CHECK_INTERVAL_ENV, "3")
    train_torch.set_controller_knobs(90.0, 0.5)
    assert os.environ[train_torch.WORKER_GROUP_START_TIMEOUT_ENV] == "90.0"
    assert os.environ[train_torch.HEALTH_CHECK_INTERVAL_ENV] == "3", "a user's own setting stays"
