"""The checkpoint writer (trainers/checkpoint_writer.py): what a snapshot copies, a checkpoint in place
before Ray hears of it, reports between intervals, retries on transient storage errors, failures
raised where they cost nothing, and the thread's CPU policy as the writer drives it."""

from __future__ import annotations

import pytest
import torch

from trainers.checkpoint_writer import to_cpu
from trainers.config.loading import validate


def test_a_snapshot_does_not_follow_the_live_state():
    live = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(live.parameters())
    live(torch.ones(1, 3)).sum().backward()
    opt.step()
    snap = to_cpu({"model": live.state_dict(), "optimizer": opt.state_dict(), "step": 4, "names": ["a", ("b", 1)]})
    before = snap["model"]["weight"].clone()
    with torch.no_grad():
        live.weight.add_(1.0)
    opt.step()
    assert torch.equal(snap["model"]["weight"], before)
    assert snap["step"] == 4 and snap["names"] == ["a", ("b", 1)]
    exp_avg = snap["optimizer"]["state"][0]["exp_avg"]
    assert exp_avg.data_ptr() != opt.state[live.weight]["exp_avg"].data_ptr()


def settling_checkpointer(work):
    """A rank-0 Checkpointer whose checkpoint in flight is ``work`` (run on its own thread)."""
    from trainers.checkpoint_writer import Checkpointer

    spec = validate({"name": "settle", "checkpoint": {"interval": 5}})
    c = Checkpointer(spec, None, "run", 0, 1, torch.device("cpu"), lambda step, jit: None)
    c._pending = c._thread.submit(work)
    return c


def test_a_failed_attempt_lets_the_checkpoint_in_flight_finish_its_report():
    """A failure a few steps after an interval checkpoint: that checkpoint's report still lands,
    so the retry resumes from it (close() alone would leave it to be torn down mid-report)."""
    import threading
    import time

    reported = threading.Event()
    c = settling_checkpointer(lambda: (time.sleep(0.3), reported.set()))
    c.settle(timeout_s=10)
    assert reported.is_set()
    c.close()


def test_settling_logs_a_failed_or_stuck_checkpoint_and_does_not_hang(caplog):
    import threading

    def failing():
        raise OSError("503 SlowDown")

    c = settling_checkpointer(failing)
    with caplog.at_level("WARNING"):
        c.settle(timeout_s=10)  # the attempt's own error is what goes on: this one is only a note
    assert "did not finish: OSError: 503 SlowDown" in caplog.text
    release = threading.Event()
    c = settling_checkpointer(release.wait)  # a report whose barrier a lost rank never joins
    with caplog.at_level("WARNING"):
        c.settle(timeout_s=0.3)
    assert "did not finish: TimeoutError" in caplog.text
    release.set()
    c.close()


LINUX_ONLY = pytest.mark.skipif(not hasattr(__import__("os"), "SCHED_IDLE"), reason="scheduling policies are Linux's")


def writing_checkpointer(monkeypatch, tmp_path, report, after=lambda step, jit: None, yield_cpu=True, folders_found=None,
                         **checkpoint):
    """A rank-0, world-1 Checkpointer on local storage whose ``ray.train.report`` is ``report``."""
    import pyarrow.fs as pafs
    import ray.train

    from cluster.ray_adapter import train_worker
    from cluster.storage import open_root
    from trainers.checkpoint_writer import Checkpointer

    monkeypatch.setattr(ray.train, "report", report)
    monkeypatch.setattr(train_worker, "run_storage_filesystem", lambda: pafs.LocalFileSystem())
    root = open_root(str(tmp_path))
    spec = validate({"name": "writes", "checkpoint": {"interval": 5, "storage_root": str(tmp_path), **checkpoint}})
    return Checkpointer(spec, root, root.path("writes", "checkpoints"), 0, 1, torch.device("cpu"), after,
                        yield_cpu=yield_cpu, folders_found=folders_found)


