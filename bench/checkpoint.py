"""What checkpointing costs training, with uploads to S3 (a moto server on loopback), in one run.

The same 2-worker job (digits MLP, wide enough that a checkpoint is a few MB) runs as
`etrain run` with no checkpoint but the last ("none"), with one every N steps uploaded
asynchronously ("async"), and with synchronous uploads ("sync"). Runs of one job on this shared
2-core machine differed by up to ~20% from one to the next (the host's speed swings within
minutes), more than the effect measured; so each comparison runs its two jobs at once, taking
turns of a few seconds (bench/turns.py: while one runs, every process of the other, its own
local Ray included, is stopped), and counts only the windows wholly inside a turn. Figures:

- async checkpoint throughput ratio: samples/s with async checkpoints over none, in turns.
  Target >= 0.97. A run's samples/s is its steady rate over its counted windows
  (bench/plain_ddp.py's ``steady_rate``: the first tenth left out, then the slowest and fastest
  tenth), and a window is one checkpoint interval long, so every window of an async run holds
  one checkpoint's copy, write and upload (one still in flight when the next is due is skipped:
  the checkpoints taken are printed). Ray's record of them, retention and the metrics flush come
  with one checkpoint in ~2 s (checkpoint.report_interval_s), about one window in seven at this
  cadence: trimming the slowest tenth could hide part of their cost, so the ratio with every
  window counted is printed beside it. The figure is the median of the pairs' ratios. Pairs
  take turns at starting first, and their number is best even: a pair's ratio depended on which
  job started first (with the job without checkpoints started first the ratio came out 0.01-0.05
  higher, in each of 8 pairs of pairs with the S3 server below and in both of 2 to local disk;
  with moto's own server, either way), so an odd number
  of pairs leans towards one order. Two identical jobs showed no such lean (second over first:
  1.003, 0.992, 1.015 with no checkpoints; 1.019, 1.001, 0.990 both checkpointing to local disk):
  it comes with a pair of unlike jobs, for a reason not yet found.
- report() blocking seconds, async and sync (median over the job's checkpoints): what the
  training thread paid at a checkpoint (the state copy is reported apart, as save seconds).
- async checkpoints taken: an interval checkpoint is left to the next interval step while the
  one before is still being written and reported (trainers.checkpoint_writer), so fewer than
  steps / interval may be taken.
- s3 server cpu seconds per pair: the moto server's CPU time over an S3 pair (both jobs; nearly
  all of it the async job's checkpoints). A remote bucket would not spend it on this machine,
  whose two cores the ranks train on.

- checkpoint window ratio within one run (to S3, and to local disk): a diagnostic with no target.
  One async job runs alone with a checkpoint every other window; the steady rate of the windows
  that hold a checkpoint (its copy, write, upload and, one time in a few, its report) over that of
  the windows between them (rank 0's word on taking it, one small broadcast, ends the window
  before: the log row's time is taken between the two). Neighbouring windows meet the same host
  and the same processes, so this is far less scattered than a pair (a pair's two jobs differ by
  a few percent whatever they do: see "job started first" above). It can understate: a
  checkpoint's background work that outlasts its window (at idle priority it waits for slack) is
  counted in the window between, and a cost spread over every window is not seen at all.

The same pairs run with local-disk storage: what our side and Ray's reporting cost, without
the S3 emulation. The S3 server (moto's S3 backend served by uvicorn: bench/s3_server.py, which
says why not moto's own server) runs in a process of its own under the idle scheduling class
(SCHED_IDLE: it runs when nothing else on the machine wants a core): it stands in for a remote
bucket, whose request handling is not this machine's work. (In the benchmark's own process, and
then at nice 19, which still takes ~1/6 of a core from Ray's nice-15 workers, moto's Python
request handling took 6-7 CPU-seconds a run from the two cores the workers train on.) That it
kept pace shows in the checkpoints taken, printed beside those taken to local disk: a checkpoint
still uploading when the next is due is skipped.

On a machine with cores to spare (the lent GPU machine: bench/gpu_run.sh), ``--job-cpus 0,1
--s3-cpus 2`` gives the jobs (their local Ray and both ranks) two cores, as here, and the stand-in
a core of its own, as a remote bucket would be: what is left is our side's cost alone.
``--spare-core`` picks three physical cores itself (no two hyperthreads of one core).

    python bench/checkpoint.py [--steps 3000] [--interval 100] [--pairs 4] [--slice-s 4] [--alternate-steps 12000]
                               [--where s3,local] [--job-cpus 0,1 --s3-cpus 2 | --spare-core]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep every address on loopback

from bench.plain_ddp import steady_rate  # noqa: E402  (the repository is on the path from here)
from bench.turns import Command, run_in_turns, windows_in_slices  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_cpus(text: str) -> set[int]:
    """A CPU list as taskset and Linux's sysfs write it (``0,1``, ``0-3,8``); ValueError if it is not one."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        try:
            span = range(int(first), int(last or first) + 1)
        except ValueError:
            raise ValueError("not a CPU list; write it as taskset does, e.g. 0,1 or 0-3") from None
        if not span:
            raise ValueError(f"the range {part.strip()} is empty; write the lower CPU first")
        cpus.update(span)
    return cpus


