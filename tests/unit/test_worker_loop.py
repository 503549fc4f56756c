"""The loop's own small parts (trainers/worker_loop.py) that run without a Ray worker: the clock's
steady throughput starts after the attempt's first step, and the first batching of an attempt."""

from __future__ import annotations

from trainers.config.loading import validate
from trainers.worker_loop import Clock, first_batching


def test_only_the_first_step_is_warm_up_and_the_others_count_as_steady():
    clock = Clock(run_start=0.0)
    assert clock.step_done(32) is True and clock.steady_start is not None and clock.steady_samples == 0
    assert clock.step_done(32) is False and clock.step_done(16) is False
    assert clock.steady_samples == 48


def test_an_attempt_keeps_the_split_an_earlier_one_healed_to_after_out_of_memory():
    spec = validate({"name": "b", "training": {"batch_size": 64}})
    fresh = first_batching(spec, 2, {})
    assert (fresh.per_worker, fresh.micro, fresh.reductions) == (32, 32, [])
    healed = first_batching(spec, 2, {"micro_batch_size": 8, "reductions": [{"step": 3, "from": 16, "to": 8}]})
    assert (healed.micro, healed.accum, healed.reductions) == (8, 4, [{"step": 3, "from": 16, "to": 8}])
