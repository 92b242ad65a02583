"""Command line of the launcher; the work is in `tfdp.launch.local`, `tfdp.launch.sbatch`, `tfdp.launch.k8s`.

Usage:

    tfdp-launch --nproc_per_node N [--port P] [--grace_period S] [--max_restarts K]
                     [--gpus_per_proc G]
                     [--nnodes M --node_rank R --hosts H0:P0,H1:P1,... [--bind_all]]
                     -- COMMAND [ARGS...]
    tfdp-launch --num_ps P --nproc_per_node N [--max_restarts K] -- COMMAND [ARGS...]
    tfdp-launch slurm --nodes M --ntasks_per_node N [...] [--submit] -- COMMAND [ARGS...]
    tfdp-launch k8s --image IMAGE --workers N [...] [--output FILE] -- COMMAND [ARGS...]
    tfdp-launch tfjob-worker -- COMMAND [ARGS...]   (a TFJob container's entry point)

Reads the flags, validates them (exit status 2 with a message, before anything
starts), then calls one library function. See the `launch` package docstring
for the workers' environment and the exit codes.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from tfdp.launch import _proc
from tfdp.launch import local

_LAUNCH_EPILOG = """\
Workers. Each worker gets TF_CONFIG (a "worker" task; worker 0 is the chief),
TFDP_RANK, TFDP_LOCAL_RANK, TFDP_WORLD_SIZE, TFDP_LOCAL_WORLD_SIZE,
TFDP_NODE_RANK, TFDP_RESTART_COUNT and PYTHONUNBUFFERED=1. Output lines are
prefixed with "[RANK] ".

