"""The Trainer: setup, restore, ``train_step``, and ``train()`` on one screen.

Per step it does what plain DDP does and no more: forward/backward over the step's micro-
batches, the optimizer step. Everything else happens at "sync steps" (every log interval,
every ``checkpoint.preemption_check_steps``, by default about once a second, at checkpoints)
in ONE small all-reduce that carries the loss window, the stop vote, the preemption flag and
Ray Train's request to checkpoint before it resizes the group (and rank 0's step time, from
which every rank sets the next check alike); Ray's own calls (heartbeat,
stop request) run in a background thread, and checkpoints are written and reported in
another (trainers.checkpointer).

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
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from cluster.metrics import node_kind
from cluster.ray_adapter.train_worker import BATCH_EVERY_THREAD, batch_schedule_worker, on_resize_request
from cluster.storage import open_root
from trainers import checkpoint as ckpt
from trainers.checkpointer import Checkpointer, Kind
from trainers.config import JobSpec, batching_summary
from trainers.console import progress_text
from trainers.data import BatchPlan, Feed, StepMicroBatches, accounting
from trainers.observe import Observer, group_kinds
from trainers.recovery import (HEARTBEAT_INTERVAL_S, INTERRUPTIONS_FILE, Heartbeat, Heartbeats, StopFlag, interruption_record,
                               launcher_cause)
from trainers.worker_log import worker_log, worker_logger
from trainers.workloads import resolve


# ------------------------------------------------------------------ decisions (pure)


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


def seed_generators(seed: int, device: torch.device) -> None:
    """Seed the CPU generator and this device's, nothing else: torch.manual_seed also queues a lazy
    seeding of every CUDA/XPU/MTIA device, and each such call formats a stack trace (about half a
    millisecond a step on CPU, found with cProfile)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


def plan_for(spec: JobSpec, dataset) -> BatchPlan:
    """The job's order of global batches: what a resume must find again, whatever the workers."""
    lengths = getattr(dataset, "lengths", None)
    return BatchPlan(len(dataset), spec.training.batch_size, spec.training.seed, spec.data.shuffle,
                     lengths=lengths if spec.data.dynamic_batching else None,
                     group_sizes=getattr(dataset, "group_sizes", None), window=spec.data.shuffle_window_row_groups)


PREEMPTION_CHECK_S = 1.0  # preemption_check_steps "auto": a check about this often
FIRST_CHECK_STEPS = 10  # "auto" before a step time is known
MAX_CHECK_STEPS = 100  # "auto" with short steps: steps that turn slow (a stalled loader) are not waited out long


def sync_due(done: int, log_every: int, next_check: int, interval_steps: int) -> bool:
    """Whether step ``done`` does the small all-reduce (loss window, stop vote, preemption flag,
    resize request)."""
    return done % log_every == 0 or done >= next_check or done % interval_steps == 0


def next_check_step(done: int, every: int | str, step_s: float) -> int:
    """The step of the next preemption check after a sync at ``done``: every ``every`` steps, or with
    "auto" about every PREEMPTION_CHECK_S at ``step_s``, rank 0's seconds a step since the last sync.
    Every rank gets rank 0's value through the all-reduce (the others add zero), so all agree. Each
    check is one small all-reduce: every 10 steps of ~3 ms, they cost ~4% of the throughput. Log steps
    (``training.log_interval_steps``) sync as well."""
    if every != "auto":
        return done + int(every)
    if step_s <= 0:
        return done + FIRST_CHECK_STEPS
    return done + max(1, min(MAX_CHECK_STEPS, int(PREEMPTION_CHECK_S / step_s)))


def oom_vote_due(auto: bool, steps_at_this_split: int) -> bool:
    """Whether ranks agree on out-of-memory at this step (one 1-element all-reduce).

    ``auto``: every step (micro-batches vary, dynamic batching). A set micro-batch: the first
    step of an attempt and of each new split, where memory peaks (activations, optimizer state).
    """
    return auto or steps_at_this_split == 0


