"""What a training worker shows the world: Prometheus gauges, the metrics history, TensorBoard
event files, goodput and cost, GPU use, and a profiler trace. The loop calls it at log steps
and checkpoints only, so it costs nothing per step but two clock reads around the loader.

Goodput outlives restarts: its running total (productive seconds) rides in every checkpoint,
so work lost to an interruption is not productive. Cost counts every paid second instead: rank 0
keeps an append-only record of segments (``cost.json``: run, start, end, nodes by kind) in the
job's folder. A new attempt stretches the one before it to its last heartbeat and opens its own
at that moment, so the work lost after the last checkpoint and the recovery are billed too.
"""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
import tempfile
import threading
import time
from collections.abc import Callable

import torch

from cluster.metrics import JobMetrics, NodeKind, cost_usd, goodput
from cluster.storage import StorageRoot
from trainers.config.job import JobSpec
from trainers.history import MetricsHistory
from trainers.job_folder import COST_FILE, PROFILES_DIR, TENSORBOARD_DIR

log = logging.getLogger(__name__)

TB_EVENTS_PREFIX = "events.out.tfevents."  # what TensorBoard looks for in a file's name
TB_SCALARS = ("loss", "learning_rate", "samples_per_s", "tokens_per_s", "step_time_s", "data_wait_fraction",
              "world_size", "goodput", "cost_usd")


def ledger_node_hours(segments: list[dict]) -> dict[NodeKind, float]:
    """Node-hours per kind over a cost record: each segment's nodes for its duration."""
    out: dict[NodeKind, float] = {}
    for seg in segments:
        for instance_type, market, nodes in seg["nodes"]:
            kind = NodeKind(instance_type, market)
            out[kind] = out.get(kind, 0.0) + nodes * max(0.0, seg["end"] - seg["start"]) / 3600
    return out


def open_segment(segments: list[dict], run_id: str, start: float, previous_end: float | None,
                 kinds: dict[NodeKind, int]) -> list[dict]:
    """The record with a new attempt's segment appended (from ``start``); with ``previous_end``
    (the last heartbeat of the attempt before, in this run) that attempt's segment reaches it."""
    out = [dict(s) for s in segments]
    if previous_end is not None:
        for seg in reversed(out):
            if seg["run_id"] == run_id:
                seg["end"] = max(seg["end"], previous_end)
                break
    nodes = [[k.instance_type, k.market, n] for k, n in sorted(kinds.items(), key=lambda kv: (kv[0].instance_type, kv[0].market))]
    return [*out, {"run_id": run_id, "start": start, "end": start, "nodes": nodes}]


def group_kinds(kinds: list[tuple[str, NodeKind]]) -> dict[NodeKind, int]:
    """Nodes per kind in the group, from each rank's (node id, kind): a node counts once."""
    nodes = dict(kinds)
    out: dict[NodeKind, int] = {}
    for kind in nodes.values():
        out[kind] = out.get(kind, 0) + 1
    return out


