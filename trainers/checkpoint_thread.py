"""The checkpoint thread and its CPU policy: one daemon thread per rank that runs the writes in
order (:class:`BackgroundThread`), SCHED_IDLE around the parts that start no thread while CPU
ranks train (:class:`Yielding`, where the process may come back from it), and short GIL slices
while it runs Python. Why it yields: see trainers.checkpoint_writer's docstring."""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future

from trainers.worker_log import worker_log


@contextlib.contextmanager
def short_gil_slices(interval_s: float = 0.0005):
    """While the background thread runs Python, hand the GIL back to the training thread within
    ``interval_s`` of its asking (after each torch op it releases it) instead of Python's 5 ms."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


@functools.cache
def idle_is_reversible() -> bool:
    """Whether a thread of this process may go to SCHED_IDLE and come back (Linux; root,
    CAP_SYS_NICE, or an RLIMIT_NICE of 20: sched(7) treats leaving SCHED_IDLE as lowering nice
    from 20). Where it may not, a thread that training must wait for could not be hurried."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    said: list[bool] = []

    def probe() -> None:  # on a thread of its own: nothing else is touched if the way back fails
        policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, policy, param)
            said.append(True)
        except OSError:
            said.append(False)

    thread = threading.Thread(target=probe, name="etrain-idle-probe")
    thread.start()
    thread.join()
    return said[0]


class Yielding:
    """The checkpoint thread's scheduling: SCHED_IDLE around the parts of its work that start no
    thread (a thread inherits its creator's policy, and an idle-class pyarrow I/O thread, which
    the data loader shares, or TensorBoard writer would stay idle for good), its own policy for
    the rest, and its own policy the moment training waits for it. Never for its first piece of
    work: the threads that one starts (Ray's report thread) keep the normal policy."""

    def __init__(self, tid: int, wanted: bool):
        self.tid = tid
        self.enabled = wanted and idle_is_reversible()
        self.own = (os.sched_getscheduler(tid), os.sched_getparam(tid)) if self.enabled else None
        self.started = 0
        self._hurried = False
        self._lock = threading.Lock()  # the training thread hurries while the thread yields

    def before_work(self) -> None:
        """On the training thread, before handing the thread a piece of work."""
        with self._lock:
            self.started += 1
            self._hurried = False

    @contextlib.contextmanager
    def idle(self):
        """On the checkpoint thread, around work that starts no thread. The lock guards the flag
        only: an idle-class thread preempted while holding it would make ``hurry`` wait."""
        with self._lock:
            yielding = (self.enabled and self.started > 1 and not self._hurried
                        and threading.get_native_id() == self.tid)  # not a JIT write on the training thread
        if yielding:
            self._set(os.SCHED_IDLE, os.sched_param(0))
            with self._lock:
                hurried = self._hurried
            if hurried:  # while it switched
                self._set(*self.own)
        try:
            yield
        finally:
            with self._lock:
                hurried = self._hurried
            if yielding and self.enabled and not hurried:
                self._set(*self.own)

    def hurry(self) -> None:
        """On the training thread: it waits for the checkpoint thread now, or finds it still busy."""
        with self._lock:
            self._hurried = True
        if self.enabled:
            self._set(*self.own)

    def stop(self) -> None:
        with self._lock:
            self.enabled = False  # the thread id may soon be another thread's

    def _set(self, policy: int, param) -> None:
        try:
            os.sched_setscheduler(self.tid, policy, param)
        except OSError as exc:  # the thread is gone, or a sandbox said no: never worth a failed step
            self.enabled = False
            worker_log().debug("checkpoint thread keeps its scheduling: %s", exc)


class BackgroundThread:
    """One daemon thread that runs the work handed to it in order, each piece's outcome in a Future.

    Not concurrent.futures' pool: Python joins its threads at exit, and a worker that Ray shuts
    down while a checkpoint is in flight (a finished sweep's trial, a job whose driver is gone)
    then waited for it past Ray's graceful-shutdown limit, yielding to the training thread that
    was still running. Every path that needs a checkpoint finished waits for its Future.
    """

    def __init__(self, name: str):
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.native_id: int = self._thread.native_id

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._work.put((future, fn, args))
        return future

    def close(self) -> None:
        """The thread ends after the work already handed to it."""
        self._work.put(None)

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001  (the Future carries it to whoever waits)
                    future.set_exception(exc)
            del item, future, fn, args  # the snapshot goes now, not when the next one is handed over
