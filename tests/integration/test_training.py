"""The training job end to end on a real local Ray with real gloo DDP workers."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import boto3
import pytest
import torch

from cluster.leftovers import writing_into
from cluster.storage import open_root
from trainers import checkpoint_files as ckpt
from trainers.config.loading import validate
from trainers.launch import EXIT_FAILED, EXIT_OK, EXIT_STOPPED, run_job

pytestmark = pytest.mark.ray
REPO = Path(__file__).resolve().parents[2]


def final_state(summary: dict) -> dict:
    root = open_root(summary["storage"])
    path = summary["checkpoint_uri"].removeprefix("s3://")
    return ckpt.load_state(root.fs, path)


# A model (on the blobs) that waits 10 ms a step (a step's compute, without the CPU): a job that
# runs until the test stops it leaves the machine to the rest of the suite meanwhile.
WAITING = {"model": {"factory": "slowpkg:busy_model", "options": {"compute_s": 0.01}},
           "data": {"factory": "userpkg:make_data"}}


def digits_spec(root, name, dropout=0.1, waiting: bool = False, **training):
    return validate({
        "name": name,
        "training": {"batch_size": 64, "learning_rate": 0.01, "max_steps": 12, **training},
        "distributed": {"num_workers": 2},
        "checkpoint": {"interval": 4, "storage_root": str(root)},
        "model": {"hidden_size": 32, "dropout": dropout},
        **(WAITING if waiting else {}),
    })


def raylets_under(folder: Path) -> list[str]:
    """Raylets whose session lives under ``folder`` (a raylet's command line names its session
    folder): those a command with RAY_TMPDIR there started, not another Ray's on the machine."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines()
            if line.split()[1].endswith("/raylet") and f"={folder}/" in line]


