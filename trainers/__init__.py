"""Training: the job spec, the launcher, the per-worker loop, data, checkpoints, workloads."""

import os

# A local Ray started here stays on loopback. Ray reads this once, at import, and otherwise swaps
# 127.0.0.1 for the machine's outward address (resolve_ip_for_localhost). Remote cluster
# addresses are not affected.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
