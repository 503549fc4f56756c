"""A cloud on one machine: fresh "instances" for rehearsing ray_cluster.yaml (root only).

Each node is what a fresh EC2 instance is to `ray up`:
- its own network namespace with its own address on a bridge (10.77.0.0/24 by default;
  the host side is ``.1``), and no route anywhere else;
- its own Unix user, named as the AWS file's ``ssh_user`` (``ubuntu``) but with a uid and
  an empty home of its own: a ``passwd`` for the namespace (``/etc/netns/NS/passwd``, which
  `ip netns exec` mounts over ``/etc/passwd``) so no account is added to this machine;
- its own process tree, ``/proc`` and ``/tmp`` (PID and mount namespaces), so a node's
  `ray stop` sees only its own processes and killing the namespace's first process
  ends everything on the node, as losing an instance does;
- an sshd on its address, taking the rehearsal's key for that user;
- on workers, a fake IMDSv2 at 169.254.169.254:80 inside the namespace, so
  `etrain spot-watch` polls its real default endpoint; :meth:`Cloud.interrupt` makes it
  serve a spot interruption notice.

What stands in for the machine image: the packages of the project (Ray, torch, every
dependency, but not the project itself) in one virtual environment on Debian's Python,
built once and cached by its pins, first on each node user's PATH. The setup commands of
ray_cluster.yaml then find Ray installed and install the project from the synced tree as on
AWS (``pip install -e ~/elastic-train``, into the node user's site-packages).

Ray's `local` provider under autoscaler v2 (what `ray up` starts by default in 2.60) counts
the head as one of the worker addresses' ``min_workers``, so one worker address never gets
a node: run `ray up` with ``RAY_UP_enable_autoscaler_v2=0`` (Ray's own switch, on the
launching side) for the rehearsal. AWS node types keep v2: there the head has its own type.

Everything started is stopped by pid or by the namespace made for it; nothing is found by
name. Use :class:`Cloud` as a context manager, or ``python -m cluster.rehearsal``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
DEBIAN_PYTHON = "/usr/bin/python3"
IMAGE_CACHE = Path("/var/cache/etrain-rehearsal")
SSHD = "/usr/sbin/sshd"
IMDS_IP = "169.254.169.254"
TORCH_PIN = "torch==2.13.0"


class RehearsalError(RuntimeError):
    """The machine cannot host the rehearsal (not root, a tool missing, an address taken)."""


def run(cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if check and proc.returncode != 0:
        raise RehearsalError(f"{' '.join(cmd)} failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[-800:]}")
    return proc


def image_requirements(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """What the node image holds: torch at the Makefile's pin, the project's dependencies, and a
    setuptools new enough to install the project editable without fetching anything."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [TORCH_PIN, "setuptools>=70", *deps]


def installers(python: Path) -> list[list[str]]:
    """The install commands for ``python``'s environment, in the order tried: uv where it sits beside
    this Python (make's venv has it: it installs the image in seconds, from wheels its cache already
    holds), then pip with all of its own settings (a mirror or certificate only pip is told of), as
    the Makefile does. uv reads none of pip's settings, so the disk's wheels (PIP_FIND_LINKS) are
    passed on."""
    pip = [str(python), "-m", "pip", "install", "-q"]
    uv = Path(sys.executable).parent / "uv"
    if not uv.exists():
        return [pip]
    links = [a for link in os.environ.get("PIP_FIND_LINKS", "").split() for a in ("--find-links", link)]
    return [[str(uv), "pip", "install", "-q", "--compile-bytecode", "--python", str(python), *links], pip]


def build_image(cache: Path = IMAGE_CACHE) -> Path:
    """The node environment for these pins, built once (seconds with uv, a minute with pip) and reused after."""
    reqs = image_requirements()
    key = hashlib.sha256(json.dumps([reqs, os.path.realpath(DEBIAN_PYTHON)]).encode()).hexdigest()[:12]
    venv = cache / f"venv-{key}"
    if (venv / ".complete").exists():
        return venv
    if not os.path.exists(DEBIAN_PYTHON):
        raise RehearsalError(f"{DEBIAN_PYTHON} is needed for the node image (apt-get install python3-venv)")
    cache.mkdir(parents=True, exist_ok=True)
    cache.chmod(0o755)
    shutil.rmtree(venv, ignore_errors=True)  # a build cut short: no .complete
    log.info(f"building the node image (Ray, torch, the project's dependencies) in {venv}")
    # System site-packages on: a node user's own `pip install` then goes to its user site, as on
    # an instance whose system Python holds the image's packages.
    run([DEBIAN_PYTHON, "-m", "venv", "--system-site-packages", str(venv)])
    *first, last = installers(venv / "bin" / "python")
    if not any(run([*cmd, *reqs], check=False, timeout=1800).returncode == 0 for cmd in first):
        run([*last, *reqs], timeout=1800)
    run(["chmod", "-R", "a+rX", str(venv)])
    (venv / ".complete").write_text("\n".join(reqs))
    return venv


