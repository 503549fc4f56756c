"""The Trainer's and the checkpointer's decisions, table-driven: when to sync, when to checkpoint,
when ranks vote on out-of-memory, how a split shrinks, and what a snapshot copies."""

from __future__ import annotations

import pytest
import torch

from trainers.checkpointer import Kind, checkpoint_kind, interval_checkpoint_ok, to_cpu
from trainers.config import SpecError, batching_summary, validate
from trainers.trainer import (FIRST_CHECK_STEPS, MAX_CHECK_STEPS, halved_split, next_check_step, oom_message,
                              oom_vote_due, sync_due)


@pytest.mark.parametrize("done,log,next_check,interval,due", [
    (10, 10, 10, 1000, True),
    (5, 10, 10, 1000, False),
    (5, 100, 5, 1000, True),  # a preemption check needs the all-reduce, not a log line
    (1000, 100, 7, 1000, True),
    (999, 100, 1007, 1000, False),
    (7, 100, 1007, 3, False),
    (9, 100, 1007, 3, True),  # a checkpoint step
])
def test_sync_due(done, log, next_check, interval, due):
    assert sync_due(done, log, next_check, interval) is due


@pytest.mark.parametrize("done,every,step_s,next_check", [
    (40, 10, 0.003, 50),  # a number is kept, whatever the step time
    (0, "auto", 0.0, FIRST_CHECK_STEPS),  # nothing measured yet
    (100, "auto", 0.02, 150),  # 20 ms steps: about once a second, not every 10 steps
    (100, "auto", 0.003, 100 + MAX_CHECK_STEPS),  # short steps: at most this many, should they turn slow
    (100, "auto", 0.25, 104),
    (100, "auto", 5.0, 101),  # slow steps: every step, never none
])
def test_next_preemption_check(done, every, step_s, next_check):
    assert next_check_step(done, every, step_s) == next_check


def test_preemption_check_steps_takes_auto_or_a_positive_number():
    assert validate({"name": "x"}).checkpoint.preemption_check_steps == "auto"
    assert validate({"name": "x", "checkpoint": {"preemption_check_steps": 25}}).checkpoint.preemption_check_steps == 25
    for bad in (0, "sometimes", True):
        with pytest.raises(SpecError, match=r"checkpoint\.preemption_check_steps: .* positive number of steps, or 'auto'"):
            validate({"name": "x", "checkpoint": {"preemption_check_steps": bad}})


@pytest.mark.parametrize("done,stop,interval,gap_ok,preempted,stop_requested,kind", [
    (100, 1000, 100, True, False, False, Kind.INTERVAL),
    (100, 1000, 100, False, False, False, None),  # too soon after the last one
    (150, 1000, 100, True, False, False, None),
    (1000, 1000, 100, False, False, False, Kind.FINAL),  # the end, whatever the gap
    (37, 1000, 100, False, False, True, Kind.FINAL),  # a stop request
    (37, 1000, 100, False, True, False, Kind.JIT),
    (1000, 1000, 100, True, True, True, Kind.JIT),  # a notice wins: it must be durable before the node goes
])
def test_checkpoint_kind(done, stop, interval, gap_ok, preempted, stop_requested, kind):
    assert checkpoint_kind(done, stop, interval, gap_ok, preempted, stop_requested) is kind


@pytest.mark.parametrize("since_last_s,min_gap_s,in_flight,ok", [
    (10.0, 5.0, False, True), (1.0, 5.0, False, False), (10.0, 5.0, True, False), (0.0, 0.0, False, True),
    (0.0, 0.0, True, False),  # never wait on Ray's one-report-per-poll: the next interval step takes it
])
def test_interval_checkpoint_ok(since_last_s, min_gap_s, in_flight, ok):
    assert interval_checkpoint_ok(since_last_s, min_gap_s, in_flight) is ok


@pytest.mark.parametrize("auto,steps_at_split,vote", [
    (True, 0, True), (True, 500, True), (False, 0, True), (False, 1, False), (False, 500, False),
])
def test_oom_vote_due(auto, steps_at_split, vote):
    assert oom_vote_due(auto, steps_at_split) is vote


@pytest.mark.parametrize("micro,per_worker,tokens,split", [
    (64, 64, None, (32, 2, None)),
    (32, 64, None, (16, 4, None)),
    (3, 64, None, (1, 64, None)),
    (1, 64, None, None),  # nothing left to halve: the clear error
    (16, 16, 512, (8, 2, 256)),  # by tokens: the budget halves too
    (1, 16, 512, (1, 16, 256)),
])
def test_halved_split(micro, per_worker, tokens, split):
    assert halved_split(micro, per_worker, tokens) == split


def test_halving_keeps_the_global_batch():
    micro, per_worker = 64, 64
    while (split := halved_split(micro, per_worker, None)) is not None:
        micro, accum, _ = split
        assert micro * accum == per_worker


def test_oom_message_names_model_size_and_memory():
    message = oom_message(1, 7_000_000_000, 14 * 2**30, torch.device("cpu"))
    assert "micro-batch 1" in message and "7,000,000,000 parameters" in message and "14.00 GiB of weights" in message
    assert "GiB of memory" in message and "gradient_checkpointing" in message


