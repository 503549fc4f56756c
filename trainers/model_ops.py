"""What the loop does to a model beyond forward and backward: build its optimizer, schedule and
autocast, seed its generators, check that DDP replicas agree, and reach the module under DDP
and torch.compile."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from trainers.config.job import JobSpec
from trainers.rules import lr_factor


def seed_generators(seed: int, device: torch.device) -> None:
    """Seed the CPU generator and this device's, nothing else: torch.manual_seed also queues a lazy
    seeding of every CUDA/XPU/MTIA device, and each such call formats a stack trace (about half a
    millisecond a step on CPU, found with cProfile)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


def build_optimizer(spec: JobSpec, params) -> torch.optim.Optimizer:
    t = spec.training
    if t.optimizer == "SGD":
        return torch.optim.SGD(params, lr=t.learning_rate, momentum=t.momentum, weight_decay=t.weight_decay)
    cls = torch.optim.AdamW if t.optimizer == "AdamW" else torch.optim.Adam
    return cls(params, lr=t.learning_rate, weight_decay=t.weight_decay)


def params_in_sync(model: torch.nn.Module, world: int) -> bool:
    """Whether every rank holds the same parameters: compare a float64 checksum across ranks."""
    if world == 1:
        return True
    with torch.no_grad():
        total = sum(p.double().sum() * (i + 1) for i, p in enumerate(unwrap(model).parameters()))
    both = torch.stack([total, -total]).reshape(2)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return bool(both[0] == -both[1])


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    model = getattr(model, "_orig_mod", model)  # torch.compile
    return getattr(model, "module", model)  # DDP


def lr_scheduler(spec: JobSpec, optimizer: torch.optim.Optimizer, target_step: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The spec's schedule (trainers.rules.lr_factor) over the run's ``target_step`` steps."""
    s = spec.training.lr_schedule
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, target_step, s.warmup_steps, s.min_lr_ratio, s.kind))


def autocast_for(device: torch.device, precision: str) -> Callable[[], contextlib.AbstractContextManager]:
    """A maker of the forward pass's autocast context for the resolved mixed precision ("no": none)."""
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return (lambda: torch.autocast(device.type, dtype=amp_dtype)) if amp_dtype else contextlib.nullcontext
