"""The benchmark harness's pure parts: figure parsing, judging against targets, the FLOPs formula."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from trainers.workloads.lm import flops_per_token

REPO = Path(__file__).resolve().parents[2]


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_flops_per_token_counts_parameters_and_attention():
    assert flops_per_token(1_000_000, 2, 128, 256) == 6e6 + 12 * 2 * 128 * 256


@pytest.mark.parametrize("name,value,expected", [
    ("throughput ratio", 0.98, True), ("throughput ratio", 0.96, False),
    ("sweep overhead ratio", 1.2, True), ("steps lost with notice", 2, False), ("cold start", 11.0, None),
])
def test_judge(name, value, expected):
    assert load("run_all").judge(name, value) is expected


def test_figures_are_read_from_name_value_lines(tmp_path, monkeypatch):
    run_all = load("run_all")
    script = tmp_path / "fake.py"
    script.write_text("print('[bench] noise: 12')\nprint('submit p50 with 16 clients: 12.5 ms (ray jobs direct 3.1 ms)')"
                      "\nprint('throughput ratio: 0.981')\nprint('asha time to fifo best ratio: inf')"
                      "\nprint('streaming batches/s from moto S3 with 2 workers: 812')\n")
    monkeypatch.setattr(run_all, "REPO", tmp_path.parent)
    (tmp_path.parent / "bench").mkdir(exist_ok=True)
    (tmp_path.parent / "bench" / "fake.py").write_text(script.read_text())
    figures, failure, _ = run_all.run("fake.py", [])
    assert not failure
    assert figures == {"submit p50 with 16 clients": 12.5, "throughput ratio": 0.981,
                       "asha time to fifo best ratio": float("inf"),
                       "streaming batches/s from moto S3 with 2 workers": 812.0}  # a capital in the name


def test_gpu_script_refuses_without_a_gpu_and_says_how():
    import subprocess

    import torch

    if torch.cuda.is_available():
        pytest.fail("this test is for machines without a GPU")
    out = subprocess.run([sys.executable, str(REPO / "bench" / "gpu.py")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no CUDA GPU here" in out.stderr and "--cpu-check" in out.stderr


@pytest.mark.parametrize("rates,expected", [
    ([10.0] + [100.0] * 9, 100.0),  # the first tenth (start-up) is left out
    ([100.0] * 19 + [20.0], 100.0),  # one window another process slowed is trimmed (the mean: 92)
    ([90.0] * 10, 90.0),  # a run that is slower throughout is measured so
    ([10.0, 100.0, 50.0], 3 / (1 / 10 + 1 / 100 + 1 / 50)),  # under ten windows nothing is left out
    # A cost in 40% of the windows (a heartbeat each second in windows of 0.4 s) stays: the median
    # of these windows is 100; 9 of 100 and 7 of 50 remain after the trim, by time 69.6.
    (([100.0] * 3 + [50.0] * 2) * 4, 16 / (9 / 100 + 7 / 50)),
])
def test_steady_rate_trims_start_up_and_outliers_and_keeps_a_frequent_cost(rates, expected):
    assert load("plain_ddp").steady_rate(rates) == pytest.approx(expected)


def test_steady_rate_of_no_windows_says_to_run_longer():
    with pytest.raises(ValueError, match="run more steps than one window"):
        load("plain_ddp").steady_rate([])


@pytest.mark.parametrize("marks,slices,expected", [
    ([0.0, 1.0, 2.0, 3.0], [(-1.0, 3.0)], [1.0, 1.0, 1.0]),  # one slice holds every window
    ([0.0, 1.0, 5.0, 6.0], [(-1.0, 1.5), (4.5, 6.5)], [1.0, 1.0]),  # the one cut by a stop (1 -> 5) is not
    ([0.1, 1.0, 2.0], [(0.0, 3.0)], [1.0]),  # it began before the settling time was over
    ([1.0, 2.0, 3.5], [(0.0, 3.0)], [1.0]),  # it ended after the slice did
    ([1.0, 2.0], [(3.0, 5.0)], []),  # another's slice
    ([], [(0.0, 3.0)], []),
])
def test_only_windows_wholly_inside_a_running_slice_count(marks, slices, expected):
    assert load("turns").windows_in_slices(marks, slices, settle_s=0.2) == pytest.approx(expected)


def test_alternate_runs_one_process_tree_at_a_time(tmp_path):
    """Two real process trees (a parent and its child each) that note the time every 5 ms: while one
    has its turn, the other notes nothing, its child included."""
    import subprocess

    turns = load("turns")
    child = ("import sys, time\nend = time.time() + {s}\nwith open(sys.argv[1], 'w') as f:\n"
             "    while time.time() < end:\n        f.write(f'{{time.time()}}\\n'); f.flush(); time.sleep(0.005)\n")
    parent = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', sys.argv[1], sys.argv[2]], check=True)\n"
    procs = {name: subprocess.Popen([sys.executable, "-c", parent, child.format(s=3 if name == "a" else 30),
                                     str(tmp_path / name)]) for name in ("a", "b")}
    try:
        for proc in procs.values():
            turns.signal_tree(proc.pid, __import__("signal").SIGSTOP)
        slices = turns.alternate(procs, slice_s=0.4)
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    assert procs["a"].returncode == 0, "a ran to its end within its own turns"
    assert len(slices["a"]) >= 3 and len(slices["b"]) >= 3
    for name, other in (("a", "b"), ("b", "a")):
        noted = [float(x) for x in (tmp_path / name).read_text().split()]
        # A stop reaches a process within a moment of its turn's end; allow 50 ms either way.
        inside_other = [t for t in noted if any(s + 0.05 < t < e - 0.05 for s, e in slices[other])]
        assert noted and inside_other == [], f"{name} ran during {other}'s turns"


def test_a_side_that_fails_stops_the_pair_at_once_and_leaves_nothing_running(tmp_path):
    """The other side is not run on to its end for nothing, nor left stopped: its whole tree goes."""
    import os
    import time

    turns = load("turns")
    pids = tmp_path / "pids"
    sleeper = ("import os, subprocess, sys, time\nchild = subprocess.Popen([sys.executable, '-c', 'import time; "
               "time.sleep(60)'])\nopen(sys.argv[1], 'w').write(f'{os.getpid()} {child.pid}')\ntime.sleep(60)\n")
    failing = ("import sys, time\ntime.sleep(1)\nprint('no such data file', file=sys.stderr)\nsys.exit(3)\n")
    started = time.monotonic()
    with pytest.raises(SystemExit, match=r"failing run failed \(exit 3\):\n.*no such data file"):
        turns.run_in_turns({"sleeper": ([sys.executable, "-c", sleeper, str(pids)], dict(os.environ)),
                            "failing": ([sys.executable, "-c", failing], dict(os.environ))},
                           slice_s=0.5, logs=tmp_path, cwd=tmp_path)
    assert time.monotonic() - started < 30
    from processes import start_time

    left = [int(p) for p in pids.read_text().split()]
    assert len(left) == 2
    assert [pid for pid in left if start_time(pid) is not None] == [], "the sleeper and its child are gone"


@pytest.mark.skipif(not hasattr(__import__("os"), "SCHED_BATCH"), reason="scheduling policies are Linux's")
def test_the_equal_scheduling_side_runs_its_whole_tree_under_batch_scheduling_and_its_figures_are_collected(
        monkeypatch, tmp_path):
    """The bench's third side (torchrun under SCHED_BATCH): every process it starts inherits the policy."""
    import os
    import subprocess

    ddp = load("ddp_overhead")
    child = "import os, subprocess, sys; print(os.sched_getscheduler(0)); sys.stdout.flush(); " \
            "subprocess.run([sys.executable, '-c', 'import os; print(os.sched_getscheduler(0))'])"
    argv, env = ddp.under_batch_scheduling(([sys.executable, "-c", child], dict(os.environ)))
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert out == [str(os.SCHED_BATCH)] * 2, "the command and what it starts"
    # run_all's parser takes both of the equal-scheduling lines as figures
    run_all = load("run_all")
    monkeypatch.setattr(run_all, "REPO", tmp_path.parent)
    (tmp_path.parent / "bench").mkdir(exist_ok=True)
    (tmp_path.parent / "bench" / "fake_batch.py").write_text(
        "print('plain ddp samples/s under batch scheduling: 61522')\n"
        "print('throughput ratio at equal scheduling (plain under batch scheduling too): 0.854')\n")
    figures, failure, _ = run_all.run("fake_batch.py", [])
    assert not failure
    assert figures == {"plain ddp samples/s under batch scheduling": 61522.0,
                       "throughput ratio at equal scheduling (plain under batch scheduling too)": 0.854}


