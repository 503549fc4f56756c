"""Where a job's files live, what each is called, and what names a job on a cluster.

A relative ``checkpoint.path`` keeps everything in ``<storage root>/<name>/``: checkpoints
in the path's folder (``checkpoints/`` by default); summary, interruptions, cost, metrics
and TensorBoard files beside it. An absolute one (the deployment guide's
``/checkpoints/model_{step}.pt``: on a cluster, typically a shared volume mounted on every
node) names the job's folder itself: its checkpoints land directly in it, every other file
of the job beside them. Built-in data sets stay under the storage root either way.

A job is its folder: the same folder means "resume this job", and the keys a running job
keeps in Ray (stop request, heartbeat) are derived from it, so two jobs of one name in two
roots never touch each other's.
"""

from __future__ import annotations

import hashlib
import posixpath
from dataclasses import dataclass

from cluster.storage import StorageRoot, open_root
from trainers.config.job import JobSpec

# Every file and folder of a job's folder, by the name it has there (the checkpoints' own
# names, checkpoint_<step>/ and its manifest, are trainers.checkpoint_files')
JOB_FILE = "job.json"  # when the job was first submitted: cost and goodput count from then
SUMMARY_FILE = "summary.json"  # the run's summary, written at its end (also printed)
INTERRUPTIONS_FILE = "interruptions.json"  # each restart: cause, steps lost, time to recover
STOP_REQUEST_FILE = "stop-request.json"  # a graceful stop asked in storage, read by rank 0
COST_FILE = "cost.json"  # the run's cost segments, one per attempt
HISTORY_DIR = "metrics"  # the metrics history, JSON Lines files by step range
TENSORBOARD_DIR = "tensorboard"
PROFILES_DIR = "profiles"  # torch profiler traces
RAY_SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"  # Ray Train's own record in the checkpoints' folder
SWEEP_RESULTS_FILE = "results.json"  # a sweep's folder: every trial's values, status and metrics
EXPORTED_DIR = "exported"  # the trained model out: save_pretrained's folder (model.hf) or `etrain export`'s weights
EXPORTED_SAFETENSORS_FILE = "model.safetensors"  # in EXPORTED_DIR: the state dict, no pickle
EXPORTED_PT_FILE = "model.pt"  # in EXPORTED_DIR: the state dict, torch.save'd
EXPORTED_FILES = {"safetensors": EXPORTED_SAFETENSORS_FILE, "pt": EXPORTED_PT_FILE}  # by `etrain export --format`


def read_interruptions(root: StorageRoot, job: str) -> list[dict]:
    """The job's interruption records, oldest first; none yet is an empty list."""
    return root.read_json(job, INTERRUPTIONS_FILE) if root.exists(job, INTERRUPTIONS_FILE) else []


@dataclass(frozen=True)
class JobHome:
    root: StorageRoot  # the root that holds the job's folder
    job: str  # the job's folder under ``root``
    run_folder: str  # the checkpoints' folder inside the job's folder; "" is the job's folder itself

    @property
    def uri(self) -> str:
        return self.root.uri_of(self.job)

    @property
    def run_path(self) -> str:
        """The checkpoints' folder as a path in ``root.fs``."""
        return self.root.path(self.job, self.run_folder) if self.run_folder else self.root.path(self.job)

    @property
    def run_uri(self) -> str:
        """The checkpoints' folder as a URI a person can paste."""
        return self.root.uri_of(self.job, self.run_folder) if self.run_folder else self.uri

    def ray_paths(self) -> tuple[str, str]:
        """(storage_path, name) for Ray's RunConfig, so Ray's run folder is :attr:`run_path`."""
        return posixpath.dirname(self.run_path), posixpath.basename(self.run_path)

    @property
    def key(self) -> str:
        """This job's name in Ray's key-value store: its folder, hashed to a short fixed size."""
        return f"etrain/{self.job}-{hashlib.sha256(self.uri.encode()).hexdigest()[:16]}"


def job_home(spec: JobSpec) -> JobHome:
    path = spec.checkpoint.path
    if path.startswith("/"):
        folder = posixpath.dirname(posixpath.normpath(path))
        return JobHome(open_root(posixpath.dirname(folder)), posixpath.basename(folder), "")
    return JobHome(open_root(spec.checkpoint.storage_root), spec.name, spec.checkpoint.run_folder)
