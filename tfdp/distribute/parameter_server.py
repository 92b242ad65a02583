"""TensorFlow's asynchronous `ParameterServerStrategy`: the cluster, its servers, its coordinator.

This module owns the runtime side of parameter-server training: which
TF_CONFIG clusters it accepts (`check_cluster`: one chief, workers, ps tasks),
the server every worker and ps task runs until it is killed (`serve`), the
strategy the chief builds (`build_strategy`) and its
`tf.distribute.coordinator.ClusterCoordinator` (`coordinator_of`).
`tfdp.make_strategy(kind="parameter_server")` is the public way in. The
training loop the chief drives is `tfdp.training.parameter_server_loop`'s.

In this strategy the chief is the *coordinator*: it holds no replica, it
creates the variables (placed on the ps tasks, round-robin), and it
schedules step functions (`ClusterCoordinator.schedule`) that any free
worker runs; each worker reads the variables from the ps tasks, computes
its gradients and applies them there, without waiting for the others. A
worker that dies has its step put back in the queue for another worker, and
is taken back when it listens again on its address (TensorFlow's
`cluster_coordinator.WorkerPreemptionHandler`). A ps task that dies ends the
job: restart it and resume from the last checkpoint.
"""

from __future__ import annotations

import os
from typing import Mapping, NoReturn

import tensorflow as tf
from absl import logging

from tfdp import _checks
from tfdp.distribute import cluster as cluster_lib

#: Tasks that run `serve` instead of training code.
SERVER_TASK_TYPES = ("worker", "ps")


def check_cluster(config: cluster_lib.ClusterConfig | None) -> cluster_lib.ClusterConfig:
    """Returns `config` if it describes a parameter-server cluster, else raises.

    Args:
        config: this task's cluster (from TF_CONFIG), or None when TF_CONFIG
            is unset.

    Returns:
        `config`.

    Raises:
        ValueError: TF_CONFIG is unset, or the cluster lacks its one chief,
            a worker or a ps task, or this task is an evaluator.
    """
    example = ('{"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"], '
               '"ps": ["h3:2222"]}, "task": {"type": "chief", "index": 0}}')
    if config is None:
        raise ValueError(
            "kind='parameter_server' needs a cluster: set TF_CONFIG on every task with a "
            f"chief, workers and ps tasks, e.g. TF_CONFIG='{example}' "
            "(tfdp-launch --num_ps N writes it). Received: TF_CONFIG unset.")
    cluster = dict(config.cluster)
    for job, rule in (("chief", "the coordinator, which runs the training program"),
                      ("worker", "the tasks that compute the steps"),
                      ("ps", "the tasks that hold the variables")):
        if job not in cluster:
            raise ValueError(
                f'kind=\'parameter_server\' needs a "{job}" job in TF_CONFIG["cluster"] '
                f"({rule}). Add one, e.g. TF_CONFIG='{example}'. "
                f'Received: TF_CONFIG["cluster"]={_checks.echo(cluster)}')
    if config.task_type == "evaluator":
        raise ValueError(
            "kind='parameter_server' does not run a side-car evaluator task: the chief "
            "evaluates (tfdp.Trainer.evaluate). Remove the evaluator task. "
            f"Received: task type {config.task_type!r}")
    return config


def cluster_from_environment(environ: Mapping[str, str] | None = None) -> cluster_lib.ClusterConfig:
    """This task's parameter-server cluster, read from TF_CONFIG and checked.

    Raises:
        ValueError: as `check_cluster`, or TF_CONFIG is malformed.
    """
    environ = os.environ if environ is None else environ
    return check_cluster(cluster_lib.parse_tf_config(environ=environ, parameter_server=True))