def test_a_script_past_its_time_is_stopped_with_what_it_started_and_the_run_goes_on(tmp_path, monkeypatch):
    """A sweep whose trials waited forever once took `make bench` and every figure measured before it
    down with it: now the script and its children (its own Ray, here a sleeping child) are stopped."""
    import os
    import time

    run_all = load("run_all")
    monkeypatch.setattr(run_all, "REPO", tmp_path.parent)
    (tmp_path.parent / "bench").mkdir(exist_ok=True)
    pid_file = tmp_path / "child.pid"
    (tmp_path.parent / "bench" / "fake_hang.py").write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('half a figure: 1', flush=True)\n"
        "time.sleep(600)\n")
    figures, failure, took = run_all.run("fake_hang.py", [], timeout_s=2)
    assert figures == {} and failure.startswith("fake_hang.py failed (timed out after 2 s)"), failure
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as stat:
            if stat.read().split(") ")[1].startswith("Z"):
                break
        time.sleep(0.1)
    else:
        raise AssertionError("the script's child still runs")


def printed_figure_labels() -> dict[str, list[str]]:
    """Per bench script, each ``print(f"<label>: {value}...")`` to stdout, every value formatted in
    written as ``{}``."""
    import ast

    labels: dict[str, list[str]] = {}
    for path in sorted((REPO / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print" and node.args
                    and not any(k.arg == "file" for k in node.keywords)):
                continue
            text = node.args[0]
            for branch in [text.body, text.orelse] if isinstance(text, ast.IfExp) else [text]:
                parts = branch.values if isinstance(branch, ast.JoinedStr) else [branch]
                template = "".join(p.value if isinstance(p, ast.Constant) and isinstance(p.value, str) else "{}"
                                   for p in parts)
                if ": {}" in template:  # a name, then a value formatted in: what run_all reads as a figure
                    labels.setdefault(path.name, []).append(template)
    return labels


def test_every_figure_a_bench_script_prints_is_one_run_all_reads():
    """A label run_all's pattern does not take (a comma, a capital first) drops its figure from the
    BENCHMARKS.md table without a word; and a target whose figure no script prints is never judged."""
    import re

    run_all = load("run_all")
    labels = printed_figure_labels()
    assert "checkpoint.py" in labels and "ddp_overhead.py" in labels, labels  # the scan finds them
    names, unread = [], []
    for script, templates in labels.items():
        for template in templates:
            label, rest = template.split(": {}", 1)
            names.append(label)
            line = label.replace("{}", "x") + ": 0.5" + rest.replace("{}", "x")  # as printed, the value 0.5
            if run_all.figure(line) != (label.replace("{}", "x"), 0.5):
                unread.append((script, template))
    assert not unread, f"lines run_all's figure pattern does not read: {unread}"
    patterns = [re.compile(re.escape(label).replace(re.escape("{}"), ".+") + "$") for label in names]
    never_printed = [name for name in run_all.TARGETS if not any(p.match(name) for p in patterns)]
    assert not never_printed, f"targets no bench script prints: {never_printed}"


def test_a_label_with_a_comma_is_not_read_as_a_figure():
    run_all = load("run_all")
    assert run_all.figure("async checkpoint throughput ratio, every window: 0.9") is None
    assert run_all.figure("async checkpoint throughput ratio (every window counted): 0.9 (pairs: 1)") == (
        "async checkpoint throughput ratio (every window counted)", 0.9)


def s3_round_trip(bench, env: dict | None = None) -> None:
    """A checkpoint's requests to bench/s3_server.py (pyarrow's PUTs, sent chunked, a GET and a
    listing; retention's boto3 DeleteObjects), then the server stopped by pid."""
    import os
    import socket

    import boto3
    import pyarrow.fs as pafs

    port = bench.free_port()
    server = bench.start_s3(port, env=env)
    try:
        fs = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", access_key="bench",
                               secret_key="bench", region="us-east-1", allow_delayed_open=True,
                               allow_bucket_creation=True)
        fs.create_dir("bench")
        state, manifest = os.urandom(1_800_000), b'{"step": 1}'
        for name, data in (("model_1.pt", state), ("manifest.json", manifest)):
            with fs.open_output_stream(f"bench/run/checkpoint_1/{name}") as out:
                out.write(data)
        with fs.open_input_stream("bench/run/checkpoint_1/model_1.pt") as f:
            assert f.read() == state
        with fs.open_input_stream("bench/run/checkpoint_1/manifest.json") as f:
            assert f.read() == manifest
        listed = fs.get_file_info(pafs.FileSelector("bench/run", recursive=True))
        assert {i.path for i in listed if i.type == pafs.FileType.File} == {
            "bench/run/checkpoint_1/model_1.pt", "bench/run/checkpoint_1/manifest.json"}
        client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="bench",
                              aws_secret_access_key="bench", region_name="us-east-1")
        client.delete_objects(Bucket="bench", Delete={"Objects": [{"Key": "run/checkpoint_1/model_1.pt"},
                                                                  {"Key": "run/checkpoint_1/manifest.json"}]})
        assert client.list_objects_v2(Bucket="bench")["KeyCount"] == 0
    finally:
        bench.stop_s3(server)
    with pytest.raises(OSError):  # stopped by pid: nothing answers there now
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_the_checkpoint_benchs_s3_server_keeps_what_the_aws_sdk_uploads_in_chunks(tmp_path):
    """pyarrow's AWS SDK sends a PUT body chunked (aws-chunked, no Content-Length); uvicorn's WSGI
    layer does not mark where such a body ends, and without bench/s3_server.py's shim werkzeug read
    it as empty: the bench would have measured a bucket that stores nothing.
    It runs on moto cut as bench/gpu_payload.sh cuts it (only MOTO_KEEP of its services, to stay
    under the device tool's size limit): a service the server needs and the list lacks fails here,
    not on a lent machine."""
    import os
    import re
    import shutil

    import moto

    script = (REPO / "bench" / "gpu_payload.sh").read_text()
    keep = re.search(r'MOTO_KEEP="([^"]*)"', script).group(1).split()
    source = Path(moto.__file__).parent
    shutil.copytree(source, tmp_path / "moto", ignore=lambda folder, names: [
        n for n in names if Path(folder) == source and (source / n).is_dir() and n not in keep])
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    where = subprocess.run([sys.executable, "-c", "import moto; print(moto.__file__)"], env=env, text=True,
                           capture_output=True, check=True, timeout=60).stdout.strip()
    assert where == str(tmp_path / "moto" / "__init__.py")
    assert not (tmp_path / "moto" / "ec2").exists() and (source / "ec2").is_dir()  # it was cut
    s3_round_trip(load("checkpoint"), env)