def test_guide_template_trains_from_the_command_line(ray_local, tmp_path):
    """The guide's template as is (only max_steps set): its checkpoints and summary land in the
    absolute directory it names. /checkpoints is this test's own folder, bind-mounted there in
    a private mount namespace, as a shared volume would be on a cluster. Another Ray (the
    test's) runs on the machine: the local Ray the command starts keeps to itself."""
    volume, root = tmp_path / "volume", tmp_path / "root"
    volume.mkdir()
    os.makedirs("/checkpoints", exist_ok=True)  # the mount point (the namespace's mount hides what is in it)
    # A laptop where a `ray start` was killed: its address record names a dead cluster.
    ray_temp = Path(tempfile.mkdtemp(prefix="etr-", dir="/tmp"))  # short: Ray's socket paths must fit
    (ray_temp / "ray").mkdir()
    stale = ray_temp / "ray" / "ray_current_cluster"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        stale.write_text(f"127.0.0.1:{s.getsockname()[1]}")
    env = {**os.environ, "PYTHONPATH": str(REPO), "ETRAIN_STORAGE_ROOT": str(root), "RAY_TMPDIR": str(ray_temp)}
    env.pop("RAY_ADDRESS", None)
    try:
        proc = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             'mount --bind "$0" /checkpoints && exec "$1" -m trainers.train configs/deployment-guide.json '
             '--set training.max_steps=6', str(volume), sys.executable],
            capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
        stale_left = stale.exists()
        confused = [str(f) for f in ray_temp.glob("ray/session_*/logs/*") if f.is_file()
                    and "Found multiple active Ray instances" in f.read_text(errors="replace")]
        sessions = [s for s in ray_temp.glob("ray/session_*") if not s.is_symlink() and (s / "logs").is_dir()]
        left_running = raylets_under(ray_temp) + [f"pid {pid}" for s in sessions for pid in writing_into(s)]
    finally:
        shutil.rmtree(ray_temp, ignore_errors=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert not stale_left, "the record of the dead cluster is removed (Ray's own lookups would use it)"
    assert confused == [], "Ray's own lookups in the local Ray (the placement-group cleaner) found two clusters"
    assert "falling back to gloo" in out and "handled by Ray's rendezvous" in out
    assert "storage /checkpoints, checkpoints /checkpoints," in out, "the first lines say where checkpoints go"
    assert "[etrain] step 6/6" in out
    summary = json.loads((volume / "summary.json").read_text())
    for key in ("name", "final_step", "target_step", "global_batch_size", "world_size", "samples_per_s",
                "final_loss", "checkpoint_uri", "interruptions"):
        assert key in summary
    assert summary["final_step"] == summary["target_step"] == 6
    assert summary["global_batch_size"] == 256 and summary["world_size"] == 2
    assert isinstance(summary["interruptions"], list)
    assert summary["checkpoint_uri"] == "/checkpoints/checkpoint_000000006"
    assert (volume / "checkpoint_000000006" / "model_6.pt").exists()
    assert (volume / "checkpoint_000000006" / "manifest.json").exists()
    assert not (root / "deployment-guide").exists(), "nothing of the job under the storage root"
    assert len(sessions) == 1, sessions
    assert left_running == [], "the command must stop the Ray it started, and every worker of it"


@pytest.fixture(scope="module")
def unbroken(ray_local, tmp_path_factory) -> tuple[Path, str, int, dict]:
    """The digits job run once to its target, never stopped: synchronous uploads (so every interval
    is taken: an async one is skipped while the last is in flight), the newest two checkpoints kept
    plus the best by loss. It is both the learning run and the bit-exact resume's reference.
    Its name is unique: TensorBoard's events hold the spec, and so the name a leak is found by."""
    import uuid

    root, name = tmp_path_factory.mktemp("unbroken"), f"unbroken-{uuid.uuid4().hex[:8]}"
    spec = digits_spec(root, name, max_steps=40)
    spec.checkpoint.min_interval_s = 0
    spec.checkpoint.upload = "sync"
    spec.checkpoint.num_to_keep = 2
    spec.checkpoint.keep_best_metric = "loss"
    return (root, name, *run_job(spec))


def test_two_workers_learn_digits_and_stay_in_sync(unbroken):
    root, name, code, summary = unbroken
    assert code == EXIT_OK, summary
    kept = sorted(p.name for p in (root / name / "checkpoints").glob("checkpoint_0*"))
    assert kept[-2:] == ["checkpoint_000000036", "checkpoint_000000040"] and len(kept) <= 3, kept
    state = final_state(summary)
    assert state["metrics"]["params_in_sync"] is True
    # On CPU every thread of a rank runs SCHED_BATCH (cluster/ray_adapter/train_worker.py: batch_schedule_worker),
    # which only works while Ray Train runs the loop beside Ray's main thread, not on it.
    assert state["scheduling"] == "SCHED_BATCH, every thread"
    assert summary["world_size"] == 2 and summary["final_step"] == 40
    assert summary["final_loss"] < 0.5 * math.log(10), summary


def test_a_run_starts_no_preemption_watcher_actor(unbroken, ray_local):
    """Ray Train's preemption watcher runs in the controller (cluster/ray_adapter/train_callbacks.py), not as an
    actor of its own at every start: none of this Ray's actors, dead or alive, is one."""
    from ray._private.worker import get_dashboard_url
    from ray.util.state import list_actors

    assert unbroken[2] == EXIT_OK
    # This Ray's own state API: with other Rays on the machine, list_actors() cannot pick one by itself.
    actors = list_actors(address=f"http://{get_dashboard_url()}", limit=10_000, detail=False)
    assert {"TrainController", "RayTrainWorker"} <= {a.class_name for a in actors}, "the state API lists the runs' actors"
    assert not [a for a in actors if a.class_name == "PreemptionWatcher"]


def test_two_workers_learn_text_with_dynamic_batching(ray_local, tmp_path):
    spec = validate({
        "name": "lm", "training": {"batch_size": 16, "learning_rate": 3e-3, "max_steps": 30, "mixed_precision": "bf16",
                                   "gradient_checkpointing": True, "grad_clip_norm": 1.0, "log_interval_steps": 5},
        "distributed": {"num_workers": 2}, "checkpoint": {"interval": 15, "storage_root": str(tmp_path)},
        "model": {"name": "tiny_gpt", "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 128},
        "data": {"source": "builtin:text", "dynamic_batching": True, "max_tokens_per_batch": 512, "num_workers": 1},
    })
    code, summary = run_job(spec)
    assert code == EXIT_OK, summary
    from trainers.data import StepMicroBatches
    from trainers.rules import plan_for
    from trainers.workloads import resolve

    workload = resolve(spec)
    plan = plan_for(spec, workload.dataset(spec, workload.prepare(spec, open_root(str(tmp_path)))))
    rank0 = StepMicroBatches(plan, 0, 2, 8, 512)  # rank 0's micro-batches, by tokens
    assert final_state(summary)["metrics"]["grad_accum_steps"] == len(rank0.at(29))  # the last step's, as planned
    assert max(len(rank0.at(s)) for s in range(30)) > 1, "the budget split some steps into several micro-batches"
    assert all(int(plan.lengths[mb].max()) * len(mb) <= 512 for s in range(30) for mb in rank0.at(s))
    assert summary["final_loss"] < 0.75 * math.log(257), summary  # well under a uniform guess over bytes


def test_resume_is_bit_exact_and_retention_and_staging_never_break_it(unbroken, tmp_path, said):
    """The unbroken run (synchronous uploads, two checkpoints kept) and a run stopped at step 6 and
    resumed (asynchronous uploads, one checkpoint kept) end bit for bit alike, dropout included.
    Retention removed the checkpoint Ray's own run snapshot still names; rank 0 keeps no local copies."""
    from staging import leftover_staging

    root, name, code, whole = unbroken
    assert code == EXIT_OK, whole
    assert leftover_staging(name, root / name / "checkpoints") == []

    broken = digits_spec(tmp_path, "broken", max_steps=40)
    broken.checkpoint.num_to_keep = 1
    broken.checkpoint.min_interval_s = 0
    code, part = run_job(broken, stop_at_step=6)
    assert code == EXIT_STOPPED and part["final_step"] == 6 and part["status"] == "stopped"
    assert [p.name for p in (tmp_path / "broken" / "checkpoints").glob("checkpoint_0*")] == ["checkpoint_000000006"]
    code, rest = run_job(broken)  # Ray's own run snapshot still names checkpoint 4, which retention removed
    assert code == EXIT_OK and rest["final_step"] == 40, rest
    a, b = final_state(whole), final_state(rest)
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for pid, st in a["optimizer"]["state"].items():
        for field, tensor in st.items():
            assert torch.equal(tensor, b["optimizer"]["state"][pid][field]), (pid, field)
    code, again = run_job(broken)  # a finished job reports its summary again, starting nothing
    assert code == EXIT_OK and again["final_step"] == 40 and again["final_loss"] == rest["final_loss"], again
    assert any("is done: its newest verified checkpoint is at step 40" in line for line in said), said


def test_a_job_starts_from_another_jobs_weights_and_resumes_from_its_own(unbroken, tmp_path):
    """model.init_from naming the unbroken job's last checkpoint: the new job's first loss is the
    trained model's, not a random one's (about ln 10). Stopped and run again, it resumes from its
    own checkpoint and never reads the weights it started from: they are torn by then."""
    from trainers.history import read_history

    root, name, code, whole = unbroken
    assert code == EXIT_OK, whole
    pretrained = tmp_path / "pretrained" / ckpt.dir_name(40)
    shutil.copytree(root / name / "checkpoints" / ckpt.dir_name(40), pretrained)
    spec = digits_spec(tmp_path, "finetune", max_steps=4, log_interval_steps=1)
    spec.model.init_from = str(pretrained)
    spec.checkpoint.min_interval_s = 0
    code, part = run_job(spec, stop_at_step=2)
    assert code == EXIT_STOPPED and part["final_step"] == 2, part
    first = {r["step"]: r for r in read_history(open_root(str(tmp_path)), "finetune")}[1]["loss"]
    assert first < 0.5 * math.log(10), (first, whole["final_loss"])
    (pretrained / "model_40.pt").write_bytes(b"torn")
    code, rest = run_job(spec)
    assert code == EXIT_OK and rest["final_step"] == 4, rest
    rows = {r["step"]: r for r in read_history(open_root(str(tmp_path)), "finetune")}
    assert rows[3]["time"] > rows[2]["time"] and rows[4]["loss"] < 0.5 * math.log(10), rows
    # One worker (no DDP to broadcast): rank 0 alone loads them, from the first job's checkpoints folder
    alone = digits_spec(tmp_path, "alone", max_steps=1, log_interval_steps=1)
    alone.distributed.num_workers = 1
    alone.model.init_from = str(root / name / "checkpoints")
    code, one = run_job(alone)
    assert code == EXIT_OK and one["final_loss"] < 0.5 * math.log(10), one


@pytest.fixture(scope="module")
def on_s3(ray_local, s3_server) -> dict:
    """The digits job on S3 (no dropout: its masks follow (step, rank), and a rank holds other
    samples at another size) behind a proxy that fails the first PUT of checkpoint 4's model:
    stopped at step 6 on two workers, then resumed to its target on one. Serves the S3 test and
    the fewer-workers test, which each assert their part of it."""
    from faulty_proxy import FaultyProxy

    boto3.client("s3").create_bucket(Bucket="etrain-ckpts")
    spec = digits_spec("s3://etrain-ckpts/runs", "on-s3", dropout=0.0)
    proxy = FaultyProxy(s3_server, lambda method, path: method == "PUT" and path.endswith("/model_4.pt"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AWS_ENDPOINT_URL", proxy.url)  # the driver's filesystem, which Ray uploads with
        try:
            code, part = run_job(spec, stop_at_step=6)
        finally:
            proxy.close()
    # Checkpoint 4 now, before the resume's retention (the newest three) may remove it.
    _, problem_at_4 = ckpt.verify(open_root("s3://etrain-ckpts").fs,
                                  "etrain-ckpts/runs/on-s3/checkpoints/checkpoint_000000004")
    one = digits_spec("s3://etrain-ckpts/runs", "on-s3", dropout=0.0)
    one.distributed.num_workers = 1
    rest_code, rest = run_job(one)
    return {"code": code, "part": part, "proxy": proxy, "problem_at_4": problem_at_4, "rest_code": rest_code,
            "rest": rest}


def test_checkpoints_to_s3_survive_a_transient_upload_error_and_resume(on_s3):
    """The first PUT of checkpoint 4's model fails (a 503 from a proxy in front of the S3 server):
    the upload is retried and lands; the job stops at 6 and resumes from S3 to its target."""
    part, proxy = on_s3["part"], on_s3["proxy"]
    assert on_s3["code"] == EXIT_STOPPED, part
    assert proxy.failed == [("PUT", "/etrain-ckpts/runs/on-s3/checkpoints/checkpoint_000000004/model_4.pt")]
    assert ("PUT", proxy.failed[0][1], 200) in proxy.passed, "the failed upload was retried and went through"
    # The run was new: no folder was in storage at restore, so none is searched for an old
    # manifest (a HEAD) before its state goes up.
    first_touch: dict[str, tuple[str, str]] = {}
    for method, path, _ in proxy.passed:
        folder, name = path.rsplit("/", 1)
        if folder.startswith("/etrain-ckpts/runs/on-s3/checkpoints/") and ckpt.step_of(folder.rsplit("/", 1)[1]):
            first_touch.setdefault(folder, (method, name))
    assert len(first_touch) >= 2 and all(method == "PUT" and name.startswith("model_")
                                         for method, name in first_touch.values()), first_touch
    assert on_s3["problem_at_4"] is None
    assert part["checkpoint_uri"].startswith("s3://etrain-ckpts/runs/on-s3/checkpoints/checkpoint_000000006")
    rest = on_s3["rest"]
    assert on_s3["rest_code"] == EXIT_OK and rest["final_step"] == 12, rest
    keys = {o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket="etrain-ckpts")["Contents"]}
    assert "runs/on-s3/checkpoints/checkpoint_000000012/manifest.json" in keys
    assert "runs/on-s3/summary.json" in keys
    assert final_state(rest)["step"] == 12


def test_resume_on_fewer_workers_keeps_step_and_global_batch(on_s3, tmp_path):
    """The S3 job, stopped at 6 on two workers and resumed on one, ends where an unbroken run on
    two workers ends: same samples, same global batch; only float summation order differs."""
    from trainers.history import read_history

    code, whole = run_job(digits_spec(tmp_path, "two", dropout=0.0))
    assert code == EXIT_OK, whole
    assert on_s3["code"] == EXIT_STOPPED, on_s3["part"]
    code, rest = on_s3["rest_code"], on_s3["rest"]
    assert code == EXIT_OK, rest
    assert rest["final_step"] == 12 and rest["world_size"] == 1 and rest["global_batch_size"] == 64
    a, b = final_state(whole), final_state(rest)
    rows = {r["step"]: r for r in read_history(open_root("s3://etrain-ckpts/runs"), "on-s3")}
    assert rows[4]["time"] < rows[6]["time"] < rows[8]["time"] and rows[6]["world_size"] == 2
    assert rows[8]["world_size"] == 1, "steps after 6 ran at one worker: the resume did not start over"
    for key in a["model"]:
        assert torch.allclose(a["model"][key], b["model"][key], atol=1e-5), key


def flaky_spec(root, name, marker, max_failures):
    return validate({
        "name": name, "training": {"batch_size": 30, "learning_rate": 0.05, "max_steps": 20, "log_interval_steps": 5},
        # Checkpoints at 5 (the first: reported) and 10 (written, and reported only with a later one),
        # each complete before the next step (sync), then the failure at step 12.
        "checkpoint": {"interval": 5, "min_interval_s": 0, "report_interval_s": 3600, "upload": "sync",
                       "storage_root": str(root)},
        "fault_tolerance": {"max_failures": max_failures},
        "cost": {"prices_per_hour": {"local": {"on_demand": 3600.0}}},  # a dollar per node-second
        "model": {"factory": "userpkg:flaky_model", "options": {"marker": str(marker), "fail_at": 12}},
        "data": {"factory": "userpkg:make_data"},
    })


@pytest.fixture(scope="module")
def flaky(ray_local, tmp_path_factory) -> tuple[Path, int, dict]:
    """A job of the user's own model and data factories (the model with options) whose model
    raises once, at its 12th forward, with one user failure allowed: it fails, resumes from a
    checkpoint Ray was never told of and trains to its target. The factories test and the budget
    test read it."""
    root = tmp_path_factory.mktemp("flaky")
    return (root, *run_job(flaky_spec(root, "flaky", root / "marker", max_failures=1)))


def test_user_factories_and_user_loop(flaky, tmp_path):
    _, code, summary = flaky
    assert code == EXIT_OK, summary
    assert summary["final_loss"] < 0.5 * math.log(3), f"the user's model and data factories trained: {summary}"
    spec = validate({"name": "own-loop", "train_loop": "userpkg:own_loop",
                     "checkpoint": {"storage_root": str(tmp_path)}})
    code, summary = run_job(spec)
    assert code == EXIT_OK, summary
    assert Path(summary["checkpoint_uri"], "done.txt").read_text() == "own-loop"
    # Ray starts its workers at nice 15, where every wake-up of its daemons preempts a rank and
    # stalls DDP's lockstep (cluster.ray_adapter.train_worker.WORKER_ENV): training workers run at nice 0.
    assert Path(summary["checkpoint_uri"], "nice.txt").read_text() == "0"


def test_user_error_uses_the_budget_and_resumes_from_checkpoint(flaky):
    from trainers.history import read_history

    root, code, summary = flaky
    assert code == EXIT_OK, summary
    (record,) = summary["interruptions"]
    assert record["cause"] == "user error"
    # From checkpoint 10, written but not yet reported to Ray: restores go by what storage holds.
    assert record["restored_step"] == 10 and record["steps_lost"] <= 2, record
    # The row logged at step 10 was flushed by no report: checkpoint 10 carried it to the next attempt.
    assert [row["step"] for row in read_history(open_root(str(root)), "flaky")] == [5, 10, 15, 20]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / "flaky" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    # Each once across the attempts, and none hidden: the first attempt logged nothing past its
    # checkpoint (the unit tests drive that case), but its step 5 must outlive the second's purge.
    assert [e.step for e in events.Scalars("train/loss")] == [5, 10, 15, 20]
    stored = json.loads((root / "flaky" / "interruptions.json").read_text())
    assert stored[-1]["run_id"] == record["run_id"]
    # Every paid second is billed: the attempts and the recovery between them, without a gap, at
    # a dollar per node-second from the first attempt's start to the second's end.
    first, second = json.loads((root / "flaky" / "cost.json").read_text())
    assert first["end"] >= record["interrupted_at"] == second["start"], (first, second, record)
    assert summary["cost_usd"] >= record["recovery_s"], (summary["cost_usd"], record)
    (node_kind,) = {tuple(n[:2]) for seg in (first, second) for n in seg["nodes"]}
    nodes = second["nodes"][0][2]
    assert first["nodes"] == second["nodes"] and node_kind == ("local", "on_demand"), (first, second)
    billed = nodes * sum(seg["end"] - seg["start"] for seg in (first, second))  # what the record charges
    assert nodes * (second["end"] - first["start"]) - 2 * nodes <= summary["cost_usd"] <= billed + 1e-6, \
        (summary["cost_usd"], first, second)  # the whole span, up to the final flush after the summary's figure


def test_a_script_importing_only_the_adapter_starts_its_local_ray_on_loopback(tmp_path):
    """A fresh process that imports ray before anything sets Ray's loopback switch (only
    `import trainers` did): its local Ray must still be on 127.0.0.1, not the machine's address.
    It starts no idle workers that nothing would use (Ray prestarts them unless told not to)."""
    ray_tmp = tempfile.mkdtemp(prefix="etr-")  # short: Ray's socket paths live under it (108 bytes at most)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    env.update(PYTHONPATH=str(REPO), RAY_TMPDIR=ray_tmp)
    script = ("import ray\nfrom cluster.ray_adapter.local import init_local_ray\n"
              "print('address', init_local_ray(num_cpus=1, include_dashboard=False, configure_logging=False))\n"
              "print('node', ray.util.get_node_ip_address())\n"
              "import time, psutil\ntime.sleep(3)\n"  # prestarted workers are up within a second of the start
              "raylet = [p for p in psutil.Process().children(recursive=True) if p.name() == 'raylet']\n"
              "print('idle', len([w for p in raylet for w in p.children() if w.cmdline()[:1] == ['ray::IDLE']]))\n"
              "ray.shutdown()\n")
    try:
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180,
                             cwd=tmp_path)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    said = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("address ", "node ", "idle ")))
    assert said["address"].startswith("127.0.0.1:") and said["node"] == "127.0.0.1", out.stdout
    assert said["idle"] == "0", "no idle workers prestarted"


