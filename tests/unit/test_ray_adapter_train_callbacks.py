"""The Ray internals cluster/ray_adapter/train_callbacks.py relies on are still where it reaches for them.

These run against the installed (pinned) Ray without starting it: an upgrade that moves or
changes one fails here, by name, before a job meets it.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

from cluster.ray_adapter import train_callbacks, train_torch, train_worker


def test_a_trainer_without_datasets_leaves_out_only_the_dataset_shard_callback():
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    def names(trainer) -> list[str]:
        return [type(c).__name__ for c in trainer._create_default_callbacks()]

    stock = names(TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1)))
    assert "DatasetsCallback" in stock, "Ray no longer adds it without datasets: drop torch_trainer from the adapter"
    assert "PlacementGroupCleanerCallback" in stock, "Ray renamed or dropped its cleaner: see PlacementGroupRecorder"
    lean = names(train_torch.torch_trainer(lambda: None, scaling_config=ScalingConfig(num_workers=1)))
    replaced = ("DatasetsCallback", "PlacementGroupCleanerCallback")
    assert lean == [n for n in stock if n not in replaced] + ["PlacementGroupRecorder", "InProcessPreemptionCallback",
                                                               "CheckpointBeforeResize"]
    with_data = train_torch.torch_trainer(lambda: None, scaling_config=ScalingConfig(num_workers=1),
                                          datasets={"train": lambda: None})  # a dataset factory; no Ray started
    assert names(with_data).count("DatasetsCallback") == 1


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
    callback = train_callbacks._preemption_callback_class()()
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
    train_worker.on_resize_request(lambda timeout_s: asked.append(timeout_s) or 40)
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: (list(refs), []))
    monkeypatch.setattr(ray, "get", lambda refs: list(refs))
    worker = SimpleNamespace(execute_async=lambda fn, *args: fn(*args))
    group = SimpleNamespace(get_workers=lambda: [worker, worker])
    callback = train_callbacks._resize_checkpoint_callback_class()(timeout_s=7.0)
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
        never = train_callbacks._resize_checkpoint_callback_class()(timeout_s=0.0)
        never.after_worker_group_start(group)
        never.after_controller_state_update(None, ResizingState(scaling_decision=decision))
        never.before_controller_execute_resize_decision(decision)
        assert asked == [7.0, 7.0], "distributed.resize_checkpoint_timeout_s 0: never wait"
    finally:
        train_worker.on_resize_request(None)
    assert train_worker.checkpoint_before_resize(1.0) is None, "no training on this worker: nothing to wait for"
