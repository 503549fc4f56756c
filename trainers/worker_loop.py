"""The Trainer: its state built in one place, ``train_step``, and ``train()`` on one screen.

Per step it does what plain DDP does and no more: forward/backward over the step's micro-
batches, the optimizer step. Everything else happens at "sync steps" (every log interval,
every ``checkpoint.preemption_check_steps``, by default about once a second, at checkpoints)
in ONE small all-reduce (trainers.sync_step) that carries the loss window, the stop vote, the preemption flag and
Ray Train's request to checkpoint before it resizes the group (and rank 0's step time, from
which every rank sets the next check alike); Ray's own calls (heartbeat,
stop request) run in a background thread, and checkpoints are written and reported in
another (trainers.checkpoint_writer).

The loss of every micro-batch is a SUM over its samples, scaled by world_size / global
samples of the step; DDP averages gradients over ranks, so the update is the exact mean
over the global batch whatever the world size or the split into micro-batches. That is
what lets an out-of-memory step be redone with half the micro-batch and the same result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import time
from collections.abc import Callable

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from cluster.ray_adapter.train_worker import BATCH_EVERY_THREAD, batch_schedule_worker, on_resize_request
from cluster.storage import open_root
from trainers import checkpoint_files as ckpt
from trainers.checkpoint_writer import Checkpointer
from trainers.config.batching import batching_summary
from trainers.config.job import JobSpec
from trainers.console import progress_text
from trainers.data import Feed, StepMicroBatches, accounting
from trainers.init_weights import load_into
from trainers.job_folder import read_interruptions
from trainers.model_ops import autocast_for, build_optimizer, lr_scheduler, params_in_sync, seed_generators, unwrap
from trainers.observe import Observer, group_kinds
from trainers.recovery import HEARTBEAT_INTERVAL_S, Heartbeats, StopFlag, launcher_cause
from trainers.rules import (Kind, halved_split, next_check_step, oom_message, oom_vote_due, plan_for, step_seed,
                            sync_due, target_step)
from trainers.sync_step import SyncOutcome, SyncVector
from trainers.worker_log import worker_logger
from trainers.worker_services import (Pulse, ResizeRequest, own_node_kind, ray_preemption_noticed, record_interruption,
                                      staging_folder, wait_out_preemption, wait_out_resize)
from trainers.workloads import resolve


@dataclasses.dataclass
class Batching:
    """How a rank splits its share of a global batch; may shrink on out-of-memory."""

    per_worker: int
    micro: int
    max_tokens: int | None
    auto: bool
    reductions: list[dict] = dataclasses.field(default_factory=list)
    steps_at_split: int = 0

    @property
    def accum(self) -> int:
        return math.ceil(self.per_worker / self.micro)


def first_batching(spec: JobSpec, world: int, saved: dict) -> Batching:
    """The split at the start of an attempt: the spec's, or a smaller one healed after an
    out-of-memory in an earlier attempt (``saved``, from the checkpoint), kept for the run."""
    t, data = spec.training, spec.data
    per_worker, micro, _ = batching_summary(t.batch_size, world, t.micro_batch_size, t.grad_accum_steps)
    tokens = data.max_tokens_per_batch if data.dynamic_batching else None
    if saved.get("micro_batch_size"):
        micro = min(micro, saved["micro_batch_size"])
        tokens = min(tokens, saved["max_tokens"]) if tokens and saved.get("max_tokens") else tokens
    return Batching(per_worker, micro, tokens, t.micro_batch_size == "auto", list(saved.get("reductions", [])))


class Trainer:
    """One rank's attempt: everything it holds is built here, in the order the ranks agree on
    (restore, then the model under DDP, then the services), and ``train()`` runs the loop."""

    def __init__(self, config: dict):
        self.config = config
        self.spec = spec = JobSpec.model_validate(config["spec"])
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.device = ray.train.torch.get_device()
        self.root = open_root(config["storage_uri"])
        self.job, self.job_key, self.run_path = config["job_dir"], config["job_key"], config["run_path"]
        self.workload = resolve(spec)
        self.dataset = self.workload.dataset(spec, config["data_uri"])
        self.plan = plan_for(spec, self.dataset)
        self.target = target_step(spec, self.plan.steps_per_epoch)
        self.stop = min(self.target, config.get("stop_at_step") or self.target)
        self.jit_taken = False
        self.logger = worker_logger(self.rank)
        # CPU ranks wholly, else Ray's main thread: its wake-ups and gloo's must not preempt the step
        self.scheduling = batch_schedule_worker(whole_process=self.device.type == "cpu")
        self.logger.debug("worker threads: %s", self.scheduling)
        # The model's parts, then the newest verified checkpoint into them
        torch.manual_seed(spec.training.seed)  # identical initial weights everywhere (DDP also broadcasts rank 0's)
        self.model = self.workload.build_model(spec)
        self.optimizer = build_optimizer(spec, self.model.parameters())
        self.scheduler = lr_scheduler(spec, self.optimizer, self.target)
        precision = config["mixed_precision"]
        self.scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
        self.autocast = autocast_for(self.device, precision)
        # rank 0: the checkpoint folders storage held at restore (the writer clears only those)
        self.start, self.restored, self.folders_found = self.restore()
        if self.start == 0 and spec.model.init_from and self.rank == 0:  # DDP hands rank 0's weights to the rest
            load_into(self.model, spec.model.init_from)
        self.model = self.distribute(self.model)
        self.batching = first_batching(spec, self.world, self.restored.get("batching") or {})
        self.steps, self.feed = self.open_loader(self.start, tuned=self.restored.get("loader"))
        self.window = SyncVector(self.device)
        self.samples = self.tokens = 0  # this rank's since the last sync step: Python ints, no tensor op per micro-batch
        self.totals = [0.0, 0.0, 0.0]  # the group's loss sum, samples and tokens since the last log
        # The services beside the loop
        beats = Heartbeats(self.job_key, config.get("run_id") or "", HEARTBEAT_INTERVAL_S,
                           config.get("attempt_started_at", 0.0)) if self.rank == 0 else None
        self.pending_beat = beats.last() if beats else None  # the attempt before this one died at its last beat
        self.pulse = Pulse(beats, StopFlag(self.job_key, (self.root, self.job)), self.world).start() if beats else None
        self.observer = self.start_observer()
        after_write = self.pulse.checkpointed if self.pulse else (lambda step, jit: None)
        self.checkpointer = Checkpointer(spec, self.root, self.run_path, self.rank, self.world, self.device, after_write,
                                         yield_cpu=self.scheduling == BATCH_EVERY_THREAD, folders_found=self.folders_found)
        self.resize = ResizeRequest()
        on_resize_request(self.resize.ask)
        # The loop's clocks, set again when it starts
        self.clock = Clock(time.perf_counter())
        self.last_sync = (self.start, self.clock.run_start)
        self.next_check = next_check_step(self.start, spec.checkpoint.preemption_check_steps, 0.0)

    # -------------------------------------------------------------- building

    def restore(self) -> tuple[int, dict, set[str] | None]:
        """Rank 0 picks the newest verified checkpoint; every rank loads that one into the model's parts.
        The step to start at, what else the checkpoint carried, and (rank 0) the folders storage held."""
        choice, folders_found = [None], None
        if self.rank == 0:
            folders = ckpt.checkpoint_folders(self.root.fs, self.run_path)
            folders_found = {path for _, path in folders}
            chosen, skipped = ckpt.find_restore(self.root.fs, self.run_path, folders)
            for c in skipped:
                self.logger.warning("skipping checkpoint %s: %s", self.root.uri_of(c.path[len(self.root.base) + 1:]),
                                    c.problem)
            choice = [chosen.path if chosen else None]
        if self.world > 1:
            dist.broadcast_object_list(choice, src=0)
        if not choice[0]:
            return 0, {}, folders_found
        state = ckpt.load_state(self.root.fs, choice[0])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.logger.info("resumed from step %s (saved at world size %s, now %s; cursor %s)", state["step"],
                         state["world_size"], self.world, state["cursor"])
        restored = {"observer": state.get("observer"), "batching": state.get("batching"), "loader": state.get("loader")}
        return state["step"], restored, folders_found

    def distribute(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model under DDP (and torch.compile), with the optimizer's state on its device."""
        d = self.spec.distributed
        ddp_kwargs = {"find_unused_parameters": d.find_unused_parameters,
                      "gradient_as_bucket_view": d.gradient_as_bucket_view, "static_graph": d.static_graph}
        model = ray.train.torch.prepare_model(model, parallel_strategy_kwargs=ddp_kwargs if self.world > 1 else None)
        if self.spec.training.compile:
            model = torch.compile(model)
        for st in self.optimizer.state.values():  # loaded on CPU; move it where the parameters now live
            for k, v in st.items():
                if torch.is_tensor(v) and k != "step":
                    st[k] = v.to(self.device)
        return model

    def open_loader(self, step: int, tuned: dict | None) -> tuple[StepMicroBatches, Feed]:
        """This rank's micro-batches from ``step`` and the feed that loads them. ``tuned``: the loader
        setting to keep (a resume: the one saved; a new split after out-of-memory: the feed's own)."""
        b, data = self.batching, self.spec.data
        steps = StepMicroBatches(self.plan, self.rank, self.world, b.micro, b.max_tokens)
        feed = Feed(self.dataset, steps, step, self.stop, data.num_workers, data.prefetch_factor, self.device,
                    tuned=tuned, announce=self.logger.info, record_ids=data.record_sample_ids)
        return steps, feed

    def start_observer(self) -> Observer:
        """Metrics, TensorBoard and cost; node kinds gathered once per attempt for the cost."""
        kinds = [(ray.get_runtime_context().get_node_id(), own_node_kind())]
        if self.world > 1:  # once per attempt: which nodes the group runs on, for its cost
            gathered = [None] * self.world
            dist.all_gather_object(gathered, kinds[0])
            kinds = gathered
        staging = staging_folder(self.job_key) if self.rank == 0 else None
        observer = Observer(self.spec, self.root, self.rank, self.device, self.config.get("submitted_at") or time.time(),
                            self.restored.get("observer"), group_kinds(kinds), job=self.job, staging=staging,
                            start_step=self.start)
        if self.rank == 0:
            observer.interruptions(read_interruptions(self.root, self.job))
        return observer

    # -------------------------------------------------------------- the loop

    def train(self) -> None:
        t, b = self.spec.training, self.batching
        self.logger.info(f"{self.spec.name}: world size {self.world}, global batch {t.batch_size} = {b.per_worker}/worker "
                         f"(micro-batch {b.micro} x {b.accum} accumulation{', dynamic by tokens' if b.max_tokens else ''}); "
                         f"steps {self.start} -> {self.stop} of {self.target}, {self.plan.steps_per_epoch} per epoch")
        self.clock = Clock(time.perf_counter())
        self.last_sync = (self.start, self.clock.run_start)
        self.model.train()
        try:
            for step in range(self.start, self.stop):
                self.train_step(step)
                done = step + 1
                if self.clock.step_done(len(self.plan.global_batch_at(step))):
                    self.take_over(done)
                if self.pulse:
                    self.pulse.step = done
                if done != self.stop and not sync_due(done, t.log_interval_steps, self.next_check, self.checkpointer.interval_steps):
                    continue
                synced = self.sync(done)
                preemption = None
                if synced.preempted and not self.jit_taken:  # agree on the notice (a Ray barrier: only when flagged)
                    # One Ray collective at a time, in the same order on every rank; an earlier failed
                    # upload is logged, not raised: the notice's own checkpoint comes first.
                    self.checkpointer.settle(timeout_s=None)
                    preemption = ray.train.get_preemption_info()
                    self.jit_taken = preemption is not None
                kind = self.checkpointer.kind(done, self.stop, preemption is not None, synced.stop,
                                               synced.resizing)
                if kind is None and done % t.log_interval_steps:
                    continue
                metrics = self.log(done)
                if kind is not None:  # when resizing, this step's checkpoint, whatever its kind, answers the resize
                    self.save(done, kind, metrics, written=self.resize.saved if synced.resizing else None)
                if preemption is not None:
                    wait_out_preemption(preemption, self.rank, done)
                if kind is Kind.RESIZE:
                    wait_out_resize(self.rank, done)
                if synced.stop:
                    self.logger.info("stop requested: stopped at step %d with a checkpoint; run again to resume", done)
                    break
            self.checkpointer.wait()
        except Exception:
            self.checkpointer.settle()  # the retry resumes from the checkpoint already under way
            raise
        finally:
            on_resize_request(None)
            self.resize.saved(None)  # a request still waiting gets its answer now
            if self.pulse:
                self.pulse.stop()
            self.checkpointer.close()
            self.observer.close()  # its local TensorBoard folder goes, whatever ended the attempt

    def train_step(self, step: int) -> None:
        """One optimizer step over the global batch; an out-of-memory redoes it with half the micro-batch."""
        seed_generators(step_seed(self.spec.training.seed, step, self.rank), self.device)
        while not self.forward_backward(step):
            self.heal(step)
        t = self.spec.training
        if t.grad_clip_norm:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.batching.steps_at_split += 1
        self.observer.step_done(step + 1)

    def forward_backward(self, step: int) -> bool:
        """Accumulate the step's gradients; False when a rank ran out of memory (every rank agrees)."""
        shares = self.steps.at(step)
        scale = self.world / len(self.plan.global_batch_at(step))
        vote = oom_vote_due(self.batching.auto, self.batching.steps_at_split)
        before = (self.window.loss, self.samples, self.tokens) if vote else None
        out_of_memory, last = False, len(shares) - 1
        for i in range(len(shares)):
            waited = time.perf_counter()
            batch = self.feed.next()
            self.observer.loader_wait(time.perf_counter() - waited)
            sync = contextlib.nullcontext() if (i == last or self.world == 1) else self.model.no_sync()
            try:
                with sync:
                    with self.autocast():
                        loss_sum, n, tokens = self.workload.loss_sum(self.model, batch)
                    if i == last and vote:  # agree before the last backward: DDP's all-reduce runs in it
                        break
                    self.scaler.scale(loss_sum * scale).backward()
            except torch.OutOfMemoryError:
                if not vote:
                    raise
                out_of_memory = True
                break
            self.window.add_loss(loss_sum)
            self.samples += n
            self.tokens += tokens
        if not vote:
            return True
        flag = torch.tensor([float(out_of_memory)], device=self.device)
        if self.world > 1:
            dist.all_reduce(flag)
        if flag.item() > 0:
            self.window.loss, self.samples, self.tokens = before
            return False
        try:
            self.scaler.scale(loss_sum * scale).backward()
        except torch.OutOfMemoryError as exc:  # past the vote: the other ranks are in DDP's all-reduce
            raise RuntimeError("out of memory in the last backward of a step, after ranks agreed it fits: "
                               "set a smaller training.micro_batch_size") from exc
        self.window.add_loss(loss_sum)
        self.samples += n
        self.tokens += tokens
        return True

    def heal(self, step: int) -> None:
        """Every rank: free, halve the micro-batch (double accumulation), redo the step from its first sample."""
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        b = self.batching
        split = halved_split(b.micro, b.per_worker, b.max_tokens)
        if split is None:
            model = unwrap(self.model)
            params = sum(p.numel() for p in model.parameters())
            raise torch.OutOfMemoryError(oom_message(b.micro, params, sum(p.numel() * p.element_size() for p in model.parameters()),
                                                     self.device))
        micro, accum, tokens = split
        b.reductions.append({"step": step, "from": b.micro, "to": micro})
        self.logger.info(f"out of memory at step {step} with micro-batch {b.micro}: now micro-batch {micro} x {accum} "
                         f"accumulation{f', {tokens} tokens' if tokens else ''} (same global batch), kept for the rest of the run")
        b.micro, b.max_tokens, b.steps_at_split = micro, tokens, 0
        self.steps, self.feed = self.open_loader(step, tuned=self.feed.state())

    def sync(self, done: int) -> SyncOutcome:
        """The one small all-reduce of a sync step: loss window, stop vote, preemption flag, resize request."""
        step_s = 0.0
        if self.rank == 0:
            now = time.perf_counter()
            step_s = (now - self.last_sync[1]) / max(1, done - self.last_sync[0])
            self.last_sync = (done, now)
        outcome = self.window.reduce(self.world, self.samples, self.tokens, stop=bool(self.pulse and self.pulse.stop_requested),
                                     preempted=ray_preemption_noticed(), step_s=step_s,
                                     resizing=self.resize.asked.is_set())
        self.samples = self.tokens = 0
        self.totals = [a + b for a, b in zip(self.totals, (outcome.loss_sum, outcome.samples, outcome.tokens))]
        self.next_check = next_check_step(done, self.spec.checkpoint.preemption_check_steps, outcome.step_s)
        return outcome

    def log(self, done: int) -> dict:
        """Metrics since the last log (one host sync), published by the observer; rank 0 prints progress."""
        t, b, clock = self.spec.training, self.batching, self.clock
        loss_total, samples, tokens = self.totals
        self.totals = [0.0, 0.0, 0.0]
        now = time.perf_counter()
        elapsed, steady_s = now - clock.window_start, now - (clock.steady_start or now)
        cursor = self.plan.cursor(done)
        seen = cursor.epoch * self.plan.num_samples + cursor.position
        steady = clock.steady_samples / steady_s if steady_s > 0 and clock.steady_samples else samples / elapsed
        metrics = {
            "step": done, "target_step": self.target, "epoch": cursor.epoch,
            "samples_seen": seen, "epochs_done": seen / self.plan.num_samples,
            "loss": loss_total / max(samples, 1), "learning_rate": self.scheduler.get_last_lr()[0],
            "samples_per_s": samples / elapsed, "tokens_per_s": tokens / elapsed, "steady_samples_per_s": steady,
            "world_size": self.world, "global_batch_size": t.batch_size, "micro_batch_size": b.micro,
            "grad_accum_steps": len(self.steps.at(done - 1)),  # this step's micro-batches: by tokens, they vary
            "micro_batch_reductions": len(b.reductions), "train_seconds": now - clock.run_start,
        }
        clock.window_start = now
        self.observer.log_step(metrics, elapsed)
        eta = (self.target - done) / max(1e-9, (done - self.start) / (now - clock.run_start))
        self.logger.info(progress_text(done, self.target, metrics["loss"], metrics["learning_rate"], metrics["samples_per_s"],
                                       metrics["tokens_per_s"], eta))
        return metrics

    def save(self, done: int, kind: Kind, metrics: dict, written: Callable[[int], None] | None = None) -> None:
        in_sync = params_in_sync(self.model, self.world)
        metrics["params_in_sync"] = in_sync
        if not in_sync:
            raise RuntimeError(
                f"step {done}: DDP replicas hold different parameters (the guide's 'parameters out of sync'): "
                "check that every worker runs the same model code and that nothing changes parameters "
                "outside the optimizer step; WORLD_SIZE and RANK are set by Ray, do not set them yourself")
        # A collective on every rank; its record goes into this checkpoint (a skipped one would break the chain).
        sample_ids = accounting.gather(self.feed, self.world, done) if self.spec.data.record_sample_ids else None
        self.checkpointer.save(done, kind, self.state_at(done, metrics, sample_ids) if self.rank == 0 else None, metrics,
                               flush=self.observer.flusher, written=written)
        timing = self.checkpointer.timing  # what the training thread paid: the copy, and any wait
        self.observer.checkpoint_times(timing.snapshot_s, timing.blocked_s)

    def state_at(self, done: int, metrics: dict, sample_ids: dict | None = None):
        """Rank 0's full training state at step ``done``, built when the checkpointer copies it."""
        t, b = self.spec.training, self.batching
        return lambda: {
            "format": ckpt.FORMAT_VERSION, "step": done, "cursor": vars(self.plan.cursor(done)),
            "model": unwrap(self.model).state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
            "world_size": self.world, "global_batch_size": t.batch_size,
            "batching": {"micro_batch_size": b.micro, "max_tokens": b.max_tokens, "reductions": list(b.reductions)},
            "rng": {"scheme": "torch.manual_seed(step_seed(seed, step, rank)) each step", "seed": t.seed},
            "metrics": dict(metrics), "observer": self.observer.checkpoint_state(),
            "loader": self.feed.state(), "sample_ids": sample_ids, "scheduling": self.scheduling,
        }

    def take_over(self, done: int) -> None:
        """At this attempt's first step (warm-up paid): record the interruption the attempt before
        ended with, beat at once, and open this attempt's cost segment."""
        pending, config = self.pending_beat, self.config
        if pending is not None:
            cause = launcher_cause(pending, config.get("attempt_started_at", 0.0), config.get("previous_failure"))
            record_interruption(self.root, self.job, pending, self.start, self.world, cause)
            self.observer.interruptions(read_interruptions(self.root, self.job))
        if self.pulse:
            self.pulse.took_over(done)
        # Paid from the moment the attempt before died (or this run started): nothing goes unbilled.
        self.observer.open_cost_segment(config.get("run_id") or "", pending.time if pending else
                                        config.get("attempt_started_at") or time.time(),
                                        pending.time if pending else None)


@dataclasses.dataclass
class Clock:
    """What the loop times: the run, the window since the last log, steady throughput after warm-up."""

    run_start: float
    window_start: float = 0.0
    steady_start: float | None = None
    steady_samples: int = 0

    def __post_init__(self) -> None:
        self.window_start = self.run_start

    def step_done(self, samples: int) -> bool:
        """Count a step; True for the attempt's first, which pays for warm-up: steady throughput
        counts from its end."""
        if self.steady_start is None:
            self.steady_start = time.perf_counter()
            return True
        self.steady_samples += samples
        return False