def test_doctor_finds_the_running_cluster(ray_local, tmp_path):
    address = ray_local.get_runtime_context().gcs_address
    ok = subprocess.run([sys.executable, "-m", "trainers.cli", "doctor", "--address", address,
                         "--storage-root", str(tmp_path)], capture_output=True, text=True, cwd=REPO, timeout=180)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "Ray cluster reachable: 1 node(s)" in ok.stdout and "every node runs ray 2.60.0" in ok.stdout
    assert "[warn] no GPU visible" in ok.stdout
    assert f"storage root {tmp_path} is writable" in ok.stdout, "the root given is the root probed"
    # An unwritable root's finding and exit code: tests/unit/test_doctor_cli.py (no cluster needed).


def test_a_stop_request_stops_its_job_only_with_a_checkpoint_and_a_stale_one_is_cleared(ray_local, tmp_path):
    """Two jobs of one name in two storage roots: stopping one leaves the other training. The
    stopped one ends with a checkpoint at its stop step. The other starts with a stop request
    already made (as a rerun after a stop does): it clears it at start and trains on."""
    import threading

    from waiting import wait_for

    from trainers.history import read_history
    from trainers.job_folder import job_home
    from trainers.recovery import StopFlag

    specs = [digits_spec(tmp_path / root, "twin", waiting=True, max_steps=1_000_000) for root in ("a", "b")]
    specs[1].distributed.num_workers = 1  # a keeps 2 workers: its stop is a vote across ranks
    results = [{}, {}]
    runners = [threading.Thread(target=lambda s=s, r=r: r.update(zip(("code", "summary"), run_job(s))))
               for s, r in zip(specs, results)]

    def steps(root: str) -> list[int]:
        return sorted(ckpt.step_of(p.parent.name) for p in (tmp_path / root / "twin" / "checkpoints").glob(
            "checkpoint_*/manifest.json"))

    try:
        runners[0].start()
        wait_for(lambda: steps("a"), 180, "a first checkpoint of twin in a")
        StopFlag(job_home(specs[1]).key).request()  # stale: b must clear it at start, and it is not a's
        runners[1].start()  # b starts (and clears its own stop key) while a runs
        wait_for(lambda: steps("b"), 180, "a first checkpoint of twin in b")
        StopFlag(job_home(specs[0]).key).request()
        runners[0].join(180)
        assert results[0]["code"] == EXIT_STOPPED, results[0]
        at_a_stop = steps("b")[-1]
        wait_for(lambda: steps("b")[-1] > at_a_stop, 60,
                 "twin in b to train on after a's stop (stopped by a's request, or by its stale one)")
        assert runners[1].is_alive(), results[1]
    finally:
        for spec in specs:
            StopFlag(job_home(spec).key).request()
        for runner in runners:
            runner.join(180)
    assert results[1]["code"] == EXIT_STOPPED and results[1]["summary"]["final_step"] > at_a_stop, results[1]

    summary = results[0]["summary"]
    stopped_at = summary["final_step"]
    assert summary["status"] == "stopped" and 0 < stopped_at  # the vote rides every all-reduce: any step
    assert summary["checkpoint_uri"].endswith(ckpt.dir_name(stopped_at))  # the final checkpoint is the stop's
    rows = read_history(open_root(str(tmp_path / "a")), "twin")
    history = [r["step"] for r in rows]
    assert history == sorted(history) and history[-1] == stopped_at and {"loss", "samples_per_s", "time"} <= set(rows[-1])


