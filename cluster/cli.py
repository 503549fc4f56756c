"""`etrain`'s cluster commands: storage init, doctor, spot-watch, metrics prometheus-config, dashboards.

trainers.cli composes them into `etrain` (:func:`add_cluster_commands`); they need no job spec.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import sys
import tempfile
from pathlib import Path


def cmd_storage_init(args: argparse.Namespace) -> int:
    from cluster.storage import StorageInitError, init_s3

    try:
        for line in init_s3(args.uri, kms_key_id=args.kms_key_id, create=not args.no_create):
            print(f"[etrain] {line}")
    except StorageInitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"[etrain] {args.uri} is ready: use it as checkpoint.storage_root")
    return 0


def cmd_spot_watch(args: argparse.Namespace) -> int:
    from cluster.log_lines import send_to
    from cluster.spot import IMDS, OwnNodeError, drain_node, find_own_node, watch

    send_to(sys.stdout)  # the watcher's lines ([spot-watch] ...), for as long as this command runs
    # One watcher per node: the worker start commands run again on every `ray up`.
    lock = open(os.path.join(tempfile.gettempdir(), "etrain-spot-watch.lock"), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("[spot-watch] another spot-watch runs on this node; leaving it be", file=sys.stderr)
        return 0
    try:
        node = [args.node_id or find_own_node(args.address)]
    except OwnNodeError as exc:
        print(f"[spot-watch] error: {exc}", file=sys.stderr)
        return 2
    print(f"[spot-watch] this node is {node[0]}", flush=True)

    def drain(notice) -> bool:
        proc = drain_node(args.address, node[0], notice)
        if proc.returncode != 0:
            print(f"[spot-watch] ray drain-node failed: {proc.stderr.strip()[-500:]}", file=sys.stderr)
            if not args.node_id:  # Ray restarted on this node since: its id is new
                try:
                    node[0] = find_own_node(args.address, timeout_s=10)
                except OwnNodeError as exc:
                    print(f"[spot-watch] {exc}", file=sys.stderr)
        return proc.returncode == 0

    print(f"[spot-watch] watching {args.imds_url} every {args.interval_s}s", flush=True)
    notice = watch(IMDS(args.imds_url), drain, interval_s=args.interval_s, on_rebalance=args.on_rebalance,
                   rebalance_deadline_s=args.rebalance_deadline_s, sigterm_deadline_s=args.sigterm_deadline_s)
    return 0 if notice else 1


def cmd_doctor(args: argparse.Namespace) -> int:
    from cluster.doctor import exit_code, render, run_checks
    from cluster.storage import default_root

    findings = run_checks(args.storage_root or default_root(), args.address)
    print(render(findings))
    return exit_code(findings)


def prometheus_config_text(interval_s: float) -> str:
    """A scrape config for the Ray this process is connected to: every live node's metrics agent."""
    import ray

    from cluster.metrics import scrape_config

    targets = [f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}" for n in ray.nodes()
               if n["Alive"] and n.get("MetricsExportPort")]
    return scrape_config(targets, prometheus_discovery_file(), interval_s)


def prometheus_discovery_file() -> str | None:
    """The file in which the head's Ray lists every node's metrics address (in Ray's temp folder,
    which RAY_TMPDIR moves), if this node has one."""
    from cluster.ray_adapter.local import PROMETHEUS_DISCOVERY_FILE, ray_temp_dir

    discovery = ray_temp_dir() / PROMETHEUS_DISCOVERY_FILE
    return str(discovery) if discovery.exists() else None


def cmd_prometheus_config(args: argparse.Namespace) -> int:
    import ray

    from cluster.ray_session import running_cluster_address

    address = args.address or running_cluster_address()
    if not address:
        print("error: no running Ray cluster: start one (ray start --head / ray up) or pass --address",
              file=sys.stderr)
        return 1
    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    try:
        text = prometheus_config_text(args.interval_s)
    finally:
        ray.shutdown()
    if args.out:
        Path(args.out).write_text(text + "\n")
        print(f"[etrain] wrote {args.out}: prometheus --config.file={args.out}")
    else:
        print(text)
    return 0


