"""Our training loop against plain PyTorch DDP, side by side in one run.

The same model (digits MLP), data (the digits Parquet, held in memory as tensors on both
sides: bench/plain_ddp.py's ``digits_pairs``), global batch, optimizer, 2 gloo workers and
1 thread each, trained (a) by torchrun running bench/plain_ddp.py and (b) by `etrain run`
on a local Ray.

The two run at once and take turns (bench/turns.py): each runs for a slice of a few seconds
while every process of the other (torchrun's ranks; the etrain driver, its Ray and Ray's
workers) is stopped, and only a 100-step window wholly inside one turn counts. Run one after
the other, a pair's ratio here measured the host (0.57-1.83 in one hour). Figures:

- throughput ratio: (b)'s steady samples/s over (a)'s, each from its counted windows
  (bench/plain_ddp.py's ``steady_rate``: the first tenth left out, then the slowest and fastest
  tenth; every cost of ours in more than a tenth of the windows stays: Ray's processes run in
  (b)'s turns only). Target >= 0.98 (Ray's own release test only asks <= 1.15 in time).
- throughput ratio with our loader: (b) reading the built-in digits set through our own
  data path (Parquet -> plan -> loader) instead of the in-memory tensors; reported.
- end-to-end ratio: the time each whole command ran (its turns, and alone after the other
  ended), start-up included, (b) over (a); reported, no target (Ray's start-up is the difference).
- ratio at equal scheduling: (b) over (a) run wholly under SCHED_BATCH, the policy our CPU ranks
  take (cluster/ray_adapter/train_worker.py: batch_schedule_worker), a third side of the in-memory turns;
  reported, no target. Torchrun's ranks gain from it as much as ours or more: the difference
  between this figure and the throughput ratio is what that policy gives, the rest is our cost.

    python bench/ddp_overhead.py [--steps 6000] [--repeats 1] [--slice-s 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]
PY = sys.executable

from bench.plain_ddp import WINDOW_STEPS, steady_rate  # noqa: E402  (the repository is on the path from here)
from bench.turns import Command, run_in_turns, windows_in_slices  # noqa: E402
from cluster.storage import open_root  # noqa: E402
from trainers.history import read_history  # noqa: E402


def prepare_data(root: str) -> str:
    from trainers.config.loading import validate
    from trainers.workloads.datasets import DIGITS_FILE, digits_table, prepare_builtin

    return prepare_builtin(validate({"name": "x"}), open_root(root), DIGITS_FILE, digits_table)


STARTUP_STEPS = 4000  # ~15 s of torchrun's training: about what etrain's start (a local Ray) takes


def plain_command(data: str, steps: int, batch: int, hidden: int) -> Command:
    """torchrun's run of bench/plain_ddp.py: (command, environment)."""
    return ([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(REPO / "bench" / "plain_ddp.py"),
             "--data", data, "--steps", str(steps), "--batch-size", str(batch), "--hidden", str(hidden)],
            {**os.environ, "OMP_NUM_THREADS": "1"})


