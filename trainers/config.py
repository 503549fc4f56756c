"""The job spec: one validated model, loaded from JSON or YAML, checked once at the edge.

Every problem in a spec is reported at once, one line each, as
``field.path: value: what is wrong: how to fix``; nothing starts until the spec is clean.
The deployment guide's template (training/distributed/checkpoint) loads unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import importlib
import json
import math
import posixpath
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from cluster.storage import check_uri, default_root

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
BUILTIN_SOURCES = {"builtin:digits": "mlp", "builtin:text": "tiny_gpt"}


class SpecError(Exception):
    """A spec that cannot run; ``problems`` holds one plain line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))

    def render(self, source: str = "job spec") -> str:
        n = len(self.problems)
        head = f"invalid {source}: {n} problem{'s' if n != 1 else ''}"
        return "\n".join([head, *(f"  - {p}" for p in self.problems)])


class Strict(BaseModel):
    """Base for every section: unknown keys are errors, values are checked on assignment too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


REF_PATTERN = r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*"
# Whether validating a spec imports the modules it names. The service turns this off: importing
# runs a module's code, and the service must never run code a tenant names (it checks the names
# against the tenant's role instead; the job imports them itself when it starts).
_IMPORT_REFS: contextvars.ContextVar[bool] = contextvars.ContextVar("import_refs", default=True)


@contextlib.contextmanager
def refs_not_imported():
    """Validate specs in this block by the shape of ``pkg.module:fn`` only, importing nothing."""
    token = _IMPORT_REFS.set(False)
    try:
        yield
    finally:
        _IMPORT_REFS.reset(token)


def check_import_ref(ref: str) -> str:
    """Check that ``pkg.module:attr`` names something importable and callable (or only its shape)."""
    if not re.fullmatch(REF_PATTERN, ref):
        raise ValueError("must look like 'package.module:function'")
    if not _IMPORT_REFS.get():
        return ref
    module_name, attr = ref.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # boundary: any import failure is the user's to fix
        raise ValueError(
            f"cannot import module {module_name!r} ({type(exc).__name__}: {exc}): "
            "install it or put it on PYTHONPATH"
        ) from None
    if not callable(getattr(module, attr, None)):
        raise ValueError(f"module {module_name!r} has no callable {attr!r}")
    return ref


MAX_OPTIONS_DEPTH = 6
MAX_OPTIONS_BYTES = 16 << 10


def check_options(options: dict[str, Any]) -> dict[str, Any]:
    """Free-form keyword arguments stay small plain data: a factory's settings, not a payload."""
    depth, stack = 0, [(options, 1)]
    while stack:
        value, level = stack.pop()
        depth = max(depth, level)
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((child, level + 1) for child in children)
    if depth > MAX_OPTIONS_DEPTH:
        raise ValueError(f"nested {depth} levels deep: options are at most {MAX_OPTIONS_DEPTH} levels: flatten them")
    size = len(json.dumps(options, default=str))
    if size > MAX_OPTIONS_BYTES:
        raise ValueError(f"{size} bytes as JSON: options hold at most {MAX_OPTIONS_BYTES} bytes: put data in "
                         "storage and pass its path")
    return options