def test_a_checkpoint_is_in_place_before_ray_hears_of_it_and_ray_is_told_to_keep_it(monkeypatch, tmp_path):
    """Background: Ray's ASYNC report with nothing to upload and, above all, nothing to delete
    (its ASYNC default deletes the folder once 'uploaded'). Just-in-time: NO_UPLOAD."""
    import pyarrow.fs as pafs

    from trainers import checkpoint_files as ckpt
    from trainers.checkpoint_writer import already_there
    from trainers.rules import Kind

    reports = []

    def report(metrics, checkpoint=None, **kwargs):
        verified, problem = ckpt.verify(pafs.LocalFileSystem(), checkpoint.path)
        reports.append((checkpoint.path, problem, kwargs))

    c = writing_checkpointer(monkeypatch, tmp_path, report)
    c.save(5, Kind.INTERVAL, lambda: {"step": 5, "w": torch.ones(3)}, {"loss": 1.0})
    c.wait()
    c.save(7, Kind.JIT, lambda: {"step": 7, "w": torch.ones(3)}, {"loss": 0.5})
    c.close()
    folder = tmp_path / "writes" / "checkpoints"
    assert [(path, problem) for path, problem, _ in reports] == [
        (str(folder / ckpt.dir_name(5)), None), (str(folder / ckpt.dir_name(7)), None)]
    background, jit = reports[0][2], reports[1][2]
    assert background["checkpoint_upload_mode"].name == "ASYNC" and background["checkpoint_upload_fn"] is already_there
    assert background["delete_local_checkpoint_after_upload"] is False
    assert jit["checkpoint_upload_mode"].name == "NO_UPLOAD"


def test_a_checkpoint_before_a_resize_is_complete_when_save_returns_and_ray_is_not_told(monkeypatch, tmp_path):
    """The controller waits for it in its resize hook and takes reports only between its polls, so
    a report could wait for a controller that waits for it: it is written on the training thread,
    after the interval checkpoint in flight, answered once written, and left for the restart's
    restore to find in storage."""
    import pyarrow.fs as pafs

    from trainers import checkpoint_files as ckpt
    from trainers.rules import Kind

    reports, written = [], []
    c = writing_checkpointer(monkeypatch, tmp_path, lambda metrics, checkpoint=None, **kw: reports.append(checkpoint),
                             after=lambda step, jit: written.append((step, jit)))
    c.save(5, Kind.INTERVAL, lambda: {"step": 5, "w": torch.ones(3)}, {"loss": 1.0}, flush=lambda: lambda: None)
    folder = tmp_path / "writes" / "checkpoints"
    answered = []
    c.save(7, Kind.RESIZE, lambda: {"step": 7, "w": torch.full((3,), 2.0)}, {"loss": 0.5},
           written=lambda step: answered.append((step, ckpt.verify(pafs.LocalFileSystem(),
                                                                   str(folder / ckpt.dir_name(step)))[1])))
    assert answered == [(7, None)], "answered once, with the files complete"
    assert written == [(5, False), (7, False)]  # in order: the one in flight first
    assert [r.path for r in reports] == [str(folder / ckpt.dir_name(5))], "the resize's is not reported"
    assert c._pending is None
    c.close()
    assert ckpt.load_state(pafs.LocalFileSystem(), str(folder / ckpt.dir_name(7)))["w"].tolist() == [2.0] * 3


def test_a_just_in_time_checkpoint_that_answers_a_resize_answers_before_ray_hears_of_it(monkeypatch, tmp_path):
    """A spot notice and a resize at one sync step: the step's checkpoint answers the resize, before
    its report to Ray, which would wait for the controller that waits for the answer."""
    from trainers.rules import Kind

    events = []
    c = writing_checkpointer(monkeypatch, tmp_path, lambda metrics, checkpoint=None, **kw: events.append("report"))
    c.save(9, Kind.JIT, lambda: {"step": 9}, {"loss": 1.0}, written=lambda step: events.append(("written", step)))
    c.close()
    assert events == [("written", 9), "report"]