GPUs. On a node with GPUs each worker gets its own through
CUDA_VISIBLE_DEVICES: with G GPUs and N workers, worker i gets GPUs
[i*G/N, (i+1)*G/N) of the launcher's CUDA_VISIBLE_DEVICES (indices or UUIDs,
in order) or, when it is unset, of the G GPUs `nvidia-smi -L` lists (then
also CUDA_DEVICE_ORDER=PCI_BUS_ID, so the indices are nvidia-smi's). G not
divisible by N is refused; --gpus_per_proc K gives each worker K GPUs (0
hides them all). Without GPUs nothing is set.

Several nodes. Run the same command on every node, each with its own
--node_rank. --hosts lists every node's address and first port in node-rank
order: node r's local worker i listens on host_r:port_r+i and has global rank
r*N+i.

Binding. TensorFlow's gRPC server listens on all interfaces whatever
TF_CONFIG says; the launcher preloads a bind() shim (launch/bindshim.c, built
once with cc) so each worker listens only on its own --hosts address
(127.0.0.1 by default; when it cannot be built, a warning says why). The
endpoints have no authentication: a job on addresses other machines can reach
logs a warning and must run on a private, firewalled network. With --bind_all
there is no shim and the workers listen on all interfaces (also warned).

Restarts. With --max_restarts K, when a worker fails the whole group is
stopped and started again (fresh free ports, or the same fixed ones), up to K
times, with TFDP_RESTART_COUNT=1, 2, ...; a program that checkpoints
(tfdp.Trainer with a model_dir) resumes from its latest checkpoint. A signal to
the launcher never restarts. Without --port, when a worker fails because
another process took its free port after the launcher picked it (tfdp-train
and tfdp-predict exit 44 for that; for other programs the port is still held),
the group is started again with new ports (up to 3 times, not counted as
restarts). When
no restart is left, the failing worker's last 20 lines of stdout and of stderr
are repeated on stderr. On several nodes, give every node the same
--max_restarts.

Parameter servers. With --num_ps P, COMMAND runs once, as the chief of a
ParameterServerStrategy job (tfdp.make_strategy(kind="parameter_server")),
and N worker tasks and P ps tasks serve (tfdp.distribute.parameter_server),
each with its TF_CONFIG role, on free 127.0.0.1 ports. The job ends with the
chief, with its exit status; a worker task that dies is started again on its
address (up to --max_restarts times each) while its steps go to the others.
Output lines are prefixed [chief], [worker:i], [ps:j].

Exit status: 0 if every worker exited 0; else the failing worker's status
(128+N if signal N killed it); 128+N if the launcher got signal N (SIGINT: 130,
SIGTERM: 143); 2 for invalid arguments; 126/127 if a worker could not start.

Cluster schedulers: `tfdp-launch slurm --help` (an sbatch script),
`tfdp-launch k8s --help` (a Kubeflow TFJob manifest).

Examples:
  tfdp-launch --nproc_per_node 2 -- python train.py --epochs 1
  tfdp-launch --nproc_per_node 2 --nnodes 2 --node_rank 0 \\
      --hosts 10.0.0.1:2222,10.0.0.2:2222 --bind_all -- python train.py
"""

_SLURM_EPILOG = """\
Prints an sbatch script (#SBATCH lines, then one `srun` running COMMAND as
nodes x ntasks_per_node tasks), or submits it with sbatch when --submit is
given. Each task is one tfdp worker; tfdp.make_strategy() finds the cluster in
srun's SLURM_* variables (no TF_CONFIG). Ports: TFDP_SLURM_PORT_BASE, else
srun --resv-ports, else derived from the job id.

Preemption: with --signal TERM@S Slurm sends SIGTERM to the workers S
seconds before the time limit (so does `scancel --signal=TERM JOB`); they
save and exit 42, and with --requeue the script then runs `scontrol requeue`,
so the job runs again and resumes from its --model_dir. Slurm holds a
requeued job about two minutes before starting it. Do not signal srun itself
(`scancel --full`, `B:`): it then kills the workers at once, without a save.

Example:
  tfdp-launch slurm --nodes 2 --ntasks_per_node 1 --gpus_per_node 4 \\
      --time 02:00:00 -- python train.py > job.sbatch && sbatch job.sbatch
  tfdp-launch slurm --nodes 2 --ntasks_per_node 4 --gpus_per_node 4 \\
      --time 04:00:00 --signal TERM@300 --requeue --output logs/%x-%j.out \\
      --setup 'source venv/bin/activate' --submit -- tfdp-train --model_dir runs/a
"""

_K8S_EPILOG = """\
Writes a Kubeflow TFJob manifest (kubeflow.org/v1; needs the Kubeflow Training
Operator): N worker replicas running COMMAND in a container named
"tensorflow". The operator sets every pod's TF_CONFIG; worker 0 is the chief.

Resuming: a restarted pod has a new container filesystem. --pvc NAME mounts
that PersistentVolumeClaim at --mount_path (default /workspace) in every
worker; with restarts on, a --model_dir in COMMAND must lie under it (or be a
remote URL such as gs://...), else nothing is written and the exit status is 2.

Restart policy (--restart_policy):
  ExitCode  (default) COMMAND runs under `tfdp-launch tfjob-worker`, which
            forwards SIGTERM and maps exit codes onto the operator's: 2
            (configuration error) and other errors fail the job; 42 (preempted,
            state saved) and 43 (a peer worker was lost), both reported as
            138, 143 (SIGTERM) and 137 (SIGKILL) re-create the pod. Not
            counted against --backoff_limit.
  OnFailure every non-zero exit restarts the container, up to --backoff_limit
            restarts over the whole job.
  Never     no restart.

Example:
  tfdp-launch k8s --image registry.example.com/tfdp:0.1 --workers 4 \\
      --gpus_per_worker 1 --pvc tfdp-runs --output tfjob.yaml -- \\
      tfdp-train --model mlp --model_dir /workspace/runs/mlp-1
  kubectl apply -f tfjob.yaml
"""


def _split_command(parser: argparse.ArgumentParser, argv: Sequence[str],
                   example: str) -> tuple[argparse.Namespace, list[str]]:
    """Parses the flags before `--`; returns them and the command after it."""
    argv = list(argv)
    if "--" in argv:
        split = argv.index("--")
        flags, command = argv[:split], argv[split + 1:]
    else:
        flags, command = argv, []
    args, unknown = parser.parse_known_args(flags)
    if unknown:
        parser.error(f"unrecognized arguments before `--`: {' '.join(unknown)}. Put the "
                     f"worker command after `--`, e.g. `{example}`")
    if not command:
        parser.error(f"missing COMMAND after `--`: give the program every worker runs, "
                     f"e.g. `{example}`")
    return args, command


def _launch_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tfdp-launch",
        usage=("%(prog)s --nproc_per_node N [--port P] [--grace_period S] [--max_restarts K]\n"
               "       [--gpus_per_proc G] [--num_ps P]\n"
               "       [--nnodes M --node_rank R --hosts H0:P0,H1:P1,... [--bind_all]]\n"
               "       -- COMMAND [ARGS ...]\n"
               "   or: %(prog)s {slurm,k8s} ... -- COMMAND [ARGS ...]"),
        description="Run COMMAND as N worker processes of one multi-worker job on this host "
                    "(or as this node's N workers of a job over several hosts).",
        epilog=_LAUNCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nproc_per_node", type=int, required=True, metavar="N",
                        help="number of worker processes to start on this node (>= 1)")
    parser.add_argument("--port", type=int, default=None, metavar="P",
                        help="one node: worker i listens on port P+i (default: free ports)")
    parser.add_argument("--grace_period", type=float, default=local.DEFAULT_GRACE_PERIOD,
                        metavar="S",
                        help="seconds between SIGTERM (or a forwarded SIGINT) and SIGKILL "
                             f"when stopping workers (default: {local.DEFAULT_GRACE_PERIOD:g})")
    parser.add_argument("--max_restarts", type=int, default=0, metavar="K",
                        help="restart the whole group up to K times after a worker fails "
                             "(default: 0)")
    parser.add_argument("--gpus_per_proc", type=int, default=None, metavar="G",
                        help="GPUs per worker, set through CUDA_VISIBLE_DEVICES (default: "
                             "this node's GPUs split evenly among the workers; 0 hides them)")
    parser.add_argument("--nnodes", type=int, default=1, metavar="M",
                        help="number of nodes in the job (default: 1)")
    parser.add_argument("--node_rank", type=int, default=0, metavar="R",
                        help="this node's rank, in [0, M) (default: 0)")
    parser.add_argument("--hosts", default=None, metavar="H0:P0,H1:P1,...",
                        help="every node's address and first worker port, in node-rank "
                             "order (needed when M > 1)")
    parser.add_argument("--num_ps", type=int, default=None, metavar="P",
                        help="a parameter-server job: COMMAND runs as the chief, N worker "
                             "tasks and P ps tasks serve (tfdp.make_strategy(kind="
                             "'parameter_server')); --max_restarts then restarts a dead worker "
                             "task on its own address")
    parser.add_argument("--bind_all", action="store_true",
                        help="workers listen on all interfaces instead of their own --hosts "
                             "address only (the gRPC endpoints are unauthenticated; logs a "
                             "warning)")
    return parser


def _main_launch(argv: Sequence[str]) -> int:
    parser = _launch_parser()
    args, command = _split_command(parser, argv,
                                   "tfdp-launch --nproc_per_node 2 -- python train.py")
    multi_node = args.hosts is not None or args.nnodes != 1
    if args.num_ps is not None:
        return _launch_parameter_server(parser, args, command, multi_node)
    try:
        if multi_node:
            if args.hosts is None:
                parser.error(
                    f"--hosts is required with --nnodes {args.nnodes}: give every node's "
                    "address and first port, in node-rank order, e.g. "
                    "--hosts 10.0.0.1:2222,10.0.0.2:2222")
            if args.port is not None:
                parser.error(
                    f"--port cannot be combined with --hosts (the ports come from --hosts: "
                    f"node r's worker i uses port_r+i). Received: --port {args.port}")
            plan = local.plan_nodes(command, nnodes=args.nnodes, node_rank=args.node_rank,
                                    hosts=args.hosts, nproc_per_node=args.nproc_per_node,
                                    bind_all=args.bind_all, grace_period=args.grace_period,
                                    max_restarts=args.max_restarts,
                                    gpus_per_proc=args.gpus_per_proc)
        else:
            if args.node_rank != 0:
                parser.error(f"--node_rank {args.node_rank} needs --nnodes > 1 and --hosts "
                             "(a one-node launch is node 0).")
            if args.bind_all:
                parser.error("--bind_all only applies with --hosts: a one-node launch uses "
                             "127.0.0.1 addresses.")
            plan = local.plan_local(command, nproc_per_node=args.nproc_per_node,
                                    port=args.port, grace_period=args.grace_period,
                                    max_restarts=args.max_restarts,
                                    gpus_per_proc=args.gpus_per_proc)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    return _run_owning_children(lambda: local.run_plan(plan), "workers'")


def _run_owning_children(run: Callable[[], int], whose: str) -> int:
    """Runs `run()` as the owner of every process it starts; returns its exit status.

    Orphaned grandchildren are adopted (a subreaper: PID 1 does not reap them on
    every machine) and reaped afterwards; any still running are named on stderr.
    `whose` names the process groups in that warning ("workers'", "tasks'").
    """
    _proc.set_child_subreaper()
    status = run()
    leftovers = _proc.reap_children()
    if leftovers:
        print(f"[launch] warning: processes outside the {whose} process groups are "
              f"still running: pids {leftovers}", file=sys.stderr)
    return status


def _launch_parameter_server(parser, args, command, multi_node: bool) -> int:
    """`--num_ps P`: the chief runs COMMAND, the worker and ps tasks serve (one host)."""
    from tfdp.launch import parameter_server

    given = [flag for flag, on in (("--nnodes/--hosts", multi_node),
                                   ("--port", args.port is not None),
                                   ("--gpus_per_proc", args.gpus_per_proc is not None),
                                   ("--bind_all", args.bind_all)) if on]
    if given:
        parser.error(f"--num_ps launches a parameter-server job on this host only; "
                     f"{', '.join(given)} cannot be combined with it (the tasks get free "
                     "127.0.0.1 ports). Remove them.")
    try:
        plan = parameter_server.plan_parameter_server(
            command, num_workers=args.nproc_per_node, num_ps=args.num_ps,
            grace_period=args.grace_period, max_restarts=args.max_restarts)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    return _run_owning_children(lambda: parameter_server.run_parameter_server(plan), "tasks'")


def _main_slurm(argv: Sequence[str]) -> int:
    from tfdp.launch import sbatch

    parser = argparse.ArgumentParser(
        prog="tfdp-launch slurm",
        usage=("%(prog)s --nodes M --ntasks_per_node N [--partition P] [--account A]\n"
               "       [--time T] [--gpus_per_node G] [--cpus_per_task C] [--mem M]\n"
               "       [--job_name J] [--output PATTERN] [--signal TERM@S] [--requeue]\n"
               "       [--setup LINE] [--submit] -- COMMAND [ARGS ...]"),
        description="Write (or submit) a Slurm batch script running COMMAND as a tfdp job.",
        epilog=_SLURM_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nodes", type=int, required=True, metavar="M",
                        help="number of nodes (>= 1)")
    parser.add_argument("--ntasks_per_node", type=int, required=True, metavar="N",
                        help="workers (Slurm tasks) per node (>= 1)")
    parser.add_argument("--partition", default=None, metavar="P", help="Slurm partition")
    parser.add_argument("--time", default=None, metavar="T",
                        help="time limit, e.g. 90 (minutes), 02:00:00 or 1-12:00:00")
    parser.add_argument("--gpus_per_node", type=int, default=0, metavar="G",
                        help="GPUs per node (default: 0)")
    parser.add_argument("--job_name", default="tfdp", metavar="J",
                        help="job name (default: tfdp)")
    parser.add_argument("--account", default=None, metavar="A",
                        help="account to charge (default: your default account)")
    parser.add_argument("--cpus_per_task", type=int, default=None, metavar="C",
                        help="CPUs per task (also given to srun)")
    parser.add_argument("--mem", default=None, metavar="M",
                        help="memory per node, e.g. 32G (M is megabytes, the default unit)")
    parser.add_argument("--output", default=None, metavar="PATTERN",
                        help="the job's output file, e.g. logs/%%x-%%j.out (default: Slurm's "
                             "slurm-%%j.out in the submission directory)")
    parser.add_argument("--signal", default=None, metavar="TERM@S",
                        help="SIGTERM the workers S seconds before the time limit, so that "
                             "they save and exit 42 (sbatch --signal; 'R:' allowed, 'B:' not)")
    parser.add_argument("--requeue", action="store_true",
                        help="when the workers exit 42 (saved after SIGTERM), requeue the job "
                             "with scontrol requeue; the rerun resumes from the saved state")
    parser.add_argument("--setup", default=None, metavar="LINE",
                        help="a shell line run before srun, e.g. 'source venv/bin/activate' or "
                             "'module load cuda'")
    parser.add_argument("--submit", action="store_true",
                        help="submit the script with sbatch instead of printing it")
    args, command = _split_command(
        parser, argv, "tfdp-launch slurm --nodes 2 --ntasks_per_node 1 -- python train.py")
    try:
        job = sbatch.plan_job(command, nodes=args.nodes, ntasks_per_node=args.ntasks_per_node,
                             partition=args.partition, time=args.time,
                             gpus_per_node=args.gpus_per_node, job_name=args.job_name,
                             account=args.account, cpus_per_task=args.cpus_per_task,
                             mem=args.mem, output=args.output, signal=args.signal,
                             requeue=args.requeue, setup=args.setup)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    script = sbatch.batch_script(job)
    if not args.submit:
        sys.stdout.write(script)
        return 0
    try:
        result = sbatch.submit(script)
    except ValueError as e:
        parser.error(str(e))
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    if result.returncode != 0:
        print(f"[launch] sbatch failed with exit code {result.returncode}; the script was:\n"
              f"{script}", file=sys.stderr)
    return result.returncode


def _main_k8s(argv: Sequence[str]) -> int:
    from tfdp.launch import k8s

    parser = argparse.ArgumentParser(
        prog="tfdp-launch k8s",
        usage=("%(prog)s --image IMAGE --workers N [--name NAME] [--namespace NS]\n"
               "       [--gpus_per_worker G] [--cpu C] [--memory M]\n"
               "       [--pvc NAME [--mount_path PATH]] [--restart_policy P]\n"
               "       [--backoff_limit K] [--clean_pod_policy C] [--ttl_seconds_after_finished S]\n"
               "       [--gang [--queue Q]] [--grace_period S] [--output FILE]\n"
               "       -- COMMAND [ARGS ...]"),
        description="Write a Kubeflow TFJob manifest running COMMAND as a tfdp job.",
        epilog=_K8S_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--image", required=True, metavar="IMAGE",
                        help="container image with tfdp and the program")
    parser.add_argument("--workers", type=int, required=True, metavar="N",
                        help="number of worker replicas (>= 1)")
    parser.add_argument("--name", default="tfdp", metavar="NAME",
                        help="TFJob name, an RFC 1123 DNS label (default: tfdp)")
    parser.add_argument("--namespace", default=None, metavar="NS", help="Kubernetes namespace")
    parser.add_argument("--gpus_per_worker", type=int, default=0, metavar="G",
                        help="nvidia.com/gpu per worker (default: 0)")
    parser.add_argument("--cpu", default=None, metavar="C",
                        help="CPU request and limit per worker, e.g. 4 or 500m")
    parser.add_argument("--memory", default=None, metavar="M",
                        help="memory request and limit per worker, e.g. 16Gi")
    parser.add_argument("--pvc", default=None, metavar="NAME",
                        help="PersistentVolumeClaim mounted in every worker (for --model_dir)")
    parser.add_argument("--mount_path", default=k8s.DEFAULT_MOUNT_PATH, metavar="PATH",
                        help=f"where --pvc is mounted (default: {k8s.DEFAULT_MOUNT_PATH})")
    parser.add_argument("--restart_policy", default="ExitCode", choices=k8s.RESTART_POLICIES,
                        help="worker restart policy (default: ExitCode; see below)")
    parser.add_argument("--backoff_limit", type=int, default=k8s.DEFAULT_BACKOFF_LIMIT,
                        metavar="K", help="restarts (OnFailure) before the job fails "
                                          f"(default: {k8s.DEFAULT_BACKOFF_LIMIT})")
    parser.add_argument("--clean_pod_policy", default="Running", choices=k8s.CLEAN_POD_POLICIES,
                        help="pods deleted when the job ends (default: Running, the pods "
                             "still running)")
    parser.add_argument("--ttl_seconds_after_finished", type=int, default=None, metavar="S",
                        help="delete the finished job S seconds after it ends (default: keep)")
    parser.add_argument("--gang", action="store_true",
                        help="schedule all workers together (runPolicy.schedulingPolicy; "
                             "needs an operator run with a gang scheduler such as Volcano)")
    parser.add_argument("--queue", default=None, metavar="Q",
                        help="the gang scheduler's queue (with --gang)")
    parser.add_argument("--grace_period", type=int, default=None, metavar="S",
                        help="seconds from a pod's SIGTERM to SIGKILL, time for the "
                             "preemption save (default: Kubernetes' 30)")
    parser.add_argument("--output", default=None, metavar="FILE",
                        help="write the manifest to FILE (default: stdout)")
    args, command = _split_command(
        parser, argv, "tfdp-launch k8s --image IMAGE --workers 2 -- tfdp-train")
    try:
        spec = k8s.plan_tfjob(command, image=args.image, workers=args.workers, name=args.name,
                              namespace=args.namespace, gpus_per_worker=args.gpus_per_worker,
                              cpu=args.cpu, memory=args.memory,
                              restart_policy=args.restart_policy, pvc=args.pvc,
                              mount_path=args.mount_path, backoff_limit=args.backoff_limit,
                              clean_pod_policy=args.clean_pod_policy,
                              ttl_seconds_after_finished=args.ttl_seconds_after_finished,
                              gang=args.gang, queue=args.queue, grace_period=args.grace_period)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    for warning in spec.warnings:
        print(f"[launch] warning: {warning}", file=sys.stderr)
    text = k8s.to_yaml(spec)
    if args.output is None:
        sys.stdout.write(text)
        return 0
    try:
        with open(args.output, "w") as f:
            f.write(text)
    except OSError as e:
        parser.error(f"--output {args.output!r} cannot be written ({e.strerror}). "
                     "Choose a writable path.")
    print(f"[launch] wrote a TFJob manifest for {spec.workers} worker(s) to {args.output}; "
          f"apply it with: kubectl apply -f {args.output}", file=sys.stderr)
    return 0


def _main_tfjob_worker(argv: Sequence[str]) -> int:
    from tfdp.launch import tfjob_worker

    parser = argparse.ArgumentParser(
        prog="tfdp-launch tfjob-worker",
        usage="%(prog)s -- COMMAND [ARGS ...]",
        description="Run COMMAND as one TFJob worker container's program (the entry point "
                    "`tfdp-launch k8s` writes under restartPolicy ExitCode): SIGTERM and "
                    "SIGINT are forwarded to it, and its exit status is mapped onto the "
                    "Training Operator's retryable codes: 42 (preempted, state saved) "
                    "and 43 (a peer worker was lost) become 138, death by signal N becomes "
                    "128+N, others are kept.",
    )
    _, command = _split_command(parser, argv, "tfdp-launch tfjob-worker -- tfdp-train")
    return tfjob_worker.run(command)


#: Subcommands; without one, `tfdp-launch` launches workers itself.
SUBCOMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "slurm": _main_slurm,
    "k8s": _main_k8s,
    "tfjob-worker": _main_tfjob_worker,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Parses `argv` (default: `sys.argv[1:]`), runs the launch, returns its status.

    `slurm`, `k8s` or `tfjob-worker` as the first argument selects that
    subcommand; anything else is a launch of workers on this node.

    Raises:
        SystemExit: with status 2 and a message for invalid arguments.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    return _main_launch(argv)


def run() -> None:
    """Console-script entry point `tfdp-launch`: `main()`, its status as the exit status."""
    sys.exit(main())


if __name__ == "__main__":
    run()
