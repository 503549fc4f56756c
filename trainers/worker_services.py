"""What runs beside the loop on a worker: rank 0's heartbeat and stop poll (:class:`Pulse`),
Ray Train's request to checkpoint before a resize (:class:`ResizeRequest`), the waits after a
just-in-time or resize checkpoint, this node's kind for cost, the staging folder, and the record
of an interruption at the first step after a restart."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import threading
import time

import ray.train

from cluster.metrics import node_kind
from trainers.job_folder import INTERRUPTIONS_FILE, read_interruptions
from trainers.recovery import HEARTBEAT_INTERVAL_S, Heartbeat, Heartbeats, StopFlag, interruption_record
from trainers.worker_log import worker_log


class Pulse:
    """Rank 0's background thread: the heartbeat in Ray's KV and the stop request poll.

    Off the step path: the loop only writes ``step`` and reads ``stop_requested``, which rides
    the next sync step's all-reduce so every rank stops at the same step.
    """

    def __init__(self, beats: Heartbeats, stop_flag: StopFlag, world: int, interval_s: float = HEARTBEAT_INTERVAL_S):
        self.beats, self.stop_flag, self.world, self.interval_s = beats, stop_flag, world, interval_s
        self.step, self.stop_requested = 0, False
        self._held_at = 0  # the step of a just-in-time checkpoint: its beat (with the cause) must be the last
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="etrain-pulse", daemon=True)

    def start(self) -> Pulse:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._halt.wait(self.interval_s):
            try:
                with self._lock:
                    if self.step and self.step != self._held_at:
                        self.beats.beat(self.step, self.world, force=True)
                self.stop_requested = self.stop_requested or self.stop_flag.requested()
            except Exception as exc:  # boundary: a missed beat only blurs recovery accounting; try next tick
                worker_log().warning("note: heartbeat: %s: %s", type(exc).__name__, exc)

    def took_over(self, step: int) -> None:
        """The attempt's first step is done and the one before it recorded: beat at once, so that
        the beat an attempt after this one reads is this attempt's. A failure before the first tick
        (a node cut a second after the restart) would otherwise leave the previous attempt's beat
        there, and the next attempt would record that interruption again, cause and all."""
        try:
            with self._lock:
                self.beats.beat(step, self.world, force=True)
                self._held_at = 0
        except Exception as exc:  # boundary: as in _run, a missed beat must not end the attempt
            worker_log().warning("note: heartbeat: %s: %s", type(exc).__name__, exc)

    def checkpointed(self, step: int, jit: bool) -> None:
        """A beat at each checkpoint; after a just-in-time one, none until training moves on."""
        with self._lock:
            self.beats.beat(step, self.world, cause="preemption notice" if jit else None, force=True)
            self._held_at = step if jit else 0

    def stop(self) -> None:
        self._halt.set()


class ResizeRequest:
    """Ray Train's word, on a worker, that it is about to restart the group to resize it
    (cluster.ray_adapter.train_callbacks.CheckpointBeforeResize, in Ray's actor thread beside the training
    thread). The loop reads ``asked`` at its next sync step, where every rank agrees on it through
    the all-reduce as on a stop, checkpoints, and says at which step (:meth:`saved`)."""

    def __init__(self):
        self.asked = threading.Event()
        self._answered = threading.Event()
        self.step: int | None = None

    def ask(self, timeout_s: float) -> int | None:
        """The step of the checkpoint taken for the resize (written: on rank 0 in storage), or None
        (none within ``timeout_s``, or the attempt ended first)."""
        self.step = None
        self._answered.clear()
        self.asked.set()
        self._answered.wait(timeout_s)
        return self.step

    def saved(self, step: int | None) -> None:
        """On the training thread: answered (None: the attempt ended without one)."""
        self.asked.clear()
        self.step = step
        self._answered.set()


RESIZE_GRACE_S = 300.0  # past the controller's wait for every rank's answer, and its shutdown's


def wait_out_resize(rank: int, step: int, grace_s: float = RESIZE_GRACE_S) -> None:
    """After the checkpoint before a resize, stop doing work the restart would throw away: Ray
    Train shuts the group down once every rank has answered. Should it not (a Ray that changed
    how it resizes), training goes on after ``grace_s``, and a later request is answered anew."""
    if rank == 0:
        worker_log().info(f"resize: checkpoint at step {step} saved; Ray Train restarts the group now")
    time.sleep(grace_s)


def ray_preemption_noticed() -> bool:
    """This worker's own view of a spot notice: a local read, no Ray call (the agreement rides the all-reduce)."""
    from cluster.ray_adapter.train_worker import local_preemption_info

    return local_preemption_info() is not None


def staging_folder(job_key: str) -> str:
    """Rank 0's local folder for this job on this node: TensorBoard files before upload (checkpoints
    go straight to storage). Emptied when an attempt starts, so an attempt killed with its
    processes (a lost node, a restart) leaves nothing behind the next one."""
    path = os.path.join(tempfile.gettempdir(), job_key.replace("/", "-"))
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


FAILURE_CAUSES = {"user_error": "user error", "node_lost": "node lost", "preemption": "preemption"}


def record_interruption(root, job: str, last: Heartbeat, restored_step: int, world: int,
                        previous_failure: str | None) -> None:
    """Rank 0, at the first step after a restart: append what the interruption cost to storage."""
    if last.cause is None and previous_failure:
        last = dataclasses.replace(last, cause=FAILURE_CAUSES.get(previous_failure, previous_failure))
    elif last.cause is None and world > last.world_size:
        last = dataclasses.replace(last, cause="scale up")  # Ray Train restarted the group to grow it
    record = interruption_record(last, restored_step, world, time.time())
    records = read_interruptions(root, job)
    root.write_json([*records, record], job, INTERRUPTIONS_FILE)
    worker_log().info(f"recovered from {record['cause']} in {record['recovery_s']:.1f}s: "
                      f"{record['steps_lost']} steps lost, world size {record['world_size_before']} -> {world}")


def own_node_kind():
    """This worker's node: instance type and market, from its custom resources."""
    node_id = ray.get_runtime_context().get_node_id()
    resources = next((n["Resources"] for n in ray.nodes() if n["NodeID"] == node_id), {})
    return node_kind(resources)


def wait_out_preemption(info, rank: int, step: int, grace_s: float = 30.0) -> None:
    """After the just-in-time checkpoint, stop doing work that the restart would throw away.

    Ray Train restarts the run at the deadline; if that does not happen (the notice was a
    false alarm), training goes on after the grace period.
    """
    deadline_s = (info.deadline_ms / 1000 - time.time()) if info.deadline_ms else 0.0
    if rank == 0:
        worker_log().warning(f"preemption notice for nodes {info.preempted_node_ids}: checkpoint at step {step} "
                             f"saved; idling {max(0.0, deadline_s):.0f}s until the restart")
    time.sleep(max(0.0, deadline_s) + grace_s)
