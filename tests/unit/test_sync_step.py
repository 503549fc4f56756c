"""The sync step's all-reduce by name (trainers/sync_step.py): what a rank adds is what it reads
back under each name, and the vector starts again at zero."""

from __future__ import annotations

import torch

from trainers.sync_step import Slot, SyncVector


def test_each_value_comes_back_under_its_own_name_and_the_vector_starts_again():
    v = SyncVector(torch.device("cpu"))
    v.add_loss(torch.tensor(1.5))
    v.add_loss(torch.tensor(2.0))
    out = v.reduce(1, samples=8, tokens=80, stop=True, preempted=False, step_s=0.25, resizing=True)
    assert (out.loss_sum, out.samples, out.tokens, out.stop, out.preempted, out.step_s, out.resizing) == (
        3.5, 8, 80, True, False, 0.25, True)
    assert v.values.tolist() == [0.0] * len(Slot)
    again = v.reduce(1, samples=0, tokens=0, stop=False, preempted=True, step_s=0.0, resizing=False)
    assert (again.loss_sum, again.stop, again.preempted, again.resizing) == (0.0, False, True, False)


def test_a_step_redone_after_out_of_memory_goes_back_to_the_loss_before_it():
    v = SyncVector(torch.device("cpu"))
    v.add_loss(torch.tensor(1.0))
    before = v.loss
    v.add_loss(torch.tensor(5.0))
    v.loss = before
    assert v.reduce(1, 0, 0, False, False, 0.0, False).loss_sum == 1.0
