"""The failure budget as `run_attempts` carries it out, over a fake trainer whose fit() fails as
Ray Train's does when a worker raises (a WorkerGroupError naming each failed rank's exception).
A real job that fails and resumes within its budget: tests/integration/test_training.py."""

from __future__ import annotations

import pytest
from ray.train.v2.api.exceptions import WorkerGroupError

from cluster.log_lines import lines_to
from trainers import launch
from trainers.config.loading import validate
from trainers.job_folder import job_home


class FakeTrainer:
    """Fails its first ``failures`` fits with a user's error on rank 0, then succeeds."""

    def __init__(self, log: list, failures: int):
        self.log, self.failures = log, failures

    def fit(self):
        self.log.append("fit")
        if len(self.log) <= self.failures:
            error = ValueError(f"user bug at forward call {len(self.log)}")
            raise WorkerGroupError(f"rank 0 failed: {error}", {0: error})  # Ray's message names each rank's error
        return type("Result", (), {"metrics": {"step": 20}, "checkpoint": None})()


def flaky_spec(root, max_failures: int):
    return validate({"name": "flaky", "checkpoint": {"storage_root": str(root)},
                     "fault_tolerance": {"max_failures": max_failures}})


def attempts(tmp_path, monkeypatch, max_failures: int, failures: int):
    spec = flaky_spec(tmp_path, max_failures)
    fits, previous, said = [], [], []

    def build_trainer(spec, home, runtime, data_uri, stop_at_step, run_id, previous_failure, *rest):
        previous.append(previous_failure)
        return FakeTrainer(fits, failures)

    monkeypatch.setattr(launch, "build_trainer", build_trainer)
    monkeypatch.setattr(launch, "node_liveness", lambda: {"node": True})
    runtime = launch.Runtime(use_gpu=False, backend="gloo", mixed_precision="no")
    with lines_to(said.append):
        result = launch.run_attempts(spec, job_home(spec), runtime, "", None, "run")
    return result, fits, previous, said


@pytest.mark.parametrize("max_failures", [0, 2])
def test_a_user_error_beyond_the_budget_gives_up_with_its_message(tmp_path, monkeypatch, max_failures):
    (metrics, checkpoint, error), fits, previous, said = attempts(tmp_path, monkeypatch, max_failures, failures=99)
    assert len(fits) == max_failures + 1, "one attempt, then one retry per allowed user failure"
    assert previous == [None] + ["user_error"] * max_failures, "each retry is told what failed before"
    assert metrics == {} and checkpoint is None and isinstance(error, WorkerGroupError)
    assert said[-1].startswith("[etrain] giving up after a user error: WorkerGroupError: rank 0 failed"), said
    assert f"(user errors {max_failures + 1}/{max_failures}, infrastructure 0)" in said[-1], said
    spec = flaky_spec(tmp_path, max_failures)
    summary = launch.make_summary(spec, job_home(spec), metrics, checkpoint, error, wall_time_s=1.0)
    assert summary["status"] == "failed" and f"user bug at forward call {len(fits)}" in summary["error"], summary


def test_a_job_that_gives_up_names_the_checkpoint_a_rerun_resumes_from(tmp_path, monkeypatch):
    """The budget is spent, but storage holds complete checkpoints: the summary says which one a
    re-run resumes from and the step and loss it holds (it said checkpoint_uri None, step None)."""
    import posixpath

    import pyarrow.fs as pafs

    from trainers import checkpoint_files as ckpt

    home = job_home(flaky_spec(tmp_path, 0))
    for step, loss in ((10, 0.7), (20, 0.5)):
        ckpt.write(pafs.LocalFileSystem(), posixpath.join(home.run_path, ckpt.dir_name(step)), {"step": step},
                   f"model_{step}.pt", {"step": step, "loss": loss})
    (metrics, checkpoint, error), fits, _, said = attempts(tmp_path, monkeypatch, max_failures=0, failures=99)
    assert isinstance(error, WorkerGroupError) and len(fits) == 1
    assert checkpoint == posixpath.join(home.run_path, ckpt.dir_name(20)), checkpoint
    summary = launch.make_summary(flaky_spec(tmp_path, 0), home, metrics, checkpoint, error, wall_time_s=1.0)
    assert summary["status"] == "failed" and summary["final_step"] == 20 and summary["final_loss"] == 0.5, summary
    assert summary["checkpoint_uri"] == posixpath.join(home.run_path, ckpt.dir_name(20)), summary


