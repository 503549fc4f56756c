"""A driver only starts workers: `etrain run`, each Ray Jobs driver of the service and each sweep
trial's build the trainer and prepare the data without importing torch (~1.7 CPU-s and ~300 MB
in every such process). Checked in a fresh interpreter; no Ray is started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

DRIVER = """
import sys
import service.cli, trainers.cli, trainers.sweep.cli  # what the commands import
from trainers.config.loading import validate
from trainers.job_folder import job_home
from trainers.launch import build_trainer, resolve_runtime
from trainers.workloads.datasets import prepare_data
from cluster.storage import open_root

root = sys.argv[1]
for model in ({"hidden_size": 8}, {"name": "tiny_gpt", "d_model": 8, "n_layers": 1, "n_heads": 1, "max_seq_len": 16}):
    spec = validate({"name": "driver", "model": model, "checkpoint": {"storage_root": root}})
    uri = prepare_data(spec, open_root(root))
    trainer = build_trainer(spec, job_home(spec), resolve_runtime(spec, 0.0), uri, None)
    trainer._create_default_callbacks()  # what fit() hands the controller
    trainer._get_train_func()
print("torch imported:", "torch" in sys.modules)
"""


def test_a_driver_builds_its_trainer_and_data_without_torch(tmp_path):
    out = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                         timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "torch imported: False" in out.stdout, out.stdout
    assert sorted(p.name for p in (tmp_path / "datasets").iterdir()) == ["digits-v1.parquet", "text-v1.parquet"]
