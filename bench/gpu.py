"""The prepared GPU run (one lent H200, see the device tool): one call, under 8 minutes.

1. the measured bf16 matmul rate (the MFU denominator);
2. the LM workload sized to fill the GPU, trained by `etrain run` with 1 NCCL DDP worker and
   bf16 autocast: tokens/s, samples/s, model FLOPs utilisation (achieved training FLOPs over
   the measured matmul rate; FLOPs from the real tokens processed and their real sequence
   length, without gradient checkpointing unless asked), checkpoint save and report seconds;
3. the CUDA tests (tests/gpu).

Figures print last as `name: value` lines. Without a GPU it says so and exits 2;
`--cpu-check` runs the same steps tiny on CPU to check the script itself.

    python bench/gpu.py [--steps 120] [--cpu-check]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]
GPU_MODEL = {"d_model": 1024, "n_layers": 16, "n_heads": 16, "max_seq_len": 1024}
CPU_MODEL = {"d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 128}


def matmul_rate(device: str, n: int, iters: int) -> float:
    """Measured FLOP/s of an n x n matmul (bf16 on GPU, fp32 on CPU)."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iters):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n ** 3 * iters / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--cpu-check", action="store_true", help="run tiny on CPU to check the script")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="recompute activations (off by default: it adds a forward that MFU does not count)")
    args = parser.parse_args()
    import torch

    from trainers.config.loading import validate
    from trainers.workloads.lm import flops_per_token

    gpu = torch.cuda.is_available()
    if not gpu and not args.cpu_check:
        print("no CUDA GPU here: run this on a lent GPU machine, or pass --cpu-check", file=sys.stderr)
        sys.exit(2)
    device = "cuda" if gpu else "cpu"
    model_cfg = GPU_MODEL if gpu else CPU_MODEL
    steps = args.steps if gpu else 6
    batch = args.batch_size if gpu else 8
    peak = matmul_rate(device, 8192 if gpu else 512, 50 if gpu else 3)
    print(f"[gpu] {torch.cuda.get_device_name() if gpu else 'cpu'}: matmul {peak / 1e12:.1f} TFLOP/s", file=sys.stderr)

    root = tempfile.mkdtemp(prefix="etrain-bench-gpu-")
    sets = {"name": "gpu-bench", "distributed.num_workers": 1, "distributed.use_gpu": gpu,
            "training.mixed_precision": "bf16", "training.max_steps": steps, "training.batch_size": batch,
            "training.log_interval_steps": max(1, steps // 12), "checkpoint.interval": max(1, steps // 2),
            "checkpoint.min_interval_s": 0, "data.dynamic_batching": False, "training.micro_batch_size": batch,
            "training.gradient_checkpointing": args.gradient_checkpointing,
            **{f"model.{k}": v for k, v in model_cfg.items()}}
    cmd = [sys.executable, "-m", "trainers.train", str(REPO / "configs" / "lm.yaml"), "--json"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={json.dumps(v)}"]
    started = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=420,
                         env={**os.environ, "ETRAIN_STORAGE_ROOT": root})
    wall = time.perf_counter() - started
    if out.returncode != 0:
        print(out.stderr[-4000:], file=sys.stderr)
        raise SystemExit("the GPU training run failed")
    summary = json.loads((Path(root) / "gpu-bench" / "summary.json").read_text())  # stdout has Ray's logs too

    from cluster.storage import open_root
    from trainers.history import read_history
    from trainers.workloads import resolve

    rows = read_history(open_root(root), "gpu-bench")
    steady = rows[len(rows) // 3:] or rows  # past warm-up and compilation of kernels
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in steady)
    # Attention's FLOPs grow with the context actually processed: real tokens per sequence, not max_seq_len.
    seq_len = statistics.median(r["tokens_per_s"] / r["samples_per_s"] for r in steady if r["samples_per_s"])
    spec = validate({"name": "x", "model": {"name": "tiny_gpt", **model_cfg}})
    params = sum(p.numel() for p in resolve(spec).build_model(spec).parameters())
    achieved = tokens_per_s * flops_per_token(params, model_cfg["n_layers"], model_cfg["d_model"], seq_len)
    saves = [r["checkpoint_save_s"] for r in rows if r.get("checkpoint_save_s") is not None]
    reports = [r["checkpoint_report_s"] for r in rows if r.get("checkpoint_report_s") is not None]
    tests = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-q"], capture_output=True, text=True,
                           cwd=REPO, timeout=300) if gpu else None

    print(f"device: {torch.cuda.get_device_name() if gpu else 'cpu (script check only)'}")
    print(f"model parameters: {params}")
    print(f"measured matmul tflops: {peak / 1e12:.1f}")
    print(f"tokens/s: {tokens_per_s:.0f}")
    print(f"tokens per sequence: {seq_len:.0f}")
    print(f"samples/s: {summary['samples_per_s']:.1f}")
    print(f"model tflops achieved: {achieved / 1e12:.2f}")
    print(f"checkpoint save s: {statistics.median(saves) if saves else float('nan'):.2f}")
    print(f"checkpoint report s: {statistics.median(reports) if reports else float('nan'):.2f}")
    print(f"job wall time s: {wall:.1f}")
    if tests is not None:
        print(tests.stdout[-1500:], file=sys.stderr)
        print(f"cuda tests exit code: {tests.returncode}")
    print(f"mfu: {achieved / peak:.3f}")


if __name__ == "__main__":
    main()
