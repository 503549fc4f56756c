"""A sweep file checked up front: its ``sweep`` section, its search space (every listed value in
its trial's job spec), its base job spec; each problem names ``sweep.<field>`` and the fix."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from trainers.config.errors import SpecError, format_errors
from trainers.config.fields import Strict
from trainers.config.job import JobSpec, WorkerRange, key_problem
from trainers.config.loading import apply_overrides, default_name, read_spec_file, validate

DOMAINS = {
    "choice": "pick one of the listed values",
    "grid": "try every listed value",
    "uniform": "a float between [low, high]",
    "loguniform": "a float between [low, high], uniform in log space (learning rates)",
    "randint": "a whole number between [low, high], both included",
}
# What the training loop reports at its checkpoints, and so what a sweep can optimise.
METRICS = ("loss", "samples_per_s", "steady_samples_per_s", "tokens_per_s", "train_seconds")
# Trials are compared at equal data seen, so batch sizes compete on the same number of samples.
TIME_ATTR = "epochs_done"
# Every listed value is checked in its trial's job spec before a sweep is accepted, at a cost that
# grows with the spec: the values a space lists in all are bounded, so that check stays short (a
# search needs far fewer; a range samples from many).
MAX_SPACE_VALUES = 256


class SweepConfig(Strict):
    base: str | None = Field(None, description="job spec file to vary (relative to the sweep file); "
                                               "default: the rest of the sweep file")
    space: dict[str, dict[str, Any]] = Field(description="dotted spec key -> {choice|grid|uniform|loguniform|randint: ...}")
    metric: Literal[METRICS] = "loss"  # type: ignore[valid-type]
    mode: Literal["min", "max"] = "min"
    search: Literal["random", "grid", "optuna"] = "random"
    scheduler: Literal["asha", "median", "fifo"] = "asha"
    num_samples: int | None = Field(None, gt=0, description="trials to sample (default 8); with search: grid, "
                                                            "repeats of the whole grid (default 1)")
    max_concurrent_trials: int = Field(2, gt=0)
    workers_per_trial: int | WorkerRange | None = Field(None, description="default: the job's distributed.num_workers")
    grace_period_epochs: float = Field(0.25, gt=0, description="ASHA/median: data every trial sees before it may stop")
    reduction_factor: float = Field(2.0, gt=1, description="ASHA: keep 1/reduction_factor of the trials at each rung")
    seed: int = Field(0, ge=0, description="seed of the search, so the same sweep samples the same trials")


    @property
    def samples(self) -> int:
        return self.num_samples or (1 if self.search == "grid" else 8)


@dataclass(frozen=True)
class SweepPlan:
    """A checked sweep: the base job spec (as data and as a model) and the sweep settings."""

    name: str
    base: dict
    spec: JobSpec
    sweep: SweepConfig


def set_dotted(data: dict, key: str, value: Any) -> dict:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value
    return data


def trial_spec_data(base: dict, values: dict[str, Any]) -> dict:
    """The base spec with one trial's values set (the base is not changed).

    An absolute checkpoint.path would put every trial in one folder: a trial's stay in its own.
    """
    data = copy.deepcopy(base)
    for key, value in values.items():
        set_dotted(data, key, value)
    checkpoint = data.get("checkpoint")
    if isinstance(checkpoint, dict) and isinstance(checkpoint.get("path"), str):
        checkpoint["path"] = checkpoint["path"].lstrip("/")
    return data


def trial_spec_view(base: dict, key: str, value: Any) -> dict:
    """The base with one value set, sharing every part the key does not pass through: for checks
    that only read it (cheap for every listed value of a space, where a deep copy each is not)."""
    top = dict(base)
    node = top
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        node[part] = dict(child) if isinstance(child, dict) else {}
        node = node[part]
    node[parts[-1]] = value
    return top


def domain_problems(key: str, domain: Any, search: str) -> list[str]:
    """Shape checks of one space entry: one known domain, sensible bounds, fits the searcher."""
    path = f"sweep.space.{key}"
    example = "e.g. {loguniform: [1.0e-4, 1.0e-1]} or {choice: [32, 64]}"
    if not isinstance(domain, dict) or len(domain) != 1 or next(iter(domain)) not in DOMAINS:
        return [f"{path}: {json.dumps(domain, default=str)}: expected exactly one of {', '.join(DOMAINS)}: {example}"]
    kind, arg = next(iter(domain.items()))
    path = f"{path}.{kind}"
    if kind in ("choice", "grid"):
        if not isinstance(arg, list):
            return [f"{path}: {json.dumps(arg, default=str)}: not a list: write the values as a list, e.g. [32, 64]"]
        if not arg:
            return [f"{path}: []: empty: list at least one value"]
        if kind == "grid" and search == "optuna":
            return [f"{path}: grid: optuna samples, it does not enumerate: use choice, or search: grid"]
        return []
    if not (isinstance(arg, list) and len(arg) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                             for v in arg)):
        return [f"{path}: {json.dumps(arg, default=str)}: expected [low, high] numbers, e.g. [0.0001, 0.1]"]
    low, high = arg
    if low > high:
        return [f"{path}: [{low}, {high}]: low > high: swap them"]
    if kind == "loguniform" and low <= 0:
        return [f"{path}: [{low}, {high}]: log-uniform needs low > 0: use a positive lower bound such as 1e-6"]
    if kind == "randint" and not (float(low).is_integer() and float(high).is_integer()):
        return [f"{path}: [{low}, {high}]: randint needs whole numbers: use uniform for floats"]
    if search == "grid":
        return [f"{path}: a range cannot be enumerated by search: grid: list the values with grid/choice, "
                "or use search: random"]
    return []


def tune_expression_at(value: Any, path: str) -> str | None:
    """Where ``value`` holds a mapping keyed like a Ray Tune expression (``eval``, ``grid_search``),
    as a problem line, or None. Walked without recursion, at any depth."""
    from cluster.ray_adapter.tune import TUNE_EXPRESSION_KEYS

    stack = [(value, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            found = [k for k in TUNE_EXPRESSION_KEYS if k in node]
            if found:
                return (f"{where}: a mapping with the key {found[0]!r}: Ray Tune would read it as "
                        f"{'Python to run' if found[0] == 'eval' else 'more trials'}: listed values are data; "
                        "rename the key, or list the values you want under this key's own domain")
            stack.extend((child, f"{where}.{key}") for key, child in node.items())
        elif isinstance(node, list):
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(node))
    return None


def candidate_values(domain: dict) -> list[Any]:
    """Values that stand for a domain when checking it against the job spec: all listed, or both bounds."""
    kind, arg = next(iter(domain.items()))
    if kind == "randint":
        return [int(arg[0]), int(arg[1])]
    return list(arg)


def space_problems(sweep: SweepConfig, base: dict) -> list[str]:
    """Every problem of the search space at once, each naming ``sweep.space.<key>``."""
    problems, listed = [], 0
    if not sweep.space:
        return ["sweep.space: {}: empty: name at least one key to vary, e.g. training.learning_rate: "
                "{loguniform: [1.0e-4, 1.0e-1]}"]
    for key, domain in sweep.space.items():
        path = f"sweep.space.{key}"
        if key in ("name", "checkpoint", "checkpoint.storage_root"):
            problems.append(f"{path}: not searchable: a sweep names and stores its trials itself")
            continue
        if key == "labels" or key.startswith("labels."):
            problems.append(f"{path}: not searchable: labels (the tenant's among them) hold for the whole sweep")
            continue
        unknown = key_problem(key)
        if unknown:
            problems.append(f"{path}: unknown key: {unknown}")
            continue
        shape = domain_problems(key, domain, sweep.search)
        if shape:
            problems.extend(shape)
            continue
        expression = tune_expression_at(next(iter(domain.values())), f"{path}.{next(iter(domain))}")
        if expression:
            problems.append(expression)
            continue
        kind, values = next(iter(domain)), candidate_values(domain)
        listed += len(values)
        if listed > MAX_SPACE_VALUES:
            problems.append(f"{path}.{kind}: {len(values)} values, {listed} in the space so far: a space lists at most "
                            f"{MAX_SPACE_VALUES} values in all (a range counts its two ends): list fewer, or sample "
                            "a range (uniform, loguniform, randint)")
            break
        for value in values:
            try:
                validate(trial_spec_view(base, key, value))
            except SpecError as exc:
                problems.append(f"{path}: {json.dumps(value)} makes the job spec invalid: {exc.problems[0]}")
                break
    return problems


def load_sweep(path: str | Path, overrides: list[str] | None = None, sha256: str | None = None) -> SweepPlan:
    """Read a sweep file (and its base), apply ``--set`` overrides to the job part, check it all.
    With ``sha256``, the file's bytes must have that digest (trainers.config.loading.read_spec_file)."""
    return plan_from_data(read_spec_file(path, sha256), str(path), overrides)


