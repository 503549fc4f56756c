"""The Ray internals cluster/ray_adapter/train_worker.py relies on are still where it reaches for them.

These run against the installed (pinned) Ray without starting it: an upgrade that moves or
changes one fails here, by name, before a job meets it.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest

from cluster.ray_adapter import train_worker

REPO = Path(__file__).resolve().parents[2]


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
    assert "preemption_context" in inspect.getsource(train_worker.local_preemption_info)


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
from cluster.ray_adapter.train_worker import batch_schedule_worker
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
    worker = threading.Thread(target=lambda: said.update(text=train_worker.batch_schedule_worker(whole_process=True)))
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
    worker = threading.Thread(target=lambda: said.update(text=train_worker.batch_schedule_worker(whole_process=True)))
    worker.start()
    worker.join()
    assert said["text"] == "default scheduling (SCHED_BATCH is Linux's)"


def test_a_checkpoint_written_in_place_is_one_ray_takes_without_an_upload(tmp_path):
    """trainers/checkpointer.py writes checkpoints straight into the run folder and reports them
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


def test_the_workers_environment_names_rays_own_knobs():
    """WORKER_ENV turns off Ray Train's print patch and runs workers at Ray's niceness 0: both read by
    Ray from these variables in the worker's environment."""
    from ray._private import ray_constants
    from ray.train.v2._internal import constants

    assert constants.ENABLE_PRINT_PATCH_ENV_VAR == train_worker.PRINT_PATCH_ENV
    assert ray_constants.RAY_WORKER_NICENESS == train_worker.WORKER_NICENESS_ENV
    assert train_worker.WORKER_ENV == {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "RAY_worker_niceness": "0"}
