"""Ray Train's callbacks: the ones :func:`~cluster.ray_adapter.train_torch.torch_trainer` leaves out and
the ones it adds in their place.

- Ray Train's default callbacks: a trainer given no Ray Dataset still starts an actor to
  hand out dataset shards (one more process, ~1.5 CPU-s, at every start and restart); the lean
  trainer leaves that callback out when there are no datasets. It also replaces the
  placement-group cleaner (``PlacementGroupCleanerCallback``: a detached actor per run that
  asks the dashboard's state API every second whether the controller lives): see
  :class:`PlacementGroupRecorder`.
- Ray Train's preemption watcher (``PreemptionCallback`` starts a ``PreemptionWatcher`` actor at
  every worker-group start: a process, ~1.4 CPU-s of imports, at each start and restart). It is
  what turns a node drain (a spot notice) into each rank's ``get_preemption_info()``, so it stays,
  as a thread of the controller (:class:`InProcessPreemptionCallback`).
- Ray Train's controller hooks around a resize (``ControllerCallback``: the ``ResizingState`` a
  running group enters when the cluster has room for a different one, then
  ``before_controller_execute_resize_decision``) and a worker's ``execute_async``: before the
  controller restarts a healthy group to resize it, each rank checkpoints
  (:class:`CheckpointBeforeResize`).

Each class is built on first use: Ray Train is imported only when a trainer is.
"""

from __future__ import annotations

import logging

from cluster.ray_adapter.kv import kv_del, kv_get, kv_put
from cluster.ray_adapter.train_worker import checkpoint_before_resize

log = logging.getLogger(__name__)


def _left_out_callback_classes() -> tuple[type, type]:
    """Ray Train's dataset-shard callback and its placement-group cleaner (see :func:`torch_trainer`)."""
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    return DatasetsCallback, PlacementGroupCleanerCallback


PG_KEY_PREFIX = b"etrain/placement-group/"


def _recorder_class():
    """Built on first use: a Ray Train callback class (Ray Train is imported only when a trainer is)."""
    from ray.train.v2._internal.execution.callback import WorkerGroupCallback

    class PlacementGroupRecorder(WorkerGroupCallback):
        """Records each worker group's placement group where the driver finds it.

        Ray Train's controller runs on the driver's node and its placement groups belong to the
        driver's job: when the driver dies, Ray removes them with the job. Only a controller that
        dies while its driver lives (killed, out of memory) leaves one holding the workers' CPUs
        or GPUs, and the driver is the one to see that: its ``fit()`` raises. A sweep trial's
        driver is a Tune actor of the sweep's job, ended with its controller when Tune stops the
        trial: there the sweep's driver removes the group, by the trial's record
        (``placement_group_key``, trainers.sweep.trial_cleanup_callback). Ray's cleaner
        watches for it with a detached actor per run (a process, ~2.3 CPU-s of imports, on the
        path to the first step), polling the dashboard every second and waiting out a poll when
        the run ends: measured here, a 20-step run took 16-18 s and 28 CPU-s with it, 12-13 s and
        20 CPU-s without. This callback writes the group's placement-group id to Ray's KV, and
        the driver's ``fit()`` removes it when the controller could not.
        """

        def __init__(self, key: bytes):
            self.key = key

        def after_worker_group_start(self, worker_group) -> None:
            state = worker_group.get_worker_group_state()
            kv_put(self.key, state.placement_group_handle.placement_group.id.binary())

    return PlacementGroupRecorder


def placement_group_record(run_key: str) -> bytes:
    """Where the placement group of the run named ``run_key`` is recorded (:class:`PlacementGroupRecorder`)."""
    return PG_KEY_PREFIX + run_key.encode()