def test_checkpoints_between_reports_are_written_and_beat_but_not_reported_pruned_or_flushed(monkeypatch, tmp_path):
    """Every interval checkpoint is complete in storage (a restart restores it by listing); Ray's
    record, retention and the observer's flush wait for the report interval, and a final
    checkpoint catches them all up."""
    import pyarrow.fs as pafs

    from trainers import checkpoint_files as ckpt
    from trainers import checkpoint_writer as checkpointer
    from trainers.rules import Kind

    clock = [1000.0]
    monkeypatch.setattr(checkpointer.time, "monotonic", lambda: clock[0])
    reports, flushes, beats = [], [], []
    c = writing_checkpointer(monkeypatch, tmp_path, lambda metrics, checkpoint=None, **kw: reports.append(metrics["n"]),
                             after=lambda step, jit: beats.append(step), min_interval_s=0, report_interval_s=10,
                             num_to_keep=1)
    for done, advance_s in ((5, 0.0), (10, 3.0), (15, 3.0), (20, 5.0), (25, 1.0)):
        clock[0] += advance_s
        kind = c.kind(done, 30, preempted=False, stop_requested=False)
        assert kind is Kind.INTERVAL, done
        c.save(done, kind, lambda d=done: flushes.append(("state", d)) or {"step": d}, {"n": done},
               flush=lambda d=done: flushes.append(d) or (lambda: flushes.append(("written", d))))
        c.wait()
    folder = tmp_path / "writes" / "checkpoints"
    on_disk = sorted(p.name for p in folder.glob("checkpoint_*"))
    # A reported checkpoint's state is built before the flush takes the rows: it carries them too,
    # as they are written only after the report (a crash in between loses none).
    assert reports == [5, 20] and flushes == [("state", 5), 5, ("written", 5), ("state", 10), ("state", 15),
                                              ("state", 20), 20, ("written", 20), ("state", 25)]
    assert beats == [5, 10, 15, 20, 25]
    assert on_disk == [ckpt.dir_name(20), ckpt.dir_name(25)], "retention ran at the report of 20 only"
    assert ckpt.verify(pafs.LocalFileSystem(), str(folder / ckpt.dir_name(25)))[1] is None
    assert ckpt.find_restore(pafs.LocalFileSystem(), str(folder))[0].step == 25
    c.save(30, c.kind(30, 30, preempted=False, stop_requested=False), lambda: {"step": 30}, {"n": 30})
    c.wait()
    c.close()
    assert reports == [5, 20, 30] and sorted(p.name for p in folder.glob("checkpoint_*")) == [ckpt.dir_name(30)]


@pytest.mark.parametrize("found, fresh", [
    (None, [False, False, False]),  # not listed: every write deletes an old manifest first
    (set(), [True, True, False]),  # a new run: only the folder it writes twice may hold one
    ({5}, [False, True, False]),  # 5 was in storage at restore
])
def test_only_a_folder_that_may_hold_a_manifest_is_cleared_before_a_write(monkeypatch, tmp_path, found, fresh):
    """The old-manifest delete costs a request a checkpoint on S3 (pyarrow's delete is a HEAD
    first): a folder that neither the restore listing nor this attempt had cannot hold one."""
    import pyarrow.fs as pafs

    from trainers import checkpoint_files as ckpt
    from trainers import checkpoint_writer as checkpointer
    from trainers.rules import Kind

    written, real_write = [], ckpt.write

    def spy(fs, path, state, file_name, metrics=None, fresh=False):
        written.append((ckpt.step_of(path.rsplit("/", 1)[-1]), fresh))
        return real_write(fs, path, state, file_name, metrics, fresh=fresh)

    folder = tmp_path / "writes" / "checkpoints"
    for step in found or ():  # in storage before the attempt: as the restore lists it
        real_write(pafs.LocalFileSystem(), str(folder / ckpt.dir_name(step)), {"step": step}, "m.pt")
    if found is not None:
        found = {path for _, path in ckpt.checkpoint_folders(pafs.LocalFileSystem(), str(folder))}
    monkeypatch.setattr(checkpointer.ckpt, "write", spy)
    c = writing_checkpointer(monkeypatch, tmp_path, lambda metrics, checkpoint=None, **kw: None, min_interval_s=0,
                             folders_found=found)
    for done, kind in ((5, Kind.INTERVAL), (10, Kind.INTERVAL), (10, Kind.JIT)):  # a notice at the step of 10
        c.save(done, kind, lambda d=done: {"step": d}, {"n": done})
        c.wait()
    c.close()
    assert written == list(zip((5, 10, 10), fresh))
    assert ckpt.find_restore(pafs.LocalFileSystem(), str(folder))[0].step == 10


