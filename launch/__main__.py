"""Command line of the local launcher; the work is in `launch.local`.

Usage:

    python -m launch --nproc_per_node N [--port P] [--grace_period S] -- COMMAND [ARGS...]

Reads the flags, validates them (exit status 2 with a message, before anything
starts), then runs `launch.local.run_plan`. See the `launch` package docstring
for the workers' environment and the exit codes.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from launch import _proc
from launch import local

_EPILOG = """\
Each worker gets TF_CONFIG (a "worker" task on 127.0.0.1; worker 0 is the chief),
TFDP_RANK, TFDP_LOCAL_RANK, TFDP_WORLD_SIZE, TFDP_LOCAL_WORLD_SIZE and
PYTHONUNBUFFERED=1. Output lines are prefixed with "[RANK] ".

Exit status: 0 if every worker exited 0; else the first failing worker's status
(128+N if signal N killed it); 128+N if the launcher got signal N (SIGINT: 130,
SIGTERM: 143); 2 for invalid arguments; 126/127 if a worker could not start.

Example: python -m launch --nproc_per_node 2 -- python train.py --epochs 1
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m launch",
        usage="%(prog)s --nproc_per_node N [--port P] [--grace_period S] -- COMMAND [ARGS ...]",
        description="Run COMMAND as N worker processes of one multi-worker job on this host.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nproc_per_node", type=int, required=True, metavar="N",
                        help="number of worker processes to start (>= 1)")
    parser.add_argument("--port", type=int, default=None, metavar="P",
                        help="worker i listens on port P+i (default: free ports)")
    parser.add_argument("--grace_period", type=float, default=local.DEFAULT_GRACE_PERIOD,
                        metavar="S",
                        help="seconds between SIGTERM (or a forwarded SIGINT) and SIGKILL "
                             f"when stopping workers (default: {local.DEFAULT_GRACE_PERIOD:g})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parses `argv` (default: `sys.argv[1:]`), runs the launch, returns its status.

    Raises:
        SystemExit: with status 2 and a message for invalid arguments.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if "--" in argv:
        split = argv.index("--")
        flags, command = argv[:split], argv[split + 1:]
    else:
        flags, command = argv, []
    args, unknown = parser.parse_known_args(flags)
    if unknown:
        parser.error(f"unrecognized arguments before `--`: {' '.join(unknown)}. Put the "
                     "worker command after `--`, e.g. "
                     "`python -m launch --nproc_per_node 2 -- python train.py`")
    if not command:
        parser.error("missing COMMAND after `--`: give the program every worker runs, e.g. "
                     "`python -m launch --nproc_per_node 2 -- python train.py`")
    try:
        plan = local.plan_local(command, nproc_per_node=args.nproc_per_node,
                                port=args.port, grace_period=args.grace_period)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    # This process owns every process it starts: adopt orphaned grandchildren
    # so they can be reaped (PID 1 does not reap them on every machine).
    _proc.set_child_subreaper()
    status = local.run_plan(plan)
    leftovers = _proc.reap_children()
    if leftovers:
        print(f"[launch] warning: processes outside the workers' process groups are "
              f"still running: pids {leftovers}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
