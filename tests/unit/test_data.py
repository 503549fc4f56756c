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


def test_plan_does_not_depend_on_world_size():
    a = BatchPlan(1000, 64, seed=3, min_batch=4)
    b = BatchPlan(1000, 64, seed=3, min_batch=4)
    assert a.epoch_batches(2) == b.epoch_batches(2)
    assert a.epoch_batches(0) != a.epoch_batches(1), "each epoch is a new shuffle"


@pytest.mark.parametrize("n,batch,min_batch,steps,last", [
    (1000, 64, 4, 16, 40),     # 15 full + a short batch of 40 kept
    (1026, 64, 4, 16, 66),     # a 2-sample tail merged into the batch before it
    (64, 64, 2, 1, 64),
])
def test_short_tail_is_kept_or_merged(n, batch, min_batch, steps, last):
    plan = BatchPlan(n, batch, seed=0, shuffle=False, min_batch=min_batch)
    assert plan.steps_per_epoch == steps
    assert len(plan.epoch_batches(0)[-1]) == last
    assert sorted(i for b in plan.epoch_batches(0) for i in b) == list(range(n))


@pytest.mark.parametrize("before,after,stop_at", [(2, 1, 5), (4, 2, 7), (1, 3, 3), (2, 2, 9)])
def test_resize_mid_epoch_sees_every_sample_exactly_once(before, after, stop_at):
    plan = BatchPlan(1797, 128, seed=7, min_batch=4)
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
    dynamic = BatchPlan(len(lengths), 64, seed=0, lengths=lengths, min_batch=2)
    fixed = BatchPlan(len(lengths), 64, seed=0, min_batch=2)
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