def plan_from_data(data: dict, path: str, overrides: list[str] | None = None) -> SweepPlan:
    """Check a parsed sweep file; ``path`` names it in errors and anchors a relative ``base``."""
    data = copy.deepcopy(data)
    raw = data.pop("sweep", None)
    if raw is None:
        raise SpecError([f"{path}: no 'sweep' section: add one (see configs/sweep.yaml), or use `etrain run` for a job"])
    if not isinstance(raw, dict):
        raise SpecError([f"sweep: {json.dumps(raw, default=str)}: not a mapping: write the sweep settings as keys"])
    try:
        sweep = SweepConfig.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(format_errors(exc, SweepConfig, "sweep")) from None
    name = data.get("name") or default_name(Path(str(path)).stem)
    if sweep.base:
        base_path = sweep.base if "://" in sweep.base else str(Path(str(path)).parent / sweep.base)
        base = read_spec_file(base_path)
        base = _merge(base, data)
    else:
        base = data
    base = apply_overrides(base, overrides or [])
    base["name"] = name
    if sweep.workers_per_trial is not None:
        workers = sweep.workers_per_trial
        base.setdefault("distributed", {})["num_workers"] = workers if isinstance(workers, int) else workers.model_dump()
    spec = validate(base)
    problems = space_problems(sweep, base)
    if problems:
        raise SpecError(problems)
    return SweepPlan(name=name, base=base, spec=spec, sweep=sweep)


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