def test_every_rank_follows_rank_zeros_word_on_reporting(monkeypatch, tmp_path):
    """The report is a barrier: a rank whose own clock says otherwise still reports exactly when
    rank 0 does (here rank 0 says: take it, do not report; this rank's clock says report)."""
    from trainers import checkpoint_writer as checkpointer
    from trainers.rules import Kind

    def rank_zero_says(tensor, src):
        assert src == 0
        tensor.copy_(torch.tensor([1.0, 0.0]))

    monkeypatch.setattr(checkpointer.dist, "broadcast", rank_zero_says)
    reports = []
    c = writing_checkpointer(monkeypatch, tmp_path, lambda metrics, checkpoint=None, **kw: reports.append(metrics),
                             min_interval_s=0, report_interval_s=0)
    c.rank, c.world = 1, 2
    kind = c.kind(5, 30, preempted=False, stop_requested=False)
    assert kind is Kind.INTERVAL
    c.save(5, kind, None, {})
    c.wait()
    c.close()
    assert reports == []


def test_a_failed_write_between_reports_is_raised_at_the_next_wait_without_a_report(monkeypatch, tmp_path):
    """No other rank waits in a barrier for a checkpoint that is not reported: the error goes
    straight to the training thread."""
    from trainers import checkpoint_writer as checkpointer

    reports = []
    c = writing_checkpointer(monkeypatch, tmp_path, lambda metrics, checkpoint=None, **kw: reports.append(checkpoint),
                             min_interval_s=0, report_interval_s=3600)
    c.save(5, c.kind(5, 30, False, False), lambda: {"step": 5}, {})
    c.wait()
    monkeypatch.setattr(checkpointer.ckpt, "write", lambda *a, **kw: (_ for _ in ()).throw(OSError("disk full")))
    c.save(10, c.kind(10, 30, False, False), lambda: {"step": 10}, {})
    with pytest.raises(OSError, match="disk full"):
        c.wait()
    c.close()
    assert len(reports) == 1


def test_a_failed_checkpoint_in_flight_does_not_cost_a_spot_notice_its_own(monkeypatch, tmp_path, caplog):
    from concurrent.futures import Future

    from trainers.rules import Kind

    reported = []
    c = writing_checkpointer(monkeypatch, tmp_path, lambda metrics, checkpoint=None, **kw: reported.append(checkpoint.path))
    failed: Future = Future()
    failed.set_exception(OSError("503 SlowDown"))
    c._pending = failed
    with caplog.at_level("WARNING"):
        c.save(9, Kind.JIT, lambda: {"step": 9}, {})
    c.close()
    assert "did not finish: OSError: 503 SlowDown" in caplog.text
    assert [p.rsplit("/", 1)[1] for p in reported] == ["checkpoint_000000009"]


