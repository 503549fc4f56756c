"""The sweep's command line, ``etrain sweep`` and ``python -m trainers.sweep``: it reads the sweep file,
shows our log lines as it runs (cluster.log_lines), and prints the report at its end."""

from __future__ import annotations

import argparse
import json
import sys

import trainers.sweep
from cluster.log_lines import send_to
from trainers.config.errors import SpecError
from trainers.config.loading import add_digest_arg
from trainers.sweep.report import render_report
from trainers.sweep.spec import load_sweep
from trainers.sweep.tune_run import run_sweep

EXAMPLES = """examples:
  etrain sweep configs/sweep.yaml
  etrain sweep configs/sweep.yaml --resume          # after the driver died or was stopped
  etrain sweep configs/sweep.yaml --set training.max_steps=40

A sweep file is a job spec plus a 'sweep' section (see configs/sweep.yaml). Every trial is a
full job: elastic, checkpointed, resumable. Exit codes: 0 done with a best trial, 1 a trial
failed or none reported the metric, 2 invalid sweep.
"""


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="sweep file: a job spec with a 'sweep' section (JSON or YAML)")
    p.add_argument("--resume", action="store_true",
                   help="continue a sweep whose driver stopped: finished trials are kept, unfinished ones "
                        "continue from their checkpoints")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the base job spec (repeatable; values read as YAML)")
    p.add_argument("--json", action="store_true", help="print the final report as JSON only")
    add_digest_arg(p)


def cmd_sweep(args: argparse.Namespace) -> int:
    try:
        plan = load_sweep(args.spec, args.overrides, args.spec_sha256)
        restore = send_to(sys.stderr if args.json else sys.stdout)  # --json: stdout holds the report only
        try:
            code, report = run_sweep(plan, resume=args.resume)
        finally:
            restore()
    except SpecError as exc:
        print(exc.render(f"sweep {args.spec}"), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render_report(report))
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainers.sweep",
                                     description=trainers.sweep.__doc__.split("\n\n")[0],
                                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_args(parser)
    return cmd_sweep(parser.parse_args(argv))