def oom_spec(root, name, micro, limit=16):
    return validate({"fault_tolerance": {"max_failures": 0},
        "name": name, "training": {"batch_size": 128, "learning_rate": 0.05, "max_steps": 6, "micro_batch_size": micro},
        "distributed": {"num_workers": 2}, "checkpoint": {"interval": 3, "min_interval_s": 0, "storage_root": str(root)},
        "model": {"factory": "userpkg:memory_bound_model", "options": {"limit": limit}},
        "data": {"factory": "userpkg:make_data", "options": {"n": 600}},
    })


def test_out_of_memory_halves_the_micro_batch_and_keeps_the_result(ray_local, tmp_path):
    """A model that fails above micro-batch 16: 'auto' (64 per worker) heals to 16 on every rank
    and ends where a run set to 16 from the start ends; the summary says so. A set micro-batch
    heals the same way once its first step fails (the vote: test_trainer_decisions)."""
    names = {16: "fits", "auto": "healed-auto"}
    (code, fits), *healed_runs = [run_job(oom_spec(tmp_path / names[m], names[m], m)) for m in names]
    assert code == EXIT_OK, fits
    assert fits["micro_batch_size"] == 16 and fits["micro_batch_reductions"] == 0
    for code, healed in healed_runs:
        assert code == EXIT_OK, healed
        assert healed["micro_batch_size"] == 16 and healed["micro_batch_reductions"] == 2, healed
        a, b = final_state(fits), final_state(healed)
        assert b["batching"]["reductions"] == [{"step": 0, "from": 64, "to": 32}, {"step": 0, "from": 32, "to": 16}]
        for key in a["model"]:
            torch.testing.assert_close(a["model"][key], b["model"][key], rtol=1e-5, atol=1e-6)


