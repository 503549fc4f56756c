"""CUDA paths: NCCL DDP, bf16 autocast, fp16 with GradScaler. Run by bench/gpu.py on a lent GPU;
`make test` leaves this folder out (this machine has no GPU)."""

from __future__ import annotations

import math

import pytest
import torch

from trainers.config.loading import validate
from trainers.launch import EXIT_OK, resolve_runtime, run_job

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu.py runs these)"),
              pytest.mark.no_dashboard]


def lm_spec(root, name: str, precision: str) -> object:
    return validate({"name": name, "training": {"batch_size": 16, "max_steps": 20, "mixed_precision": precision},
                     "distributed": {"num_workers": 1, "use_gpu": True}, "model": {"name": "tiny_gpt"},
                     "checkpoint": {"interval": 10, "storage_root": str(root)}})


def test_runtime_picks_nccl_on_gpus(tmp_path):
    runtime = resolve_runtime(lm_spec(tmp_path, "rt", "bf16"), cluster_gpus=1)
    assert runtime.use_gpu and runtime.backend == "nccl"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_gpu_job_trains_and_resumes(ray_local, tmp_path, precision):
    spec = lm_spec(tmp_path, f"gpu-{precision}", precision)
    code, summary = run_job(spec, stop_at_step=10)
    assert summary["final_step"] == 10
    code, summary = run_job(spec)
    assert code == EXIT_OK and summary["final_step"] == 20
    assert summary["final_loss"] < 0.8 * math.log(257), summary  # well below a uniform guess over bytes