def test_micro_batch_auto_starts_at_the_whole_share():
    assert batching_summary(128, 2, "auto", None) == (64, 64, 1)
    assert validate({"training": {"micro_batch_size": "auto"}}).training.micro_batch_size == "auto"


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


def test_short_gil_slices_only_while_the_background_work_runs():
    import sys

    from trainers.checkpointer import short_gil_slices

    before = sys.getswitchinterval()
    with short_gil_slices(0.0005):
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    assert sys.getswitchinterval() == before
    with pytest.raises(RuntimeError), short_gil_slices(0.0005):
        raise RuntimeError("a failed upload")
    assert sys.getswitchinterval() == before


def settling_checkpointer(work):
    """A rank-0 Checkpointer whose checkpoint in flight is ``work`` (run on its own thread)."""
    from trainers.checkpointer import Checkpointer

    spec = validate({"name": "settle", "checkpoint": {"interval": 5}})
    c = Checkpointer(spec, None, "run", 0, 1, torch.device("cpu"), lambda step, jit: None)
    c._pending = c._pool.submit(work)
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


def yielding_checkpointer(monkeypatch, work):
    """A rank-0 Checkpointer whose background work is ``work(done)``, on its own thread."""
    from trainers.checkpointer import Checkpointer

    c = Checkpointer(validate({"name": "yield", "checkpoint": {"interval": 5}}), None, "run", 0, 1,
                     torch.device("cpu"), lambda step, jit: None)
    monkeypatch.setattr(c, "_in_background", lambda done, state, metrics, then: work(done))
    return c


@pytest.mark.skipif(not hasattr(__import__("os"), "SCHED_IDLE"), reason="scheduling policies are Linux's")
def test_the_checkpoint_thread_yields_from_its_second_checkpoint_and_gets_its_policy_back_when_waited_for(monkeypatch):
    """The first checkpoint runs at the thread's own policy (the threads it starts inherit that);
    later ones at SCHED_IDLE; a training thread that must wait for one hurries it first."""
    import concurrent.futures
    import os
    import threading

    from trainers.checkpointer import idle_is_reversible

    if not idle_is_reversible():
        pytest.skip("this machine does not let a thread leave SCHED_IDLE: the refusal test covers it")
    seen, started, release = [], threading.Event(), threading.Event()

    def work(done):
        seen.append(os.sched_getscheduler(0))
        if done == 3:
            started.set()
            release.wait(10)
            seen.append(os.sched_getscheduler(0))

    own = os.sched_getscheduler(0)  # the pool's thread was started by this one: it inherited this
    c = yielding_checkpointer(monkeypatch, work)
    for done in (1, 2):
        c.save(done, Kind.INTERVAL, None, {})
        concurrent.futures.wait([c._pending])  # done before anyone waits: no hurry
        c.wait()
    c.save(3, Kind.INTERVAL, None, {})
    assert started.wait(10)
    threading.Timer(0.3, release.set).start()
    c.wait()  # the training thread waits: the thread gets its own policy back
    c.close()
    assert seen == [own, os.SCHED_IDLE, os.SCHED_IDLE, own]


@pytest.mark.skipif(not hasattr(__import__("os"), "SCHED_IDLE"), reason="scheduling policies are Linux's")
def test_where_a_thread_could_not_leave_sched_idle_the_checkpoint_thread_never_enters_it(monkeypatch, caplog):
    """Unprivileged with the usual RLIMIT_NICE of 0, Linux refuses the way back from SCHED_IDLE:
    the probe says so, and no checkpoint thread is put where training could not hurry it."""
    import os

    from trainers import checkpointer

    real = os.sched_setscheduler

    def no_way_back(pid, policy, param):
        if policy != os.SCHED_IDLE:
            raise PermissionError(1, "Operation not permitted")
        return real(pid, policy, param)

    monkeypatch.setattr(os, "sched_setscheduler", no_way_back)
    assert checkpointer.idle_is_reversible.__wrapped__() is False
    monkeypatch.setattr(os, "sched_setscheduler", real)
    monkeypatch.setattr(checkpointer, "idle_is_reversible", lambda: False)
    seen = []
    c = yielding_checkpointer(monkeypatch, lambda done: seen.append(os.sched_getscheduler(0)))
    for done in (1, 2, 3):
        c.save(done, Kind.INTERVAL, None, {})
        c.wait()
    c.close()
    assert seen == [os.sched_getscheduler(0)] * 3


@pytest.mark.skipif(not hasattr(__import__("os"), "SCHED_IDLE"), reason="scheduling policies are Linux's")
def test_a_refused_policy_change_turns_yielding_off_and_training_goes_on(monkeypatch, caplog):
    import os

    from trainers import checkpointer

    monkeypatch.setattr(checkpointer, "idle_is_reversible", lambda: True)
    yielding = checkpointer.Yielding(os.getpid())  # a thread that exists, then a sandbox that says no
    monkeypatch.setattr(os, "sched_setscheduler", lambda *a: (_ for _ in ()).throw(PermissionError(1, "seccomp")))
    with caplog.at_level("DEBUG"):
        yielding.before_work()
        yielding.before_work()
        yielding.hurry()
    assert yielding.enabled is False
    assert "checkpoint thread keeps its scheduling: [Errno 1] seccomp" in caplog.text