def cmd_dashboards(args: argparse.Namespace) -> int:
    from cluster.dashboards import build_dashboards, push, write_provisioning

    boards = build_dashboards(gpu=args.gpu)
    if args.dashboards_command == "write":
        for path in write_provisioning(args.directory, boards):
            print(f"[etrain] wrote {path}")
        return 0
    token = args.token or os.environ.get("GRAFANA_TOKEN")
    if not token:
        print("error: --token (or GRAFANA_TOKEN): a Grafana service account token with Editor rights", file=sys.stderr)
        return 2
    try:
        for url in push(args.url, token, boards):
            print(f"[etrain] dashboard: {url}")
    except Exception as exc:  # boundary: report Grafana's refusal plainly
        print(f"error: pushing to {args.url} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def add_cluster_commands(sub: argparse._SubParsersAction) -> None:
    """Add the cluster commands to `etrain`'s subcommands (``sub``), in the order its help lists them."""
    storage = sub.add_parser("storage", help="set up object storage for checkpoints")
    storage_sub = storage.add_subparsers(dest="storage_command", required=True)
    init = storage_sub.add_parser(
        "init", help="create or check an S3 bucket: AES-256 (or KMS) encryption, versioning, multipart clean-up",
        description="Credentials and region come from the standard AWS settings; AWS_ENDPOINT_URL "
                    "points at an S3-compatible server.")
    init.add_argument("uri", help="s3://bucket[/prefix]")
    init.add_argument("--kms-key-id", help="encrypt with this KMS key (aws:kms) instead of SSE-S3 AES-256")
    init.add_argument("--no-create", action="store_true", help="fail if the bucket does not exist")
    init.set_defaults(fn=cmd_storage_init)
    doctor = sub.add_parser(
        "doctor", help="check Python, torch/CUDA/NCCL, GPUs, the Ray cluster and the storage root; say how to fix",
        description="The deployment guide's environment checklist as one command. Exit code 1 on a blocking problem.")
    doctor.add_argument("--storage-root", help="storage root to probe (default: $ETRAIN_STORAGE_ROOT or ~/etrain-storage)")
    doctor.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or the running local cluster)")
    doctor.set_defaults(fn=cmd_doctor)
    spot = sub.add_parser(
        "spot-watch", help="per-node daemon: turn spot interruption notices (and SIGTERM) into a Ray node drain",
        description="Polls the AWS instance metadata service (IMDSv2) for spot/instance-action and the "
                    "rebalance recommendation; on a notice, drains this Ray node with reason PREEMPTION and "
                    "the notice's deadline, so training takes a just-in-time checkpoint and moves on.")
    spot.add_argument("--address", help="Ray cluster address (default: the node's own)")
    spot.add_argument("--node-id", help="Ray node id to drain (default: the alive node at this machine's address)")
    spot.add_argument("--imds-url", default="http://169.254.169.254", help="metadata endpoint (tests use a local one)")
    spot.add_argument("--interval-s", type=float, default=5.0, help="poll interval in seconds (default 5)")
    spot.add_argument("--on-rebalance", choices=["drain", "ignore"], default="drain",
                      help="what a rebalance recommendation does (default: drain early)")
    spot.add_argument("--rebalance-deadline-s", type=int, default=120, help="drain deadline for a rebalance")
    spot.add_argument("--sigterm-deadline-s", type=int, default=25, help="drain deadline after SIGTERM")
    spot.set_defaults(fn=cmd_spot_watch)
    metrics = sub.add_parser("metrics", help="Prometheus: a scrape config for this cluster's metrics agents")
    metrics_sub = metrics.add_subparsers(dest="metrics_command", required=True)
    prom = metrics_sub.add_parser(
        "prometheus-config", help="print (or --out) a prometheus.yml scraping every Ray node's metrics port",
        description="Job series are ray_etrain_* (loss, throughput, data-wait fraction, goodput, cost...); "
                    "ray_cluster.yaml pins the metrics port to 8080 on every node.")
    prom.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or the running local cluster)")
    prom.add_argument("--interval-s", type=float, default=15.0, help="scrape interval (default 15)")
    prom.add_argument("--out", help="write to this file instead of printing")
    prom.set_defaults(fn=cmd_prometheus_config)
    boards = sub.add_parser("dashboards", help="Grafana dashboards as code: push them, or write file provisioning")
    boards_sub = boards.add_subparsers(dest="dashboards_command", required=True)
    push_p = boards_sub.add_parser("push", help="create or update the dashboards in a Grafana (folder elastic-train)")
    push_p.add_argument("--url", required=True, help="Grafana URL, e.g. http://127.0.0.1:3000")
    push_p.add_argument("--token", help="service account token (default: $GRAFANA_TOKEN)")
    write_p = boards_sub.add_parser("write", help="write dashboards + a provisioning file for Grafana to load")
    write_p.add_argument("directory")
    for p in (push_p, write_p):
        p.add_argument("--gpu", action="store_true", help="add GPU utilisation and memory panels (GPU clusters)")
        p.set_defaults(fn=cmd_dashboards)
