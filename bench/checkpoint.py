"""What checkpointing costs training, with uploads to S3 (a moto server on loopback), in one run.

The same 2-worker job (digits MLP, wide enough that a checkpoint is a few MB) runs three
times on one local Ray: with no checkpoint but the last, with one every N steps uploaded
asynchronously, and the same uploaded synchronously. Figures:

- async checkpoint throughput ratio: samples/s with async checkpoints over none. Target >= 0.97.
- report() blocking seconds, async and sync (median over the job's checkpoints): what the
  training thread paid at a checkpoint (the state copy is reported apart, as save seconds).
- async checkpoints taken: an interval checkpoint is left to the next interval step while the
  one before is still being written and reported (trainers.checkpointer), so fewer than
  steps / interval may be taken.

    python bench/checkpoint.py [--steps 1500] [--interval 100]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep every address on loopback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--interval", type=int, default=100)
    parser.add_argument("--hidden", type=int, default=2048)
    args = parser.parse_args()

    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1"})
    boto3.client("s3").create_bucket(Bucket="bench")
    import ray

    from cluster.storage import open_root
    from trainers.config import validate
    from trainers.history import read_history
    from trainers.launch import run_job

    ray.init(address="local", num_cpus=4, _node_ip_address="127.0.0.1", include_dashboard=True,
             dashboard_host="127.0.0.1", configure_logging=True, logging_level="WARNING", log_to_driver=False)
    results = {}
    try:
        for name, interval, upload in (("none", args.steps, "async"), ("async", args.interval, "async"),
                                       ("sync", args.interval, "sync")):
            spec = validate({
                "name": f"ckpt-{name}", "training": {"batch_size": 128, "max_steps": args.steps,
                                                     "learning_rate": 0.001, "log_interval_steps": 50},
                "distributed": {"num_workers": 2}, "model": {"hidden_size": args.hidden},
                "checkpoint": {"interval": interval, "upload": upload, "min_interval_s": 0, "num_to_keep": 2,
                               "storage_root": "s3://bench/runs"}})
            code, summary = run_job(spec, say=lambda m: print(m, file=sys.stderr))
            if code != 0:
                raise SystemExit(f"{name} run failed: {summary['error']}")
            rows = read_history(open_root("s3://bench/runs"), spec.name)
            blocked = [r["checkpoint_report_s"] for r in rows if r.get("checkpoint_report_s") is not None]
            results[name] = (summary["samples_per_s"], statistics.median(blocked) if blocked else None, len(blocked))
            print(f"[bench] {name}: {results[name][0]:.0f} samples/s, report() median {results[name][1]}s",
                  file=sys.stderr)
    finally:
        ray.shutdown()
        server.stop()
    size = args.hidden * (64 + 10) * 4 * 3 / 1e6
    print(f"checkpoint size: {size:.1f} MB (model + AdamW state)")
    print(f"samples/s without checkpoints: {results['none'][0]:.0f}")
    print(f"samples/s with async checkpoints every {args.interval} steps: {results['async'][0]:.0f}")
    print(f"samples/s with sync checkpoints every {args.interval} steps: {results['sync'][0]:.0f}")
    print(f"async checkpoints taken: {results['async'][2]}")
    print(f"report() blocking with async upload: {results['async'][1]:.3f} s")
    print(f"report() blocking with sync upload: {results['sync'][1]:.3f} s")
    print(f"sync checkpoint throughput ratio: {results['sync'][0] / results['none'][0]:.3f}")
    print(f"async checkpoint throughput ratio: {results['async'][0] / results['none'][0]:.3f}")


if __name__ == "__main__":
    main()
