"""The one per-worker training loop: data -> DDP step -> report/checkpoint.

It talks to Ray only through ``ray.train.get_context / report / get_preemption_info``,
Ray Train's ``prepare_model``, and (rank 0) a heartbeat in Ray's key-value store. Everything it needs arrives in ``config`` from the launcher:

- ``spec``: the validated job spec (as a dict),
- ``data_uri``: where the workload's Parquet data is,
- ``storage_uri`` / ``run_path``: the storage root and the run folder holding checkpoints,
- ``stop_at_step``: stop early (with a checkpoint), leaving the job resumable,
- ``mixed_precision``: what the launcher resolved for this cluster (fp16 only with GPUs),
- ``run_id``, ``previous_failure``, ``attempt_started_at``: for recovery accounting.

The loss of every micro-batch is a SUM over its samples, scaled by world_size / global
samples of the step; DDP averages gradients over ranks, so the update is the exact mean
over the global batch whatever the world size or the split into micro-batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import tempfile
import time

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.train import Checkpoint, CheckpointUploadMode

from cluster.storage import open_root
from trainers import checkpoint as ckpt
from trainers.config import JobSpec, batching_summary
from trainers.console import progress_line
from trainers.data import BatchPlan, Feed, StepMicroBatches, accounting
from cluster.metrics import node_kind
from trainers.observe import Observer, group_kinds
from trainers.recovery import HEARTBEAT_INTERVAL_S, INTERRUPTIONS_FILE, Heartbeat, Heartbeats, StopFlag, interruption_record
from trainers.workloads import resolve


def build_optimizer(spec: JobSpec, params) -> torch.optim.Optimizer:
    t = spec.training
    if t.optimizer == "SGD":
        return torch.optim.SGD(params, lr=t.learning_rate, momentum=t.momentum, weight_decay=t.weight_decay)
    cls = torch.optim.AdamW if t.optimizer == "AdamW" else torch.optim.Adam
    return cls(params, lr=t.learning_rate, weight_decay=t.weight_decay)


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_ratio: float, kind: str) -> float:
    """Multiplier on the base learning rate at ``step``: constant, or linear warmup then cosine."""
    if kind == "constant":
        return 1.0
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def target_step(spec: JobSpec, steps_per_epoch: int) -> int:
    return spec.training.max_steps or spec.training.epochs * steps_per_epoch


def step_seed(seed: int, step: int, rank: int) -> int:
    """RNG seed of one step on one rank: randomness (dropout) is a function of where we are,
    so nothing random needs saving and a resumed run draws what an unbroken one would."""
    return (seed * 1_000_003 + step) * 1_009 + rank


def plan_for(spec: JobSpec, dataset) -> BatchPlan:
    """The job's order of global batches: what a resume must find again, whatever the workers."""
    lengths = getattr(dataset, "lengths", None)
    return BatchPlan(len(dataset), spec.training.batch_size, spec.training.seed, spec.data.shuffle,
                     lengths=lengths if spec.data.dynamic_batching else None,
                     group_sizes=getattr(dataset, "group_sizes", None), window=spec.data.shuffle_window_row_groups)


