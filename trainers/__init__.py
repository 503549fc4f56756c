"""Training: the job spec, the launcher, the per-worker loop, data, checkpoints, workloads."""

from cluster.ray_adapter.local import default_to_loopback

# A local Ray started here stays on loopback: Ray reads its switch once, at import (see there).
default_to_loopback()