def test_out_of_memory_at_micro_batch_one_names_model_size_and_memory(ray_local, tmp_path):
    """A user error beyond the budget (max_failures 0) on a real run: the job fails with its message."""
    code, summary = run_job(oom_spec(tmp_path, "never-fits", "auto", limit=0))
    assert code == EXIT_FAILED and summary["status"] == "failed", summary
    assert "out of memory at micro-batch 1" in summary["error"] and "parameters" in summary["error"], summary
    assert "GiB of memory" in summary["error"], summary


def test_a_controller_killed_while_its_driver_lives_leaves_no_placement_group(ray_local, tmp_path):
    """Ray Train's placement-group cleaner actor is replaced (cluster/ray_adapter/train_callbacks.py:
    PlacementGroupRecorder): a controller that dies while its driver lives (killed, out of memory) must
    still not leave its workers' CPUs reserved, or the driver's next attempt waits for them until its
    start timeout."""
    import signal
    import threading

    from ray.train import RunConfig, ScalingConfig
    from ray.util.placement_group import placement_group_table
    from ray.util.state import list_actors
    from waiting import wait_for

    from cluster.ray_adapter import train_torch

    def live_groups() -> set[str]:
        return {pg_id for pg_id, pg in placement_group_table().items() if pg["state"] != "REMOVED"}

    def sleeping_loop(config: dict) -> None:  # nested: pickled by value (Ray's workers cannot import this module)
        import pathlib
        import time

        pathlib.Path(config["marker"]).touch()
        time.sleep(600)

    before, marker, seen = live_groups(), tmp_path / "started", {}
    trainer = train_torch.torch_trainer(
        sleeping_loop, train_loop_config={"marker": str(marker)}, scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path / "ray"), name="killed-controller"))

    def kill_the_controller() -> None:
        wait_for(marker.exists, 120, "the workers to start")
        seen["during"] = live_groups() - before
        (controller,) = list_actors(filters=[("class_name", "=", "TrainController"), ("state", "=", "ALIVE")])
        seen["torch in the controller"] = "libtorch" in Path(f"/proc/{controller.pid}/maps").read_text()
        os.kill(controller.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_the_controller)
    killer.start()
    with pytest.raises(Exception, match="(?i)died|dead|actor"):
        trainer.fit()
    killer.join()
    assert len(seen["during"]) == 1, "the run held one placement group for its workers"
    assert not seen["torch in the controller"], "the controller imported torch (~1.6 CPU-s): see train_torch.torch_config"
    wait_for(lambda: not (live_groups() - before), 10, f"the dead controller's placement group {seen['during']} to go")