def train_loop_per_worker(config: dict) -> None:
    spec = JobSpec.model_validate(config["spec"])
    t, d = spec.training, spec.distributed
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    root = open_root(config["storage_uri"])
    job, job_key = config["job_dir"], config["job_key"]  # the job's folder under root, its name in Ray's KV
    run_path = config["run_path"]

    workload = resolve(spec)
    dataset = workload.dataset(spec, config["data_uri"])
    plan = plan_for(spec, dataset)
    target = target_step(spec, plan.steps_per_epoch)
    stop = min(target, config.get("stop_at_step") or target)

    torch.manual_seed(t.seed)  # identical initial weights everywhere (DDP also broadcasts rank 0's)
    model = workload.build_model(spec)
    optimizer = build_optimizer(spec, model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(
        s, target, t.lr_schedule.warmup_steps, t.lr_schedule.min_lr_ratio, t.lr_schedule.kind))
    fp16 = config["mixed_precision"] == "fp16"
    scaler = torch.amp.GradScaler("cuda", enabled=fp16)

    # Restore: rank 0 picks the newest verified checkpoint, every rank loads that one.
    choice = [None]
    if rank == 0:
        chosen, skipped = ckpt.find_restore(root.fs, run_path)
        for c in skipped:
            print(f"[etrain] skipping checkpoint {root.uri_of(c.path[len(root.base) + 1:])}: {c.problem}", flush=True)
        choice = [chosen.path if chosen else None]
    if world > 1:
        dist.broadcast_object_list(choice, src=0)
    start, restored, loader_choice = 0, None, None
    if choice[0]:
        state = ckpt.load_state(root.fs, choice[0])
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        start, restored, loader_choice = state["step"], state.get("observer"), state.get("loader")
        if rank == 0:
            print(f"[etrain] resumed from step {start} (saved at world size {state['world_size']}, "
                  f"now {world}; cursor {state['cursor']})", flush=True)

    ddp_kwargs = {"find_unused_parameters": d.find_unused_parameters,
                  "gradient_as_bucket_view": d.gradient_as_bucket_view, "static_graph": d.static_graph}
    model = ray.train.torch.prepare_model(model, parallel_strategy_kwargs=ddp_kwargs if world > 1 else None)
    if t.compile:
        model = torch.compile(model)
    # Optimizer state was loaded on CPU tensors; move it where the parameters now live.
    for st in optimizer.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and k != "step":
                st[k] = v.to(device)

    per_worker, micro, accum = batching_summary(t.batch_size, world, t.micro_batch_size, t.grad_accum_steps)
    steps = StepMicroBatches(plan, rank, world, micro, spec.data.max_tokens_per_batch if spec.data.dynamic_batching else None)
    feed = Feed(dataset, steps, start, stop, spec.data.num_workers, spec.data.prefetch_factor, device,
                tuned=loader_choice, announce=(lambda line: print(line, flush=True)) if rank == 0 else None,
                record_ids=spec.data.record_sample_ids)
    if rank == 0:
        print(f"[etrain] {spec.name}: world size {world}, global batch {t.batch_size} = {per_worker}/worker "
              f"(micro-batch {micro} x {accum} accumulation{', dynamic by tokens' if spec.data.dynamic_batching else ''}); "
              f"steps {start} -> {stop} of {target}, {plan.steps_per_epoch} per epoch", flush=True)

    beats = Heartbeats(job_key, config.get("run_id") or "", HEARTBEAT_INTERVAL_S) if rank == 0 else None
    stop_flag = StopFlag(job_key) if rank == 0 else None
    kinds = [(ray.get_runtime_context().get_node_id(), own_node_kind())]
    if world > 1:  # once per attempt: which nodes the group runs on, for its cost
        gathered = [None] * world
        dist.all_gather_object(gathered, kinds[0])
        kinds = gathered
    staging = staging_folder(job_key) if rank == 0 else None
    observer = Observer(spec, root, rank, device, config.get("submitted_at") or time.time(), restored,
                        group_kinds(kinds), job=job, staging=staging)
    if rank == 0:
        observer.interruptions(root.read_json(job, INTERRUPTIONS_FILE) if root.exists(job, INTERRUPTIONS_FILE) else [])
    pending = beats.last() if beats else None  # the attempt before this one died at its last beat

    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config["mixed_precision"])
    autocast = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if amp_dtype else contextlib.nullcontext
    upload_mode = CheckpointUploadMode.ASYNC if spec.checkpoint.upload == "async" else CheckpointUploadMode.SYNC
    log_every, ckpt_every = t.log_interval_steps, spec.checkpoint.interval
    preempt_every, jit_taken = spec.checkpoint.preemption_check_steps, False
    min_gap_s, last_ckpt_at = spec.checkpoint.min_interval_s, float("-inf")
    window = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, samples, tokens, stop request
    window_start = time.perf_counter()
    run_start, steady_start, steady_samples = window_start, None, 0
    model.train()

    try:
        for step in range(start, stop):
            torch.manual_seed(step_seed(t.seed, step, rank))
            shares = steps.at(step)
            global_samples = len(plan.global_batch_at(step))
            scale = world / global_samples
            for i in range(len(shares)):
                waited = time.perf_counter()
                batch = feed.next()
                observer.loader_wait(time.perf_counter() - waited)
                sync = contextlib.nullcontext() if (i == len(shares) - 1 or world == 1) else model.no_sync()
                with sync:
                    with autocast():
                        loss_sum, n, tokens = workload.loss_sum(model, batch)
                    scaler.scale(loss_sum * scale).backward()
                window[0] += loss_sum.detach().double()
                window[1] += n
                window[2] += tokens
            if t.grad_clip_norm:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip_norm)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            done = step + 1
            observer.step_done(done)
            if steady_start is None:
                steady_start = time.perf_counter()  # the first step pays for warm-up; measure after it
                if pending is not None:
                    launcher_cause = config.get("previous_failure") if pending.time < config.get("attempt_started_at", 0) else None
                    record_interruption(root, job, pending, start, world, launcher_cause)
                    observer.interruptions(root.read_json(job, INTERRUPTIONS_FILE))
                # Paid from the moment the attempt before died (or this run started): nothing goes unbilled.
                observer.open_cost_segment(config.get("run_id") or "", pending.time if pending else
                                           config.get("attempt_started_at") or time.time(),
                                           pending.time if pending else None)
            else:
                steady_samples += global_samples
            if beats:
                beats.beat(done, world)

            # A barrier on every rank (so every rank checks at the same steps); set by a node drain.
            preemption = ray.train.get_preemption_info() if not jit_taken and done % preempt_every == 0 else None
            is_ckpt = done == stop or preemption is not None or (
                done % ckpt_every == 0 and checkpoint_due(time.monotonic() - last_ckpt_at, min_gap_s, world, device))
            if not (is_ckpt or done % log_every == 0):
                continue
            if stop_flag is not None and stop_flag.requested():
                window[3] = 1.0  # rides on the all-reduce below: every rank learns it at this step
            if world > 1:
                dist.all_reduce(window)
            now = time.perf_counter()
            loss_total, samples, tokens, stop_votes = window.tolist()
            stop_now = stop_votes > 0
            is_ckpt = is_ckpt or stop_now
            elapsed = now - window_start
            steady_s = now - steady_start
            cursor = plan.cursor(done)
            seen = cursor.epoch * plan.num_samples + cursor.position
            metrics = {
                "step": done, "target_step": target, "epoch": cursor.epoch,
                "samples_seen": seen, "epochs_done": seen / plan.num_samples,
                "loss": loss_total / max(samples, 1), "learning_rate": scheduler.get_last_lr()[0],
                "samples_per_s": samples / elapsed, "tokens_per_s": tokens / elapsed,
                "steady_samples_per_s": steady_samples / steady_s if steady_s > 0 and steady_samples else samples / elapsed,
                "world_size": world, "global_batch_size": t.batch_size, "micro_batch_size": micro,
                "grad_accum_steps": len(shares),  # this step's micro-batches: by tokens, they vary
                "train_seconds": now - run_start,
            }
            window.zero_()
            window_start = now
            observer.log_step(metrics, elapsed)
            if rank == 0:
                eta = (target - done) / max(1e-9, (done - start) / (now - run_start))
                print(progress_line(done, target, metrics["loss"], metrics["learning_rate"], metrics["samples_per_s"],
                                    metrics["tokens_per_s"], eta), flush=True)
            if not is_ckpt:
                continue
            in_sync = params_in_sync(model, world)
            metrics["params_in_sync"] = in_sync
            if not in_sync:
                raise RuntimeError(
                    f"step {done}: DDP replicas hold different parameters (the guide's 'parameters out of sync'): "
                    "check that every worker runs the same model code and that nothing changes parameters "
                    "outside the optimizer step; WORLD_SIZE and RANK are set by Ray, do not set them yourself")
            # Only checkpoints go through ray.train.report: it is a barrier on every rank and Ray's
            # controller drains one report per poll (about 2 s), so reporting more often stalls training.
            checkpoint = None
            sample_ids = accounting.gather(feed, world, done) if spec.data.record_sample_ids else None
            if rank == 0:
                # Outlives report() for an async upload; Ray deletes it once uploaded (asked below).
                directory = tempfile.mkdtemp(prefix=f"ckpt-{done}-", dir=staging)
                state = {
                    "format": ckpt.FORMAT_VERSION, "step": done, "cursor": vars(cursor),
                    "model": _unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                    "world_size": world, "global_batch_size": t.batch_size,
                    "rng": {"scheme": "torch.manual_seed(step_seed(seed, step, rank)) each step", "seed": t.seed},
                    "metrics": metrics, "observer": observer.checkpoint_state(), "loader": feed.state(),
                    "sample_ids": sample_ids,
                }
                saving = time.perf_counter()
                ckpt.write_local(directory, state, spec.checkpoint.file_name(done), metrics)
                save_s = time.perf_counter() - saving
                checkpoint = Checkpoint.from_directory(directory)
            # A just-in-time checkpoint must be durable before the node goes: upload it synchronously.
            reporting = time.perf_counter()
            mode = CheckpointUploadMode.SYNC if preemption else upload_mode
            try:
                ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=ckpt.dir_name(done),
                                 checkpoint_upload_mode=mode, delete_local_checkpoint_after_upload=True)
            finally:
                if checkpoint is not None and mode == CheckpointUploadMode.SYNC:
                    shutil.rmtree(directory, ignore_errors=True)  # a failed upload leaves no copy either
            observer.checkpoint_times(save_s if rank == 0 else 0.0, time.perf_counter() - reporting)
            last_ckpt_at = time.monotonic()
            if rank == 0:
                c = spec.checkpoint
                ckpt.prune(root.fs, run_path, c.num_to_keep, c.keep_best_metric, c.keep_best_mode)
            if beats:
                beats.beat(done, world, cause="preemption notice" if preemption else None, force=True)
            observer.flush()
            if preemption is not None:
                jit_taken = True
                wait_out_preemption(preemption, rank, done)
            if stop_now:
                if rank == 0:
                    print(f"[etrain] stop requested: stopped at step {done} with a checkpoint; run again to resume",
                          flush=True)
                break
    finally:
        observer.close()  # its local TensorBoard folder goes, whatever ended the attempt