def cpu_list(text: str, flag: str) -> frozenset[int]:
    """``0,1`` or ``0-3,8``: CPUs this process may run on, or a SystemExit naming ``flag`` and the fix."""
    allowed = os.sched_getaffinity(0)
    try:
        cpus = parse_cpus(text)
    except ValueError as exc:
        raise SystemExit(f"{flag} {text!r}: {exc}") from None
    if not cpus or not cpus <= allowed:
        raise SystemExit(f"{flag} {text!r}: CPUs {sorted(cpus - allowed) or '(none)'} are not this machine's "
                         f"(it may use {','.join(map(str, sorted(allowed)))})")
    return frozenset(cpus)


def core_of(cpu: int) -> frozenset[int]:
    """The CPUs that share ``cpu``'s physical core (hyperthreads), as Linux lists them; {cpu} where it does not say."""
    try:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
        return frozenset(parse_cpus(siblings))
    except OSError:
        return frozenset({cpu})


def spare_core_placement(allowed: set[int], core: Callable[[int], frozenset[int]] = core_of,
                         ) -> tuple[frozenset[int], frozenset[int]]:
    """Two CPUs for the jobs and one for the S3 stand-in, each on a physical core of its own (two
    hyperthreads of one core would share it), the highest-numbered first (CPU 0 takes most of a
    machine's interrupts); a SystemExit where the machine has fewer than three such cores."""
    chosen: list[int] = []
    taken: set[int] = set()
    for cpu in sorted(allowed, reverse=True):
        if cpu not in taken:
            chosen.append(cpu)
            taken |= core(cpu) | {cpu}
        if len(chosen) == 3:
            return frozenset(chosen[:2]), frozenset(chosen[2:])
    raise SystemExit(f"--spare-core: this process may use CPUs {','.join(map(str, sorted(allowed)))}, on "
                     f"{len(chosen)} physical cores; two ranks and a stand-in off their cores need three")


def placement(job_cpus: frozenset[int] | None, s3_cpus: frozenset[int] | None) -> str:
    """What the run says of where things run; a SystemExit when the two share a CPU (the point of
    placing them is that the stand-in takes nothing from the ranks) or one is placed alone."""
    if (job_cpus is None) != (s3_cpus is None):
        raise SystemExit("--job-cpus and --s3-cpus go together: a stand-in off the ranks' cores needs both")
    if job_cpus is None:
        return "jobs and the S3 stand-in share every CPU"
    if job_cpus & s3_cpus:
        raise SystemExit(f"--job-cpus and --s3-cpus share CPU {min(job_cpus & s3_cpus)}: "
                         "give the stand-in a core the ranks do not train on")
    return (f"jobs on CPUs {','.join(map(str, sorted(job_cpus)))}, "
            f"the S3 stand-in on CPUs {','.join(map(str, sorted(s3_cpus)))}")


