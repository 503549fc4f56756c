"""The one small all-reduce of a sync step, by name.

Every rank adds its micro-batches' loss sums into ``loss`` on the device as it trains (no host
sync per micro-batch) and counts samples and tokens in Python. At a sync step it fills the rest:
its stop and preemption votes, the resize request it was handed, and (rank 0 only; the others
add zero, so every rank reads rank 0's) the seconds a step took since the last sync. One
all-reduce of seven float64 values carries it all, and :meth:`SyncVector.reduce` reads it back
as a :class:`SyncOutcome`.
"""

from __future__ import annotations

import dataclasses
from enum import IntEnum

import torch
import torch.distributed as dist


class Slot(IntEnum):
    """Where each value sits in the reduced tensor."""

    LOSS = 0  # sum of the micro-batches' loss sums since the last sync
    SAMPLES = 1
    TOKENS = 2
    STOP_VOTES = 3  # ranks whose pulse saw a stop request
    PREEMPT_VOTES = 4  # ranks whose node has a spot notice
    STEP_S = 5  # rank 0's seconds a step since the last sync
    RESIZE_VOTES = 6  # ranks Ray Train asked to checkpoint before a resize


@dataclasses.dataclass(frozen=True)
class SyncOutcome:
    """What every rank reads after the all-reduce: the group's sums and votes."""

    loss_sum: float
    samples: float
    tokens: float
    stop: bool
    preempted: bool
    step_s: float
    resizing: bool


class SyncVector:
    """This rank's side of the sync all-reduce, between two sync steps."""

    def __init__(self, device: torch.device):
        self.values = torch.zeros(len(Slot), dtype=torch.float64, device=device)

    def add_loss(self, loss_sum: torch.Tensor) -> None:
        self.values[Slot.LOSS] += loss_sum.detach().double()

    @property
    def loss(self) -> torch.Tensor:
        """A copy of the loss sum so far: what a step redone after out-of-memory goes back to."""
        return self.values[Slot.LOSS].clone()

    @loss.setter
    def loss(self, value: torch.Tensor) -> None:
        self.values[Slot.LOSS] = value

    def reduce(self, world: int, samples: int, tokens: int, stop: bool, preempted: bool, step_s: float,
               resizing: bool) -> SyncOutcome:
        """Add this rank's counts and votes, all-reduce (world > 1), read the group's, and start again at zero."""
        v = self.values
        v[Slot.SAMPLES], v[Slot.TOKENS] = samples, tokens
        v[Slot.STOP_VOTES], v[Slot.PREEMPT_VOTES], v[Slot.RESIZE_VOTES] = float(stop), float(preempted), float(resizing)
        v[Slot.STEP_S] = step_s
        if world > 1:
            dist.all_reduce(v)
        read = v.tolist()
        v.zero_()
        return SyncOutcome(loss_sum=read[Slot.LOSS], samples=read[Slot.SAMPLES], tokens=read[Slot.TOKENS],
                           stop=read[Slot.STOP_VOTES] > 0, preempted=read[Slot.PREEMPT_VOTES] > 0,
                           step_s=read[Slot.STEP_S], resizing=read[Slot.RESIZE_VOTES] > 0)
