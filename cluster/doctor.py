"""`etrain doctor`: the deployment guide's environment checklist as one command.

Python, torch, CUDA and NCCL versions and whether they fit each other; GPUs visible; the
Ray cluster reachable, its resources, and the same Ray (and torch) on every node; the
storage root writable. Each finding says what to do. Exit code 1 on a blocking problem.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from typing import Literal

from cluster.capacity import GpuCapacity, gpu_capacity

PINNED_RAY = "2.60.0"
MIN_PYTHON = (3, 10)

Level = Literal["ok", "warn", "error"]


@dataclass(frozen=True)
class Finding:
    level: Level
    what: str
    fix: str = ""


def exit_code(findings: list[Finding]) -> int:
    return 1 if any(f.level == "error" for f in findings) else 0


def check_python(version: tuple[int, int, int] = sys.version_info[:3]) -> Finding:
    shown = ".".join(map(str, version))
    if tuple(version[:2]) < MIN_PYTHON:
        return Finding("error", f"Python {shown}", f"use Python {'.'.join(map(str, MIN_PYTHON))} or newer")
    return Finding("ok", f"Python {shown}")


def check_torch() -> list[Finding]:
    """torch, its CUDA build, NCCL, and the GPUs the driver shows, with how they fit."""
    try:
        import torch
    except ImportError:
        return [Finding("error", "torch is not installed", "make demo (or pip install torch) in this environment")]
    out = [Finding("ok", f"torch {torch.__version__}")]
    built_cuda = torch.version.cuda
    smi = shutil.which("nvidia-smi")
    driver = _nvidia_smi_driver() if smi else None
    if not built_cuda:
        level: Level = "warn" if smi else "ok"
        out.append(Finding(level, "torch is a CPU build" + (" but this machine has NVIDIA GPUs" if smi else ""),
                           "install a CUDA build of torch to train on the GPUs" if smi else ""))
    else:
        out.append(Finding("ok", f"torch built for CUDA {built_cuda}"))
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
            out.append(Finding("ok", f"NCCL {nccl}"))
        except Exception as exc:  # boundary: report, do not crash the doctor
            out.append(Finding("warn", f"NCCL version unknown ({exc})", "reinstall torch with its NCCL"))
    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        out.append(Finding("ok", f"{torch.cuda.device_count()} GPU(s) visible: {', '.join(names)}"
                                 + (f", driver {driver}" if driver else "")))
    elif smi and built_cuda:
        out.append(Finding("error", f"nvidia-smi sees GPUs (driver {driver}) but torch cannot use them",
                           f"the driver is likely too old for CUDA {built_cuda}: upgrade the NVIDIA driver "
                           "or install a torch built for an older CUDA"))
    else:
        out.append(Finding("warn", "no GPU visible: training runs on CPUs with gloo",
                           "fine for a laptop; on a GPU node check nvidia-smi and the driver"))
    return out


def _nvidia_smi_driver() -> str | None:
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
        return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def check_ray(address: str | None) -> list[Finding]:
    """Ray's version, the cluster's resources, and the same Ray and torch on every node."""
    import ray

    out = [Finding("ok" if ray.__version__ == PINNED_RAY else "error", f"Ray {ray.__version__} here",
                   "" if ray.__version__ == PINNED_RAY else f"install ray=={PINNED_RAY}, as every node has")]
    try:
        ray.init(address=address or "auto", logging_level="ERROR", log_to_driver=False)
    except (ConnectionError, RuntimeError) as exc:
        out.append(Finding("warn", f"no running Ray cluster found ({str(exc).splitlines()[0][:120]})",
                           "fine for `etrain run` (it starts a local Ray); for a cluster: ray up ray_cluster.yaml, "
                           "then set RAY_ADDRESS"))
        return out
    try:
        res = ray.cluster_resources()
        nodes = [n for n in ray.nodes() if n["Alive"]]
        out.append(Finding("ok", f"Ray cluster reachable: {len(nodes)} node(s), {res.get('CPU', 0):g} CPU, "
                                 f"{res.get('GPU', 0):g} GPU"))
        out.append(check_gpu_decision(gpu_capacity(res.get("GPU", 0))))
        versions = _versions_per_node(nodes)
        distinct = sorted(set(versions.values()))
        if len(distinct) > 1:
            detail = "; ".join(f"{ip}: ray {r}, torch {t}" for ip, (r, t) in sorted(versions.items()))
            out.append(Finding("error", f"nodes run different versions ({detail})",
                               f"install ray=={PINNED_RAY} and the same torch on every node (setup_commands)"))
        elif distinct:
            out.append(Finding("ok", f"every node runs ray {distinct[0][0]}, torch {distinct[0][1]}"))
    finally:
        ray.shutdown()
    return out


def check_gpu_decision(capacity: GpuCapacity) -> Finding:
    """Which way `use_gpu: auto` goes on this cluster, and why."""
    if capacity.now > 0 or capacity.launchable > 0:
        return Finding("ok", f"jobs with use_gpu: auto train on GPUs with NCCL: {capacity.describe()}")
    return Finding("ok", f"jobs with use_gpu: auto train on CPUs with gloo: {capacity.describe()}")


def _versions_per_node(nodes: list[dict]) -> dict[str, tuple[str, str]]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def versions() -> tuple[str, str]:
        import ray as r

        try:
            import torch

            return r.__version__, torch.__version__
        except ImportError:
            return r.__version__, "missing"

    refs = {n["NodeManagerAddress"] + ":" + n["NodeID"][:6]: versions.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote() for n in nodes}
    return {k: tuple(ray.get(v, timeout=60)) for k, v in refs.items()}


def check_storage(uri: str) -> Finding:
    """Write, read back and delete a probe file under the storage root."""
    from cluster.storage import open_root

    probe = f".etrain-doctor-{uuid.uuid4().hex[:8]}"
    try:
        root = open_root(uri)
        root.write_bytes(b"ok", probe)
        assert root.read_bytes(probe) == b"ok"
        root.fs.delete_file(root.path(probe))
    except Exception as exc:  # boundary: any failure means the root cannot hold checkpoints
        return Finding("error", f"storage root {uri} is not writable ({type(exc).__name__}: {str(exc)[:160]})",
                       "choose a writable directory or bucket (checkpoint.storage_root / $ETRAIN_STORAGE_ROOT); "
                       "for S3 check credentials, region and `etrain storage init`")
    return Finding("ok", f"storage root {uri} is writable")


HF_PACKAGES = ("transformers", "tokenizers")


def check_hf(find=importlib.util.find_spec) -> Finding:
    """The Hugging Face packages ``model.hf`` needs: a warning only, other jobs run without them."""
    missing = [name for name in HF_PACKAGES if find(name) is None]
    if missing:
        return Finding("warn", f"{' and '.join(missing)} not installed: jobs with model.hf cannot run here",
                       "pip install transformers==5.23.0 tokenizers==0.23.3 (pinned in pyproject.toml)")
    from importlib.metadata import version

    return Finding("ok", ", ".join(f"{name} {version(name)}" for name in HF_PACKAGES))


def run_checks(storage_uri: str, address: str | None) -> list[Finding]:
    return [check_python(), *check_torch(), check_hf(), *check_ray(address), check_storage(storage_uri)]


def render(findings: list[Finding]) -> str:
    marks = {"ok": "ok  ", "warn": "warn", "error": "FAIL"}
    lines = []
    for f in findings:
        lines.append(f"[{marks[f.level]}] {f.what}")
        if f.fix and f.level != "ok":
            lines.append(f"       fix: {f.fix}")
    problems = sum(f.level == "error" for f in findings)
    lines.append(f"{problems} blocking problem(s)" if problems else "no blocking problems")
    return "\n".join(lines)