def server_config(config: cluster_lib.ClusterConfig) -> tf.compat.v1.ConfigProto:
    """The session config every task of the cluster starts its server with.

    Each worker's step reads and updates variables on the ps tasks while the
    others do the same; with fewer inter-op threads than workers + 1, a ps
    task can run out of threads and the first scheduled steps deadlock
    (seen with 2 workers on this 2-core machine). So at least workers + 1.
    """
    num_workers = len(config.cluster["worker"])
    threads = max(num_workers + 1, os.cpu_count() or 1)
    return tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads)


def _cluster_spec(config: cluster_lib.ClusterConfig) -> tf.train.ClusterSpec:
    return tf.train.ClusterSpec({job: list(addresses) for job, addresses in config.cluster.items()
                                 if job != "evaluator"})


def serve(config: cluster_lib.ClusterConfig | None = None) -> NoReturn:
    """Runs this worker or ps task's server until the process is killed.

    The entry point of every task but the chief: start it on each worker and
    ps address of TF_CONFIG (`tfdp-launch --num_ps N` does), or let
    `tfdp.make_strategy(kind="parameter_server")` call it on those tasks. It
    never returns.

    Args:
        config: the cluster and this task; defaults to TF_CONFIG's.

    Raises:
        ValueError: the cluster is not a parameter-server cluster, or this
            task is the chief (which builds the strategy instead).
    """
    config = check_cluster(config) if config is not None else cluster_from_environment()
    if config.task_type not in SERVER_TASK_TYPES:
        raise ValueError(
            f"tfdp.distribute.parameter_server.serve runs a worker or ps task's server; "
            f"this task is the {config.task_type!r}, which runs the training program and "
            "builds the strategy with tfdp.make_strategy(kind='parameter_server'). "
            f"Received: task type {config.task_type!r}")
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")  # TensorFlow's PS tutorial
    server = tf.distribute.Server(
        _cluster_spec(config), job_name=config.task_type, task_index=config.task_index,
        protocol=config.rpc_layer or "grpc", config=server_config(config), start=True)
    logging.info("tfdp parameter server: %s task %d serving at %s", config.task_type,
                 config.task_index, config.address)
    server.join()
    raise SystemExit(0)  # join() returns only if the server is stopped


def build_strategy(config: cluster_lib.ClusterConfig) -> tf.distribute.Strategy:
    """The chief's `ParameterServerStrategy` over `config`'s cluster.

    Variables are not partitioned: each lives whole on one ps task, the ps
    tasks taking them in turn.
    """
    if config.task_type != "chief":
        raise ValueError(
            f"Only the chief builds the ParameterServerStrategy; a {config.task_type!r} "
            "task serves (tfdp.distribute.parameter_server.serve).")
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        _cluster_spec(config), task_type="chief", task_id=0,
        rpc_layer=config.rpc_layer or "grpc")
    # The coordinator's own server gets the same thread floor as the others
    # (only possible before TensorFlow's runtime starts).
    try:
        tf.config.threading.set_inter_op_parallelism_threads(
            server_config(config).inter_op_parallelism_threads)
    except RuntimeError:
        logging.warning("tfdp parameter server: TensorFlow had already started, so the "
                        "chief keeps its inter-op thread count; call make_strategy first.")
    return tf.distribute.experimental.ParameterServerStrategy(resolver)


def is_parameter_server(strategy: tf.distribute.Strategy) -> bool:
    """Whether `strategy` is TensorFlow's `ParameterServerStrategy`."""
    return isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)


def num_workers(strategy: tf.distribute.Strategy) -> int:
    """Worker tasks (those that run steps) of a `ParameterServerStrategy`."""
    from tfdp._upstream import strategy_internals

    return strategy_internals.parameter_server_cluster(strategy).num_tasks("worker")


def coordinator_of(strategy: tf.distribute.Strategy):
    """The strategy's `tf.distribute.coordinator.ClusterCoordinator` (one per strategy)."""
    if not is_parameter_server(strategy):
        raise ValueError(
            "A ClusterCoordinator drives a ParameterServerStrategy only. "
            f"Received: strategy={type(strategy).__name__}")
    return tf.distribute.coordinator.ClusterCoordinator(strategy)
