"""What a strategy is, in one line: `StrategyInfo` and `strategy_info`.

This module owns the summary of a built `tf.distribute.Strategy` that the
chief logs at start and that training code reads (workers, this worker's
rank, replicas in sync, local devices, the all-reduce). It builds nothing:
choosing and building the strategy is `tfdp.distribute.strategy`'s.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tfdp.distribute import visible_gpus as visible_gpus_lib


@dataclasses.dataclass(frozen=True)
class StrategyInfo:
    """A summary of a strategy, as the chief logs it at start.

    Attributes:
        strategy: the strategy's class name, e.g. `"MirroredStrategy"`.
        num_workers: worker processes taking part in training.
        worker_index: this process's rank among them (0 is the chief).
        is_chief: whether this process logs, and owns output files.
        num_replicas_in_sync: replicas across all workers; each gets
            `global_batch / num_replicas_in_sync` examples per step.
        devices: this worker's compute devices, one per local replica.
        all_reduce: the gradient all-reduce in use (see
            `tfdp._upstream.strategy_internals.all_reduce_name`).
        visible_gpus: the physical GPUs this process may use, as
            `CUDA_VISIBLE_DEVICES` names them (indices or UUIDs; its local
            `GPU:0` is the first), or None when the variable is unset (every
            GPU of the host). Defaults to None.
    """

    strategy: str
    num_workers: int
    worker_index: int
    is_chief: bool
    num_replicas_in_sync: int
    devices: tuple[str, ...]
    all_reduce: str
    visible_gpus: tuple[str, ...] | None = None

    def describe(self) -> str:
        """One line for the start-up log."""
        text = (
            f"{self.strategy}: {self.num_workers} worker(s), this is worker "
            f"{self.worker_index}{' (chief)' if self.is_chief else ''}; "
            f"{self.num_replicas_in_sync} replica(s) in sync; local devices "
            f"{', '.join(self.devices)}; all-reduce {self.all_reduce}"
        )
        if self.visible_gpus is not None:
            text += (f"; visible GPUs {','.join(self.visible_gpus) or 'none'} "
                     f"({visible_gpus_lib.VISIBLE_DEVICES_VAR})")
        return text



def check_synchronous(strategy: tf.distribute.Strategy, caller: str) -> None:
    """Raises when `strategy` is TensorFlow's asynchronous `ParameterServerStrategy`.

    Keras 3 has no parameter-server support at all: its `fit` runs the train
    function on the coordinator without a `ClusterCoordinator`, and
    TensorFlow fails at the first batch with "To use this dataset, you need
    to pass this dataset to ClusterCoordinator.create_per_worker_dataset".
    `fit` and `tfdp.compile` are synchronous; this says so before anything
    is built. `tfdp.Trainer` trains under that strategy on its asynchronous
    path (`tfdp.training.parameter_server_loop`).

    Args:
        strategy: the strategy `caller` would train under.
        caller: what refuses, e.g. `"tfdp.compile"`.

    Raises:
        ValueError: naming the strategy and what to use instead.
    """
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        raise ValueError(
            f"{caller} trains synchronously and cannot run under "
            "tf.distribute.experimental.ParameterServerStrategy: Keras 3's fit has no "
            "parameter-server support (it would run on the coordinator without a "
            "ClusterCoordinator, and TensorFlow fails at the first batch). Train it "
            "asynchronously with tfdp.Trainer (its steps scheduled on the workers through a "
            "ClusterCoordinator), or train synchronously: Use tfdp.make_strategy() "
            "(MirroredStrategy on one host, MultiWorkerMirroredStrategy across workers); for "
            "workers of different speeds, balance_batches=True.")


def _parameter_server_info(strategy) -> StrategyInfo:
    """`ParameterServerStrategy` as its chief (the coordinator, the only task that runs Python) sees it.

    Its workers are the `"worker"` tasks; the chief holds no replica and
    computes no step, so it is not one of them (`worker_index` 0 stands for
    "the task that logs"). Each worker is one replica that steps on its own.
    """
    from tfdp._upstream import strategy_internals

    spec = strategy_internals.parameter_server_cluster(strategy)
    num_ps = spec.num_tasks("ps")
    return StrategyInfo(
        strategy="ParameterServerStrategy",
        num_workers=spec.num_tasks("worker"),
        worker_index=0,
        is_chief=True,
        num_replicas_in_sync=strategy.num_replicas_in_sync,
        devices=tuple(f"/job:worker/task:{i}" for i in range(spec.num_tasks("worker"))),
        all_reduce=f"none (asynchronous updates on {num_ps} ps task(s))",
        visible_gpus=visible_gpus_lib.visible_gpus(),
    )


def _public_name(strategy: tf.distribute.Strategy) -> str:
    """The name users know the strategy by (`tf.distribute.<name>`)."""
    for name in ("MultiWorkerMirroredStrategy", "MirroredStrategy", "OneDeviceStrategy"):
        if isinstance(strategy, getattr(tf.distribute, name)):
            return name
    if strategy is tf.distribute.get_strategy() and not tf.distribute.has_strategy():
        return "default"
    return type(strategy).__name__


def _local_devices(strategy: tf.distribute.Strategy) -> tuple[str, ...]:
    try:
        return tuple(strategy.extended.worker_devices)
    except RuntimeError:
        # The default strategy has no device list: it places ops where
        # TensorFlow would without a strategy, the first GPU or the CPU.
        gpus = tf.config.list_logical_devices("GPU")
        return ((gpus or tf.config.list_logical_devices("CPU"))[0].name,)


def strategy_info(strategy: tf.distribute.Strategy | None = None) -> StrategyInfo:
    """Summarises `strategy` (default: the current one) for logs and records.

    Args:
        strategy: a `tf.distribute.Strategy`; defaults to
            `tf.distribute.get_strategy()`.

    Returns:
        A frozen `StrategyInfo`.
    """
    from tfdp._upstream import strategy_internals

    strategy = strategy or tf.distribute.get_strategy()
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        return _parameter_server_info(strategy)
    resolver = getattr(strategy, "cluster_resolver", None)
    num_workers, worker_index, is_chief = 1, 0, True
    if resolver is not None and resolver.cluster_spec().jobs:
        spec = resolver.cluster_spec()
        num_chiefs = spec.num_tasks("chief") if "chief" in spec.jobs else 0
        num_workers = num_chiefs + (
            spec.num_tasks("worker") if "worker" in spec.jobs else 0
        )
        task_type, task_id = resolver.task_type, resolver.task_id or 0
        worker_index = task_id + (num_chiefs if task_type == "worker" else 0)
        is_chief = bool(strategy.extended.should_checkpoint)
    return StrategyInfo(
        strategy=_public_name(strategy),
        num_workers=num_workers,
        worker_index=worker_index,
        is_chief=is_chief,
        num_replicas_in_sync=strategy.num_replicas_in_sync,
        devices=_local_devices(strategy),
        all_reduce=strategy_internals.all_reduce_name(strategy),
        visible_gpus=visible_gpus_lib.visible_gpus(),
    )
