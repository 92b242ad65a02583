"""tfdp's performance suite: `python -m tfdp.bench` (console script `tfdp-bench`).

Nine cases, run side by side in one invocation so their ratios come from the
same minutes of the same machine, each in fresh processes with deadlines:

1. scaling (`scaling`): the CNN on 1 vs 2 worker processes (`python -m
   launch`), tfdp's fit path and its custom loop;
2. overhead (`overhead`): tfdp fit vs plain Keras fit vs tfdp's Trainer vs
   hand-written loops, same strategy (both from `throughput`);
3. peer (`peer_torch`): PyTorch DDP (gloo, CPU) on the same network;
4. communication (`communication`): gradient compression, tfdp's and DDP's hooks;
5. accumulation (`accumulation`): k micro-batches per all-reduce vs one
   all-reduce per micro-batch, time and peak memory;
6. all-reduce (`allreduce`): latency and bandwidth vs message size and
   `bytes_per_pack`, beside the ring lower bound;
7. input pipeline (`input_pipeline`): `make_dataset` against a naive tf.data pipeline;
8. batch inference (`predict`): `tfdp.predict` against Keras' `predict`;
9. memory (`memory`): per-worker memory and step time with and without ZeRO-1
   (`shard_optimizer_state`), and the transformer with and without remat.

and, after them, time to accuracy on digits (`time_to_accuracy`), the fixed
costs of the README's job (`fixed_costs`) and the stragglers (`stragglers`:
one of 2 workers held at half a CPU by a cgroup, the equal split against
balanced batches, and both without the straggler).

`workloads` defines the networks and data, `procs` runs processes,
`worker` is the measurement processes' entry point, `suite` the order and
sizes, `targets` the issue's thresholds, `report` the output files, `link`
the shaped link of `--link`, `straggler` a worker held to a fraction of a
CPU (a CPU cgroup; `python -m tfdp.bench.straggler`). Nothing
here is imported by the rest of tfdp.
"""
