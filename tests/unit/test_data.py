"""The batch plan: world-size independent, exactly-once per epoch across a resize, budgets kept."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from trainers.data import BatchPlan, PlanSampler, StepMicroBatches, micro_batches, padding_fraction, rank_share


def consumed(plan: BatchPlan, start: int, stop: int, world: int, micro: int, max_tokens=None) -> list[int]:
    """Every index all ranks' loaders yield for steps [start, stop) (the loop's exact inputs)."""
    out = []
    for rank in range(world):
        sampler = PlanSampler(StepMicroBatches(plan, rank, world, micro, max_tokens), start, stop)
        out += [i for mb in sampler for i in mb]
    return out


class Samples:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("first,then", [(1, {"min": 1, "max": 2}), ({"min": 1, "max": 4}, 2), (8, 1)])
def test_a_resume_with_another_num_workers_range_keeps_the_data_order(first, then):
    """1793 samples in batches of 64 leave a 1-sample tail: the plan (steps per epoch, every
    batch) must not move when the job resumes with another worker range."""
    from trainers.config import validate
    from trainers.trainer import plan_for, target_step

    def spec(workers):
        return validate({"training": {"batch_size": 64, "epochs": 3}, "distributed": {"num_workers": workers}})

    a, b = plan_for(spec(first), Samples(1793)), plan_for(spec(then), Samples(1793))
    assert a.steps_per_epoch == b.steps_per_epoch
    assert target_step(spec(first), a.steps_per_epoch) == target_step(spec(then), b.steps_per_epoch)
    for epoch in range(3):
        assert a.epoch_batches(epoch) == b.epoch_batches(epoch)
    assert a.epoch_batches(0) != a.epoch_batches(1), "each epoch is a new shuffle"


@pytest.mark.parametrize("n,batch,steps,last", [
    (1000, 64, 15, 104),   # 15 full batches; the 40-sample tail joins the last one
    (1026, 64, 16, 66),    # a 2-sample tail merged into the batch before it
    (64, 64, 1, 64),
    (1793, 64, 28, 65),
])
def test_short_tail_is_merged(n, batch, steps, last):
    plan = BatchPlan(n, batch, seed=0, shuffle=False)
    assert plan.steps_per_epoch == steps
    assert len(plan.epoch_batches(0)[-1]) == last
    assert sorted(i for b in plan.epoch_batches(0) for i in b) == list(range(n))


@pytest.mark.parametrize("before,after,stop_at", [(2, 1, 5), (4, 2, 7), (1, 3, 3), (2, 2, 9)])
def test_resize_mid_epoch_sees_every_sample_exactly_once(before, after, stop_at):
    plan = BatchPlan(1797, 128, seed=7)
    epoch = plan.steps_per_epoch
    seen = consumed(plan, 0, stop_at, before, micro=40) + consumed(plan, stop_at, epoch, after, micro=40)
    counts = Counter(seen)
    assert set(counts) == set(range(1797)) and set(counts.values()) == {1}
    assert plan.cursor(stop_at).position == stop_at * 128


def test_rank_shares_partition_the_batch():
    batch = list(range(10))
    shares = [rank_share(batch, r, 3) for r in range(3)]
    assert [len(s) for s in shares] == [3, 3, 4]
    assert sum(shares, []) == batch


def test_token_budget_is_never_exceeded_and_dynamic_pads_less():
    from trainers.workloads.lm import stdlib_paragraphs

    lengths = np.array([min(len(p), 256) for p in stdlib_paragraphs(3000)])
    budget = 2048
    dynamic = BatchPlan(len(lengths), 64, seed=0, lengths=lengths)
    fixed = BatchPlan(len(lengths), 64, seed=0)
    dyn_mbs, fixed_mbs = [], []
    for step in range(dynamic.steps_per_epoch):
        for rank in range(2):
            dyn_mbs += StepMicroBatches(dynamic, rank, 2, 32, budget).at(step)
            fixed_mbs += StepMicroBatches(fixed, rank, 2, 8).at(step)
    assert all(int(lengths[mb].max()) * len(mb) <= budget for mb in dyn_mbs)
    dyn, fix = padding_fraction(dyn_mbs, lengths), padding_fraction(fixed_mbs, lengths)
    assert dyn < fix / 3, (dyn, fix)


def test_micro_batches_fixed_size():
    assert micro_batches(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]


def test_plan_refuses_data_smaller_than_a_batch():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        BatchPlan(10, 64, seed=0)