def test_storage_failures_are_tried_three_times_then_raised(monkeypatch, caplog):
    from trainers import checkpoint_writer as checkpointer

    calls = []

    def flaky(*args, fresh):
        calls.append((*args, fresh))
        if len(calls) < 3:
            raise OSError("When uploading part: AWS Error SLOW_DOWN")
        return {"step": 1}

    monkeypatch.setattr(checkpointer.ckpt, "write", flaky)
    monkeypatch.setattr(checkpointer.time, "sleep", lambda s: None)
    with caplog.at_level("WARNING"):
        assert checkpointer.write_with_retries(None, "run/checkpoint_000000001", {}, "m.pt", {}, fresh=True) == {"step": 1}
    assert len(calls) == 3 and "checkpoint_000000001: writing failed" in caplog.text and "try 3 of 3" in caplog.text
    # a failed try may have left a manifest (its PUT landed, the answer did not): later tries clear it
    assert [fresh for *_, fresh in calls] == [True, False, False]
    calls.clear()

    def denied(*args, fresh):
        calls.append(args)
        raise OSError("When initiating multiple part upload: AWS Error ACCESS_DENIED")

    monkeypatch.setattr(checkpointer.ckpt, "write", denied)
    with pytest.raises(OSError, match="ACCESS_DENIED"):
        checkpointer.write_with_retries(None, "run/checkpoint_000000001", {}, "m.pt", {})
    assert len(calls) == 1  # not worth a retry: it would only cost a spot notice its time


