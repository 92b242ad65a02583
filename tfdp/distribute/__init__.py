"""tfdp's runtime wing: the processes of a job, and what passes between them.

- `cluster`: TF_CONFIG read, validated and written (no TensorFlow);
- `slurm_env`: a Slurm job step's environment as a cluster (no TensorFlow);
- `strategy`: which `tf.distribute.Strategy` and all-reduce a job runs under;
- `startup`: failures between workers at start-up and in collectives, said plainly;
- `preemption`: save-and-exit on SIGTERM at a step every worker agrees on;
- `reduction`: how gradients are summed over replicas.

Nothing here imports the training wing (`tfdp.training`), and nothing here
imports TensorFlow at module level where the launcher needs it (`cluster`,
`slurm_env`).
"""