def halved_split(micro: int, per_worker: int, max_tokens: int | None) -> tuple[int, int, int | None] | None:
    """(micro-batch, accumulation, token budget) after an out-of-memory step; None at micro-batch 1."""
    if micro <= 1 and (max_tokens is None or max_tokens <= 1):
        return None
    new_micro = max(1, micro // 2)
    new_tokens = max(1, max_tokens // 2) if max_tokens else None
    return new_micro, math.ceil(per_worker / new_micro), new_tokens


def oom_message(micro: int, params: int, param_bytes: int, device: torch.device) -> str:
    """The error when even micro-batch 1 does not fit: what the model needs, what the device has."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        memory = f"{device} has {total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free now)"
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        memory = f"this node has {total / 2**30:.1f} GiB of memory"
    return (f"out of memory at micro-batch {micro}: the model has {params:,} parameters "
            f"({param_bytes / 2**30:.2f} GiB of weights, about {4 * param_bytes / 2**30:.2f} GiB with gradients "
            f"and Adam state); {memory}. Use a smaller model, shorter sequences "
            "(data.max_tokens_per_batch, model.max_seq_len), training.gradient_checkpointing: true, "
            "or a device with more memory")


# ------------------------------------------------------------------ helpers with state


class Pulse:
    """Rank 0's background thread: the heartbeat in Ray's KV and the stop request poll.

    Off the step path: the loop only writes ``step`` and reads ``stop_requested``, which rides
    the next sync step's all-reduce so every rank stops at the same step.
    """

    def __init__(self, beats: Heartbeats, stop_flag: StopFlag, world: int, interval_s: float = HEARTBEAT_INTERVAL_S):
        self.beats, self.stop_flag, self.world, self.interval_s = beats, stop_flag, world, interval_s
        self.step, self.stop_requested = 0, False
        self._held_at = 0  # the step of a just-in-time checkpoint: its beat (with the cause) must be the last
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="etrain-pulse", daemon=True)

    def start(self) -> Pulse:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._halt.wait(self.interval_s):
            try:
                with self._lock:
                    if self.step and self.step != self._held_at:
                        self.beats.beat(self.step, self.world, force=True)
                self.stop_requested = self.stop_requested or self.stop_flag.requested()
            except Exception as exc:  # boundary: a missed beat only blurs recovery accounting; try next tick
                worker_log().warning("note: heartbeat: %s: %s", type(exc).__name__, exc)

    def took_over(self, step: int) -> None:
        """The attempt's first step is done and the one before it recorded: beat at once, so that
        the beat an attempt after this one reads is this attempt's. A failure before the first tick
        (a node cut a second after the restart) would otherwise leave the previous attempt's beat
        there, and the next attempt would record that interruption again, cause and all."""
        try:
            with self._lock:
                self.beats.beat(step, self.world, force=True)
                self._held_at = 0
        except Exception as exc:  # boundary: as in _run, a missed beat must not end the attempt
            worker_log().warning("note: heartbeat: %s: %s", type(exc).__name__, exc)

    def checkpointed(self, step: int, jit: bool) -> None:
        """A beat at each checkpoint; after a just-in-time one, none until training moves on."""
        with self._lock:
            self.beats.beat(step, self.world, cause="preemption notice" if jit else None, force=True)
            self._held_at = step if jit else 0

    def stop(self) -> None:
        self._halt.set()


class ResizeRequest:
    """Ray Train's word, on a worker, that it is about to restart the group to resize it
    (cluster.ray_adapter.train_callbacks.CheckpointBeforeResize, in Ray's actor thread beside the training
    thread). The loop reads ``asked`` at its next sync step, where every rank agrees on it through
    the all-reduce as on a stop, checkpoints, and says at which step (:meth:`saved`)."""

    def __init__(self):
        self.asked = threading.Event()
        self._answered = threading.Event()
        self.step: int | None = None

    def ask(self, timeout_s: float) -> int | None:
        """The step of the checkpoint taken for the resize (written: on rank 0 in storage), or None
        (none within ``timeout_s``, or the attempt ended first)."""
        self.step = None
        self._answered.clear()
        self.asked.set()
        self._answered.wait(timeout_s)
        return self.step

    def saved(self, step: int | None) -> None:
        """On the training thread: answered (None: the attempt ended without one)."""
        self.asked.clear()
        self.step = step
        self._answered.set()


RESIZE_GRACE_S = 300.0  # past the controller's wait for every rank's answer, and its shutdown's


def wait_out_resize(rank: int, step: int, grace_s: float = RESIZE_GRACE_S) -> None:
    """After the checkpoint before a resize, stop doing work the restart would throw away: Ray
    Train shuts the group down once every rank has answered. Should it not (a Ray that changed
    how it resizes), training goes on after ``grace_s``, and a later request is answered anew."""
    if rank == 0:
        worker_log().info(f"resize: checkpoint at step {step} saved; Ray Train restarts the group now")
    time.sleep(grace_s)


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


class Trainer:
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
        self.start, self.restored, self.jit_taken = 0, {}, False
        self.folders_found: set[str] | None = None  # rank 0: the checkpoint folders storage held at restore
        self.logger = worker_logger(self.rank)
        # CPU ranks wholly, else Ray's main thread: its wake-ups and gloo's must not preempt the step
        self.scheduling = batch_schedule_worker(whole_process=self.device.type == "cpu")
        self.logger.debug("worker threads: %s", self.scheduling)

    # -------------------------------------------------------------- setup and restore

    def setup(self) -> None:
        t = self.spec.training
        torch.manual_seed(t.seed)  # identical initial weights everywhere (DDP also broadcasts rank 0's)
        self.model = self.workload.build_model(self.spec)
        self.optimizer = build_optimizer(self.spec, self.model.parameters())
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(
            s, self.target, t.lr_schedule.warmup_steps, t.lr_schedule.min_lr_ratio, t.lr_schedule.kind))
        precision = self.config["mixed_precision"]
        self.scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
        amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        self.autocast = (lambda: torch.autocast(self.device.type, dtype=amp_dtype)) if amp_dtype else contextlib.nullcontext
        self.restore()
        d = self.spec.distributed
        ddp_kwargs = {"find_unused_parameters": d.find_unused_parameters,
                      "gradient_as_bucket_view": d.gradient_as_bucket_view, "static_graph": d.static_graph}
        self.model = ray.train.torch.prepare_model(self.model, parallel_strategy_kwargs=ddp_kwargs if self.world > 1 else None)
        if t.compile:
            self.model = torch.compile(self.model)
        for st in self.optimizer.state.values():  # loaded on CPU; move it where the parameters now live
            for k, v in st.items():
                if torch.is_tensor(v) and k != "step":
                    st[k] = v.to(self.device)
        per_worker, micro, _ = batching_summary(t.batch_size, self.world, t.micro_batch_size, t.grad_accum_steps)
        data = self.spec.data
        tokens = data.max_tokens_per_batch if data.dynamic_batching else None
        saved = self.restored.get("batching") or {}
        if saved.get("micro_batch_size"):  # a split healed after an out-of-memory is kept for the run
            micro = min(micro, saved["micro_batch_size"])
            tokens = min(tokens, saved["max_tokens"]) if tokens and saved.get("max_tokens") else tokens
        self.batching = Batching(per_worker, micro, tokens, t.micro_batch_size == "auto", list(saved.get("reductions", [])))
        self.open_loader(self.start)
        # loss, samples, tokens, stop, preempt, rank 0's seconds a step since the last sync, resize
        self.window = torch.zeros(7, dtype=torch.float64, device=self.device)
        self.samples = self.tokens = 0  # this rank's since the last sync step: Python ints, no tensor op per micro-batch
        self.totals = torch.zeros(3, dtype=torch.float64, device=self.device)  # reduced window since the last log

    def restore(self) -> None:
        """Rank 0 picks the newest verified checkpoint; every rank loads that one."""
        choice = [None]
        if self.rank == 0:
            folders = ckpt.checkpoint_folders(self.root.fs, self.run_path)
            self.folders_found = {path for _, path in folders}
            chosen, skipped = ckpt.find_restore(self.root.fs, self.run_path, folders)
            for c in skipped:
                self.logger.warning("skipping checkpoint %s: %s", self.root.uri_of(c.path[len(self.root.base) + 1:]),
                                    c.problem)
            choice = [chosen.path if chosen else None]
        if self.world > 1:
            dist.broadcast_object_list(choice, src=0)
        if not choice[0]:
            return
        state = ckpt.load_state(self.root.fs, choice[0])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.start, self.restored = state["step"], {"observer": state.get("observer"), "batching": state.get("batching"),
                                                    "loader": state.get("loader")}
        self.logger.info("resumed from step %s (saved at world size %s, now %s; cursor %s)", self.start,
                         state["world_size"], self.world, state["cursor"])

    def open_loader(self, step: int) -> None:
        b, data = self.batching, self.spec.data
        self.steps = StepMicroBatches(self.plan, self.rank, self.world, b.micro, b.max_tokens)
        # A new split (out of memory) keeps the loader setting the feed had tuned; a resume, the one saved.
        tuned = self.feed.state() if getattr(self, "feed", None) is not None else self.restored.get("loader")
        self.feed = Feed(self.dataset, self.steps, step, self.stop, data.num_workers, data.prefetch_factor, self.device,
                         tuned=tuned, announce=self.logger.info,
                         record_ids=data.record_sample_ids)

    def start_services(self) -> None:
        """Heartbeat and stop poll, node kinds for cost, the observer, the checkpointer."""
        spec, rank = self.spec, self.rank
        beats = Heartbeats(self.job_key, self.config.get("run_id") or "", HEARTBEAT_INTERVAL_S,
                           self.config.get("attempt_started_at", 0.0)) if rank == 0 else None
        self.pending_beat = beats.last() if beats else None  # the attempt before this one died at its last beat
        self.pulse = Pulse(beats, StopFlag(self.job_key, (self.root, self.job)), self.world).start() if rank == 0 \
            else None
        kinds = [(ray.get_runtime_context().get_node_id(), own_node_kind())]
        if self.world > 1:  # once per attempt: which nodes the group runs on, for its cost
            gathered = [None] * self.world
            dist.all_gather_object(gathered, kinds[0])
            kinds = gathered
        staging = staging_folder(self.job_key) if rank == 0 else None
        self.observer = Observer(spec, self.root, rank, self.device, self.config.get("submitted_at") or time.time(),
                                 self.restored.get("observer"), group_kinds(kinds), job=self.job, staging=staging,
                                 start_step=self.start)
        if rank == 0:
            known = self.root.read_json(self.job, INTERRUPTIONS_FILE) if self.root.exists(self.job, INTERRUPTIONS_FILE) else []
            self.observer.interruptions(known)

        after_write = self.pulse.checkpointed if self.pulse else (lambda step, jit: None)
        self.checkpointer = Checkpointer(spec, self.root, self.run_path, rank, self.world, self.device, after_write,
                                         yield_cpu=self.scheduling == BATCH_EVERY_THREAD, folders_found=self.folders_found)
        self.resize = ResizeRequest()
        on_resize_request(self.resize.ask)

    # -------------------------------------------------------------- the loop

    def train(self) -> None:
        self.setup()
        self.start_services()
        t, b = self.spec.training, self.batching
        self.logger.info(f"{self.spec.name}: world size {self.world}, global batch {t.batch_size} = {b.per_worker}/worker "
                         f"(micro-batch {b.micro} x {b.accum} accumulation{', dynamic by tokens' if b.max_tokens else ''}); "
                         f"steps {self.start} -> {self.stop} of {self.target}, {self.plan.steps_per_epoch} per epoch")
        self.clock = Clock(time.perf_counter())
        self.last_sync = (self.start, self.clock.run_start)
        self.next_check = next_check_step(self.start, self.spec.checkpoint.preemption_check_steps, 0.0)
        self.model.train()
        try:
            for step in range(self.start, self.stop):
                self.train_step(step)
                done = step + 1
                self.after_first_step(done)
                if self.pulse:
                    self.pulse.step = done
                if done != self.stop and not sync_due(done, t.log_interval_steps, self.next_check, self.checkpointer.interval_steps):
                    continue
                stop_now, preempted, resizing = self.sync(done)
                preemption = None
                if preempted and not self.jit_taken:  # agree on the notice (a Ray barrier: only when flagged)
                    # One Ray collective at a time, in the same order on every rank; an earlier failed
                    # upload is logged, not raised: the notice's own checkpoint comes first.
                    self.checkpointer.settle(timeout_s=None)
                    preemption = ray.train.get_preemption_info()
                    self.jit_taken = preemption is not None
                kind = self.checkpointer.kind(done, self.stop, preemption is not None, stop_now, resizing)
                if kind is None and done % t.log_interval_steps:
                    continue
                metrics = self.log(done)
                if kind is not None:  # when resizing, this step's checkpoint, whatever its kind, answers the resize
                    self.save(done, kind, metrics, written=self.resize.saved if resizing else None)
                if preemption is not None:
                    wait_out_preemption(preemption, self.rank, done)
                if kind is Kind.RESIZE:
                    wait_out_resize(self.rank, done)
                if stop_now:
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
        before = (self.window[0].clone(), self.samples, self.tokens) if vote else None
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
            self.window[0] += loss_sum.detach().double()
            self.samples += n
            self.tokens += tokens
        if not vote:
            return True
        flag = torch.tensor([float(out_of_memory)], device=self.device)
        if self.world > 1:
            dist.all_reduce(flag)
        if flag.item() > 0:
            self.window[0], self.samples, self.tokens = before
            return False
        try:
            self.scaler.scale(loss_sum * scale).backward()
        except torch.OutOfMemoryError as exc:  # past the vote: the other ranks are in DDP's all-reduce
            raise RuntimeError("out of memory in the last backward of a step, after ranks agreed it fits: "
                               "set a smaller training.micro_batch_size") from exc
        self.window[0] += loss_sum.detach().double()
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
            model = _unwrap(self.model)
            params = sum(p.numel() for p in model.parameters())
            raise torch.OutOfMemoryError(oom_message(b.micro, params, sum(p.numel() * p.element_size() for p in model.parameters()),
                                                     self.device))
        micro, accum, tokens = split
        b.reductions.append({"step": step, "from": b.micro, "to": micro})
        self.logger.info(f"out of memory at step {step} with micro-batch {b.micro}: now micro-batch {micro} x {accum} "
                         f"accumulation{f', {tokens} tokens' if tokens else ''} (same global batch), kept for the rest of the run")
        b.micro, b.max_tokens, b.steps_at_split = micro, tokens, 0
        self.open_loader(step)

    def sync(self, done: int) -> tuple[bool, bool, bool]:
        """The one small all-reduce of a sync step: loss window, stop vote, preemption flag, resize request."""
        self.window[1], self.window[2] = self.samples, self.tokens
        self.samples = self.tokens = 0
        if self.pulse and self.pulse.stop_requested:
            self.window[3] = 1.0
        if ray_preemption_noticed():
            self.window[4] = 1.0
        if self.rank == 0:
            now = time.perf_counter()
            self.window[5] = (now - self.last_sync[1]) / max(1, done - self.last_sync[0])
            self.last_sync = (done, now)
        if self.resize.asked.is_set():
            self.window[6] = 1.0
        if self.world > 1:
            dist.all_reduce(self.window)
        self.totals += self.window[:3]
        stop_votes, preempt_votes, step_s, resize_votes = self.window[3:].tolist()
        self.window.zero_()
        self.next_check = next_check_step(done, self.spec.checkpoint.preemption_check_steps, step_s)
        return stop_votes > 0, preempt_votes > 0, resize_votes > 0

    def log(self, done: int) -> dict:
        """Metrics since the last log (one host sync), published by the observer; rank 0 prints progress."""
        t, b, clock = self.spec.training, self.batching, self.clock
        loss_total, samples, tokens = self.totals.tolist()
        self.totals.zero_()
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
            "model": _unwrap(self.model).state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
            "world_size": self.world, "global_batch_size": t.batch_size,
            "batching": {"micro_batch_size": b.micro, "max_tokens": b.max_tokens, "reductions": list(b.reductions)},
            "rng": {"scheme": "torch.manual_seed(step_seed(seed, step, rank)) each step", "seed": t.seed},
            "metrics": dict(metrics), "observer": self.observer.checkpoint_state(),
            "loader": self.feed.state(), "sample_ids": sample_ids, "scheduling": self.scheduling,
        }

    def after_first_step(self, done: int) -> None:
        """The first step pays for warm-up; steady throughput and the cost segment start after it."""
        clock = self.clock
        if clock.steady_start is not None:
            clock.steady_samples += len(self.plan.global_batch_at(done - 1))
            return
        clock.steady_start = time.perf_counter()
        pending, config = self.pending_beat, self.config
        if pending is not None:
            cause = launcher_cause(pending, config.get("attempt_started_at", 0.0), config.get("previous_failure"))
            record_interruption(self.root, self.job, pending, self.start, self.world, cause)
            self.observer.interruptions(self.root.read_json(self.job, INTERRUPTIONS_FILE))
        if self.pulse:
            self.pulse.took_over(done)
        # Paid from the moment the attempt before died (or this run started): nothing goes unbilled.
        self.observer.open_cost_segment(config.get("run_id") or "", pending.time if pending else
                                        config.get("attempt_started_at") or time.time(),
                                        pending.time if pending else None)


@dataclasses.dataclass
class Clock:
    run_start: float
    window_start: float = 0.0
    steady_start: float | None = None
    steady_samples: int = 0

    def __post_init__(self) -> None:
        self.window_start = self.run_start


# ------------------------------------------------------------------ small parts


def build_optimizer(spec: JobSpec, params) -> torch.optim.Optimizer:
    t = spec.training
    if t.optimizer == "SGD":
        return torch.optim.SGD(params, lr=t.learning_rate, momentum=t.momentum, weight_decay=t.weight_decay)
    cls = torch.optim.AdamW if t.optimizer == "AdamW" else torch.optim.Adam
    return cls(params, lr=t.learning_rate, weight_decay=t.weight_decay)


def ray_preemption_noticed() -> bool:
    """This worker's own view of a spot notice: a local read, no Ray call (the agreement rides the all-reduce)."""
    from cluster.ray_adapter.train_worker import local_preemption_info

    return local_preemption_info() is not None


def staging_folder(job_key: str) -> str:
    """Rank 0's local folder for this job on this node: TensorBoard files before upload (checkpoints
    go straight to storage). Emptied when an attempt starts, so an attempt killed with its
    processes (a lost node, a restart) leaves nothing behind the next one."""
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
    worker_log().info(f"recovered from {record['cause']} in {record['recovery_s']:.1f}s: "
                      f"{record['steps_lost']} steps lost, world size {record['world_size_before']} -> {world}")


def own_node_kind():
    """This worker's node: instance type and market, from its custom resources."""
    node_id = ray.get_runtime_context().get_node_id()
    resources = next((n["Resources"] for n in ray.nodes() if n["NodeID"] == node_id), {})
    return node_kind(resources)


def wait_out_preemption(info, rank: int, step: int, grace_s: float = 30.0) -> None:
    """After the just-in-time checkpoint, stop doing work that the restart would throw away.

    Ray Train restarts the run at the deadline; if that does not happen (the notice was a
    false alarm), training goes on after the grace period.
    """
    deadline_s = (info.deadline_ms / 1000 - time.time()) if info.deadline_ms else 0.0
    if rank == 0:
        worker_log().warning(f"preemption notice for nodes {info.preempted_node_ids}: checkpoint at step {step} "
                             f"saved; idling {max(0.0, deadline_s):.0f}s until the restart")
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