class Observer:
    def __init__(self, spec: JobSpec, root: StorageRoot, rank: int, device: torch.device, submitted_at: float,
                 restored: dict | None, kinds: dict[NodeKind, int], job: str | None = None,
                 staging: str | None = None, *, start_step: int):
        """``job``: the job's folder under ``root`` (its name unless checkpoint.path is absolute);
        ``staging``: rank 0's local folder for files on their way to storage; ``start_step``: the
        step the attempt resumed from (0: from the start)."""
        self.spec, self.root, self.rank, self.device = spec, root, rank, device
        self.job = job or spec.name
        self.submitted_at = submitted_at
        self.metrics = JobMetrics(spec.name, spec.labels.get("tenant", ""), rank)
        self.kinds = kinds
        restored = restored or {}
        self.productive_base_s = restored.get("productive_s", 0.0)
        self.segments: list[dict] = []  # rank 0: the cost record, this attempt's segment last
        self.node_hours: dict[NodeKind, float] = {}
        self.history = MetricsHistory(root, self.job) if rank == 0 else None
        self.staging = staging or tempfile.gettempdir()
        carried = restored.get("unflushed_rows") or []  # rank 0's: logged, not yet flushed at the checkpoint
        first_step = min((row["step"] for row in carried), default=start_step + 1)
        self.tb = (TensorBoard(root, spec, self.job, os.path.join(self.staging, TENSORBOARD_DIR), first_step)
                   if rank == 0 else None)
        self.wait_s = 0.0
        self.window_steps = 0
        self.last_checkpoint: dict = {}
        self.attempt_start = time.perf_counter()
        p = spec.training.profile
        self.profile_range = (p.start_step, p.start_step + p.num_steps) if p and rank == 0 else None
        self.profiler = None
        if self.history is not None:  # rows the restored checkpoint carried: no flush wrote them
            for row in carried:
                self.history.carry(row)
                self.tb.scalars(row)

    # ------------------------------------------------------------ per step (cheap)

    def loader_wait(self, seconds: float) -> None:
        self.wait_s += seconds

    def step_done(self, done: int) -> None:
        self.window_steps += 1
        if self.profile_range:
            self._profile(done)

    # ------------------------------------------------------------ log steps and checkpoints

    def log_step(self, metrics: dict, elapsed_s: float) -> None:
        """Add derived figures to ``metrics`` and publish them (gauges; rank 0: history, TensorBoard)."""
        metrics.update(self.last_checkpoint)
        self.last_checkpoint = {}
        metrics["step_time_s"] = elapsed_s / max(1, self.window_steps)
        metrics["data_wait_fraction"] = min(1.0, self.wait_s / elapsed_s) if elapsed_s > 0 else 0.0
        self.wait_s, self.window_steps = 0.0, 0
        productive = self.productive_s()
        metrics["goodput"] = goodput(productive, time.time() - self.submitted_at)
        if self.segments:
            self.segments[-1]["end"] = time.time()
            self.node_hours = ledger_node_hours(self.segments)
        totals = [cost_usd(h, k, self.spec.cost.prices_per_hour) for k, h in self.node_hours.items()]
        metrics["cost_usd"] = sum(c for c, _ in totals)
        metrics["savings_usd"] = sum(s for _, s in totals)
        m = self.metrics
        m.set(step_time_s=metrics["step_time_s"], data_wait_fraction=metrics["data_wait_fraction"],
              samples_per_s=metrics["samples_per_s"], tokens_per_s=metrics["tokens_per_s"], loss=metrics["loss"],
              learning_rate=metrics["learning_rate"], world_size=metrics["world_size"], step=metrics["step"])
        if self.device.type == "cuda":
            m.set(gpu_memory_bytes=torch.cuda.memory_allocated(self.device), gpu_utilization=gpu_utilization())
        if self.rank == 0:
            m.set(goodput=metrics["goodput"])
            for (kind, hours), (cost, saved) in zip(self.node_hours.items(), totals):
                m.set_cost(kind, hours, cost, saved)
            self.history.add(metrics)
            self.tb.scalars(metrics)

    def productive_s(self) -> float:
        return self.productive_base_s + (time.perf_counter() - self.attempt_start)

    def checkpoint_state(self) -> dict:
        """Running totals to carry in the checkpoint (steps after it are lost, so is their time), and
        rank 0's history rows that no flush has written yet (a checkpoint not reported flushes none)."""
        state = {"productive_s": self.productive_s()}
        if self.history is not None:
            state["unflushed_rows"] = self.history.pending()
        return state

    def open_cost_segment(self, run_id: str, start: float, previous_end: float | None) -> None:
        """Rank 0, at an attempt's first step: bill this attempt's nodes from ``start`` (the
        previous attempt's last heartbeat, or the run's start) and write the record."""
        if self.rank != 0:
            return
        known = self.root.read_json(self.job, COST_FILE) if self.root.exists(self.job, COST_FILE) else []
        self.segments = open_segment(known, run_id, start, previous_end, self.kinds)
        self.segments[-1]["end"] = time.time()
        self.root.write_json(self.segments, self.job, COST_FILE)

    def checkpoint_times(self, save_s: float, report_s: float) -> None:
        """The last checkpoint's local write and how long report() blocked; the next log row carries them."""
        self.last_checkpoint = {"checkpoint_save_s": save_s, "checkpoint_report_s": report_s}
        if self.rank == 0:
            self.metrics.set(checkpoint_save_s=save_s, checkpoint_upload_s=report_s)

    def interruptions(self, records: list[dict]) -> None:
        if self.rank == 0:
            self.metrics.interruptions_so_far(records)

    def flush(self) -> None:
        """At the end (reported checkpoints use :meth:`flusher`): history chunk and TensorBoard events to storage."""
        self.flusher()()

    def flusher(self) -> Callable[[], None]:
        """What to flush, taken now on the training thread; the writes, to run in the background."""
        rows = self.history.take() if self.history is not None else []
        if self.segments:
            self.segments[-1]["end"] = time.time()
        segments = [dict(s) for s in self.segments]

        def write() -> None:
            if self.history is not None:
                self.history.write(rows)
                self.tb.upload()
            if segments:
                self.root.write_json(segments, self.job, COST_FILE)

        return write

    def close(self) -> None:
        """End of an attempt: stop a running trace and remove local staging (the last flush uploaded it)."""
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            self.profiler = None
        if self.tb is not None:
            self.tb.close()

    # ------------------------------------------------------------ profiling

    def _profile(self, done: int) -> None:
        start, stop = self.profile_range
        if done == start and self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self.profiler.__enter__()
        elif done == stop and self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            with tempfile.TemporaryDirectory(prefix="profile-", dir=self.staging) as staging:
                local = os.path.join(staging, "trace.json")
                self.profiler.export_chrome_trace(local)
                with open(local, "rb") as f:
                    self.root.write_bytes(f.read(), self.job, PROFILES_DIR, f"trace-steps-{start}-{stop}.json")
            self.profiler, self.profile_range = None, None
            log.info(f"profile of steps {start}-{stop}: "
                     f"{self.root.uri_of(self.job, PROFILES_DIR, f'trace-steps-{start}-{stop}.json')}")