def pinned(argv: list[str], cpus: frozenset[int] | None) -> list[str]:
    """``argv`` run on ``cpus`` only (with every process it starts), or anywhere when None."""
    return argv if cpus is None else ["taskset", "--cpu-list", ",".join(map(str, sorted(cpus))), *argv]


def start_s3(port: int, cpus: frozenset[int] | None = None, env: dict | None = None) -> subprocess.Popen:
    """The S3 stand-in (bench/s3_server.py) in its own process on loopback, under the idle
    scheduling class once it answers: it yields to the ranks while they train, but its start
    (~1 CPU-s of imports) is not starved by a machine busy on every core."""
    log = tempfile.TemporaryFile("w+")  # its words, should it not start
    server = subprocess.Popen(pinned([sys.executable, str(REPO / "bench" / "s3_server.py"), str(port)], cpus),
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and server.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            time.sleep(0.2)
            continue
        idle_class(server.pid)  # outside the try: its own error must not read as "not started yet"
        return server
    stop_s3(server)
    log.seek(0)
    raise SystemExit(f"the S3 server (bench/s3_server.py) did not start within 60 s:\n{log.read()[-2000:]}")


def idle_class(pid: int) -> None:
    """Every thread of ``pid`` under the idle scheduling class; the threads they start inherit it."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setscheduler(int(task), os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def stop_s3(server: subprocess.Popen) -> None:
    """By pid: asked first, then killed."""
    server.terminate()
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


BATCH = 128  # global samples a step


def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far (user + system; Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_command(spec: dict, spec_dir: Path, cpus: frozenset[int] | None = None) -> Command:
    """`etrain run` of ``spec`` (written to a file) on a local Ray of its own, on ``cpus`` (None:
    anywhere): (command, environment)."""
    path = spec_dir / f"{spec['name']}.json"
    path.write_text(json.dumps(spec))  # JSON is YAML
    run_env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    run_env.pop("RAY_ADDRESS", None)
    return pinned([sys.executable, "-m", "trainers.train", str(path), "--json"], cpus), run_env


def job_spec(name: str, kind: str, root: str, steps: int, interval: int, hidden: int) -> dict:
    """The bench's job: ``kind`` none (a checkpoint only at the end), async or sync."""
    every, upload = (steps, "async") if kind == "none" else (interval, kind)
    return {"name": name, "training": {"batch_size": BATCH, "max_steps": steps, "learning_rate": 0.001,
                                       "log_interval_steps": interval},
            "distributed": {"num_workers": 2, "use_gpu": False},  # CPU ranks, as here, on a GPU machine too
            "model": {"name": "mlp", "hidden_size": hidden},
            "data": {"source": "builtin:digits"},
            "checkpoint": {"interval": every, "upload": upload, "min_interval_s": 0, "num_to_keep": 2,
                           "storage_root": root}}


@dataclasses.dataclass
class Run:
    steady: float  # samples/s over the windows inside its turns
    every_window: float  # the same with no window trimmed: a cost in few windows (a report) stays in
    report_s: float | None  # report() blocking, median over its checkpoints
    checkpoints: int
    windows: int  # counted: wholly inside its turns


def pair_in_turns(kinds: tuple[str, str], root: str, tag: str, args, work: Path) -> dict[str, Run]:
    """Two jobs (``kinds``, the first starts first) at once in turns; each one's figures."""
    from cluster.storage import open_root
    from trainers.history import read_history

    names = {kind: f"ckpt-{kind}-{tag}" for kind in kinds}
    commands = {kind: run_command(job_spec(names[kind], kind, root, args.steps, args.interval, args.hidden), work,
                                  args.job_cpus) for kind in kinds}
    slices, _ = run_in_turns(commands, args.slice_s, work, REPO)
    runs = {}
    for kind in kinds:
        rows = read_history(open_root(root), names[kind])
        windows = windows_in_slices([r["time"] for r in rows], slices[kind], args.settle_s)
        blocked = [r["checkpoint_report_s"] for r in rows if r.get("checkpoint_report_s") is not None]
        rates = [args.interval * BATCH / d for d in windows]
        runs[kind] = Run(steady_rate(rates), steady_rate(rates, trim_fraction=0.0),
                         statistics.median(blocked) if blocked else None, len(blocked), len(windows))
    return runs


def within_one_run(root: str, tag: str, args, work: Path) -> tuple[float, int]:
    """One async job alone, a checkpoint every other window: (steady samples/s of the windows that
    start at a checkpoint step over that of the others, windows of each kind)."""
    from cluster.storage import open_root
    from trainers.history import read_history

    name = f"ckpt-alternate-{tag}"
    spec = job_spec(name, "async", root, args.alternate_steps, 2 * args.interval, args.hidden)
    spec["training"]["log_interval_steps"] = args.interval  # a window per interval, a checkpoint every other
    cmd, env = run_command(spec, work, args.job_cpus)
    with open(work / f"{name}.out", "w") as out:
        if subprocess.run(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
            raise SystemExit(f"{name} failed:\n{(work / f'{name}.out').read_text()[-3000:]}")
    times = {row["step"]: row["time"] for row in read_history(open_root(root), name)}
    holding, between = [], []
    for step in sorted(times):
        if step + args.interval in times:
            rate = args.interval * BATCH / (times[step + args.interval] - times[step])
            (holding if step % (2 * args.interval) == 0 else between).append(rate)
    return steady_rate(holding) / steady_rate(between), min(len(holding), len(between))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--interval", type=int, default=100)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--pairs", type=int, default=4, help="(none, async) pairs, each run in turns, taking turns "
                        "at starting first (an even number balances the two orders)")
    parser.add_argument("--slice-s", type=float, default=4.0, help="how long each job runs in its turn")
    parser.add_argument("--alternate-steps", type=int, default=12000, help="steps of the job alone with a "
                        "checkpoint every other window (0: not run)")
    parser.add_argument("--settle-s", type=float, default=0.3, help="windows starting this soon after a turn "
                        "begins are not counted")
    parser.add_argument("--where", default="s3,local", help="storage to measure: s3, local or both (s3,local)")
    parser.add_argument("--job-cpus", help="CPUs the jobs run on (taskset's list, e.g. 0,1); with --s3-cpus")
    parser.add_argument("--s3-cpus", help="CPUs the S3 stand-in runs on, none of the jobs' (e.g. 2)")
    parser.add_argument("--spare-core", action="store_true", help="choose --job-cpus and --s3-cpus: three "
                        "physical cores, two for the jobs and one for the stand-in")
    args = parser.parse_args()
    wanted = [w.strip() for w in args.where.split(",")]
    if not wanted or any(w not in ("s3", "local") for w in wanted):
        raise SystemExit(f"--where {args.where!r}: say s3, local or s3,local")
    if args.spare_core and (args.job_cpus or args.s3_cpus):
        raise SystemExit("--spare-core chooses the CPUs itself: leave out --job-cpus and --s3-cpus")
    if args.spare_core:
        args.job_cpus, args.s3_cpus = spare_core_placement(os.sched_getaffinity(0))
    else:
        args.job_cpus = cpu_list(args.job_cpus, "--job-cpus") if args.job_cpus else None
        args.s3_cpus = cpu_list(args.s3_cpus, "--s3-cpus") if args.s3_cpus else None
    where_run = placement(args.job_cpus, args.s3_cpus)
    print(f"[bench] {where_run}", file=sys.stderr)
    print(f"[bench] {where_run}", flush=True)  # with the figures too, which then say where they were taken

    port = free_port()
    server = start_s3(port, args.s3_cpus)
    os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1"})
    import boto3

    work = Path(tempfile.mkdtemp(prefix="etrain-bench-ckpt-"))
    roots = {"s3": "s3://bench/runs", "local": str(work / "storage")}  # local disk: our side and Ray's without S3
    roots = {where: root for where, root in roots.items() if where in wanted}
    pairs: dict[str, list[dict[str, Run]]] = {where: [] for where in roots}
    server_cpu_s: list[float] = []  # the S3 server's CPU time in each S3 pair: this machine's, not a bucket's
    alternate: dict[str, tuple[float, int]] = {}  # within one run: (ratio, windows of each kind)

    def say(label: str, runs: dict[str, Run], other: str) -> None:
        base, it = runs["none"], runs[other]
        print(f"[bench] {label}: none {base.steady:.0f} samples/s ({base.windows} windows), {other} {it.steady:.0f} "
              f"samples/s ({it.windows} windows), ratio {it.steady / base.steady:.3f}; checkpoints {it.checkpoints}, "
              f"report() median {it.report_s:.4f} s", file=sys.stderr)

    try:
        boto3.client("s3").create_bucket(Bucket="bench")
        for where, root in roots.items():
            for i in range(args.pairs):
                kinds = ("none", "async") if i % 2 == 0 else ("async", "none")
                cpu_at = cpu_seconds(server.pid)
                pairs[where].append(pair_in_turns(kinds, root, f"{where}-{i}", args, work))
                if where == "s3":
                    server_cpu_s.append(cpu_seconds(server.pid) - cpu_at)
                say(f"{where} pair {i}", pairs[where][-1], "async")
            if where == "s3":
                sync = pair_in_turns(("sync", "none"), root, "sync", args, work)
                say("s3 sync pair", sync, "sync")
            if args.alternate_steps:
                alternate[where] = within_one_run(root, where, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        stop_s3(server)

    def ratios(where: str, field: str = "steady") -> list[float]:
        return [getattr(p["async"], field) / getattr(p["none"], field) for p in pairs[where]]

    def median(where: str, kind: str, field: str) -> float:
        return statistics.median(getattr(p[kind], field) for p in pairs[where])

    size = args.hidden * (64 + 10) * 4 * 3 / 1e6
    print(f"checkpoint size: {size:.1f} MB (model + AdamW state)")
    if "s3" in pairs:
        print(f"samples/s without checkpoints: {median('s3', 'none', 'steady'):.0f}")
        print(f"samples/s with async checkpoints every {args.interval} steps: {median('s3', 'async', 'steady'):.0f}")
        print(f"samples/s with sync checkpoints every {args.interval} steps: {sync['sync'].steady:.0f}")
        print(f"async checkpoints taken: {median('s3', 'async', 'checkpoints'):.0f}")
        print(f"s3 server cpu seconds per pair: {statistics.median(server_cpu_s):.1f}")
        print(f"report() blocking with async upload: {median('s3', 'async', 'report_s'):.3f} s")
        print(f"report() blocking with sync upload: {sync['sync'].report_s:.3f} s")
        print(f"sync checkpoint throughput ratio: {sync['sync'].steady / sync['none'].steady:.3f}")
        print(f"async checkpoint throughput ratio: {statistics.median(ratios('s3')):.3f} "
              f"(median of {args.pairs} pairs in turns: {', '.join(f'{r:.3f}' for r in ratios('s3'))})")
    if "local" in pairs:
        print(f"async checkpoints taken to local disk: {median('local', 'async', 'checkpoints'):.0f}")
        print(f"async checkpoint throughput ratio to local disk: {statistics.median(ratios('local')):.3f} "
              f"(pairs: {', '.join(f'{r:.3f}' for r in ratios('local'))})")
    for where, label in (("s3", ""), ("local", " to local disk")):
        if where in alternate:
            ratio, windows = alternate[where]
            print(f"checkpoint window ratio within one run{label}: {ratio:.3f} (one job alone, a checkpoint every "
                  f"other {args.interval}-step window: those holding one over the others, {windows} of each)")
    for where, label in (("s3", ""), ("local", " to local disk")):
        if where in pairs:
            every = ratios(where, "every_window")
            print(f"async checkpoint throughput ratio{label} (every window counted): {statistics.median(every):.3f} "
                  f"(pairs: {', '.join(f'{r:.3f}' for r in every)})")

if __name__ == "__main__":
    main()