def test_an_unreadable_checkpoint_does_not_replace_the_failure_in_the_summary(tmp_path):
    """A manifest that is JSON but not a manifest (a hand edit, another tool): the summary goes
    without a checkpoint and says why, rather than raising in place of the job's failure."""
    import posixpath

    from trainers import checkpoint_files as ckpt

    home = job_home(flaky_spec(tmp_path, 0))
    home.root.fs.create_dir(posixpath.join(home.run_path, ckpt.dir_name(30)))
    with home.root.fs.open_output_stream(posixpath.join(home.run_path, ckpt.dir_name(30), ckpt.MANIFEST)) as f:
        f.write(b"[1, 2]")
    said: list[str] = []
    with lines_to(said.append):
        assert launch.resume_point(home) == ({}, None)
    listed = ckpt.list_checkpoints(home.root.fs, home.run_path)
    assert [(c["step"], c["complete"]) for c in listed] == [(30, False)]  # a damaged manifest: not complete
    with home.root.fs.open_output_stream(posixpath.join(home.run_path, ckpt.dir_name(30), ckpt.MANIFEST)) as f:
        f.write(b'{"state_file": "s.pt", "files": {"s.pt": {"size": "big"}}, "metrics": [1]}')
    listed = ckpt.list_checkpoints(home.root.fs, home.run_path)  # what the service lists: no crash
    assert (listed[0]["size_bytes"], listed[0]["metrics"]) == (0, {})


def test_a_user_error_within_the_budget_is_retried_and_the_job_goes_on(tmp_path, monkeypatch):
    (metrics, _, error), fits, previous, said = attempts(tmp_path, monkeypatch, max_failures=1, failures=1)
    assert error is None and metrics == {"step": 20} and len(fits) == 2
    assert previous == [None, "user_error"]
    assert any("attempt failed: user error (rank 0 failed: user bug at forward call 1)" in line for line in said), said


class GrowThenLoseTrainer:
    """An elastic fit as Ray Train v2 runs it: a node joins mid-fit and the group grows onto it (a
    restart inside the same fit), then that node dies; the surviving rank fails in gloo first."""

    def __init__(self, nodes: dict, log: list):
        self.nodes, self.log = nodes, log

    def fit(self):
        self.log.append("fit")
        if len(self.log) > 1:
            return type("Result", (), {"metrics": {"step": 20}, "checkpoint": None})()
        self.nodes["joined"] = False  # joined after the fit began, the group grew onto it, and it died
        error = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                             "[127.0.0.1]:41234")
        raise WorkerGroupError(f"rank 0 failed: {error}", {0: error})


def test_a_node_that_joined_during_the_fit_and_died_is_a_node_loss_not_a_user_error(tmp_path, monkeypatch):
    nodes = {"head": True, "first": True}
    fits, said = [], []
    monkeypatch.setattr(launch, "build_trainer", lambda *a, **k: GrowThenLoseTrainer(nodes, fits))
    monkeypatch.setattr(launch, "node_liveness", lambda: dict(nodes))  # Ray lists a dead node as not alive
    monkeypatch.setattr(launch, "settle_cluster_view", lambda error: None)  # it asks Ray
    monkeypatch.setattr(launch, "PEER_LOSS_WAIT_S", 0.2)
    spec = flaky_spec(tmp_path, max_failures=0)
    runtime = launch.Runtime(use_gpu=False, backend="gloo", mixed_precision="no")
    with lines_to(said.append):
        metrics, _, error = launch.run_attempts(spec, job_home(spec), runtime, "", None, "run")
    assert error is None and metrics == {"step": 20} and len(fits) == 2, said
    assert any("attempt failed: node lost" in line for line in said), said