def test_a_failed_write_still_joins_rays_report_barrier_then_raises(monkeypatch, tmp_path):
    """Only rank 0 writes; every other rank waits in the report's barrier. Raising before the
    report would leave them there and pair their next Ray collective with rank 0's next one."""
    from trainers import checkpoint_writer as checkpointer
    from trainers.rules import Kind

    reported = []
    c = writing_checkpointer(monkeypatch, tmp_path, lambda metrics, checkpoint=None, **kw: reported.append(checkpoint))
    monkeypatch.setattr(checkpointer.ckpt, "write", lambda *a, **kw: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        c.save(9, Kind.JIT, lambda: {"step": 9}, {})
    c.close()
    assert reported == [None]


def test_writes_happen_in_the_calling_thread():
    """pyarrow's background writes would hand each upload to its shared I/O threads."""
    import pyarrow.fs as pafs

    from trainers.checkpoint_writer import foreground

    s3 = pafs.S3FileSystem(endpoint_override="127.0.0.1:9", scheme="http", allow_delayed_open=True, request_timeout=15)
    options = foreground(s3).__reduce__()[1][0]
    assert options["background_writes"] is False and options["allow_delayed_open"] is True
    assert options["request_timeout"] == 15 and options["endpoint_override"] == "127.0.0.1:9"
    local = pafs.LocalFileSystem()
    assert foreground(local) is local


@LINUX_ONLY
def test_the_checkpoint_thread_yields_while_it_writes_and_reports_and_gets_its_policy_back(monkeypatch, tmp_path):
    """Never for the first checkpoint (threads it starts inherit the policy); from the second on,
    SCHED_IDLE while it writes, reports and beats, its own policy for retention and the observer's
    writes (which start threads), and its own policy once training waits for it."""
    import os
    import threading

    from trainers.checkpoint_thread import idle_is_reversible
    from trainers.rules import Kind

    if not idle_is_reversible():
        pytest.skip("this machine does not let a thread leave SCHED_IDLE: the refusal test covers it")
    seen, started, release = [], threading.Event(), threading.Event()

    def report(metrics, checkpoint=None, **kwargs):
        seen.append(("report", metrics["n"], os.sched_getscheduler(0)))
        if metrics["n"] == 3:
            started.set()
            assert release.wait(30)
            seen.append(("hurried", 3, os.sched_getscheduler(0)))

    own = os.sched_getscheduler(0)  # the checkpoint thread was started by this one: it inherited this
    c = writing_checkpointer(monkeypatch, tmp_path, report,
                             after=lambda step, jit: seen.append(("beat", step, os.sched_getscheduler(0))))
    real_hurry = c._yielding.hurry
    monkeypatch.setattr(c._yielding, "hurry", lambda: (real_hurry(), release.set()))
    for n in (1, 2):
        c.save(n, Kind.INTERVAL, lambda: {"step": n}, {"n": n},
               flush=lambda n=n: lambda: seen.append(("then", n, os.sched_getscheduler(0))))
        while not c._pending.done():  # done before anyone waits: no hurry
            release.wait(0.01)
        c.wait()
    c.save(3, Kind.INTERVAL, lambda: {"step": 3}, {"n": 3})
    assert started.wait(30)
    c.wait()  # the training thread waits: the thread gets its own policy back
    c.close()
    idle = os.SCHED_IDLE
    assert seen == [("report", 1, own), ("beat", 1, own), ("then", 1, own),
                    ("report", 2, idle), ("beat", 2, idle), ("then", 2, own),
                    ("report", 3, idle), ("hurried", 3, own), ("beat", 3, own)]


def test_a_checkpoint_still_in_flight_at_the_next_interval_step_is_hurried(monkeypatch):
    from concurrent.futures import Future

    from trainers.checkpoint_writer import Checkpointer

    c = Checkpointer(validate({"name": "hurry", "checkpoint": {"interval": 5}}), None, "run", 0, 1,
                     torch.device("cpu"), lambda step, jit: None)
    hurried = []
    monkeypatch.setattr(c._yielding, "hurry", lambda: hurried.append(True))
    c._pending = Future()  # still running
    assert c._gap_ok() is False and hurried == [True]
    c._pending = None
    c.close()


@LINUX_ONLY
def test_closing_gives_a_yielding_checkpoint_thread_its_policy_back(monkeypatch, tmp_path):
    """A report that outlived ``settle`` goes on after the attempt ends: not at SCHED_IDLE, where a
    busy machine would starve it."""
    import os
    import threading

    from trainers.checkpoint_thread import idle_is_reversible
    from trainers.rules import Kind

    if not idle_is_reversible():
        pytest.skip("this machine does not let a thread leave SCHED_IDLE: the refusal test covers it")
    in_report, release = threading.Event(), threading.Event()

    def report(metrics, checkpoint=None, **kwargs):
        if metrics["n"] == 2:
            in_report.set()
            assert release.wait(30)

    c = writing_checkpointer(monkeypatch, tmp_path, report)
    own = os.sched_getscheduler(c._thread.native_id)
    c.save(1, Kind.INTERVAL, lambda: {"step": 1}, {"n": 1})
    c.wait()
    c.save(2, Kind.INTERVAL, lambda: {"step": 2}, {"n": 2})
    assert in_report.wait(30)
    assert os.sched_getscheduler(c._thread.native_id) == os.SCHED_IDLE
    c.close()
    assert os.sched_getscheduler(c._thread.native_id) == own
    release.set()


@LINUX_ONLY
def test_where_ranks_are_not_wholly_batch_scheduled_the_checkpoint_thread_never_yields(monkeypatch, tmp_path):
    """A GPU rank's training thread (or a rank where SCHED_BATCH was refused) preempts the checkpoint
    thread on waking anyway; there an idle-class thread would only risk holding the GIL while starved."""
    import os

    from trainers import checkpoint_thread
    from trainers.rules import Kind

    # Where the process could leave SCHED_IDLE: only ``yield_cpu`` keeps the thread from it.
    monkeypatch.setattr(checkpoint_thread, "idle_is_reversible", lambda: True)
    policies = []
    c = writing_checkpointer(monkeypatch, tmp_path, lambda metrics, checkpoint=None, **kw: policies.append(
        os.sched_getscheduler(0)), yield_cpu=False)
    for n in (1, 2, 3):
        c.save(n, Kind.INTERVAL, lambda n=n: {"step": n}, {"n": n})
        c._pending.result(timeout=30)  # done before anyone waits: a wait would hurry it out of yielding
        c.wait()
    c.close()
    assert policies == [os.sched_getscheduler(0)] * 3 and os.SCHED_IDLE not in policies