def _resize_checkpoint_callback_class():
    """Built on first use, like :func:`_recorder_class`."""
    from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
    from ray.train.v2._internal.execution.controller.state import ResizingState

    class CheckpointBeforeResize(ControllerCallback, WorkerGroupCallback):
        """Before Ray Train restarts a running group to resize it, every rank checkpoints.

        Ray Train grows a group (``num_workers: {min, max}``) by shutting it down and starting a
        bigger one, which then resumes from the newest checkpoint: the steps since it were lost,
        up to a checkpoint interval, more when the restart caught a checkpoint mid-write. Here the
        controller, once it has decided (a running group enters ``ResizingState``; a restart
        after a failure does not, and its workers may be gone), asks each worker and waits for
        every answer, ``timeout_s`` at most (``distributed.resize_checkpoint_timeout_s``): the
        ranks agree on the request at their next sync step, as on a stop, rank 0 writes the
        checkpoint and each rank answers once it is written, before any report to Ray (whose
        controller is the one waiting here); the restart finds it in storage. Meanwhile the
        controller's loop and each worker's actor thread wait with it (a second Ctrl-C's abort
        and a spot notice's marks queue behind it); after it the group is shut down whatever
        the answers.
        """

        def __init__(self, timeout_s: float):
            self.timeout_s = timeout_s
            self._group = None
            self._planned = False

        def after_worker_group_start(self, worker_group) -> None:
            self._group = worker_group

        def after_worker_group_shutdown(self, worker_group_context) -> None:
            self._group = None

        def after_worker_group_abort(self, worker_group_context) -> None:
            self._group = None

        def after_controller_state_update(self, previous_state, current_state) -> None:
            if isinstance(current_state, ResizingState):
                self._planned = True

        def before_controller_execute_resize_decision(self, resize_decision) -> None:
            planned, self._planned = self._planned, False
            if not planned or self._group is None or self.timeout_s <= 0:
                return
            import ray

            try:
                refs = [w.execute_async(checkpoint_before_resize, self.timeout_s) for w in self._group.get_workers()]
                ready, late = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s + 5)
            except Exception:  # boundary: a resize goes ahead without it, from the newest checkpoint as before
                log.warning("could not ask the workers to checkpoint before the resize", exc_info=True)
                return
            answers = []
            for ref in ready:
                try:
                    answers.append(ray.get(ref))
                except Exception as exc:  # a rank that died meanwhile: the others' answers still count
                    answers.append(f"{type(exc).__name__}")
            log.info("resizing to %s workers: checkpoints before the restart at steps %s%s", resize_decision.num_workers,
                     answers, f"; {len(late)} ranks did not answer in {self.timeout_s:g} s" if late else "")

    return CheckpointBeforeResize


def _preemption_callback_class():
    """Built on first use, like :func:`_recorder_class`."""
    from ray.train.v2._internal.callbacks.preemption_callback import PreemptionCallback
    from ray.train.v2._internal.execution.preemption import PreemptionWatcher

    class InProcessPreemptionCallback(PreemptionCallback):
        """Ray's preemption watcher, run as a thread of the controller instead of an actor of its own.

        The watcher polls the GCS for drained nodes every few seconds and, when one of the group's
        nodes drains, marks every rank preempted: a plain object with a daemon thread, which Ray
        wraps in an actor for each worker-group start. Here the same object runs in the
        controller's process (which outlives every group it starts): the same drains seen, the
        same marks sent, one process fewer per start. Stopping it ends its thread at its next wait.
        """

        def after_worker_group_start(self, worker_group) -> None:
            self._stop_watcher()
            node_to_ranks: dict[str, list[int]] = {}
            actors_by_rank = {}
            for worker in worker_group.get_workers():
                rank = worker.distributed_context.world_rank
                node_to_ranks.setdefault(worker.metadata.node_id, []).append(rank)
                actors_by_rank[rank] = worker.actor
            self._watcher = PreemptionWatcher(node_to_ranks=node_to_ranks, poll_interval_s=self._poll_interval_s,
                                              worker_actors_by_rank=actors_by_rank)

        def _stop_watcher(self) -> None:
            watcher, self._watcher = self._watcher, None
            if watcher is not None:
                watcher._stop_event.set()

    return InProcessPreemptionCallback


def remove_recorded_placement_group(key: bytes) -> None:
    """Remove the placement group recorded under ``key`` if it is still there (its controller
    died without removing it); forget the record."""
    import ray
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    recorded = kv_get(key)
    if recorded is None:
        return
    pg = PlacementGroup(PlacementGroupID(recorded))
    if placement_group_table(pg).get("state") not in (None, "REMOVED"):
        try:
            remove_placement_group(pg)
        except ray.exceptions.RaySystemError:  # removed meanwhile
            pass
    kv_del(key)  # only now: a removal that failed is found again by the next caller
