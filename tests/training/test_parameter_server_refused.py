"""`tfdp.compile` refuses TensorFlow's ParameterServerStrategy by name; `tfdp.Trainer` takes it.

Keras 3 has no parameter-server support: its `fit` runs on the coordinator
without a `ClusterCoordinator` and TensorFlow fails at the first batch with a
message about `create_per_worker_dataset`, so `tfdp.compile` refuses the
strategy before anything is built. `tfdp.Trainer` trains it on its
asynchronous path (tests/training/test_parameter_server_training.py trains
there). Building the strategy connects
the process's eager context to the cluster, so the check runs in a child
process with an in-process cluster of 1 worker and 1 ps.
"""

import subprocess
import sys
import textwrap

import pytest

_CHILD = textwrap.dedent("""
    import os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import keras
    import tensorflow as tf
    import tfdp
    from tfdp.distribute import local_cluster

    ports = local_cluster.free_ports(2)
    spec = tf.train.ClusterSpec({"worker": [f"127.0.0.1:{ports[0]}"],
                                 "ps": [f"127.0.0.1:{ports[1]}"]})
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=4)
    servers = [tf.distribute.Server(spec, job_name=job, task_index=0, config=config)
               for job in ("worker", "ps")]
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc"))
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.1)
    for name, call in [
        ("compile", lambda: tfdp.compile(model, optimizer="sgd", loss="mse")),
        ("trainer", lambda: tfdp.Trainer(model, optimizer=optimizer,
                                         loss=keras.losses.MeanSquaredError(),
                                         batch=tfdp.BatchConfig(8, 1), strategy=strategy)),
    ]:
        try:
            call()
        except ValueError as error:
            print(f"{name} REFUSED: {error}", flush=True)
        else:
            print(f"{name} ACCEPTED", flush=True)
    os._exit(0)  # the in-process servers never stop
""")


@pytest.mark.slow
def test_parameter_server_strategy_is_refused_by_compile_and_taken_by_trainer():
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                          timeout=180)
    lines = [line for line in done.stdout.splitlines() if " REFUSED: " in line
             or " ACCEPTED" in line]
    assert len(lines) == 2, done.stdout[-2000:] + done.stderr[-3000:]
    compile_line, trainer_line = lines
    assert "REFUSED" in compile_line, compile_line
    assert ("tfdp.compile trains synchronously and cannot run under "
            "tf.distribute.experimental.ParameterServerStrategy") in compile_line
    assert "Use tfdp.make_strategy()" in compile_line and "balance_batches=True" in compile_line
    assert "asynchronously with tfdp.Trainer" in compile_line
    assert trainer_line == "trainer ACCEPTED", trainer_line
