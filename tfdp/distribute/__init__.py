"""tfdp's runtime wing: the processes of a job, and what passes between them.

- `cluster`: TF_CONFIG read, validated and written (no TensorFlow);
- `local_cluster`: free ports and TF_CONFIG for N workers on this host (no TensorFlow);
- `slurm_env`: a Slurm job step's environment as a cluster (no TensorFlow);
- `strategy`: which `tf.distribute.Strategy` and all-reduce a job runs under;
- `parameter_server`: `ParameterServerStrategy`'s cluster, task servers and coordinator;
- `strategy_info`: a built strategy in one line (workers, rank, replicas, devices);
- `devices`: logical CPU devices, and where XLA can compile;
- `startup`: workers that cannot start together (ports, the start-up deadline);
- `config_check`: the same configuration on every worker;
- `peer_failures`: stuck and dead peers while training;
- `failure_text`: how those messages name workers and quote TensorFlow;
- `preemption`: save-and-exit on SIGTERM at a step every worker agrees on;
- `reduction`: how gradients are summed over replicas.

Nothing here imports the training wing (`tfdp.training`).
"""
