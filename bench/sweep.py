"""Sweep overhead and what ASHA buys, measured side by side in one run on a local Ray.

The same sweep (the quickstart over batch size, learning rate and loader workers, same seed,
so the same trials) runs twice, 2 trials at a time: first with FIFO (every trial to the end),
then with ASHA.

- overhead: FIFO's wall time over its theoretical minimum, the sum of the trials' own times
  divided by the concurrency. Target <= 1.2 (Ray's release tests allow 1.2-1.28).
- ASHA speed: the time until ASHA has a trial within 1% of FIFO's best loss, over the time
  FIFO took to finish (when FIFO's best is known). Target <= 0.5.

    python bench/sweep.py [--trials 8] [--steps 300]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
from pathlib import Path
from tempfile import mkdtemp

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep every address on loopback


def run(scheduler: str, trials: int, steps: int, root: str, concurrency: int) -> dict:
    from cluster.log_lines import lines_to
    from trainers.sweep.spec import load_sweep
    from trainers.sweep.tune_run import run_sweep

    plan = load_sweep(REPO / "configs" / "sweep.yaml", [f"training.max_steps={steps}",
                                                        f"checkpoint.interval={max(1, steps // 6)}",
                                                        f"checkpoint.storage_root={root}"])
    sweep = plan.sweep.model_copy(update={"scheduler": scheduler, "num_samples": trials,
                                          "max_concurrent_trials": concurrency})
    plan = dataclasses.replace(plan, name=f"bench-{scheduler}", sweep=sweep)
    with lines_to(lambda line: print(line, file=sys.stderr, flush=True)):  # stdout holds the figures only
        code, report = run_sweep(plan)
    if code != 0:
        raise SystemExit(f"{scheduler} sweep failed: {[t['error'] for t in report['trials'] if t['error']]}")
    return report


def time_to_reach(report: dict, loss: float) -> float | None:
    """Seconds from the sweep's start to its first report with a loss at or under ``loss``."""
    times = [h["timestamp"] for t in report["trials"] for h in t["history"] if h.get("loss") is not None
             and h["loss"] <= loss]
    return min(times) - report["started_at"] if times else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300, help="steps per trial")
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()

    import ray

    root = mkdtemp(prefix="etrain-bench-sweep-")
    ray.init(address="local", num_cpus=max(4, 2 * args.concurrency), _node_ip_address="127.0.0.1",
             include_dashboard=True, dashboard_host="127.0.0.1", configure_logging=True, logging_level="WARNING",
             log_to_driver=False)
    try:
        fifo = run("fifo", args.trials, args.steps, root, args.concurrency)
        asha = run("asha", args.trials, args.steps, root, args.concurrency)
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    work = sum(t["time_s"] for t in fifo["trials"])
    minimum = work / args.concurrency
    best = fifo["best"]["loss"]
    reach = time_to_reach(asha, best * 1.01)
    stopped = sum(t["status"] == "stopped early" for t in asha["trials"])
    print(f"trials: {args.trials} ({args.steps} steps each, {args.concurrency} at a time)")
    print(f"fifo wall time: {fifo['wall_time_s']:.1f} s")
    print(f"fifo theoretical minimum: {minimum:.1f} s")
    print(f"asha wall time: {asha['wall_time_s']:.1f} s")
    print(f"asha trials stopped early: {stopped}")
    print(f"fifo best loss: {best:.4f}")
    print(f"asha best loss: {asha['best']['loss']:.4f}")
    print(f"sweep overhead ratio: {fifo['wall_time_s'] / minimum:.2f}")
    print(f"asha time to fifo best ratio: {reach / fifo['wall_time_s']:.2f}" if reach is not None
          else "asha time to fifo best ratio: inf")


if __name__ == "__main__":
    main()