def staging_folder(job_key: str) -> str:
    """Rank 0's local folder for this job on this node: checkpoint copies before upload, TensorBoard
    files. Emptied when an attempt starts, so an attempt killed with its processes (a lost node,
    a restart) leaves nothing behind the next one; the copies of a running one go as they upload."""
    path = os.path.join(tempfile.gettempdir(), job_key.replace("/", "-"))
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


FAILURE_CAUSES = {"user_error": "user error", "node_lost": "node lost", "preemption": "preemption"}


def record_interruption(root, job: str, last: Heartbeat, restored_step: int, world: int,
                        previous_failure: str | None) -> None:
    """Rank 0, at the first step after a restart: append what the interruption cost to storage."""
    if last.cause is None and previous_failure:
        last = dataclasses.replace(last, cause=FAILURE_CAUSES.get(previous_failure, previous_failure))
    elif last.cause is None and world > last.world_size:
        last = dataclasses.replace(last, cause="scale up")  # Ray Train restarted the group to grow it
    record = interruption_record(last, restored_step, world, time.time())
    records = root.read_json(job, INTERRUPTIONS_FILE) if root.exists(job, INTERRUPTIONS_FILE) else []
    root.write_json([*records, record], job, INTERRUPTIONS_FILE)
    print(f"[etrain] recovered from {record['cause']} in {record['recovery_s']:.1f}s: "
          f"{record['steps_lost']} steps lost, world size {record['world_size_before']} -> {world}", flush=True)


