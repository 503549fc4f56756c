"""Our data path against an in-memory upper bound, and what dynamic batching saves, in one run.

- loader ratio: batches/s of our loader (Parquet dataset, the resumable batch plan, a
  DataLoader with 0, 1, 2 worker processes) over indexing tensors already in memory with
  the same batches. Target >= 0.9 at the best worker count.
- padding: the LM workload's padded-token fraction with fixed micro-batches of 8 and with
  dynamic batching under a 2048-token budget.

    python bench/data.py [--steps 400]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()

    import numpy as np
    import torch

    from cluster.storage import open_root
    from trainers.config import validate
    from trainers.data import BatchPlan, PlanSampler, StepMicroBatches, make_loader, padding_fraction
    from trainers.workloads import resolve

    torch.set_num_threads(1)
    root = open_root(tempfile.mkdtemp(prefix="etrain-bench-data-"))
    spec = validate({"name": "data", "training": {"batch_size": 128}})
    workload = resolve(spec)
    dataset = workload.dataset(spec, workload.prepare(spec, root))
    plan = BatchPlan(len(dataset), 128, seed=0)
    steps = StepMicroBatches(plan, 0, 1, 128)
    memory_x, memory_y = dataset.x, dataset.y  # the upper bound: tensors already in memory

    def in_memory() -> float:
        started = time.perf_counter()
        for step in range(args.steps):
            for mb in steps.at(step):
                index = torch.as_tensor(mb)
                _ = memory_x[index], memory_y[index]
        return args.steps / (time.perf_counter() - started)

    def ours(workers: int) -> float:
        loader = make_loader(dataset, PlanSampler(steps, 0, args.steps), workers, 2)
        it = iter(loader)
        next(it)  # worker start-up is paid once per run, not per batch
        started = time.perf_counter()
        for _ in range(args.steps - 1):
            next(it)
        return (args.steps - 1) / (time.perf_counter() - started)

    upper = max(in_memory() for _ in range(3))
    rates = {w: max(ours(w) for _ in range(2)) for w in (0, 1, 2)}

    from trainers.workloads.lm import stdlib_paragraphs

    lengths = np.array([min(len(p), 256) for p in stdlib_paragraphs(3000)])
    dynamic = BatchPlan(len(lengths), 64, seed=0, lengths=lengths)
    fixed = BatchPlan(len(lengths), 64, seed=0)
    dyn, fix = [], []
    for step in range(dynamic.steps_per_epoch):
        for rank in range(2):
            dyn += StepMicroBatches(dynamic, rank, 2, 32, 2048).at(step)
            fix += StepMicroBatches(fixed, rank, 2, 8).at(step)

    print(f"in-memory batches/s: {upper:.0f}")
    for w, r in rates.items():
        print(f"parquet loader batches/s with {w} workers: {r:.0f}")
    best = max(rates, key=rates.get)
    print(f"best loader workers: {best}")
    print(f"lm padding fraction fixed micro-batches: {padding_fraction(fix, lengths):.3f}")
    print(f"lm padding fraction dynamic batching: {padding_fraction(dyn, lengths):.3f}")
    print(f"loader ratio: {rates[best] / upper:.3f}")


if __name__ == "__main__":
    main()