class LRSchedule(Strict):
    kind: Literal["constant", "warmup_cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)


class ProfileConfig(Strict):
    start_step: int = Field(10, ge=0, description="first step traced (after warm-up)")
    num_steps: int = Field(5, gt=0, le=1000, description="steps traced")


class TrainingConfig(Strict):
    batch_size: int = Field(64, gt=0, description="GLOBAL samples per optimizer step, whatever the world size")
    learning_rate: float = Field(1e-3, gt=0)
    epochs: int = Field(1, gt=0)
    max_steps: int | None = Field(None, gt=0, description="stop after this many optimizer steps (overrides epochs)")
    optimizer: Literal["AdamW", "Adam", "SGD"] = "AdamW"
    weight_decay: float = Field(0.0, ge=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    mixed_precision: Literal["none", "bf16", "fp16"] = "none"
    grad_accum_steps: int | None = Field(None, gt=0)
    micro_batch_size: Annotated[int, Field(gt=0)] | Literal["auto"] | None = Field(
        None, description="samples per forward/backward on a worker; 'auto': start at the whole per-worker share "
                          "and halve it (doubling accumulation) on out-of-memory, checked every step")
    gradient_checkpointing: bool = False
    grad_clip_norm: float | None = Field(None, gt=0)
    lr_schedule: LRSchedule = LRSchedule()
    seed: int = Field(0, ge=0)
    compile: bool = False
    log_interval_steps: int = Field(10, gt=0)
    profile: ProfileConfig | None = Field(None, description="a PyTorch profiler trace of rank 0, stored with the job")

    @field_validator("optimizer", mode="before")
    @classmethod
    def _canonical_optimizer(cls, v: Any) -> Any:
        names = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}
        return names.get(v.lower(), v) if isinstance(v, str) else v



class WorkerRange(Strict):
    min: int = Field(gt=0)
    max: int = Field(gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> WorkerRange:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is greater than max ({self.max}): swap them")
        return self


class DistributedConfig(Strict):
    strategy: Literal["DDP"] = "DDP"
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    master_addr: str | None = Field(None, description="accepted for compatibility; Ray's rendezvous sets it")
    master_port: int | None = Field(None, ge=1, le=65535, description="accepted; Ray's rendezvous sets it")
    num_workers: Annotated[
        Annotated[int, Tag("int")] | Annotated[WorkerRange, Tag("range")],
        Discriminator(lambda v: "range" if isinstance(v, (dict, WorkerRange)) else "int"),
    ] = 2
    use_gpu: bool | None = Field(None, description="None: use GPUs when the cluster has them")
    resources_per_worker: dict[str, float] | None = None
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    timeout_s: int = Field(1800, gt=0)
    resize_check_interval_s: float = Field(
        60.0, gt=0, description="with {min, max} workers: how often Ray Train looks for room to grow")
    resize_checkpoint_timeout_s: float = Field(
        120.0, ge=0, description="with {min, max} workers: how long Ray Train waits, before it restarts the group "
                                 "to grow it, for the checkpoint every rank takes at its next sync step (then the "
                                 "write); past it the restart goes ahead from the newest checkpoint; 0: never wait")

    @field_validator("strategy", "backend", mode="before")
    @classmethod
    def _canonical_case(cls, v: Any) -> Any:
        if isinstance(v, str):
            return v.upper() if v.lower() == "ddp" else v.lower()
        return v

    @field_validator("num_workers", mode="before")
    @classmethod
    def _int_or_range(cls, v: Any) -> Any:
        if isinstance(v, dict) or (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            return v
        raise ValueError("must be a positive integer or {min: m, max: n}")

    @field_validator("resources_per_worker")
    @classmethod
    def _non_negative(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, amount in (v or {}).items():
            if amount < 0:
                raise ValueError(f"resource {key!r} is negative ({amount}): use 0 or more")
        return v

    @property
    def min_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers.min

    @property
    def max_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers.max


class CheckpointConfig(Strict):
    interval: int = Field(1000, gt=0, description="steps between checkpoints; one is always taken at the end")
    path: str = Field(
        "checkpoints/model_{step}.pt",
        description="checkpoint file: relative, inside the job's folder under the storage root; absolute "
                    "(/checkpoints/model_{step}.pt), that directory on every node (a shared volume) is the job's folder",
    )
    storage_root: str = Field(default_factory=default_root, description="local directory or s3://bucket/prefix")
    num_to_keep: int | None = Field(3, gt=0, description="newest complete checkpoints kept (null: all); pruned at "
                                    "reports, so between them a few more may exist for up to report_interval_s")
    keep_best_metric: str | None = Field(None, description="also keep the best checkpoint by this metric, e.g. loss")
    keep_best_mode: Literal["min", "max"] = "min"
    upload: Literal["async", "sync"] = "async"
    min_interval_s: float = Field(
        5.0, ge=0, description="skip an interval checkpoint taken sooner than this after the last one (each copies "
        "the state and writes it); 0: one at every interval")
    report_interval_s: float = Field(
        2.0, ge=0, description="report a checkpoint to Ray Train (a barrier across ranks), prune old ones and flush "
        "the metrics history at most this often; the checkpoints between (only when min_interval_s is shorter) are "
        "written and restorable all the same, and the final and just-in-time ones are always reported. 0: every one; "
        "a sweep's trials default to 0")
    preemption_check_steps: int | Literal["auto"] = Field(
        "auto", description="steps between checks for a spot notice (and a stop request): each rank reads its own "
                            "notice and the ranks agree in one small all-reduce (with the loss window and the stop "
                            "vote). 'auto': about once a second at the measured step time; a number: keep steps x "
                            "this well inside the notice's deadline")

    @field_validator("preemption_check_steps", mode="before")
    @classmethod
    def _steps_or_auto(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            return v
        raise ValueError("must be a positive number of steps, or 'auto' (about once a second)")

    @field_validator("path")
    @classmethod
    def _inside_job_folder(cls, v: str) -> str:
        if "://" in v:
            raise ValueError("is a URI: put the bucket or directory in checkpoint.storage_root; path is a file name")
        rel = posixpath.normpath(v.lstrip("/"))
        if v.startswith("/") and posixpath.dirname(posixpath.normpath(v)) == "/":
            raise ValueError("an absolute path names the job's folder: give one, e.g. '/checkpoints/model_{step}.pt'")
        if not v.startswith("/") and (rel.startswith("..") or rel in (".", "")):
            raise ValueError("escapes the job's folder: use a path like 'checkpoints/model_{step}.pt' without '..'")
        if not rel.endswith(".pt"):
            raise ValueError("must name a .pt file, e.g. 'checkpoints/model_{step}.pt'")
        # Only the literal '{step}': a format spec such as '{step:>2000000000}' would make
        # every str.format of the path allocate gigabytes.
        if re.search(r"[{}]", v.replace("{step}", "")):
            raise ValueError("only the placeholder '{step}' is allowed, written exactly so (no format spec): "
                             "e.g. 'checkpoints/model_{step}.pt'")
        return v

    @field_validator("storage_root")
    @classmethod
    def _valid_root(cls, v: str) -> str:
        problem = check_uri(v)
        if problem:
            raise ValueError(problem)
        return v

    @property
    def run_folder(self) -> str:
        """The folder (relative to the job folder) where Ray Train keeps the checkpoints of a relative path."""
        return posixpath.dirname(posixpath.normpath(self.path.lstrip("/"))) or "checkpoints"

    def file_name(self, step: int) -> str:
        return posixpath.basename(self.path).format(step=step)


class DataColumns(Strict):
    """Which Parquet columns hold what, for a user's ``data.source``."""

    features: str = Field("features", description="list of floats, the same length in every row")
    label: str = Field("label", description="int (classes) or float (regression)")
    tokens: str = Field("tokens", description="list of ints, for tiny_gpt")


class DataConfig(Strict):
    source: str | None = Field(None, description="builtin:digits, builtin:text, or a Parquet path / s3:// URI")
    factory: str | None = Field(None, description="'pkg.module:fn' returning a map-style Dataset")
    options: dict[str, Any] = {}
    columns: DataColumns = DataColumns()
    num_workers: int | Literal["auto"] = Field(
        0, description="DataLoader worker processes per training worker, or 'auto': measured in the first steps")
    prefetch_factor: int = Field(2, gt=0)
    shuffle_window_row_groups: int = Field(
        4, gt=0, description="samples are shuffled within windows of this many row groups (row groups themselves "
        "in a new order each epoch): larger mixes better and holds more data in memory")
    record_sample_ids: bool = Field(
        False, description="keep each rank's sample ids per step in the checkpoints: proof that no sample is "
        "skipped or repeated across interruptions and resizes (trainers.data.accounting); for tests and audits")
    dynamic_batching: bool = False
    max_tokens_per_batch: int = Field(4096, gt=0, description="token budget per micro-batch with dynamic_batching")
    shuffle: bool = True

    @field_validator("source")
    @classmethod
    def _known_source(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if v.startswith("builtin:"):
            if v not in BUILTIN_SOURCES:
                raise ValueError(f"unknown built-in data set: use one of {', '.join(BUILTIN_SOURCES)}")
            return v
        problem = check_uri(v)
        if problem:
            raise ValueError(problem)
        if not v.rstrip("/").endswith(".parquet") and not v.endswith("/"):
            raise ValueError("must be a .parquet file or a folder ending in '/'")
        return v

    @field_validator("factory")
    @classmethod
    def _importable(cls, v: str | None) -> str | None:
        return v if v is None else check_import_ref(v)

    @field_validator("options")
    @classmethod
    def _small_options(cls, v: dict[str, Any]) -> dict[str, Any]:
        return check_options(v)

    @field_validator("num_workers", mode="before")
    @classmethod
    def _count_or_auto(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            return v
        raise ValueError("must be 0 or more loader processes, or 'auto' to measure and choose")


class ModelConfig(Strict):
    name: Literal["mlp", "tiny_gpt"] = "mlp"
    factory: str | None = Field(None, description="'pkg.module:fn' returning an nn.Module")
    options: dict[str, Any] = {}
    loss: Literal["cross_entropy", "mse"] = "cross_entropy"
    hidden_size: int = Field(128, gt=0)
    d_model: int = Field(128, gt=0)
    n_layers: int = Field(2, gt=0)
    n_heads: int = Field(4, gt=0)
    max_seq_len: int = Field(256, gt=1)
    dropout: float = Field(0.0, ge=0, lt=1)

    @field_validator("factory")
    @classmethod
    def _importable(cls, v: str | None) -> str | None:
        return v if v is None else check_import_ref(v)

    @field_validator("options")
    @classmethod
    def _small_options(cls, v: dict[str, Any]) -> dict[str, Any]:
        return check_options(v)

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.name == "tiny_gpt" and self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) is not a multiple of n_heads ({self.n_heads}): change either")
        return self


class FaultToleranceConfig(Strict):
    worker_start_timeout_s: float = Field(
        20.0, gt=0, description="how long a restart waits for its workers before Ray Train re-plans the group "
        "size (after a node loss its view of the cluster can be stale for a while)")
    max_failures: int = Field(3, ge=-1, description="retries for errors in user code; -1 is unlimited")
    max_infrastructure_failures: int = Field(
        -1, ge=-1, description="retries after preemptions and lost nodes (never charged to max_failures); -1 is unlimited")


# Illustrative us-west-2 list prices (USD per hour); set your own in the spec's cost section.
DEFAULT_PRICES = {
    "g5.2xlarge": {"on_demand": 1.212, "spot": 0.485},
    "p4d.24xlarge": {"on_demand": 32.77, "spot": 9.83},
    "p5.48xlarge": {"on_demand": 98.32, "spot": 39.33},
    "m6i.2xlarge": {"on_demand": 0.384, "spot": 0.154},
}


class CostConfig(Strict):
    prices_per_hour: dict[str, dict[Literal["on_demand", "spot"], float]] = Field(
        default_factory=lambda: dict(DEFAULT_PRICES),
        description="instance type -> {on_demand, spot} USD per hour; nodes say their type with an "
                    "'instance_<type>' resource (see ray_cluster.yaml)")


class JobSpec(Strict):
    name: str = Field("job", pattern=NAME_PATTERN)
    training: TrainingConfig = TrainingConfig()
    distributed: DistributedConfig = DistributedConfig()
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    fault_tolerance: FaultToleranceConfig = FaultToleranceConfig()
    train_loop: str | None = Field(None, description="'pkg.module:fn': your own Ray Train loop, our settings")
    cost: CostConfig = Field(default_factory=CostConfig)
    labels: dict[str, str] = Field(default_factory=dict, description="free-form; 'tenant' labels the metrics")

    @field_validator("train_loop")
    @classmethod
    def _importable(cls, v: str | None) -> str | None:
        return v if v is None else check_import_ref(v)

    @property
    def data_source(self) -> str:
        """The data source, defaulting to the built-in set that fits the model."""
        if self.data.source:
            return self.data.source
        return "builtin:text" if self.model.name == "tiny_gpt" else "builtin:digits"


def cross_field_problems(spec: JobSpec) -> list[str]:
    """Rules that span sections, as 'field: value: problem: fix' lines."""
    problems = []
    t, d = spec.training, spec.distributed
    if t.grad_accum_steps is not None and t.micro_batch_size is not None:
        problems.append(
            f"training.grad_accum_steps: {t.grad_accum_steps}: set together with micro_batch_size: set one; "
            "the other is derived from the global batch_size and the world size"
        )
    if t.batch_size < d.max_workers:
        problems.append(
            f"training.batch_size: {t.batch_size}: smaller than the most workers ({d.max_workers}), "
            "so some would get no samples: raise batch_size or lower distributed.num_workers"
        )
    if spec.data.source in BUILTIN_SOURCES and spec.model.factory is None:
        wanted = BUILTIN_SOURCES[spec.data.source]
        if spec.model.name != wanted:
            problems.append(
                f"data.source: {spec.data.source}: fits model.name '{wanted}', not '{spec.model.name}': "
                f"set model.name to '{wanted}' or choose another source"
            )
    if spec.data.dynamic_batching and spec.data.max_tokens_per_batch < spec.model.max_seq_len:
        problems.append(
            f"data.max_tokens_per_batch: {spec.data.max_tokens_per_batch}: smaller than model.max_seq_len "
            f"({spec.model.max_seq_len}), so a long sequence fits no batch: raise it"
        )
    if spec.model.factory and not (spec.data.factory or (spec.data.source and not spec.data.source.startswith("builtin:"))):
        problems.append("model.factory: set: needs its own data: set data.factory or a Parquet data.source")
    return problems


# ---------------------------------------------------------------- loading and errors


def _nested_models(ann: Any) -> list[type[BaseModel]]:
    """Every model class inside a (possibly Annotated or union) annotation."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    return [m for arg in typing.get_args(ann) for m in _nested_models(arg)]


def _model_at(loc: tuple, root: type[BaseModel]) -> type[BaseModel] | None:
    """The model class that holds the field at ``loc`` (for listing valid keys)."""
    model = root
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        nested = _nested_models(field.annotation) if field else []
        if not nested:
            return None
        model = nested[0]
    return model


def key_problem(dotted: str) -> str | None:
    """None when ``dotted`` names a spec field (or a key inside a free-form mapping), else why not."""
    model: type[BaseModel] = JobSpec
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        where = ".".join(parts[:i]) or "the job spec"
        if field is None:
            return f"no {part!r} in {where}: valid keys there are {', '.join(model.model_fields)}"
        if i == len(parts) - 1:
            return None
        if typing.get_origin(field.annotation) is dict:
            return None  # options mappings take any key
        nested = _nested_models(field.annotation)
        if not nested:
            return f"{'.'.join(parts[:i + 1])} is a value, not a section: remove {'.'.join(parts[i + 1:])!r}"
        model = nested[0]
    return None


FIXES = {
    "int_type": "use a whole number",
    "int_parsing": "use a whole number",
    "int_from_float": "use a whole number",
    "float_type": "use a number",
    "float_parsing": "use a number",
    "bool_type": "use true or false",
    "bool_parsing": "use true or false",
    "string_type": "use a string",
    "greater_than": "use a larger value",
    "greater_than_equal": "use a larger value",
    "less_than": "use a smaller value",
    "less_than_equal": "use a smaller value",
    "literal_error": "use one of the listed values",
    "string_pattern_mismatch": "use lowercase letters, digits, '.', '_' or '-', starting with a letter or digit",
    "model_type": "use a mapping of keys to values",
    "model_attributes_type": "use a mapping of keys to values",
    "dict_type": "use a mapping",
}


def format_errors(exc: ValidationError, root: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """Turn pydantic's errors into ``path: value: problem: fix`` lines (paths under ``prefix``)."""
    lines = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in ("int", "range"))))
        path = ".".join(str(p) for p in (prefix.split(".") if prefix else []) + list(loc)) or "(top level)"
        value = err.get("input")
        shown = json.dumps(value, default=str) if not isinstance(value, dict) or len(str(value)) < 80 else "{...}"
        kind = err["type"]
        if kind == "extra_forbidden":
            holder = _model_at(loc, root or JobSpec)
            valid = ", ".join(holder.model_fields) if holder else "see the documentation"
            lines.append(f"{path}: unknown key: valid keys here are {valid}")
            continue
        if kind == "missing":
            lines.append(f"{path}: missing: add it")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        fix = FIXES.get(kind)
        line = f"{path}: {shown}: {msg}" + (f": {fix}" if fix else "")
        if line not in lines:
            lines.append(line)
    return lines


# What a spec may look like before it is even read: a job spec has a few hundred values at most.
MAX_DEPTH = 32
MAX_NODES = 20_000
MAX_INT_DIGITS = 30
# The longest text a spec holds: a path, a URI, a factory name. Every route that shows a spec (and every
# regex that reads one) then works on short strings, whatever a tenant sends.
MAX_STRING_CHARS = 4096
MAX_KEY_CHARS = 256


class _SpecLoader(yaml.CSafeLoader):
    """libyaml's C loader with whole numbers capped (Python would build a 10,000-digit int)."""

    def construct_bounded_int(self, node: yaml.ScalarNode) -> int:
        if len(node.value.lstrip("+-").replace("_", "")) > MAX_INT_DIGITS:
            raise SpecError([f"line {node.start_mark.line + 1}: a number of {len(node.value)} digits: "
                             f"numbers in a spec have at most {MAX_INT_DIGITS} digits"])
        return self.construct_yaml_int(node)

    def construct_timestamp_text(self, node: yaml.ScalarNode) -> str:
        """A date or time as written: a spec is stored as JSON, which has no dates."""
        return self.construct_scalar(node)


_SpecLoader.add_constructor("tag:yaml.org,2002:int", _SpecLoader.construct_bounded_int)
_SpecLoader.add_constructor("tag:yaml.org,2002:timestamp", _SpecLoader.construct_timestamp_text)

# What YAML can hold and JSON cannot (the spec is stored and passed on as JSON), by the tag a user wrote.
_NOT_JSON = {bytes: "binary data (!!binary)", set: "a set (!!set)"}


def _json_unsafe(data: Any) -> str | None:
    """Where ``data`` holds a value (or a key) JSON cannot, as 'path: what', or None; walked without recursion."""
    stack = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for key, child in value.items():
                where = f"{path}.{key}" if path else str(key)
                if not isinstance(key, (str, int, float, bool)) and key is not None:
                    return f"{where}: {_NOT_JSON.get(type(key), type(key).__name__)} as a key"
                stack.append((child, where))
        elif isinstance(value, (list, tuple)):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(value))
        elif not isinstance(value, (str, int, float, bool)) and value is not None:
            return f"{path or '(top level)'}: {_NOT_JSON.get(type(value), type(value).__name__)}"
    return None


def _yaml_shape_problem(text: str) -> str | None:
    """Why YAML text may not be loaded (aliases, depth, size), from libyaml's events, or None.

    Aliases are refused outright: six lines of them expand to megabytes. The event stream is
    flat (libyaml keeps its own stack), so this pass cannot recurse however deep the text nests.
    """
    depth = nodes = 0
    for event in yaml.parse(text, Loader=yaml.CSafeLoader):
        where = f"line {event.start_mark.line + 1}"
        if (isinstance(event, yaml.ScalarEvent) and len(event.value) > MAX_STRING_CHARS
                and not re.fullmatch(r"[-+]?[0-9_]+", event.value)):  # a long number: the int loader says so
            return f"{where}: {_long_text(event.value)}"
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            return f"{where}: YAML anchors and aliases (& and *) are not accepted: write the values out"
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                return f"{where}: nested deeper than {MAX_DEPTH} levels: a job spec is a few levels deep"
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
        if isinstance(event, yaml.NodeEvent):
            nodes += 1
            if nodes > MAX_NODES:
                return f"{where}: more than {MAX_NODES} values: a job spec has a few hundred"
    return None


def _bounded_json_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise SpecError([f"a number of {len(digits)} digits: numbers in a spec have at most {MAX_INT_DIGITS} digits"])
    return int(digits)


def _long_text(text: str, what: str = "a text") -> str:
    limit = MAX_KEY_CHARS if what == "a key" else MAX_STRING_CHARS
    return (f"{what} of {len(text)} characters ({json.dumps(text[:40])[:-1]}...\"): a spec's texts have at most "
            f"{limit} characters: shorten it (data belongs in storage, named by a path)")


def _refuse_constant(name: str) -> float:
    raise SpecError([f"{name}: not a number a spec can hold: write a finite number"])


def _json_shape_problem(data: Any) -> str | None:
    """Depth, size, text lengths and finite numbers of parsed data, walked without recursion."""
    nodes, stack = 0, [(data, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        nodes += 1
        where = f"{path}: " if path else ""
        if depth > MAX_DEPTH:
            return f"nested deeper than {MAX_DEPTH} levels: a job spec is a few levels deep"
        if nodes > MAX_NODES:
            return f"more than {MAX_NODES} values: a job spec has a few hundred"
        if isinstance(value, str) and len(value) > MAX_STRING_CHARS:
            return where + _long_text(value)
        if isinstance(value, float) and not math.isfinite(value):
            return f"{where}{value}: not a number a spec can hold: write a finite number"
        if isinstance(value, dict):
            long_key = next((k for k in value if isinstance(k, str) and len(k) > MAX_KEY_CHARS), None)
            if long_key is not None:
                return where + _long_text(long_key, "a key")
            stack.extend((child, depth + 1, f"{path}.{key}" if path else str(key)) for key, child in value.items())
        elif isinstance(value, list):
            stack.extend((child, depth + 1, f"{path}[{i}]") for i, child in enumerate(value))
    return None


def parse_text(text: str, source: str, fmt: Literal["auto", "json"] = "auto") -> dict:
    """Parse JSON or YAML text into a mapping; syntax errors name the line and column.

    Bounded on every input: no YAML aliases, at most MAX_DEPTH levels, MAX_NODES values and
    MAX_INT_DIGITS digits per number, so a small body can neither blow up nor crash the parser.
    """
    stripped = text.lstrip()
    if not stripped:
        raise SpecError([f"{source}: the file is empty: write a job spec (see configs/)"])
    try:
        if fmt == "json" or stripped.startswith("{"):
            data = json.loads(text, parse_int=_bounded_json_int, parse_constant=_refuse_constant)
            problem = _json_shape_problem(data)
        else:
            problem, data = _yaml_shape_problem(text), None
            if not problem:
                data = yaml.load(text, Loader=_SpecLoader)  # noqa: S506 (a safe loader)
                unsafe = _json_unsafe(data)
                if unsafe:
                    problem = (f"{unsafe}: a spec holds text, numbers, true/false, lists and mappings only: "
                               "write the value as a string")
                else:
                    problem = _json_shape_problem(data)  # keys' lengths, NaN and infinities (.nan, .inf)
    except SpecError as exc:
        raise SpecError([f"{source}: {p}" for p in exc.problems]) from None
    except json.JSONDecodeError as exc:
        raise SpecError([f"{source}: line {exc.lineno}, column {exc.colno}: {exc.msg}: fix the JSON syntax"]) from None
    except RecursionError:
        raise SpecError([f"{source}: nested deeper than {MAX_DEPTH} levels: a job spec is a few levels deep"]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError([f"{source}: {where}: {problem}: fix the YAML syntax"]) from None
    except ValueError as exc:  # what the parsers raise for values they cannot hold (e.g. a huge exponent)
        raise SpecError([f"{source}: {exc}: fix the value"]) from None
    if problem:
        raise SpecError([f"{source}: {problem}"])
    if not isinstance(data, dict):
        raise SpecError([f"{source}: top level is {type(data).__name__}: a job spec is a mapping of sections"])
    return data


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``key.path=value`` overrides; values are read as YAML (``10``, ``true``, ``{min: 1, max: 2}``)."""
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"--set {item}: expected key.path=value, e.g. training.max_steps=20")
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[parts[-1]] = value
    if problems:
        raise SpecError(problems)
    return data


def validate(data: dict) -> JobSpec:
    """The one way in: field checks, then rules that span sections."""
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_errors(exc)) from None
    problems = cross_field_problems(spec)
    if problems:
        raise SpecError(problems)
    return spec


def load_spec(path: str | Path, overrides: list[str] | None = None, sha256: str | None = None) -> JobSpec:
    """Load, override and validate a spec file; the job name defaults to the file's stem.
    With ``sha256``, the file's bytes must have that digest (read_spec_file)."""
    data = read_spec_file(path, sha256)
    if "name" not in data:
        data["name"] = default_name(Path(str(path)).stem)
    return validate(apply_overrides(data, overrides or []))


def read_spec_file(path: str | Path, sha256: str | None = None) -> dict:
    """Parse a spec file: a local path, or a URI in storage (s3://bucket/key) as the service writes.

    ``sha256``: the digest of the bytes the service checked. A stored spec lies where others may
    write (a tenant's keys reach its prefix); bytes that differ are refused before they are parsed.
    """
    where = str(path)
    try:
        if "://" in where:
            from cluster.storage import open_root

            parent, _, leaf = where.rpartition("/")
            raw = open_root(parent).read_bytes(leaf)
        else:
            raw = Path(where).read_bytes()
        text = raw.decode()
    except (OSError, ValueError) as exc:
        if isinstance(exc, UnicodeDecodeError):
            raise SpecError([f"{where}: not text: a job spec is JSON or YAML"]) from None
        reason = getattr(exc, "strerror", None) or str(exc)
        raise SpecError([f"{where}: cannot read: {reason}: check the path"]) from None
    if sha256 is not None and hashlib.sha256(raw).hexdigest() != sha256:
        raise SpecError([f"{where}: its SHA-256 is not {sha256}, the digest of the spec that was checked: it was "
                         "changed after it was checked, so it is not run; submit the spec again"])
    return parse_text(text, where)


def add_digest_arg(parser) -> None:
    """``--spec-sha256``: what the service passes with the spec it checked (both entry points)."""
    parser.add_argument("--spec-sha256", metavar="HEX", default=None, type=str.lower,
                        help="run the spec only if its bytes have this SHA-256 (the service passes the digest of "
                             "the spec it checked, so a spec changed in storage after the check is not run)")


def default_name(stem: str) -> str:
    name = re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-._") or "job"
    return name[:63]


def batching_summary(global_batch: int, world_size: int, micro_batch_size: int | str | None,
                     grad_accum_steps: int | None) -> tuple[int, int, int]:
    """(per-worker samples, micro-batch size, accumulation steps) for a world size.

    The global batch stays as the spec says; what each worker does follows from it, so a
    resize changes only these derived numbers, never the optimisation.
    """
    per_worker = math.ceil(global_batch / world_size)
    if micro_batch_size == "auto":
        micro = per_worker
    elif micro_batch_size:
        micro = min(micro_batch_size, per_worker)
    elif grad_accum_steps:
        micro = math.ceil(per_worker / grad_accum_steps)
    else:
        micro = per_worker
    return per_worker, micro, math.ceil(per_worker / micro)
