"""Rehearse ray_cluster.yaml on this machine (root).

    python -m cluster.rehearsal up [--workers 2]   # nodes, their sshd and IMDS; prints the rendered file
    ray get-auth-token --generate && ray up -y <printed file>
    python -m cluster.rehearsal down               # stop every process in the nodes' namespaces, remove them

`up` keeps running (Ctrl-C stops the cloud); `down` cleans up after one that was killed.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import yaml

from cluster.log_lines import send_to
from cluster.rehearsal.cloud import REPO, Cloud, RehearsalError, run
from cluster.rehearsal.render import rehearsal_config


def down(prefix: str) -> list[str]:
    """Everything a cloud with ``prefix`` made, stopped by namespace and removed: for a cloud whose
    owner died. Returns what was removed."""
    removed = []
    listed = run(["ip", "netns", "list"], check=False).stdout.split("\n")
    for ns in [line.split()[0] for line in listed if line.startswith(f"{prefix}-")]:
        for pid in run(["ip", "netns", "pids", ns], check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        run(["ip", "netns", "del", ns], check=False)
        etc = Path("/etc/netns") / ns
        for f in etc.glob("*"):
            f.unlink()
        if etc.exists():
            etc.rmdir()
        removed.append(ns)
    links = [line.split(":")[1].strip().split("@")[0] for line in run(["ip", "-o", "link", "show"]).stdout.splitlines()]
    for link in links:
        if link.startswith(f"{prefix}h-") or link == f"{prefix}-br0":
            run(["ip", "link", "del", link], check=False)
            removed.append(link)
    return removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.rehearsal", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the nodes and print the rendered ray_cluster.yaml")
    up.add_argument("--workers", type=int, default=2)
    up.add_argument("--base", default="/var/tmp/etrain-rehearsal", help="where the nodes' disks live")
    up.add_argument("--prefix", default="etr", help="names of namespaces and links")
    up.add_argument("--subnet", default="10.77.0", help="the nodes' /24 (host side .1, nodes from .11)")
    up.add_argument("--first-uid", type=int, default=27100, help="uid of the head's user; workers follow")
    dn = sub.add_parser("down", help="stop and remove a cloud left behind")
    dn.add_argument("--prefix", default="etr")
    args = parser.parse_args(argv)
    send_to(sys.stdout)  # the cloud's own lines ([rehearsal] ...) while this command runs
    try:
        if args.command == "down":
            print("\n".join(down(args.prefix)) or "nothing to remove")
            return 0
        with Cloud(Path(args.base), workers=args.workers, prefix=args.prefix, subnet=args.subnet,
                   first_uid=args.first_uid) as cloud:
            aws = yaml.safe_load((REPO / "ray_cluster.yaml").read_text())
            config = cloud.base / "cluster.yaml"
            config.write_text(yaml.safe_dump(rehearsal_config(
                aws, cloud.head.ip, [n.ip for n in cloud.nodes[1:]], str(cloud.key), REPO)))
            print(f"rendered: {config}\nnow: ray get-auth-token --generate && chmod 600 ~/.ray/auth_token && "
                  f"RAY_UP_enable_autoscaler_v2=0 ray up -y {config}\n"
                  f"a spot notice to worker wN: write the instance-action JSON to {cloud.base}/wN/"
                  f"{cloud.nodes[-1].notice_file.name}\nCtrl-C stops the cloud", flush=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    except RehearsalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
