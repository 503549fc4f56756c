"""The checkpointer: when to take a checkpoint, and taking it without stalling training.

At a checkpoint step every rank copies what it must (rank 0: the full state, to CPU memory,
pinned when it lives on a GPU) and goes back to training. A background thread per rank then
streams the files straight to their place in storage (rank 0: no local copy for Ray to read
back, upload and delete) and beats the heartbeat. Every checkpoint is then durable: a restart
restores the newest complete one by listing storage, whatever Ray was told.

The bookkeeping around it is done at most once per ``checkpoint.report_interval_s``
(:func:`report_due`), and always for a final or just-in-time checkpoint: ``ray.train.report``
(a barrier on every rank, paid off the step path; Ray only records the checkpoint), retention
(so up to a report interval's worth of checkpoints more than ``num_to_keep`` may exist for a
while), and the observer's flush (metrics history, TensorBoard, cost). Checkpoints every fraction
of a second would otherwise pay a Ray round trip and a dozen storage requests each. The history
rows not yet written ride in each checkpoint, so a restart loses none. One thread per rank keeps
Ray's collectives in the same order on every rank; while it is busy, an interval checkpoint is
left to the next interval step rather than stall training.

On CPU ranks that thread yields the CPU to training (Linux's SCHED_IDLE, :class:`Yielding`,
where the process may leave it again): DDP ranks move in lockstep, and a rank's thread woken
by a collective waited behind the checkpoint thread's slice (under SCHED_BATCH, which CPU
ranks run at, a waking thread does not preempt), so every step of the interval slowed down,
not just the checkpoint's. An idle-class thread is preempted
at once and runs in the time the ranks wait for each other. It yields only while it writes,
reports and beats (work that starts no thread: a thread inherits its creator's policy), and
gets its policy back the moment training waits for it, finds it still busy at the next
interval step, or ends the attempt. It is a daemon (:class:`BackgroundThread`): a worker that
Ray shuts down does not wait for it at exit.

A just-in-time checkpoint (a spot notice) is synchronous: it drains the thread (an earlier
failure there is logged, not raised), then writes and reports before the node goes, on the
training thread.
"""

from __future__ import annotations

import posixpath
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import pyarrow.fs as pafs
import torch
import torch.distributed as dist

from cluster.storage import s3_client_like
from trainers import checkpoint_files as ckpt
from trainers.checkpoint_thread import BackgroundThread, Yielding, short_gil_slices
from trainers.rules import Kind, checkpoint_kind, interval_checkpoint_ok, report_due
from trainers.worker_log import worker_log

# How long a failed attempt waits for its checkpoint in flight to be reported: a report waits for
# the controller's next poll (~2 s) after the upload.
SETTLE_TIMEOUT_S = 30.0


def to_cpu(obj, pin: bool = False):
    """A deep copy of a state tree with every tensor on CPU: training may change the originals at once."""
    if torch.is_tensor(obj):
        if obj.device.type == "cpu":
            return obj.detach().clone()
        out = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=pin)
        return out.copy_(obj.detach(), non_blocking=pin)
    if isinstance(obj, dict):
        return {k: to_cpu(v, pin) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v, pin) for v in obj)
    return obj


@dataclass
class Timing:
    """What the last checkpoint cost: on the training thread, and in the background."""

    snapshot_s: float = 0.0  # copying the state (rank 0)
    blocked_s: float = 0.0  # the training thread waited for the previous checkpoint or a sync upload


