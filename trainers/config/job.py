"""The job spec: one validated model, checked once at the edge.

The deployment guide's template (training/distributed/checkpoint) loads unchanged. Field rules
live on the sections; rules that span sections are :func:`cross_field_problems`.
"""

from __future__ import annotations

import posixpath
import re
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator, model_validator

from cluster.storage import check_uri, default_root
from trainers.config.errors import nested_models
from trainers.config.fields import Strict, check_import_ref, check_options
from trainers.config.hf import TEXT_SUFFIXES, HFModel, hf_problems
from trainers.config.prices import CostConfig

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
BUILTIN_SOURCES = {"builtin:digits": "mlp", "builtin:text": "tiny_gpt"}


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
    text: str | None = Field(None, description="strings, for model.hf (tokenized once, cached)")


class FactoryFields(Strict):
    """A section that may name a user's factory (``factory: 'pkg.module:fn'``) and its ``options``:
    the reference is checked by its shape, the options by their size."""

    @field_validator("factory", check_fields=False)
    @classmethod
    def _importable(cls, v: str | None) -> str | None:
        return v if v is None else check_import_ref(v)

    @field_validator("options", check_fields=False)
    @classmethod
    def _small_options(cls, v: dict[str, Any]) -> dict[str, Any]:
        return check_options(v)


class DataConfig(FactoryFields):
    source: str | None = Field(None, description="builtin:digits, builtin:text, or a Parquet path / s3:// URI "
                                                 "(with model.hf also JSON Lines: .jsonl)")
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
        if not v.rstrip("/").endswith(TEXT_SUFFIXES) and not v.endswith("/"):
            raise ValueError("must be a .parquet file (or, for model.hf, a .jsonl one) or a folder ending in '/'")
        return v

    @field_validator("num_workers", mode="before")
    @classmethod
    def _count_or_auto(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            return v
        raise ValueError("must be 0 or more loader processes, or 'auto' to measure and choose")


class ModelConfig(FactoryFields):
    name: Literal["mlp", "tiny_gpt"] = "mlp"
    factory: str | None = Field(None, description="'pkg.module:fn' returning an nn.Module")
    hf: HFModel | None = Field(None, description="a Hugging Face save_pretrained model: {path, task, tokenizer}")
    options: dict[str, Any] = {}
    loss: Literal["cross_entropy", "mse"] = "cross_entropy"
    hidden_size: int = Field(128, gt=0)
    d_model: int = Field(128, gt=0)
    n_layers: int = Field(2, gt=0)
    n_heads: int = Field(4, gt=0)
    max_seq_len: int = Field(256, gt=1)
    dropout: float = Field(0.0, ge=0, lt=1)
    init_from: str | None = Field(
        None, description="pretrained weights for step 0 (a resume starts from the job's own checkpoint): a state "
                          "dict .pt/.pth/.bin, a Lightning .ckpt, .safetensors, a job's checkpoint_<step> folder or "
                          "its checkpoints folder (the newest verified); a local path or s3:// URI")

    @field_validator("init_from")
    @classmethod
    def _weights_uri(cls, v: str | None) -> str | None:
        problem = None if v is None else check_uri(v)
        if problem:
            raise ValueError(problem)
        return v

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
    if spec.data.source in BUILTIN_SOURCES and spec.model.factory is None and spec.model.hf is None:
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
    problems += hf_problems(spec)
    if spec.model.factory and not spec.model.hf and not (spec.data.factory or (spec.data.source and not spec.data.source.startswith("builtin:"))):
        problems.append("model.factory: set: needs its own data: set data.factory or a Parquet data.source")
    if spec.model.init_from and spec.train_loop:
        problems.append(f"model.init_from: {spec.model.init_from!r}: not used by your own train_loop: load the "
                        "weights in your loop, or drop train_loop to use ours")
    return problems


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
        nested = nested_models(field.annotation)
        if not nested:
            return f"{'.'.join(parts[:i + 1])} is a value, not a section: remove {'.'.join(parts[i + 1:])!r}"
        model = nested[0]
    return None
