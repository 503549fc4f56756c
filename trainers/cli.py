"""`etrain`: run a job spec, or the demo. (`python -m trainers.train SPEC` is `etrain run SPEC`.)"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from cluster.cli import add_cluster_commands
from cluster.log_lines import send_to
from trainers.config.errors import SpecError
from trainers.config.loading import add_digest_arg, load_spec
from trainers.worker_log import LOG_LEVEL_ENV

EXAMPLES = """examples:
  etrain run configs/quickstart.yaml
  etrain run configs/deployment-guide.json --set training.max_steps=50
  etrain run configs/lm.yaml --set distributed.num_workers=1 --set checkpoint.storage_root=s3://bucket/runs
  etrain demo
  etrain sweep configs/sweep.yaml
  etrain export configs/quickstart.yaml --format pt

A job's name and storage root identify it: running the same spec again resumes it from
its latest verified checkpoint. Exit codes: 0 reached the target step, 1 failed,
2 invalid spec, 3 stopped early by --stop-at-step (resumable).

On a terminal, progress is one live line (step/target, loss, samples/s, ETA); piped or
redirected, it is a plain line per log step. Ray's own log lines are hidden unless
--verbose (or --log-level debug).
"""


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="job spec file, JSON or YAML (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec field, e.g. training.max_steps=20 (repeatable; values read as YAML)")
    p.add_argument("--stop-at-step", type=int, default=None, metavar="N",
                   help="stop after step N with a checkpoint; run again to resume")
    p.add_argument("--json", action="store_true", help="print the final summary as JSON only")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also show Ray's own log lines (worker and controller chatter), hidden by default")
    p.add_argument("--log-level", choices=["warning", "info", "debug"], default="info",
                   help="our workers' lines: warning (problems only), info (progress, the default) or "
                        "debug (ours in detail, and Ray's own log lines as with --verbose)")
    add_digest_arg(p)


def cmd_run(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.spec, args.overrides, args.spec_sha256)
    except SpecError as exc:
        print(exc.render(f"job spec {args.spec}"), file=sys.stderr)
        return 2
    from cluster.log_lines import lines_to
    from trainers.console import Console
    from trainers.launch import run_job

    verbose = args.verbose or args.log_level == "debug"
    os.environ[LOG_LEVEL_ENV] = args.log_level.upper()  # the workers' level: launch passes it on
    try:
        with Console(sys.stderr if args.json else sys.stdout, verbose=verbose) as console, lines_to(console.say):
            code, summary = run_job(spec, stop_at_step=args.stop_at_step)
    except SpecError as exc:
        print(exc.render(f"job spec {args.spec}"), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary)
    return code


def print_summary(s: dict) -> None:
    rate = f"{s['samples_per_s']:.0f}" if s.get("samples_per_s") else "-"
    loss = f"{s['final_loss']:.4f}" if s.get("final_loss") is not None else "-"
    print(f"\n[etrain] job {s['name']}: {s['status']} at step {s['final_step']}/{s['target_step']} "
          f"in {s['wall_time_s']:.1f}s; {rate} samples/s; final loss {loss}; "
          f"world size {s['world_size']}, global batch {s['global_batch_size']}")
    for r in s.get("interruptions", []):
        print(f"[etrain] interruption: {r['cause']} at step {r['step_reached']}, {r['steps_lost']} steps lost, "
              f"{r['recovery_s']:.1f}s to the next step, world size {r['world_size_before']} -> {r['world_size_after']}")
    resumes = " (a re-run resumes from it)" if s["status"] != "succeeded" and s.get("checkpoint_uri") else ""
    print(f"[etrain] checkpoint: {s['checkpoint_uri']}{resumes}")
    print(f"[etrain] summary:    {s['storage']}/summary.json")
    if s.get("error"):
        print(f"[etrain] error: {s['error']}")


def cmd_export(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.spec, args.overrides)
    except SpecError as exc:
        print(exc.render(f"job spec {args.spec}"), file=sys.stderr)
        return 2
    from trainers.export import ExportError, export_weights

    try:
        uri = export_weights(spec, step=args.step, fmt=args.format)
    except ExportError as exc:
        print(f"[etrain] error: {exc}", file=sys.stderr)
        return 1
    print(uri)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    spec = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"
    print(f"[etrain] demo: training {spec.name} on a local Ray (2 gloo DDP workers, local storage)")
    return cmd_run(argparse.Namespace(spec=str(spec), overrides=args.overrides, stop_at_step=None, json=False,
                                      spec_sha256=None,
                                      verbose=args.verbose, log_level="info"))


def main(argv: list[str] | None = None) -> int:
    parser, _ = build_parser()
    args = parser.parse_args(argv)
    send_to(sys.stderr)  # our lines on stderr: stdout holds what a command answers (a summary, JSON)
    return args.fn(args)


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The `etrain` parser with the training commands and the cluster's (cluster.cli); service.cli adds the service's."""
    parser = argparse.ArgumentParser(
        prog="etrain", description="Elastic, spot-tolerant PyTorch DDP training on Ray.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job spec to its target step (resumes if it ran before)",
                         epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(run)
    run.set_defaults(fn=cmd_run)
    export = sub.add_parser(
        "export", help="write the model weights of a job's newest (or given) verified checkpoint to "
                       "<job folder>/exported/ and print the file's URI",
        description="The model's state dict alone (no optimizer or loop state), loadable with safetensors' "
                    "load_file or torch.load, and by another job's model.init_from.")
    export.add_argument("spec", help="the job's spec file: its name and storage root say which job")
    export.add_argument("--step", type=int, default=None, metavar="N",
                        help="export the checkpoint at step N (default: the newest verified one)")
    export.add_argument("--format", choices=["safetensors", "pt"], default="safetensors",
                        help="safetensors (default: no pickle) or pt (torch.save)")
    export.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec field, as for run (e.g. checkpoint.storage_root=s3://bucket/runs)")
    export.set_defaults(fn=cmd_export)
    demo = sub.add_parser("demo", help="run the quickstart job locally and say where its checkpoints went")
    demo.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    demo.add_argument("-v", "--verbose", action="store_true", help="also show Ray's own log lines")
    demo.set_defaults(fn=cmd_demo)
    from trainers.sweep.cli import EXAMPLES as SWEEP_EXAMPLES
    from trainers.sweep.cli import add_sweep_args, cmd_sweep

    sweep = sub.add_parser("sweep", help="search hyperparameters with Ray Tune; every trial is a full job",
                           epilog=SWEEP_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_args(sweep)
    sweep.set_defaults(fn=cmd_sweep)
    add_cluster_commands(sub)
    return parser, sub


if __name__ == "__main__":
    sys.exit(main())
