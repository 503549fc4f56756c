"""Training: the job spec, the launcher, the per-worker loop, data, checkpoints, workloads."""