def test_an_s3_server_that_cannot_start_is_said_at_once_with_its_words():
    """A port already taken (or a uvicorn without its WSGI layer): the server exits, and the bench
    says so with the server's own output instead of waiting its minute for an answer."""
    import socket
    import time

    bench = load("checkpoint")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # bound, not listening: connecting is refused, binding fails
        started = time.monotonic()
        with pytest.raises(SystemExit, match=r"did not start(.|\n)*address already in use"):
            bench.start_s3(taken.getsockname()[1])
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("text,expected", [("0", {0}), ("0-1", {0, 1}), (" 1 , 0", {0, 1})])
def test_a_cpu_list_reads_as_tasksets_does(text, expected):
    assert load("checkpoint").cpu_list(text, "--job-cpus") == expected


@pytest.mark.parametrize("text,message", [
    ("a", r"--job-cpus 'a': not a CPU list; write it as taskset does"),
    ("0,4096", r"--job-cpus '0,4096': CPUs \[4096\] are not this machine's \(it may use 0"),
    ("", r"--job-cpus '': not a CPU list"),
])
def test_a_cpu_list_that_is_not_one_or_not_this_machines_is_refused_by_name(text, message):
    with pytest.raises(SystemExit, match=message):
        load("checkpoint").cpu_list(text, "--job-cpus")