@dataclass
class Node:
    name: str
    ip: str
    uid: int
    netns: str
    root: Path  # the node's own disk: home/, tmp/
    init_pid: int | None = None  # host pid of the node's first process (its sshd)
    launcher: subprocess.Popen | None = None
    imds: subprocess.Popen | None = None

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def notice_file(self) -> Path:
        return self.root / "spot-instance-action.json"


@dataclass
class Cloud:
    """A head and ``workers`` worker nodes; ``base`` holds their disks (world-traversable)."""

    base: Path
    workers: int = 2
    subnet: str = "10.77.0"
    prefix: str = "etr"
    user: str = "ubuntu"
    first_uid: int = 27100
    image: Path | None = None
    cpus: dict[str, int] = field(default_factory=lambda: {"head": 0, "worker": 1})
    nodes: list[Node] = field(default_factory=list)
    key: Path | None = None

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br0"

    @property
    def host_ip(self) -> str:
        return f"{self.subnet}.1"

    @property
    def head(self) -> Node:
        return self.nodes[0]

    def __enter__(self) -> "Cloud":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- start -------------------------------------------------------------------------------
    def start(self) -> None:
        if os.geteuid() != 0:
            raise RehearsalError("the rehearsal makes network namespaces and node users: run it as root")
        for tool in (SSHD, "/usr/bin/rsync", "/usr/bin/nsenter", "/usr/bin/unshare"):
            if not os.path.exists(tool):
                raise RehearsalError(f"{tool} is missing: apt-get install openssh-server rsync util-linux")
        if run(["ip", "link", "show", self.bridge], check=False).returncode == 0:
            raise RehearsalError(f"{self.bridge} exists already: another rehearsal runs here, or one was not "
                                 f"stopped (python -m cluster.rehearsal down --prefix {self.prefix})")
        taken = _uids_in_use(set(range(self.first_uid, self.first_uid + self.workers + 1)))
        if taken:
            raise RehearsalError(f"uids {sorted(taken)} already run processes (another rehearsal?): "
                                 "give this one another first_uid")
        self.image = self.image or build_image()
        self.base.mkdir(parents=True, exist_ok=True)
        self.base.chmod(0o755)
        keys = self.base / "keys"
        keys.mkdir(exist_ok=True)
        self.key = keys / "id_ed25519"
        if not self.key.exists():
            for name in ("id_ed25519", "host_key"):
                run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)])
        run(["ip", "link", "add", self.bridge, "type", "bridge"])
        run(["ip", "addr", "add", f"{self.host_ip}/24", "dev", self.bridge])
        run(["ip", "link", "set", self.bridge, "up"])
        names = ["head", *[f"w{i}" for i in range(1, self.workers + 1)]]
        for i, name in enumerate(names):
            node = Node(name, f"{self.subnet}.{11 + i}", self.first_uid + i, f"{self.prefix}-{name}",
                        self.base / name)
            self.nodes.append(node)
            self._make_node(node)
        for node in self.nodes:
            self._wait_ssh(node)
        log.info(f"{len(self.nodes)} nodes up: " + ", ".join(f"{n.name} {n.ip}" for n in self.nodes))

    def _make_node(self, node: Node) -> None:
        ns, host_end, node_end = node.netns, f"{self.prefix}h-{node.name}", f"{self.prefix}n-{node.name}"
        run(["ip", "netns", "add", ns])
        run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end])
        run(["ip", "link", "set", host_end, "master", self.bridge, "up"])
        run(["ip", "link", "set", node_end, "netns", ns])
        inside = ["ip", "netns", "exec", ns]
        run([*inside, "ip", "addr", "add", f"{node.ip}/24", "dev", node_end])
        run([*inside, "ip", "link", "set", node_end, "up"])
        run([*inside, "ip", "link", "set", "lo", "up"])
        # An on-link default route, as an instance has one: Ray finds its node's address by the
        # route to a public resolver. No gateway answers on the bridge and this machine does not
        # forward, so nothing sent that way leaves the bridge.
        run([*inside, "ip", "route", "add", "default", "dev", node_end])
        self._make_user(node)
        self._start_sshd(node)
        if node.name != "head":
            run([*inside, "ip", "addr", "add", f"{IMDS_IP}/32", "dev", "lo"])
            node.imds = subprocess.Popen(
                [*inside, sys.executable, "-m", "cluster.rehearsal.imds", "--host", IMDS_IP, "--port", "80",
                 "--notice-file", str(node.notice_file)],
                cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                stdout=subprocess.DEVNULL, stderr=open(node.root / "imds.log", "w"))

    def _make_user(self, node: Node) -> None:
        """The node's account: in the namespace's own passwd, with a fresh home (no ~/.ray)."""
        etc = Path("/etc/netns") / node.netns
        etc.mkdir(parents=True, exist_ok=True)
        uid = node.uid
        passwd = [line for line in Path("/etc/passwd").read_text().splitlines()
                  if not line.startswith(f"{self.user}:")]
        group = [line for line in Path("/etc/group").read_text().splitlines()
                 if not line.startswith(f"{self.user}:")]
        shadow = [line for line in Path("/etc/shadow").read_text().splitlines()
                  if not line.startswith(f"{self.user}:")]
        (etc / "passwd").write_text("\n".join([*passwd, f"{self.user}:x:{uid}:{uid}::{node.home}:/bin/bash"]) + "\n")
        (etc / "group").write_text("\n".join([*group, f"{self.user}:x:{uid}:"]) + "\n")
        (etc / "shadow").write_text("\n".join([*shadow, f"{self.user}:*:20000:0:99999:7:::"]) + "\n")
        (etc / "shadow").chmod(0o640)
        # As on an instance, the host name resolves to the node's own address (gloo and NCCL
        # pick their interface by it).
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n{node.ip} {socket.gethostname()}\n")
        node.root.mkdir(parents=True)
        node.root.chmod(0o755)
        shutil.copytree("/etc/skel", node.home)
        ssh = node.home / ".ssh"
        ssh.mkdir()
        (ssh / "authorized_keys").write_text(Path(f"{self.key}.pub").read_text())
        node.tmp.mkdir()
        node.tmp.chmod(0o1777)
        # The image: its packages first on PATH, the user's own installs after them, and how
        # many CPUs Ray may hand out here (a GPU node runs one training worker per GPU; a
        # worker here runs one per CPU it offers, and the head none, as on AWS).
        cpus = self.cpus["head" if node.name == "head" else "worker"]
        env = node.home / ".etrain-image"
        env.write_text(
            f"export PATH={self.image}/bin:$HOME/.local/bin:$PATH\n"
            "export PIP_NO_INDEX=1 PIP_NO_BUILD_ISOLATION=0 PIP_DISABLE_PIP_VERSION_CHECK=1\n"
            f"export RAY_OVERRIDE_RESOURCES='{{\"CPU\": {cpus}}}'\n")
        for rc in (".profile", ".bashrc"):
            original = (node.home / rc).read_text() if (node.home / rc).exists() else ""
            (node.home / rc).write_text(f". ~/.etrain-image\n{original}")
        run(["chown", "-R", f"{uid}:{uid}", str(node.home)])
        (ssh / "authorized_keys").chmod(0o600)
        ssh.chmod(0o700)

    def _start_sshd(self, node: Node) -> None:
        config = node.root / "sshd_config"
        config.write_text(
            f"ListenAddress {node.ip}\nPort 22\nHostKey {self.base / 'keys' / 'host_key'}\n"
            f"PidFile {node.root / 'sshd.pid'}\nAuthorizedKeysFile .ssh/authorized_keys\nPermitRootLogin no\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            "MaxSessions 100\nMaxStartups 100\nSubsystem sftp internal-sftp\n")
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
        # New PID and mount namespaces: the node's own /proc and /tmp; sshd is its first process.
        script = f"mount --bind {node.tmp} /tmp && exec {SSHD} -D -e -f {config}"
        node.launcher = subprocess.Popen(
            ["ip", "netns", "exec", node.netns, "unshare", "--mount", "--pid", "--fork", "--mount-proc",
             "--propagation", "private", "sh", "-c", script],
            stdout=subprocess.DEVNULL, stderr=open(node.root / "sshd.log", "w"), start_new_session=True)

    def _wait_ssh(self, node: Node, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if node.init_pid is None and node.launcher:
                node.init_pid = _namespace_init(node.launcher.pid)
            probe = self.ssh(node, "true", check=False, timeout=10)
            if probe.returncode == 0:
                return
            if node.launcher.poll() is not None:
                break
            time.sleep(0.3)
        log = (node.root / "sshd.log").read_text()[-1000:]
        raise RehearsalError(f"sshd on {node.name} ({node.ip}) did not answer: {log}")

    # -- use ---------------------------------------------------------------------------------
    def ssh(self, node: Node, command: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run ``command`` on ``node`` as its user, through its sshd, as `ray up` does."""
        return run(["ssh", "-i", str(self.key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                    "-o", "LogLevel=ERROR", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
                    f"{self.user}@{node.ip}", command], check=check, timeout=timeout)

    def interrupt(self, node: Node, deadline_s: int = 20) -> None:
        """The cloud's two-minute warning, shortened: the node's IMDS serves a spot notice."""
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + deadline_s))
        node.notice_file.write_text(json.dumps({"action": "terminate", "time": when}))

    def cut_network(self, node: Node) -> None:
        """The node drops off the network (its link goes down); its processes live on."""
        run(["ip", "netns", "exec", node.netns, "ip", "link", "set", f"{self.prefix}n-{node.name}", "down"])

    def kill(self, node: Node) -> None:
        """Everything on the node dies at once: its PID namespace's first process is killed
        (the kernel then kills the rest of the namespace), and the launcher of that namespace."""
        if node.launcher is None:
            return
        if node.init_pid is None:  # start() failed before this node answered on ssh
            node.init_pid = _namespace_init(node.launcher.pid)
        if node.init_pid:
            try:
                os.kill(node.init_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:  # the launcher (unshare) reaps the namespace's init, then exits
            node.launcher.wait(timeout=10)
        except subprocess.TimeoutExpired:
            node.launcher.kill()
            node.launcher.wait(timeout=30)

    def pids(self) -> list[int]:
        """Processes still running in any node's network namespace, or as any node's user."""
        found = set()
        for node in self.nodes:
            out = run(["ip", "netns", "pids", node.netns], check=False).stdout
            found.update(int(p) for p in out.split())
        uids = {n.uid for n in self.nodes}
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                text = status.read_text()
            except OSError:
                continue
            uid_line = next((line for line in text.splitlines() if line.startswith("Uid:")), "")
            if uid_line and int(uid_line.split()[1]) in uids:
                found.add(int(status.parent.name))
        return sorted(found)

    # -- stop --------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop what was started, by pid and by namespace, and remove what was made. Each step
        runs even when one before it failed (a half-started cloud is cleaned up too)."""
        for node in self.nodes:
            for step in (lambda: self.kill(node), lambda: _stop_process(node.imds)):
                try:
                    step()
                except (OSError, subprocess.SubprocessError) as exc:
                    log.warning(f"stopping {node.name}: {exc}; going on")
        for pid in self.pids():  # anything that left its PID namespace's tree (none expected)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for node in self.nodes:
            run(["ip", "netns", "del", node.netns], check=False)
            run(["ip", "link", "del", f"{self.prefix}h-{node.name}"], check=False)
            shutil.rmtree(Path("/etc/netns") / node.netns, ignore_errors=True)
        run(["ip", "link", "del", self.bridge], check=False)
        shutil.rmtree(self.base, ignore_errors=True)


def _stop_process(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=10)


def _uids_in_use(uids: set[int]) -> set[int]:
    """Which of ``uids`` some process runs as (a node user of another rehearsal)."""
    found = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            line = next(x for x in status.read_text().splitlines() if x.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if int(line.split()[1]) in uids:
            found.add(int(line.split()[1]))
    return found


def _namespace_init(pid: int) -> int | None:
    """The first descendant of ``pid`` in another PID namespace: the node's init (its sshd)."""
    mine = os.readlink("/proc/self/ns/pid")
    todo = [pid]
    while todo:
        current = todo.pop(0)
        try:
            if os.readlink(f"/proc/{current}/ns/pid") != mine:
                return current
            todo += [int(p) for p in Path(f"/proc/{current}/task/{current}/children").read_text().split()]
        except OSError:
            continue
    return None
