"""The loop's pure decisions (trainers/rules.py), table-driven: learning-rate schedule, step seeds,
when a step syncs and checks for a notice, how an out-of-memory step splits, which checkpoint a
step takes and whether it is reported."""

from __future__ import annotations

import math

import pytest
import torch

from trainers.config.batching import batching_summary
from trainers.config.errors import SpecError
from trainers.config.loading import validate
from trainers.rules import (FIRST_CHECK_STEPS, MAX_CHECK_STEPS, Kind, checkpoint_kind, halved_split,
                            interval_checkpoint_ok, lr_factor, next_check_step, oom_message, oom_vote_due, report_due,
                            step_seed, sync_due)


@pytest.mark.parametrize("step,expected", [(0, 0.1), (9, 1.0), (10, 1.0), (55, 0.55), (100, 0.1)])
def test_warmup_cosine(step, expected):
    assert math.isclose(lr_factor(step, 100, 10, 0.1, "warmup_cosine"), expected, abs_tol=1e-9)


def test_constant_schedule():
    assert lr_factor(50, 100, 10, 0.1, "constant") == 1.0


def test_step_seeds_differ_by_rank_and_step():
    seeds = {step_seed(0, s, r) for s in range(100) for r in range(8)}
    assert len(seeds) == 800


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


@pytest.mark.parametrize("done,stop,interval,gap_ok,preempted,stop_requested,resizing,kind", [
    (100, 1000, 100, True, False, False, False, Kind.INTERVAL),
    (100, 1000, 100, False, False, False, False, None),  # too soon after the last one
    (150, 1000, 100, True, False, False, False, None),
    (1000, 1000, 100, False, False, False, False, Kind.FINAL),  # the end, whatever the gap
    (37, 1000, 100, False, False, True, False, Kind.FINAL),  # a stop request
    (37, 1000, 100, False, True, False, False, Kind.JIT),
    (1000, 1000, 100, True, True, True, False, Kind.JIT),  # a notice wins: it must be durable before the node goes
    (37, 1000, 100, False, False, False, True, Kind.RESIZE),  # between intervals: the restart would lose 37 steps
    (100, 1000, 100, True, False, False, True, Kind.RESIZE),  # one checkpoint a step, durable before the restart
    (37, 1000, 100, False, True, False, True, Kind.JIT),  # the notice's, which the resize takes as its own
    (1000, 1000, 100, False, False, False, True, Kind.FINAL),  # a run at its end finishes instead
    (37, 1000, 100, False, False, True, True, Kind.FINAL),
])
def test_checkpoint_kind(done, stop, interval, gap_ok, preempted, stop_requested, resizing, kind):
    assert checkpoint_kind(done, stop, interval, gap_ok, preempted, stop_requested, resizing) is kind


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


@pytest.mark.parametrize("kind, since_report_s, interval_s, due", [
    ("INTERVAL", float("inf"), 2.0, True),  # the run's first: Ray hears of the job's progress at once
    ("INTERVAL", 0.5, 2.0, False),  # written and restorable, reported with a later one
    ("INTERVAL", 2.0, 2.0, True),
    ("INTERVAL", 0.0, 0.0, True),  # 0: every one
    ("FINAL", 0.0, 60.0, True),  # Ray's result, and the last retention round
    ("JIT", 0.0, 60.0, True),  # what outlives the node
    ("RESIZE", float("inf"), 0.0, False),  # the controller that would take it waits for the write
])
def test_report_due(kind, since_report_s, interval_s, due):
    from trainers.rules import Kind

    assert report_due(Kind[kind], since_report_s, interval_s) is due