def test_the_jobs_and_the_s3_stand_in_are_placed_together_and_apart():
    bench = load("checkpoint")
    assert bench.placement(None, None) == "jobs and the S3 stand-in share every CPU"
    assert bench.placement(frozenset({0, 1}), frozenset({2})) == "jobs on CPUs 0,1, the S3 stand-in on CPUs 2"
    with pytest.raises(SystemExit, match="share CPU 1: give the stand-in a core the ranks do not train on"):
        bench.placement(frozenset({0, 1}), frozenset({1, 2}))
    with pytest.raises(SystemExit, match="--job-cpus and --s3-cpus go together"):
        bench.placement(frozenset({0}), None)


@pytest.mark.parametrize("allowed,siblings,expected", [
    (set(range(16)), {}, ({15, 14}, {13})),  # no hyperthreads: the highest-numbered, CPU 0 left alone
    (set(range(16)), {c: {c, c + 8} for c in range(8)} | {c: {c - 8, c} for c in range(8, 16)},
     ({15, 14}, {13})),  # siblings 8 apart: 15, 14, 13 are on cores 7, 6, 5
    (set(range(8)), {c: {c - c % 2, c - c % 2 + 1} for c in range(8)}, ({7, 5}, {3})),  # siblings side by side
])
def test_the_spare_core_placement_puts_each_on_a_physical_core_of_its_own(allowed, siblings, expected):
    bench = load("checkpoint")
    jobs, s3 = bench.spare_core_placement(allowed, lambda cpu: frozenset(siblings.get(cpu, {cpu})))
    assert (set(jobs), set(s3)) == expected


