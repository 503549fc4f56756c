"""What each worker does for the spec's global batch: the one rule every world size follows."""

from __future__ import annotations

import math


def batching_summary(global_batch: int, world_size: int, micro_batch_size: int | str | None,
                     grad_accum_steps: int | None) -> tuple[int, int, int]:
    """(per-worker samples, micro-batch size, accumulation steps) for a world size.

    The global batch stays as the spec says; what each worker does follows from it, so a
    resize changes only these derived numbers, never the optimisation.
    """
    per_worker = math.ceil(global_batch / world_size)
    if micro_batch_size == "auto":
        micro = per_worker
    elif micro_batch_size:
        micro = min(micro_batch_size, per_worker)
    elif grad_accum_steps:
        micro = math.ceil(per_worker / grad_accum_steps)
    else:
        micro = per_worker
    return per_worker, micro, math.ceil(per_worker / micro)