def ours_command(root: str, steps: int, batch: int, hidden: int, name: str,
                 data: str | None = None) -> Command:
    """One `etrain run` of the quickstart at the same settings: (command, environment). ``data``: the
    Parquet file to hold in memory (else the built-in set through our loader)."""
    env = {**os.environ, "ETRAIN_STORAGE_ROOT": root, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    in_memory = ["--set", "data.factory=bench.plain_ddp:digits_pairs", "--set", "data.source=null",
                 "--set", f"data.options={{path: {data}}}"] if data else []
    return ([PY, "-m", "trainers.train", str(REPO / "configs" / "quickstart.yaml"), "--json",
             "--set", f"name={name}", "--set", f"training.max_steps={steps}",
             "--set", f"training.batch_size={batch}", "--set", "training.learning_rate=0.001",
             "--set", "training.lr_schedule={kind: constant}",
             "--set", f"training.log_interval_steps={WINDOW_STEPS}",
             "--set", f"model.hidden_size={hidden}", "--set", f"checkpoint.interval={steps}",
             "--set", "distributed.num_workers=2", *in_memory], env)


BATCH_EXEC = ("import os, sys; os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0)); "
              "os.execvp(sys.argv[1], sys.argv[1:])")


def batch_scheduling_allowed() -> bool:
    """Whether this machine lets a process take SCHED_BATCH (Linux; not refused by a sandbox): else the
    bench runs without its equal-scheduling side rather than fail the pair."""
    if not hasattr(os, "SCHED_BATCH"):
        return False
    import subprocess

    argv, _ = under_batch_scheduling(([PY, "-c", "pass"], {}))
    probe = subprocess.run(argv, capture_output=True, timeout=60)
    return probe.returncode == 0


def under_batch_scheduling(command: Command) -> Command:
    """``command`` with SCHED_BATCH from its start: every process and thread it starts inherits it."""
    argv, env = command
    return [PY, "-c", BATCH_EXEC, *argv], env


def sliced_runs(plain: dict[str, Command], ours_cmd: Command, ours_root: str, ours_name: str,
                batch: int, slice_s: float, settle_s: float) -> tuple[dict[str, float], float]:
    """Plain DDP (one run per entry of ``plain``) and one etrain run at once, taking turns on the machine
    in slices of ``slice_s``: all meet the same host, whose speed here swings by up to 2x within
    minutes (one after the other, a pair's ratio ranged 0.57-1.83). Returns (each side's steady
    samples/s, "ours" included; the running-time ratio of the etrain command over the first plain
    one, start-up included). Only windows inside a slice count (:func:`windows_in_slices`)."""
    logs = tempfile.TemporaryDirectory(prefix="etrain-bench-sliced-")
    slices, alone = run_in_turns({**plain, "ours": ours_cmd}, slice_s, Path(logs.name), REPO)
    marks = {"ours": [row["time"] for row in read_history(open_root(ours_root), ours_name)]}
    for side in plain:
        out = (Path(logs.name) / f"{side}.out").read_text()
        marks[side] = json.loads([x for x in out.splitlines() if x.startswith("{")][-1])["window_marks"]
    rates = {}
    for side, side_marks in marks.items():
        durations = windows_in_slices(side_marks, slices[side], settle_s)
        rates[side] = steady_rate([WINDOW_STEPS * batch / d for d in durations])
    running = {side: sum(b - a for a, b in slices[side]) + alone[side] for side in slices}
    return rates, running["ours"] / running[next(iter(plain))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6000, help="steps of each etrain run")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=1, help="sliced pairs of each kind")
    parser.add_argument("--slice-s", type=float, default=4.0, help="how long each side runs in its turn")
    parser.add_argument("--settle-s", type=float, default=0.3, help="windows starting this soon after a turn begins "
                        "are not counted")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="etrain-bench-ddp-")
    data = prepare_data(root)
    # torchrun starts in seconds where etrain starts Ray: its extra steps keep it running until etrain trains
    plain_steps = args.steps + STARTUP_STEPS
    equal_side = batch_scheduling_allowed()
    if not equal_side:
        print("[bench] SCHED_BATCH is not available here: no ratio at equal scheduling", file=sys.stderr)
    figures: dict[str, list[float]] = {"plain": [], "ours": [], "loader": [], "ratio": [], "loader ratio": [], "wall": [],
                                       "plain batch": [], "batch ratio": []}
    for i in range(args.repeats):
        for kind, data_arg in (("in-memory", data), ("loader", None)):
            name = f"ddp-bench-{kind}-{i}"
            plain = {"plain": plain_command(data, plain_steps, args.batch_size, args.hidden)}
            if kind == "in-memory" and equal_side:
                plain["plain batch"] = under_batch_scheduling(plain["plain"])
            rates, wall = sliced_runs(plain, ours_command(root, args.steps, args.batch_size, args.hidden, name, data_arg),
                                      root, name, args.batch_size, args.slice_s, args.settle_s)
            a, b = rates["plain"], rates["ours"]
            batch_note = (f"; plain under SCHED_BATCH {rates['plain batch']:.0f} samples/s, ratio to it "
                          f"{b / rates['plain batch']:.3f}" if "plain batch" in rates else "")
            print(f"[bench] pair {i} ({kind}): plain {a:.0f} samples/s, etrain {b:.0f} samples/s, ratio {b / a:.3f}; "
                  f"running time ratio {wall:.2f}{batch_note}", file=sys.stderr)
            if kind == "in-memory":
                figures["plain"].append(a)
                figures["ours"].append(b)
                figures["ratio"].append(b / a)
                figures["wall"].append(wall)
                if "plain batch" in rates:
                    figures["plain batch"].append(rates["plain batch"])
                    figures["batch ratio"].append(b / rates["plain batch"])
            else:
                figures["loader"].append(b)
                figures["loader ratio"].append(b / a)
    median = {k: statistics.median(v) for k, v in figures.items() if v}
    print(f"plain ddp samples/s: {median['plain']:.0f}")
    print(f"etrain samples/s: {median['ours']:.0f}")
    print(f"end-to-end time ratio: {median['wall']:.2f}")
    if "batch ratio" in median:
        # (no capitals or underscores in a figure's name: bench/run_all.py collects `name: value` lines)
        print(f"plain ddp samples/s under batch scheduling: {median['plain batch']:.0f}")
        print(f"throughput ratio at equal scheduling (plain under batch scheduling too): {median['batch ratio']:.3f}")
    print(f"etrain samples/s with our loader: {median['loader']:.0f}")
    print(f"throughput ratio with our loader: {median['loader ratio']:.3f}")
    print(f"throughput ratio: {median['ratio']:.3f} (pairs: {', '.join(f'{r:.3f}' for r in figures['ratio'])})")


if __name__ == "__main__":
    main()