def gpu_utilization() -> float | None:
    try:
        return torch.cuda.utilization() / 100.0  # NVML through pynvml
    except Exception:  # boundary: no NVML on this node; memory is still reported
        return None


class TensorBoard:
    """Event files written locally by rank 0 and copied to ``<job>/tensorboard/`` at each flush,
    so `tensorboard --logdir <root>/<job>/tensorboard` (or s3://...) shows the run as it goes.

    Each flush closes the current event file, uploads it, and starts the next: a flush moves only
    the events since the last, where copying the one growing file would move the whole run's events
    again at every checkpoint. TensorBoard reads a folder's event files in the order of their names,
    so each is stored under a name that sorts in upload order, across attempts too (the writer's own
    names end in a counter that sorts 10 before 9). An attempt's first file starts with a session
    start at the first step the attempt logs: TensorBoard's Python loader (an s3:// logdir,
    ``--load_fast=false``) then drops what earlier files hold from that step on (what the attempt
    before logged past its checkpoint, trained again now); to it a step going back means nothing
    in event files of version 2. Its fast local loader ignores the session start and drops a tag's
    points from any step that goes back, which comes to the same here."""

    def __init__(self, root: StorageRoot, spec: JobSpec, job: str, local: str, first_step: int = 1):
        """``first_step``: the first step this attempt logs (rows a restored checkpoint carried count)."""
        self.root, self.job, self.local = root, job, local
        self._purge_step: int | None = first_step  # for the attempt's first event file only
        self._lock = threading.Lock()  # the training thread logs while the checkpoint thread flushes
        self._uploaded = 0
        self._dirty, self._closed = True, False  # events since the last upload; closed for good
        self._suffix = f".{spec.name}"  # in each local file's name: a leaked copy says whose it is
        self.writer = self._open()
        t = spec.training
        hparams = {"batch_size": t.batch_size, "learning_rate": t.learning_rate, "optimizer": t.optimizer,
                   "num_workers": spec.distributed.max_workers, "loader_workers": spec.data.num_workers,
                   "mixed_precision": t.mixed_precision, "model": spec.model.name}
        self.writer.add_text("spec", "```\n" + spec.model_dump_json(indent=2) + "\n```")
        self.writer.add_hparams(hparams, {"hparams/loss": float("nan")}, run_name=".")

    def scalars(self, metrics: dict) -> None:
        with self._lock:
            if self._closed:
                return
            for key in TB_SCALARS:
                if metrics.get(key) is not None:
                    self.writer.add_scalar(f"train/{key}", metrics[key], metrics["step"])
            self._dirty = True

    def close(self) -> None:
        """End of the attempt (after its last flush); a flush still running after it does nothing."""
        with self._lock:
            self._closed = True
            self.writer.close()
        shutil.rmtree(self.local, ignore_errors=True)

    def _open(self):
        from torch.utils.tensorboard import SummaryWriter

        purge_step, self._purge_step = self._purge_step, None
        return SummaryWriter(log_dir=self.local, filename_suffix=self._suffix, purge_step=purge_step)

    def upload(self) -> None:
        """Upload the events written since the last upload (each closed file once, then removed)."""
        with self._lock:
            if self._closed or not self._dirty:
                return
            self.writer.close()
            closed = [entry.path for entry in os.scandir(self.local) if entry.is_file()]  # hparams' too
            self.writer = self._open()
            self._dirty = False
        for path in sorted(closed, key=lambda p: os.stat(p).st_mtime_ns):
            name = os.path.basename(path).removeprefix(TB_EVENTS_PREFIX)
            # milliseconds: a later attempt's first upload comes seconds after this one's last
            stored = f"{TB_EVENTS_PREFIX}{time.time_ns() // 1_000_000:013d}.{self._uploaded:06d}.{name}"
            self._uploaded += 1
            with open(path, "rb") as f:
                self.root.write_bytes(f.read(), self.job, TENSORBOARD_DIR, stored)
            os.remove(path)


def profiles_of(root: StorageRoot, job: str) -> list[str]:
    """URIs of a job's profiler traces."""
    import pyarrow.fs as pafs

    if not root.exists(job, PROFILES_DIR):
        return []
    infos = root.fs.get_file_info(pafs.FileSelector(root.path(job, PROFILES_DIR)))
    return sorted(root.uri_of(job, PROFILES_DIR, posixpath.basename(i.path)) for i in infos
                  if i.type == pafs.FileType.File)