def own_node_kind():
    """This worker's node: instance type and market, from its custom resources."""
    node_id = ray.get_runtime_context().get_node_id()
    resources = next((n["Resources"] for n in ray.nodes() if n["NodeID"] == node_id), {})
    return node_kind(resources)


def checkpoint_due(since_last_s: float, min_gap_s: float, world: int, device: torch.device) -> bool:
    """Whether an interval checkpoint is taken now: rank 0 decides from its clock, all ranks agree."""
    if min_gap_s <= 0:
        return True
    due = torch.tensor([1.0 if since_last_s >= min_gap_s else 0.0], device=device)
    if world > 1:
        dist.broadcast(due, src=0)
    return bool(due.item())


def wait_out_preemption(info, rank: int, step: int, grace_s: float = 30.0) -> None:
    """After the just-in-time checkpoint, stop doing work that the restart would throw away.

    Ray Train restarts the run at the deadline; if that does not happen (the notice was a
    false alarm), training goes on after the grace period.
    """
    deadline_s = (info.deadline_ms / 1000 - time.time()) if info.deadline_ms else 0.0
    if rank == 0:
        print(f"[etrain] preemption notice for nodes {info.preempted_node_ids}: checkpoint at step {step} "
              f"saved; idling {max(0.0, deadline_s):.0f}s until the restart", flush=True)
    time.sleep(max(0.0, deadline_s) + grace_s)


def params_in_sync(model: torch.nn.Module, world: int) -> bool:
    """Whether every rank holds the same parameters: compare a float64 checksum across ranks."""
    if world == 1:
        return True
    with torch.no_grad():
        total = sum(p.double().sum() * (i + 1) for i, p in enumerate(_unwrap(model).parameters()))
    both = torch.stack([total, -total]).reshape(2)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return bool(both[0] == -both[1])


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    model = getattr(model, "_orig_mod", model)  # torch.compile
    return getattr(model, "module", model)  # DDP

