"""The loop's decisions as pure functions, each table-tested in tests/unit/test_rules.py: the
learning-rate schedule, the step's RNG seed, the order of global batches, when a step syncs and
when it checks for a spot notice, how an out-of-memory step is split, and which checkpoint, if
any, a step takes and whether it is reported. No Ray, no collectives, no clock: the loop
(trainers.worker_loop) and the checkpoint writer call them with what they measured."""

from __future__ import annotations

import math
import os
from enum import Enum

import torch

from trainers.config.job import JobSpec
from trainers.data import BatchPlan


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_ratio: float, kind: str) -> float:
    """Multiplier on the base learning rate at ``step``: constant, or linear warmup then cosine."""
    if kind == "constant":
        return 1.0
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def target_step(spec: JobSpec, steps_per_epoch: int) -> int:
    return spec.training.max_steps or spec.training.epochs * steps_per_epoch


def step_seed(seed: int, step: int, rank: int) -> int:
    """RNG seed of one step on one rank: randomness (dropout) is a function of where we are,
    so nothing random needs saving and a resumed run draws what an unbroken one would."""
    return (seed * 1_000_003 + step) * 1_009 + rank


def plan_for(spec: JobSpec, dataset) -> BatchPlan:
    """The job's order of global batches: what a resume must find again, whatever the workers."""
    lengths = getattr(dataset, "lengths", None)
    return BatchPlan(len(dataset), spec.training.batch_size, spec.training.seed, spec.data.shuffle,
                     lengths=lengths if spec.data.dynamic_batching else None,
                     group_sizes=getattr(dataset, "group_sizes", None), window=spec.data.shuffle_window_row_groups)


PREEMPTION_CHECK_S = 1.0  # preemption_check_steps "auto": a check about this often


FIRST_CHECK_STEPS = 10  # "auto" before a step time is known


MAX_CHECK_STEPS = 100  # "auto" with short steps: steps that turn slow (a stalled loader) are not waited out long


def sync_due(done: int, log_every: int, next_check: int, interval_steps: int) -> bool:
    """Whether step ``done`` does the small all-reduce (loss window, stop vote, preemption flag,
    resize request)."""
    return done % log_every == 0 or done >= next_check or done % interval_steps == 0


def next_check_step(done: int, every: int | str, step_s: float) -> int:
    """The step of the next preemption check after a sync at ``done``: every ``every`` steps, or with
    "auto" about every PREEMPTION_CHECK_S at ``step_s``, rank 0's seconds a step since the last sync.
    Every rank gets rank 0's value through the all-reduce (the others add zero), so all agree. Each
    check is one small all-reduce: every 10 steps of ~3 ms, they cost ~4% of the throughput. Log steps
    (``training.log_interval_steps``) sync as well."""
    if every != "auto":
        return done + int(every)
    if step_s <= 0:
        return done + FIRST_CHECK_STEPS
    return done + max(1, min(MAX_CHECK_STEPS, int(PREEMPTION_CHECK_S / step_s)))


def oom_vote_due(auto: bool, steps_at_this_split: int) -> bool:
    """Whether ranks agree on out-of-memory at this step (one 1-element all-reduce).

    ``auto``: every step (micro-batches vary, dynamic batching). A set micro-batch: the first
    step of an attempt and of each new split, where memory peaks (activations, optimizer state).
    """
    return auto or steps_at_this_split == 0


def halved_split(micro: int, per_worker: int, max_tokens: int | None) -> tuple[int, int, int | None] | None:
    """(micro-batch, accumulation, token budget) after an out-of-memory step; None at micro-batch 1."""
    if micro <= 1 and (max_tokens is None or max_tokens <= 1):
        return None
    new_micro = max(1, micro // 2)
    new_tokens = max(1, max_tokens // 2) if max_tokens else None
    return new_micro, math.ceil(per_worker / new_micro), new_tokens


def oom_message(micro: int, params: int, param_bytes: int, device: torch.device) -> str:
    """The error when even micro-batch 1 does not fit: what the model needs, what the device has."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        memory = f"{device} has {total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free now)"
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        memory = f"this node has {total / 2**30:.1f} GiB of memory"
    return (f"out of memory at micro-batch {micro}: the model has {params:,} parameters "
            f"({param_bytes / 2**30:.2f} GiB of weights, about {4 * param_bytes / 2**30:.2f} GiB with gradients "
            f"and Adam state); {memory}. Use a smaller model, shorter sequences "
            "(data.max_tokens_per_batch, model.max_seq_len), training.gradient_checkpointing: true, "
            "or a device with more memory")


class Kind(Enum):
    INTERVAL = "interval"
    FINAL = "final"  # the run's last step, or a stop request
    JIT = "jit"  # a preemption notice: durable before the node goes
    RESIZE = "resize"  # Ray Train restarts the group to resize it: durable before, not reported (its controller waits)


def checkpoint_kind(done: int, stop: int, interval_steps: int, gap_ok: bool, preempted: bool,
                    stop_requested: bool, resizing: bool = False) -> Kind | None:
    """Which checkpoint, if any, step ``done`` takes. ``gap_ok``: the minimum time since the last one passed.
    ``resizing``: the controller waits to restart the group (a run at its end finishes instead)."""
    if preempted:
        return Kind.JIT
    if done == stop or stop_requested:
        return Kind.FINAL
    if resizing:
        return Kind.RESIZE
    if done % interval_steps == 0 and gap_ok:
        return Kind.INTERVAL
    return None


def report_due(kind: Kind, since_report_s: float, report_interval_s: float) -> bool:
    """Whether a checkpoint is reported to Ray, retention runs and the observer flushes.

    A final or just-in-time checkpoint always is (Ray's result, and what outlives the node); an
    interval one when ``report_interval_s`` has passed since the last report. The ones between
    are written and restorable all the same. One before a resize never is: the controller that
    would take the report is waiting for it to be written.
    """
    if kind is Kind.INTERVAL:
        return since_report_s >= report_interval_s
    return kind in (Kind.FINAL, Kind.JIT)


def interval_checkpoint_ok(since_last_s: float, min_gap_s: float, previous_in_flight: bool) -> bool:
    """Whether an interval checkpoint is taken now, or left to the next interval step.

    Never while the previous one is still being written and reported: Ray takes one report per
    controller poll (about 2 s), so waiting for it would stall training; skipping costs only
    how fresh the newest checkpoint is.
    """
    return since_last_s >= min_gap_s and not previous_in_flight
