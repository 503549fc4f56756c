"""Loss curves against stored references (as torchtitan keeps golden loss files): the same small
language-model job with accumulation x2, dynamic batching, bf16 autocast and gradient
checkpointing, each compared step by step with its curve in tests/golden/. A change that alters
the math fails here; a change that only moves work around does not.

Regenerate after an intended change of the math: ETRAIN_UPDATE_GOLDEN=1 pytest this file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cluster.storage import open_root
from trainers.config.loading import validate
from trainers.history import read_history
from trainers.launch import EXIT_OK, run_job

pytestmark = [pytest.mark.ray, pytest.mark.no_dashboard]
GOLDEN = Path(__file__).resolve().parents[1] / "golden"
VARIANTS = {
    "accumulation_x2": ({"training": {"micro_batch_size": 4}}, 1e-5),
    "dynamic_batching": ({"data": {"dynamic_batching": True, "max_tokens_per_batch": 512}}, 1e-5),
    "bf16_autocast": ({"training": {"mixed_precision": "bf16"}}, 1e-3),
    "gradient_checkpointing": ({"training": {"gradient_checkpointing": True}}, 1e-5),
}


def lm_spec(root: Path, name: str, overrides: dict):
    spec = {
        "name": name, "training": {"batch_size": 16, "learning_rate": 3e-3, "max_steps": 8, "log_interval_steps": 1},
        "distributed": {"num_workers": 2}, "checkpoint": {"interval": 8, "storage_root": str(root)},
        "model": {"name": "tiny_gpt", "d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 64},
        "data": {"source": "builtin:text", "num_workers": 0},
    }
    for section, values in overrides.items():
        spec[section] = {**spec[section], **values}
    return validate(spec)


@pytest.fixture(scope="module")
def curves(ray_local, tmp_path_factory) -> dict[str, tuple[int, dict, list[float]] | BaseException]:
    """Every variant's job, one after another (two at a time in threads of this process met
    CPython 3.11's "AST constructor recursion depth mismatch" in a full run). Each test reads its
    own variant's."""
    roots = {v: tmp_path_factory.mktemp(v) for v in VARIANTS}  # one each: a job prepares its data in its root

    def run(variant: str) -> tuple[int, dict, list[float]] | BaseException:
        name, root = variant.replace("_", "-"), roots[variant]
        try:
            code, summary = run_job(lm_spec(root, name, VARIANTS[variant][0]))
        except Exception as exc:  # boundary: the variant's own test reports it; the others still run
            return exc
        return code, summary, [row["loss"] for row in read_history(open_root(str(root)), name)]

    return {variant: run(variant) for variant in sorted(VARIANTS)}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_loss_curve_matches_its_reference(curves, variant):
    _, rtol = VARIANTS[variant]
    if isinstance(curves[variant], BaseException):
        raise curves[variant]
    code, summary, losses = curves[variant]
    assert code == EXIT_OK, summary
    assert len(losses) == 8
    path = GOLDEN / f"loss_{variant}.json"
    if os.environ.get("ETRAIN_UPDATE_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(json.dumps({"losses": losses}, indent=1) + "\n")
    reference = json.loads(path.read_text())["losses"]
    assert losses == pytest.approx(reference, rel=rtol), f"{variant}: the loss curve moved"


def test_references_agree_where_the_math_is_the_same():
    """Accumulation and recomputation change how, not what: their curves are one curve; bf16 stays
    within its rounding of it; dynamic batching trains on other batches and must differ."""
    curves = {v: json.loads((GOLDEN / f"loss_{v}.json").read_text())["losses"] for v in VARIANTS}
    assert curves["gradient_checkpointing"] == pytest.approx(curves["accumulation_x2"], rel=1e-5)
    assert curves["bf16_autocast"] == pytest.approx(curves["accumulation_x2"], rel=1e-3)
    assert curves["dynamic_batching"] != pytest.approx(curves["accumulation_x2"], rel=1e-3)