def test_a_machine_without_three_physical_cores_is_told_so_by_the_spare_core_placement():
    bench = load("checkpoint")
    pairs = {0: {0, 1}, 1: {0, 1}, 2: {2, 3}, 3: {2, 3}}  # 4 CPUs, 2 cores
    with pytest.raises(SystemExit, match=r"--spare-core: this process may use CPUs 0,1,2,3, on 2 physical cores; "
                                         r"two ranks and a stand-in off their cores need three"):
        bench.spare_core_placement({0, 1, 2, 3}, lambda cpu: frozenset(pairs[cpu]))
    with pytest.raises(SystemExit, match=r"--job-cpus '1-0': the range 1-0 is empty; write the lower CPU first"):
        bench.cpu_list("1-0", "--job-cpus")


def test_the_device_runs_checkpoint_part_is_skipped_when_too_little_of_its_budget_is_left(tmp_path):
    """bench/gpu_run.sh, as on the lent machine after a long gpu part: it says so and how to run
    the part alone, instead of being cut off by the call's limit with no figure printed."""
    import os

    # PY: the part is skipped before it runs Python; `true` spares the versions line's imports (~1.5 s)
    env = {**os.environ, "OUT": str(tmp_path), "SKIP_SITE": "1", "PY": "true", "PARTS": "checkpoint",
           "RUN_BUDGET_S": "100"}
    out = subprocess.run(["bash", str(REPO / "bench" / "gpu_run.sh")], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 3 and "checkpoint: skipped" in out.stdout and "PARTS=checkpoint" in out.stdout
    assert not (tmp_path / "checkpoint_bench.txt").exists(), "no job started"


def test_the_s3_stand_in_starts_on_a_busy_core():
    """Started in the idle class, its imports waited for a free core: on a machine busy on every
    core (another pytest worker and its child) it did not answer within its minute. It starts at
    normal priority and goes idle once it answers. One core, held busy, stands in for the machine."""
    import os

    bench = load("checkpoint")
    cpu = max(os.sched_getaffinity(0))
    busy = subprocess.Popen(bench.pinned([sys.executable, "-c", "while True: pass"], frozenset({cpu})))
    try:
        server = bench.start_s3(bench.free_port(), frozenset({cpu}))
        try:
            assert os.sched_getscheduler(server.pid) == os.SCHED_IDLE
        finally:
            bench.stop_s3(server)
    finally:
        busy.kill()
        busy.wait()


def test_a_placed_s3_stand_in_and_job_run_on_their_cpus_only(tmp_path, monkeypatch):
    """The stand-in's process itself (taskset execs it: one pid) is held to its CPU, every thread of
    it in the idle class, and a job's command keeps the caller's PYTHONPATH (the lent GPU
    machine's carried packages are there)."""
    import os

    bench = load("checkpoint")
    cpu = max(os.sched_getaffinity(0))
    server = bench.start_s3(bench.free_port(), frozenset({cpu}))
    try:
        assert os.sched_getaffinity(server.pid) == {cpu}
        threads = [int(t) for t in os.listdir(f"/proc/{server.pid}/task")]
        assert [os.sched_getscheduler(t) for t in threads] == [os.SCHED_IDLE] * len(threads)
    finally:
        bench.stop_s3(server)
    monkeypatch.setenv("PYTHONPATH", "/carried/site")
    argv, env = bench.run_command({"name": "job"}, tmp_path, frozenset({cpu}))
    assert argv[:3] == ["taskset", "--cpu-list", str(cpu)] and argv[3:5] == [sys.executable, "-m"]
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/carried/site"]
    out = subprocess.run(argv[:3] + [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                         capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == f"[{cpu}]"
