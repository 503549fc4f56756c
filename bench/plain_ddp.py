"""Plain PyTorch DDP over gloo, the baseline of bench/ddp_overhead.py; run by torchrun.

The same model (the digits MLP), data (the digits Parquet file), global batch, optimizer
and thread count as the etrain job it is compared with; a DistributedSampler and a
DataLoader, as a DDP user writes it, fetching each micro-batch from the in-memory tensors in one
gather (a BatchSampler, as for in-memory data; the etrain side indexes its tensors likewise), so
the comparison is of the loops. Rank 0 prints one JSON line with its figures.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

WINDOW_STEPS = 100  # the etrain side logs its samples/s every 100 steps: the same windows here
WARMUP_FRACTION = 0.1
TRIM_FRACTION = 0.1


def steady_rate(window_rates: list[float], warmup_fraction: float = WARMUP_FRACTION,
                trim_fraction: float = TRIM_FRACTION) -> float:
    """Steady samples/s from a run's per-window rates (windows of equal samples): the first tenth
    left out, then the slowest and the fastest tenth, and the mean of the rest by time (samples
    over seconds).

    Both sides of a comparison are judged by this one rule. The first windows carry start-up (on
    the etrain side Ray's controller starts its helper actors beside the first steps). Trimming a
    tenth at each end keeps a window that another process on this shared machine slowed from
    deciding the figure, while any cost in more than a tenth of the windows (a heartbeat every
    second, a checkpoint every window) stays in it, as a median would not keep it.
    """
    if not window_rates:
        raise ValueError("no windows to measure: run more steps than one window")
    kept = sorted(window_rates[int(len(window_rates) * warmup_fraction):] or window_rates)
    cut = int(len(kept) * trim_fraction)
    core = kept[cut:len(kept) - cut] or kept
    return len(core) / sum(1.0 / rate for rate in core)


def digits_pairs(path: str) -> TensorDataset:
    """The digits Parquet file held in memory as tensors: the data of both sides of the comparison
    (an etrain job takes it as ``data.factory``), so the bench measures the loop, not a loader."""
    table = pq.read_table(path)
    x = torch.tensor(table.column("features").to_pylist(), dtype=torch.float32)
    y = torch.tensor(table.column("label").to_numpy(), dtype=torch.long)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=128, help="global")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = digits_pairs(args.data)
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10)))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    per_rank = args.batch_size // world
    step, epoch, warm_at, started = 0, 0, None, time.perf_counter()
    marks: list[float] = []  # the time at step 1 and at each window's end after it
    wall_marks: list[float] = []  # the same on the wall clock: a time-sliced comparison places them
    while step < args.steps:
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
        sampler.set_epoch(epoch)
        for xb, yb in DataLoader(data, sampler=BatchSampler(sampler, per_rank, drop_last=True), batch_size=None):
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step == 1:
                warm_at = time.perf_counter()  # the first step pays for warm-up; measure after it
            if step % WINDOW_STEPS == 1:
                marks.append(time.perf_counter())
                wall_marks.append(time.time())
            if step >= args.steps:
                break
        epoch += 1
    mean = (args.steps - 1) * args.batch_size / (time.perf_counter() - warm_at)
    rates = [WINDOW_STEPS * args.batch_size / (b - a) for a, b in zip(marks, marks[1:])]
    if rank == 0:
        print(json.dumps({"samples_per_s": steady_rate(rates), "mean_samples_per_s": mean,
                          "window_rates": rates, "window_marks": wall_marks, "train_s": time.perf_counter() - started,
                          "threads": torch.get_num_threads(), "world": world}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
