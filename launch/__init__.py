"""tfdp's process launcher: `python -m launch --nproc_per_node N -- COMMAND ...`.

Starts N worker processes of COMMAND on this host, each with its own
`TF_CONFIG` on 127.0.0.1 and the `TFDP_RANK`, `TFDP_LOCAL_RANK`,
`TFDP_WORLD_SIZE` and `TFDP_LOCAL_WORLD_SIZE` variables (see `launch.local`),
prefixes every output line with the worker's rank (`[0] ...`), forwards
SIGINT/SIGTERM to the workers, and stops them all as soon as one fails.

Exit status of `python -m launch`:

- 0: every worker exited 0.
- the first failing worker's exit status, or 128 + signum if a signal killed
  it (e.g. 137 for SIGKILL);
- 128 + signum when the launcher received SIGINT (130) or SIGTERM (143);
- 2: invalid arguments (nothing was started);
- 126/127: a worker could not be started.

Modules: `launch.local` (what each worker runs, with which environment),
`launch.worker_group` (start, supervise, stop a set of processes),
`launch.output` (rank-prefixed output), `launch.signals` (signal catching),
`launch._proc` (process groups, /proc, reaping). This package may import
`tfdp.cluster`; `tfdp` never imports `launch`.
"""
