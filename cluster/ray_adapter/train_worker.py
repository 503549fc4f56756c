"""What a Ray Train worker process relies on: its threads, its context, the environment it starts with.

- The environment each training worker starts with (:data:`WORKER_ENV`): Ray Train's print patch
  off and Ray's worker niceness at 0.
- This worker's own copy of a spot notice (``get_train_context().preemption_context``):
  :func:`local_preemption_info`.
- Which thread of a Ray Train worker does what: Ray's core worker keeps the process's main
  thread in its task-execution loop, which wakes every 10 ms to check for signals
  (``CoreWorker::RunTaskExecutionLoop``, "CoreWorker.CheckSignal"), and Ray Train v2 runs the
  training function in a thread of its own (``ThreadRunner``): :func:`batch_schedule_worker`.
- A worker's side of the resize handshake: the controller's callback (train_callbacks.py) runs
  :func:`checkpoint_before_resize` in the worker through its ``execute_async``.
- The run's storage filesystem (``get_context().get_storage()``, a DeveloperAPI): checkpoints are
  written in place and reported without an upload, which Ray accepts only on that filesystem
  and under the run's folder (:func:`run_storage_filesystem`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

PRINT_PATCH_ENV = "RAY_TRAIN_ENABLE_PRINT_PATCH"  # ray.train.v2._internal.constants.ENABLE_PRINT_PATCH_ENV_VAR
WORKER_NICENESS_ENV = "RAY_worker_niceness"  # ray._private.ray_constants.RAY_WORKER_NICENESS
# What each training worker process starts with:
# - RAY_TRAIN_ENABLE_PRINT_PATCH=0: Ray would also log every print() of a worker, doubling each
#   progress line.
# - RAY_worker_niceness=0: Ray starts its workers at nice 15, below its own daemons and the driver.
#   DDP's ranks move in lockstep, so every wake-up of those (the controller's polls, the driver's
#   log reads, the raylet) that preempts one rank stalls all of them: plain DDP's own loop inside
#   Ray Train ran at 0.70-0.80 of torchrun's samples/s at nice 15 and 0.87-1.00 at nice 0, side by
#   side on 2 cores. At equal niceness the daemons still get their fair share when they wake.
WORKER_ENV = {PRINT_PATCH_ENV: "0", WORKER_NICENESS_ENV: "0"}


def local_preemption_info():
    """This worker's own copy of a spot notice (Ray Train sets it when a node drain names the group),
    read without the cross-rank barrier of ``ray.train.get_preemption_info``: the training loop
    checks it often and agrees on it in an all-reduce it already does."""
    from ray.train.v2._internal.execution.context import get_train_context

    return get_train_context().preemption_context.preemption_info


BATCH_EVERY_THREAD = "SCHED_BATCH, every thread"  # what batch_schedule_worker says when it moved them all


def batch_schedule_worker(whole_process: bool) -> str:
    """Called from the training thread of a Ray Train worker: put Ray's main thread (its 10 ms
    signal check), or with ``whole_process`` every thread of the process, under SCHED_BATCH.
    Returns what it did, in words, for the worker's log and its checkpoints.

    A waking SCHED_BATCH thread does not preempt the thread running on its core (the kernel's
    wake-up preemption check passes over any policy but SCHED_NORMAL; sched(7) calls it "mildly
    disfavored"); it runs at the next switch, at most a few ms later. Under the default policy the
    wake-ups of a rank's helper threads (Ray's signal check, ~130 a second; each of gloo's transport
    threads ~900-1,300, counted in /proc's voluntary context switches during training) land on
    cores where the ranks compute, and DDP's ranks move in lockstep, so a stalled rank stalls
    them all. Measured with 2 gloo ranks on 2 cores, side by side in turns: our loop at 0.87-0.90
    of torchrun's samples/s as torchrun runs by default, 1.13 with every thread of our ranks under
    SCHED_BATCH, 0.90 with Ray's main thread alone (gloo's threads, started before the loop runs,
    kept the default). On a GPU the training thread launches kernels and should wake at once:
    only the main thread moves there (``whole_process`` False). Threads and processes started
    later (loader workers, a user factory's own, checkpoint uploads) inherit the policy of the
    thread that starts them.

    Moving to SCHED_BATCH needs no privilege; a refusal (a sandbox's seccomp, no /proc) leaves
    every thread as it was, and training goes on.
    """
    import threading

    if not hasattr(os, "SCHED_BATCH"):
        return "default scheduling (SCHED_BATCH is Linux's)"
    if threading.current_thread() is threading.main_thread():
        return "default scheduling (the training function runs on Ray's main thread)"
    moved: list[tuple[int, int, os.sched_param]] = []
    try:
        # Linux: a thread id names one thread; the main thread's is the process id.
        threads = sorted(int(t) for t in os.listdir("/proc/self/task")) if whole_process else [os.getpid()]
        for tid in threads:
            try:
                was = (tid, os.sched_getscheduler(tid), os.sched_getparam(tid))
                os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
            except ProcessLookupError:  # a thread that ended since the listing
                continue
            moved.append(was)
    except OSError as exc:
        for tid, policy, param in moved:  # all or nothing: a mix would be neither setting measured
            with contextlib.suppress(OSError):
                os.sched_setscheduler(tid, policy, param)
        return f"default scheduling (SCHED_BATCH refused: {exc.strerror or exc})"
    return BATCH_EVERY_THREAD if whole_process else "SCHED_BATCH, Ray's main thread"


_resize_handler: Callable[[float], int | None] | None = None


def on_resize_request(handler: Callable[[float], int | None] | None) -> None:
    """On a worker: who checkpoints when the controller is about to restart the group to resize it
    (the trainer, while its attempt trains; None once it ends). ``handler(timeout_s)`` returns the
    step of the checkpoint it took, or None."""
    global _resize_handler
    _resize_handler = handler


def checkpoint_before_resize(timeout_s: float) -> int | None:
    """Run on each worker by :class:`CheckpointBeforeResize` (in Ray's actor thread, beside the
    training thread): the step of the checkpoint taken, or None (no training running here)."""
    handler = _resize_handler
    return handler(timeout_s) if handler is not None else None


def run_storage_filesystem():
    """The filesystem Ray Train holds for this run's storage. A checkpoint reported in place (no
    upload by Ray) must be on it: Ray compares the filesystem objects, not just the paths.
    ``get_storage()`` is a DeveloperAPI that Ray may change between minor versions."""
    import ray.train

    return ray.train.get_context().get_storage().storage_filesystem