class Checkpointer:
    """Owns cadence, the background write/report, JIT checkpoints and retention."""

    def __init__(self, spec, root, run_path: str, rank: int, world: int, device: torch.device,
                 after_write: Callable[[int, bool], None], yield_cpu: bool = False,
                 folders_found: set[str] | None = None):
        """``after_write(step, jit)``: run once each checkpoint is written (and reported, when it is): the
        heartbeat, on the checkpoint thread.
        ``yield_cpu``: the ranks run wholly under SCHED_BATCH, where a waking rank thread does not preempt
        the checkpoint thread (CPU training): only there does the thread yield. Elsewhere a waking thread
        preempts it anyway, and an idle-class thread that holds the GIL on a busy machine would make the
        training thread wait for the little CPU time SCHED_IDLE gets.
        ``folders_found``: the checkpoint folders storage held when the attempt began (rank 0's restore
        listing). Only those, and the ones this attempt writes, can hold an old manifest to delete
        before a write; None: not known, so every write deletes first (on S3 a HEAD a checkpoint). This
        takes one writer a run at a time: Ray ends an attempt's workers (within seconds) before the next
        attempt lists, so no earlier attempt adds a folder after the listing."""
        c = spec.checkpoint
        self.interval_steps, self.min_gap_s, self.background = c.interval, c.min_interval_s, c.upload == "async"
        self.report_interval_s = c.report_interval_s
        self.spec, self.root, self.run_path = spec, root, run_path
        self.rank, self.world, self.device = rank, world, device
        self.after_write = after_write
        self.last_at = self.reported_at = float("-inf")
        self._report_next = True  # rank 0's word, at the last interval step: report the interval checkpoint
        self.timing = Timing()
        self._thread = BackgroundThread("etrain-checkpoint")
        self._yielding = Yielding(self._thread.native_id, yield_cpu)
        self._write_fs = None  # the run's filesystem, writing in the calling thread
        self._pending: Future | None = None
        self._retention_known: dict[str, ckpt.Kept] = {}  # complete checkpoints retention has read
        self._maybe_written = None if folders_found is None else set(folders_found)  # may hold a manifest
        fs = root.fs if root is not None else None  # None: a checkpointer that never prunes
        if rank == 0 and spec.checkpoint.num_to_keep is not None and isinstance(fs, pafs.S3FileSystem):
            s3_client_like(fs)  # retention's S3 client (boto3's import, ~0.5 s) now, not mid-training

    def kind(self, done: int, stop: int, preempted: bool, stop_requested: bool, resizing: bool = False) -> Kind | None:
        gap_ok = (not preempted and not stop_requested and not resizing and done != stop
                  and done % self.interval_steps == 0 and self._gap_ok())
        return checkpoint_kind(done, stop, self.interval_steps, gap_ok, preempted, stop_requested, resizing)

    def _gap_ok(self) -> bool:
        """Rank 0 decides whether to take it and whether to report it; every rank agrees (one
        broadcast, at interval steps only)."""
        in_flight = self._pending is not None and not self._pending.done()
        if in_flight:
            self._yielding.hurry()  # an interval went by while it yielded: it no longer waits for idle time
        now = time.monotonic()
        ok = interval_checkpoint_ok(now - self.last_at, self.min_gap_s, in_flight)
        report = report_due(Kind.INTERVAL, now - self.reported_at, self.report_interval_s)
        if self.world > 1:
            due = torch.tensor([float(ok), float(report)], device=self.device)
            dist.broadcast(due, src=0)
            ok, report = bool(due[0].item()), bool(due[1].item())
        self._report_next = report
        return ok

    def save(self, done: int, kind: Kind, state: Callable[[], dict] | None, metrics: dict,
             flush: Callable[[], Callable[[], None]] = lambda: lambda: None,
             written: Callable[[int], None] | None = None) -> None:
        """Take a checkpoint at step ``done``. ``state`` builds rank 0's state (other ranks: None).
        ``flush``, for a checkpoint that is reported: takes what the observer writes (on the training
        thread, after the state is built: the checkpoint carries the rows too, as they are written
        only after the report) and returns the writes, run after the report on the same thread.
        ``written(done)``: once the files are in storage, before any report (a resize waits for it)."""
        report = self._report_next if kind is Kind.INTERVAL else report_due(kind, 0.0, 0.0)
        started = time.perf_counter()
        if kind is Kind.JIT:
            self.settle(timeout_s=None)  # an earlier failed upload must not cost the notice its checkpoint
        elif kind is Kind.RESIZE:
            self.settle()  # its report needs no controller (the barrier is the ranks'); an error is logged
        else:
            self.wait()
        waited = time.perf_counter() - started
        snap_at = time.perf_counter()
        snapshot = to_cpu(state(), pin=self.device.type == "cuda") if state is not None else None
        writes = flush() if report else None
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.timing = Timing(snapshot_s=time.perf_counter() - snap_at, blocked_s=waited)
        self.last_at = time.monotonic()
        if report:
            self.reported_at = self.last_at
        if kind in (Kind.JIT, Kind.RESIZE) or not self.background:
            sync_at = time.perf_counter()
            self._write_and_report(done, snapshot, dict(metrics), kind is Kind.JIT, writes, written)
            self.timing.blocked_s += time.perf_counter() - sync_at
        else:
            self._yielding.before_work()
            self._pending = self._thread.submit(self._in_background, done, snapshot, dict(metrics), writes, written)

    def wait(self, timeout_s: float | None = None) -> None:
        """Until the checkpoint in flight is written (and reported); its error (or TimeoutError) is raised here."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            if not pending.done():
                self._yielding.hurry()  # training waits for it now: no longer only the idle time
            pending.result(timeout=timeout_s)

    def settle(self, timeout_s: float | None = SETTLE_TIMEOUT_S) -> None:
        """On the way out of a failed attempt: let the checkpoint in flight finish its report (every
        rank's checkpoint thread meets in Ray's report barrier, whatever its training thread hit),
        so the next attempt resumes from it. Without this a failure a few steps after an interval
        checkpoint tore the worker group down mid-report, and the retry started from the one before
        (or from scratch). Its own error, or a report that does not finish in ``timeout_s`` (a rank
        that is gone), is logged: the attempt's failure is the one that counts. Before a just-in-time
        checkpoint, with no timeout: that one is what counts."""
        try:
            self.wait(timeout_s)
        except Exception as exc:  # boundary: the loop's own error is already on its way out
            worker_log().warning("note: the checkpoint in flight did not finish: %s: %s",
                                 type(exc).__name__, exc)

    def close(self) -> None:
        """Whatever is still in flight (a report that outlived ``settle``) finishes at its own policy."""
        self._yielding.hurry()
        self._yielding.stop()
        self._thread.close()

    def _in_background(self, done: int, state: dict | None, metrics: dict,
                       writes: Callable[[], None] | None, written: Callable[[int], None] | None) -> None:
        with short_gil_slices():
            self._write_and_report(done, state, metrics, False, writes, written)

    def _write_and_report(self, done: int, state: dict | None, metrics: dict, jit: bool,
                          writes: Callable[[], None] | None, written: Callable[[int], None] | None = None) -> None:
        """Write the checkpoint (then ``written(done)``); with ``writes`` (the observer's), report
        it, prune, and run them."""
        import ray.train
        from ray.train import Checkpoint, CheckpointUploadMode

        from cluster.ray_adapter.train_worker import run_storage_filesystem

        failed: Exception | None = None
        with self._yielding.idle():  # none of this starts a thread (writes in this one, see below)
            checkpoint = None
            if state is not None:
                # Through the run's own filesystem, the one Ray records the checkpoint on (its endpoint
                # and region are the driver's, as for Ray's own upload), writing in this thread.
                fs, path = run_storage_filesystem(), posixpath.join(self.run_path, ckpt.dir_name(done))
                if self._write_fs is None:
                    self._write_fs = foreground(fs)
                fresh = self._maybe_written is not None and path not in self._maybe_written
                if self._maybe_written is not None:
                    self._maybe_written.add(path)
                try:
                    manifest = write_with_retries(self._write_fs, path, state, self.spec.checkpoint.file_name(done),
                                                  metrics, fresh)
                    self._retention_known[path] = ckpt.kept(manifest, self.spec.checkpoint.keep_best_metric, done)
                    checkpoint = Checkpoint(path, filesystem=fs)
                except Exception as exc:  # re-raised below, after the report every other rank waits in
                    failed = exc
            if written is not None and failed is None:
                written(done)

            if writes is None:  # not reported: no barrier for the other ranks to wait in
                if failed is not None:
                    raise failed
                self.after_write(done, jit)
                return
            # The files are complete where Ray keeps its checkpoints: Ray only records them. In the
            # background its thread queues the record for the controller's next poll and this thread
            # goes on; a just-in-time or sync checkpoint waits until the controller has it.
            if self.background and not jit:  # Ray's default for ASYNC deletes the folder once "uploaded"
                how = {"checkpoint_upload_mode": CheckpointUploadMode.ASYNC, "checkpoint_upload_fn": already_there,
                       "delete_local_checkpoint_after_upload": False}
            else:
                how = {"checkpoint_upload_mode": CheckpointUploadMode.NO_UPLOAD}
            ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=ckpt.dir_name(done), **how)
            if failed is not None:
                raise failed
            self.after_write(done, jit)
        if self.rank == 0:  # pyarrow's listing and deletes use its shared I/O threads: not while idle
            c = self.spec.checkpoint
            ckpt.prune(self.root.fs, self.run_path, c.num_to_keep, c.keep_best_metric, c.keep_best_mode,
                       known=self._retention_known)
        writes()  # the observer's (its TensorBoard writer starts a thread)


WRITE_ATTEMPTS = 3  # as Ray's own upload tried a checkpoint: S3's 503 SlowDown comes in spells
# The AWS SDK's names for errors worth another try (those Ray's upload retried on): not a denied
# access, a missing bucket or a full disk, which would only cost a spot notice its time.
TRANSIENT_STORAGE_ERRORS = ("AWS Error SLOW_DOWN", "AWS Error INTERNAL_FAILURE", "AWS Error SERVICE_UNAVAILABLE",
                            "AWS Error NETWORK_CONNECTION", "AWS Error UNKNOWN")


def write_with_retries(fs, path: str, state: dict, file_name: str, metrics: dict, fresh: bool = False) -> dict:
    """``ckpt.write``, tried again after 1 s and 2 s when storage fails transiently (past the S3
    client's own retries). ``fresh`` holds for the first try only: a failed one may have left a
    manifest (its PUT landed, the answer did not)."""
    for attempt in range(1, WRITE_ATTEMPTS + 1):
        try:
            return ckpt.write(fs, path, state, file_name, metrics, fresh=fresh and attempt == 1)
        except OSError as exc:
            if attempt == WRITE_ATTEMPTS or not any(token in str(exc) for token in TRANSIENT_STORAGE_ERRORS):
                raise
            worker_log().warning("checkpoint %s: writing failed (%s), try %d of %d in %d s",
                                 posixpath.basename(path), exc, attempt + 1, WRITE_ATTEMPTS, attempt)
            time.sleep(attempt)
    raise AssertionError("unreachable")


def foreground(fs):
    """``fs`` with S3 writes done in the calling thread: with pyarrow's background writes each
    upload is a task for its shared I/O threads, and one started for it by a yielding thread
    would stay idle-class. Other filesystems write in the calling thread already."""
    import pyarrow.fs as pafs

    if not isinstance(fs, pafs.S3FileSystem):
        return fs
    rebuild, (options,) = fs.__reduce__()
    return rebuild({**options, "background_writes": False})


def already_there(checkpoint, dir_name: str):
    """Ray's upload step for a checkpoint written in place: nothing to move."""
    return checkpoint

