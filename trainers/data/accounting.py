"""Sample-id accounting (``data.record_sample_ids``): proof that no sample is skipped or repeated.

Each rank keeps the ids of the samples its loader really fetched, step by step. At a
checkpoint rank 0 gathers every rank's record of the steps since the attempt's previous
checkpoint (or since its restore) and saves it in the checkpoint. A checkpoint therefore
says which samples produced the steps it covers and where the steps before it are
recorded; following those links back from the last checkpoint gives the run the final
parameters came from, with every attempt, world size and interruption on the way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence


def record(from_step: int, to_step: int, world_size: int, ranks: Sequence[Sequence[Sequence[int]]]) -> dict:
    """One checkpoint's record: ``ranks[r][k]`` are the ids rank r trained on at step from_step + k."""
    for r, steps in enumerate(ranks):
        if len(steps) != to_step - from_step:
            raise ValueError(f"rank {r} recorded {len(steps)} steps, not the {to_step - from_step} "
                             f"from {from_step} to {to_step}")
    return {"from_step": from_step, "to_step": to_step, "world_size": world_size,
            "ranks": [[[int(i) for i in ids] for ids in steps] for steps in ranks]}


def trained_by_step(records: Iterable[dict]) -> dict[int, list[int]]:
    """The samples of every step of the run that led to the last record (the highest ``to_step``):
    its record, then the one ending where it starts, and so on back to step 0. Records of
    attempts whose work was lost (no later checkpoint links to them) are left out."""
    by_end = {}
    for r in records:
        by_end.setdefault(r["to_step"], r)
    if not by_end:
        return {}
    steps: dict[int, list[int]] = {}
    end = max(by_end)
    while end > 0:
        if end not in by_end:
            raise ValueError(f"no record ends at step {end}: the chain of checkpoints is broken "
                             "(keep every checkpoint, checkpoint.num_to_keep: null, to prove exactness)")
        r = by_end[end]
        for k in range(r["to_step"] - r["from_step"]):
            steps[r["from_step"] + k] = [i for rank in r["ranks"] for i in rank[k]]
        end = r["from_step"]
    return steps


def epoch_problems(by_step: dict[int, list[int]], steps_per_epoch: int, num_samples: int) -> list[str]:
    """What breaks "every complete epoch trained on each sample exactly once": [] when nothing."""
    problems = []
    last = max(by_step, default=-1) + 1
    missing = sorted(set(range(last)) - set(by_step))
    if missing:
        problems.append(f"steps with no record: {missing[:10]}")
    for epoch in range(last // steps_per_epoch):
        counts = Counter(i for s in range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch)
                         for i in by_step.get(s, []))
        skipped = sorted(set(range(num_samples)) - set(counts))
        repeated = sorted(i for i, n in counts.items() if n > 1)
        if skipped or repeated:
            problems.append(f"epoch {epoch}: {len(skipped)} samples skipped (e.g. {skipped[:5]}), "
                            f"{len(repeated)} repeated (e.g. {repeated[:5]})")
    return problems


def gather(feed, world_size: int, to_step: int) -> dict:
    """Every rank's record of the steps since its feed's last one, as one ``record`` (a collective:
    every rank calls it at the same step)."""
    import torch.distributed as dist

    first, steps = feed.take_record()
    parts = [(first, steps)]
    if world_size > 1:
        parts = [None] * world_size
        dist.all_gather_object(parts, (first, steps))
    starts = {p[0] for p in parts}
    if len(starts) != 1:
        raise RuntimeError(f"ranks recorded from different steps {sorted(starts)}: their feeds are out of step")
    return record(first, to_step, world_size, [p[1] for p in parts])
