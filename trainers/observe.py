"""What a training worker shows the world: Prometheus gauges, the metrics history, TensorBoard
event files, goodput and cost, GPU use, and a profiler trace. The loop calls it at log steps
and checkpoints only, so it costs nothing per step but two clock reads around the loader.

Goodput and cost outlive restarts: their running totals ride in every checkpoint.
"""

from __future__ import annotations

import os
import posixpath
import tempfile
import time

import torch

from cluster.metrics import JobMetrics, NodeKind, cost_usd, goodput, node_kind
from cluster.storage import StorageRoot
from trainers.config import JobSpec
from trainers.history import MetricsHistory

TENSORBOARD_DIR = "tensorboard"
PROFILES_DIR = "profiles"
TB_SCALARS = ("loss", "learning_rate", "samples_per_s", "tokens_per_s", "step_time_s", "data_wait_fraction",
              "world_size", "goodput", "cost_usd")


def group_kinds(kinds: list[tuple[str, NodeKind]]) -> dict[NodeKind, int]:
    """Nodes per kind in the group, from each rank's (node id, kind): a node counts once."""
    nodes = dict(kinds)
    out: dict[NodeKind, int] = {}
    for kind in nodes.values():
        out[kind] = out.get(kind, 0) + 1
    return out


class Observer:
    def __init__(self, spec: JobSpec, root: StorageRoot, rank: int, device: torch.device, submitted_at: float,
                 restored: dict | None, kinds: dict[NodeKind, int], job: str | None = None):
        """``job``: the job's folder under ``root`` (its name unless checkpoint.path is absolute)."""
        self.spec, self.root, self.rank, self.device = spec, root, rank, device
        self.job = job or spec.name
        self.submitted_at = submitted_at
        self.metrics = JobMetrics(spec.name, spec.labels.get("tenant", ""), rank)
        self.kinds = kinds
        restored = restored or {}
        self.productive_base_s = restored.get("productive_s", 0.0)
        self.node_hours: dict[NodeKind, float] = {NodeKind(*k): h for k, h in restored.get("node_hours", [])}
        self.history = MetricsHistory(root, self.job) if rank == 0 else None
        self.tb = TensorBoard(root, spec, self.job) if rank == 0 else None
        self.wait_s = 0.0
        self.window_steps = 0
        self.last_checkpoint: dict = {}
        self.attempt_start = time.perf_counter()
        self.last_cost_at = time.time()
        p = spec.training.profile
        self.profile_range = (p.start_step, p.start_step + p.num_steps) if p and rank == 0 else None
        self.profiler = None

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
        now = time.time()
        for kind, nodes in self.kinds.items():
            self.node_hours[kind] = self.node_hours.get(kind, 0.0) + nodes * (now - self.last_cost_at) / 3600
        self.last_cost_at = now
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
        """Running totals to carry in the checkpoint (steps after it are lost, so is their time)."""
        return {"productive_s": self.productive_s(),
                "node_hours": [[[k.instance_type, k.market], h] for k, h in self.node_hours.items()]}

    def checkpoint_times(self, save_s: float, report_s: float) -> None:
        """The last checkpoint's local write and how long report() blocked; the next log row carries them."""
        self.last_checkpoint = {"checkpoint_save_s": save_s, "checkpoint_report_s": report_s}
        if self.rank == 0:
            self.metrics.set(checkpoint_save_s=save_s, checkpoint_upload_s=report_s)

    def interruptions(self, records: list[dict]) -> None:
        if self.rank == 0:
            self.metrics.interruptions_so_far(records)

    def flush(self) -> None:
        """At checkpoints and at the end: history chunk and TensorBoard events to storage."""
        if self.history is not None:
            self.history.flush()
            self.tb.upload()

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
            local = os.path.join(tempfile.mkdtemp(prefix="etrain-prof-"), "trace.json")
            self.profiler.export_chrome_trace(local)
            with open(local, "rb") as f:
                self.root.write_bytes(f.read(), self.job, PROFILES_DIR, f"trace-steps-{start}-{stop}.json")
            self.profiler, self.profile_range = None, None
            print(f"[etrain] profile of steps {start}-{stop}: "
                  f"{self.root.uri_of(self.job, PROFILES_DIR, f'trace-steps-{start}-{stop}.json')}", flush=True)


def gpu_utilization() -> float | None:
    try:
        return torch.cuda.utilization() / 100.0  # NVML through pynvml
    except Exception:  # boundary: no NVML on this node; memory is still reported
        return None


class TensorBoard:
    """Event files written locally by rank 0 and copied whole to ``<job>/tensorboard/`` at each flush,
    so `tensorboard --logdir <root>/<job>/tensorboard` (or s3://...) shows the run as it goes."""

    def __init__(self, root: StorageRoot, spec: JobSpec, job: str):
        from torch.utils.tensorboard import SummaryWriter

        self.root, self.job = root, job
        self.local = tempfile.mkdtemp(prefix="etrain-tb-")
        self.writer = SummaryWriter(log_dir=self.local)
        t = spec.training
        hparams = {"batch_size": t.batch_size, "learning_rate": t.learning_rate, "optimizer": t.optimizer,
                   "num_workers": spec.distributed.max_workers, "loader_workers": spec.data.num_workers,
                   "mixed_precision": t.mixed_precision, "model": spec.model.name}
        self.writer.add_text("spec", "```\n" + spec.model_dump_json(indent=2) + "\n```")
        self.writer.add_hparams(hparams, {"hparams/loss": float("nan")}, run_name=".")

    def scalars(self, metrics: dict) -> None:
        for key in TB_SCALARS:
            if metrics.get(key) is not None:
                self.writer.add_scalar(f"train/{key}", metrics[key], metrics["step"])

    def upload(self) -> None:
        self.writer.flush()
        for dirpath, _, files in os.walk(self.local):
            for name in files:
                rel = os.path.relpath(os.path.join(dirpath, name), self.local)
                with open(os.path.join(dirpath, name), "rb") as f:
                    self.root.write_bytes(f.read(), self.job, TENSORBOARD_DIR, *rel.split(os.sep))


def profiles_of(root: StorageRoot, job: str) -> list[str]:
    """URIs of a job's profiler traces."""
    import pyarrow.fs as pafs

    if not root.exists(job, PROFILES_DIR):
        return []
    infos = root.fs.get_file_info(pafs.FileSelector(root.path(job, PROFILES_DIR)))
    return sorted(root.uri_of(job, PROFILES_DIR, posixpath.basename(i.path)) for i in infos
                  if i.type == pafs.FileType.File)
