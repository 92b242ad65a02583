"""tfdp's process launcher: `tfdp-launch --nproc_per_node N -- COMMAND ...`.

Starts N worker processes of COMMAND on this host, each with its own
`TF_CONFIG` and the `TFDP_RANK`, `TFDP_LOCAL_RANK`, `TFDP_WORLD_SIZE`,
`TFDP_LOCAL_WORLD_SIZE`, `TFDP_NODE_RANK` and `TFDP_RESTART_COUNT` variables
(see `tfdp.launch.local`), prefixes every output line with the worker's rank
(`[0] ...`), forwards SIGINT/SIGTERM to the workers, and stops them all as soon
as one fails.

- Several nodes: `--nnodes M --node_rank R --hosts H0:P0,H1:P1,...`, the same
  command on every node with its own `--node_rank`; node r's worker i listens
  on `H_r:P_r+i` and has global rank `r*N+i` (`tfdp.launch.nodes`).
- Binding: TensorFlow's gRPC server listens on *all* interfaces whatever the
  TF_CONFIG address says, and nothing in TensorFlow 2.21 restricts it (see
  `tfdp.launch.nodes`), so the launcher preloads a small `bind()` shim
  (`tfdp.launch.bind`) that makes each worker listen on its own `--hosts` address
  only (loopback by default). Addresses other machines can reach, and
  `--bind_all` (no shim: all interfaces), log a warning that the endpoints are
  unauthenticated.
- Restarts: `--max_restarts K` stops and restarts the whole group after a
  worker fails, up to K times (`tfdp.launch.restarts`); a signal never restarts.
- GPUs: each local worker gets its own share of the node's GPUs through
  `CUDA_VISIBLE_DEVICES` (`tfdp.launch.gpus`; `--gpus_per_proc K`).
- Schedulers: `tfdp-launch slurm ...` writes or submits an sbatch script
  (`tfdp.launch.sbatch`; the workers then find the cluster through `tfdp.distribute.slurm_env`),
  `tfdp-launch k8s ...` writes a Kubeflow TFJob manifest (`tfdp.launch.k8s`),
  whose containers run `tfdp-launch tfjob-worker -- COMMAND`
  (`tfdp.launch.tfjob_worker`: SIGTERM forwarding, exit codes the operator's
  restart policy understands).
- Parameter servers: `--num_ps P` runs COMMAND as the chief of a
  `ParameterServerStrategy` job with N worker and P ps tasks serving
  (`tfdp.launch.parameter_server`); the job ends with the chief.

Exit status of `tfdp-launch` (without a subcommand):

- 0: every worker exited 0.
- the failing worker's exit status (the last attempt's, with restarts), or
  128 + signum if a signal killed it (e.g. 137 for SIGKILL);
- 128 + signum when the launcher received SIGINT (130) or SIGTERM (143);
- 2: invalid arguments (nothing was started);
- 126/127: a worker could not be started.

Modules: `tfdp.launch.local` (what each worker runs, with which environment),
`tfdp.launch.gpus` (each worker's GPUs),
`tfdp.launch.nodes` (multi-node layout and address checks), `tfdp.launch.restarts`
(the attempt loop), `tfdp.launch.worker_group` (start, supervise, stop a set of
processes), `tfdp.launch.output` (rank-prefixed output, log tails),
`tfdp.launch.signals` (signal catching), `tfdp.launch.bind` (the bind shim), `tfdp.launch._proc` (process groups, /proc,
reaping), `tfdp.launch.sbatch` and `tfdp.launch.k8s` (scheduler files),
`tfdp.launch.tfjob_worker` (a TFJob container's entry point),
`tfdp.launch.parameter_server` (`--num_ps`: a chief, worker and ps tasks). This
package imports only the library modules that load without TensorFlow
(`tfdp._checks`, `tfdp.distribute.cluster`, `tfdp.distribute.local_cluster`,
`tfdp.distribute.visible_gpus`);
the library never imports it.
"""
