"""Build the `tf.distribute.Strategy` a training job runs under.

This module owns one decision: given the job's arguments and the devices and
workers it can see, which strategy and which all-reduce to use. The decision
(`plan_strategy`) is a pure function of its inputs, so it is tested with any
device list, GPUs included; building the TensorFlow objects (`make_strategy`)
is a thin step after it. Parsing TF_CONFIG belongs to `tfdp.distribute.cluster`; the
Keras fixes a multi-worker strategy needs belong to `tfdp._upstream`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

import tensorflow as tf
from absl import logging

from tfdp import _checks
from tfdp.distribute import cluster as cluster_lib
from tfdp.distribute import devices
from tfdp.distribute import slurm_env
from tfdp.distribute import startup
from tfdp.distribute import visible_gpus
from tfdp.distribute.strategy_info import strategy_info

KINDS = ("auto", "default", "one_device", "mirrored", "multi_worker", "parameter_server")
CROSS_DEVICE_OPS = ("auto", "nccl", "hierarchical_copy", "reduce_to_one", "collective")
COMMUNICATIONS = ("auto", "nccl", "ring")

#: `bytes_per_pack` when it is not given and the workers have no GPU: 4 MiB.
#: TensorFlow's default (0) concatenates every gradient into one tensor and
#: all-reduces it in one ring pass over gRPC. On 2 CPU workers over loopback,
#: a 10M-parameter MLP's 40 MB of gradients took 67-266 ms that way and
#: 72-134 ms, mostly about 85, in 4 MiB packs (15 calls each), which skip the
#: big concatenation and pipeline the transfers; the suite's all-reduce case
#: (`python -m tfdp.bench`, case 5) measured 122 and 137 ms against 80 and 74.
#: Gradient lists under 4 MiB stay one pack either way. GPU workers keep
#: TensorFlow's default: NCCL's trade-offs were not measured here.
CPU_BYTES_PER_PACK = 4 << 20


@dataclasses.dataclass(frozen=True)
class StrategyPlan:
    """What `make_strategy` will build, decided before TensorFlow is touched.

    Attributes:
        kind: one of `"default"`, `"one_device"`, `"mirrored"`, `"multi_worker"`,
            `"parameter_server"`.
        devices: device strings for `one_device` / `mirrored`, or `None` to let
            TensorFlow use every local GPU (or the CPU).
        cross_device_ops: for `mirrored`: `"nccl"`, `"hierarchical_copy"`,
            `"reduce_to_one"` or `"collective"` (TensorFlow's default: ring
            collectives on CPUs, NCCL collectives on GPUs).
        num_packs: pack count for `nccl` / `hierarchical_copy`.
        communication: for `multi_worker`: `"auto"`, `"nccl"` or `"ring"`.
        bytes_per_pack: for `multi_worker`: gradient packing, in bytes (0: one
            pack per gradient dtype group, TensorFlow's default). Resolved
            from `None` by `plan_for` (see `CPU_BYTES_PER_PACK`).
        timeout_seconds: for `multi_worker`: collective timeout in seconds, or
            `None` to wait forever.
        startup_timeout: for `multi_worker`: seconds every worker waits for
            all the others to start, or `None` for TensorFlow's own wait (an
            hour).
        warnings: fallbacks taken, each logged once when the strategy is built.
        num_replicas: replicas in sync the strategy will have, over all
            workers (known before it is built, to validate batch sizes before
            any collective starts).
        memory_growth: whether GPU memory grows as needed instead of being
            reserved at start (`tfdp.distribute.devices.configure_gpu_memory_growth`).
    """

    kind: str
    devices: tuple[str, ...] | None = None
    cross_device_ops: str | None = None
    num_packs: int = 1
    communication: str | None = None
    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    startup_timeout: float | None = None
    warnings: tuple[str, ...] = ()
    num_replicas: int = 1
    memory_growth: bool = False


def plan_strategy(
    kind: str = "auto",
    *,
    num_gpus: int,
    num_workers: int = 1,
    cpu_replicas: int | None = None,
    cross_device_ops: str = "auto",
    num_packs: int = 1,
    communication: str = "auto",
    bytes_per_pack: int | None = None,
    timeout_seconds: float | None = None,
    startup_timeout: float | None = None,
    memory_growth: bool = False,
) -> StrategyPlan:
    """Decides which strategy to build, from arguments and visible hardware.

    A pure function: it reads no environment and touches no device, so every
    branch (several GPUs included) is testable on a CPU-only machine.

    Args:
        kind: see `make_strategy`.
        num_gpus: physical GPUs visible on this host.
        num_workers: workers in the cluster (TF_CONFIG or Slurm); 1 when there
            is no cluster.
        cpu_replicas, cross_device_ops, num_packs, communication,
            bytes_per_pack, timeout_seconds: see `make_strategy`.
        startup_timeout: seconds, or `None` (TensorFlow's own wait); unlike
            `make_strategy`, no environment variable is read here.
        memory_growth: see `make_strategy`.

    Returns:
        A `StrategyPlan`.

    Raises:
        ValueError: an argument is out of range, or the combination cannot
            work (for example `kind="one_device"` with `cpu_replicas=2`).
    """
    _checks.check_choice("kind", kind, KINDS)
    _checks.check_choice("cross_device_ops", cross_device_ops, CROSS_DEVICE_OPS)
    _checks.check_choice("communication", communication, COMMUNICATIONS)
    _checks.check_int("cpu_replicas", cpu_replicas, allow_none=True)
    _checks.check_int("num_packs", num_packs)
    _checks.check_int("bytes_per_pack", bytes_per_pack, minimum=0, allow_none=True)
    _checks.check_int("num_gpus", num_gpus, minimum=0)
    _checks.check_int("num_workers", num_workers)
    if timeout_seconds is not None and (
        isinstance(timeout_seconds, bool)
        or not isinstance(timeout_seconds, (int, float))
        or timeout_seconds <= 0
    ):
        raise ValueError(
            "`timeout_seconds` must be a positive number of seconds or None "
            f"(wait forever). Received: timeout_seconds={timeout_seconds!r}"
        )
    if startup_timeout is not None:
        startup.check_seconds("startup_timeout", startup_timeout)
    if not isinstance(memory_growth, bool):
        raise TypeError(
            f"`memory_growth` must be True or False. Received: memory_growth={memory_growth!r}")
    plan = _plan_kind(kind, num_gpus=num_gpus, num_workers=num_workers,
                      cpu_replicas=cpu_replicas, cross_device_ops=cross_device_ops,
                      num_packs=num_packs, communication=communication,
                      bytes_per_pack=bytes_per_pack, timeout_seconds=timeout_seconds,
                      startup_timeout=startup_timeout)
    return dataclasses.replace(plan, memory_growth=memory_growth)


def _plan_kind(kind, *, num_gpus, num_workers, cpu_replicas, cross_device_ops, num_packs,
               communication, bytes_per_pack, timeout_seconds, startup_timeout) -> StrategyPlan:
    """`plan_strategy` after its arguments are checked: the kind and its settings."""
    if cpu_replicas is not None and cpu_replicas > 1 and num_gpus > 0:
        raise ValueError(
            f"`cpu_replicas` splits the CPU into logical devices for testing "
            f"without GPUs, but this host has {num_gpus} GPU(s). Remove "
            f"cpu_replicas={cpu_replicas} to train on the GPUs."
        )

    if kind == "parameter_server":
        return _plan_parameter_server(cpu_replicas=cpu_replicas, num_gpus=num_gpus,
                                      cross_device_ops=cross_device_ops,
                                      communication=communication, bytes_per_pack=bytes_per_pack,
                                      timeout_seconds=timeout_seconds, num_packs=num_packs)

    if kind == "auto":
        if num_workers > 1:
            kind = "multi_worker"
        elif num_gpus > 1 or (cpu_replicas or 1) > 1:
            kind = "mirrored"
        else:
            kind = "default"

    if num_workers > 1 and kind != "multi_worker":
        raise ValueError(
            f"The cluster configuration (TF_CONFIG or Slurm) describes "
            f"{num_workers} workers, but kind={kind!r} trains on one worker "
            f"only. Use kind='multi_worker' (or 'auto'), or unset TF_CONFIG "
            f"to train on this host alone."
        )

    if kind == "default":
        if (cpu_replicas or 1) > 1:
            raise ValueError(
                f"kind='default' runs one replica, so cpu_replicas="
                f"{cpu_replicas} would be ignored. Use kind='mirrored' (or "
                f"'auto') for several replicas."
            )
        return StrategyPlan(kind="default")

    if kind == "one_device":
        if (cpu_replicas or 1) > 1:
            raise ValueError(
                f"kind='one_device' runs one replica, so cpu_replicas="
                f"{cpu_replicas} would be ignored. Use kind='mirrored' (or "
                f"'auto') for several replicas."
            )
        return StrategyPlan(
            kind="one_device", devices=("/gpu:0" if num_gpus else "/cpu:0",)
        )

    if kind == "multi_worker":
        if (cpu_replicas or 1) > 1:
            raise ValueError(
                f"MultiWorkerMirroredStrategy runs one replica per worker on "
                f"CPUs, so cpu_replicas={cpu_replicas} cannot apply. Start more "
                f"workers instead (tfdp-launch --nproc_per_node N), or use "
                f"kind='mirrored' for several replicas in one process."
            )
        warnings = []
        if communication == "nccl" and num_gpus == 0:
            warnings.append(
                "communication='nccl' needs GPUs and this worker has none; "
                "falling back to 'ring' collectives."
            )
            communication = "ring"
        if bytes_per_pack is None:
            bytes_per_pack = CPU_BYTES_PER_PACK if num_gpus == 0 else 0
        return StrategyPlan(
            kind="multi_worker",
            communication=communication,
            bytes_per_pack=bytes_per_pack,
            timeout_seconds=timeout_seconds,
            startup_timeout=startup_timeout,
            warnings=tuple(warnings),
            num_replicas=num_workers * max(num_gpus, 1),
        )

    # kind == "mirrored"
    warnings = []
    if num_gpus:
        devices = None  # every local GPU
        chosen = cross_device_ops
        if chosen == "auto":
            chosen = "nccl" if num_gpus > 1 else "reduce_to_one"
    else:
        devices = tuple(f"/cpu:{i}" for i in range(cpu_replicas or 1))
        chosen = cross_device_ops
        if chosen in ("nccl", "hierarchical_copy"):
            warnings.append(
                f"cross_device_ops={chosen!r} needs GPUs and this host has none; "
                f"falling back to ring collectives across "
                f"{len(devices)} CPU device(s)."
            )
            chosen = "collective"
        elif chosen == "auto":
            chosen = "collective"
    return StrategyPlan(
        kind="mirrored",
        devices=devices,
        cross_device_ops=chosen,
        num_packs=num_packs,
        warnings=tuple(warnings),
        num_replicas=len(devices) if devices is not None else num_gpus,
    )


def _plan_parameter_server(*, cpu_replicas, num_gpus, **all_reduce) -> StrategyPlan:
    """The plan of `kind="parameter_server"`: nothing to choose, arguments that do not apply refused."""
    if (cpu_replicas or 1) > 1:
        raise ValueError(
            f"kind='parameter_server' runs one replica per worker task, so "
            f"cpu_replicas={cpu_replicas} cannot apply. Start more worker tasks instead "
            "(tfdp-launch --num_ps N --nproc_per_node M).")
    defaults = dict(cross_device_ops="auto", communication="auto", bytes_per_pack=None,
                    timeout_seconds=None, num_packs=1)
    changed = {k: v for k, v in all_reduce.items() if v != defaults[k]}
    if changed:
        raise ValueError(
            "kind='parameter_server' has no all-reduce: each worker applies its gradients "
            "on the ps tasks, so the all-reduce arguments do not apply. Remove "
            f"{', '.join(f'{k}={v!r}' for k, v in changed.items())}.")
    if num_gpus:
        warning = ("kind='parameter_server' was tested on CPU workers only; GPU workers "
                   "run their steps on their first GPU, as TensorFlow places them.")
        return StrategyPlan(kind="parameter_server", warnings=(warning,))
    return StrategyPlan(kind="parameter_server")


def _cross_device_ops(plan: StrategyPlan):
    if plan.cross_device_ops == "nccl":
        return tf.distribute.NcclAllReduce(num_packs=plan.num_packs)
    if plan.cross_device_ops == "hierarchical_copy":
        return tf.distribute.HierarchicalCopyAllReduce(num_packs=plan.num_packs)
    if plan.cross_device_ops == "reduce_to_one":
        return tf.distribute.ReductionToOneDevice()
    return None  # "collective": MirroredStrategy's own default


def _communication_options(plan: StrategyPlan):
    implementation = {
        "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
        "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
        "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    }[plan.communication]
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=plan.bytes_per_pack,
        timeout_seconds=plan.timeout_seconds,
        implementation=implementation,
    )


def _slurm_cluster(environ: Mapping[str, str]):
    """This Slurm job step's `ClusterConfig` when it has several tasks, else None."""
    config = slurm_env.cluster_config(environ)
    return config if config is not None and config.num_workers > 1 else None


def _cluster_resolver(environ: Mapping[str, str]):
    """The resolver for this job's cluster: TF_CONFIG first, then a Slurm job step.

    For Slurm, `tfdp.distribute.slurm_env` reads the step's environment (TensorFlow's
    `SlurmClusterResolver` fails on CPU-only nodes and misorders nodes such as
    `node[9-10]`; see that module) and the cluster reaches TensorFlow as a
    `SimpleClusterResolver`. MultiWorkerMirroredStrategy takes a non-TF_CONFIG
    resolver's GPU count from `num_accelerators()`, so it is this task's
    visible GPUs (Slurm's `--gpus-per-task` binding is already applied).
    """
    if cluster_lib.parse_tf_config(environ=environ) is not None:
        return tf.distribute.cluster_resolver.TFConfigClusterResolver()
    config = _slurm_cluster(environ)
    if config is not None:
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({job: list(tasks) for job, tasks in config.cluster.items()}),
            task_type=config.task_type,
            task_id=config.task_index,
            num_accelerators={"GPU": len(tf.config.list_physical_devices("GPU"))},
            rpc_layer="grpc",
        )
    return None


def _cluster_config(environ: Mapping[str, str]) -> cluster_lib.ClusterConfig | None:
    """This job's cluster: TF_CONFIG, else a Slurm job step of several tasks, else None."""
    config = cluster_lib.parse_tf_config(environ=environ)
    return _slurm_cluster(environ) if config is None else config


def _num_workers(environ: Mapping[str, str]) -> int:
    """Workers in this job: from TF_CONFIG, else the Slurm job step, else 1."""
    config = _cluster_config(environ)
    return 1 if config is None else config.num_workers


def _build_multi_worker(
    plan: StrategyPlan, config: cluster_lib.ClusterConfig | None
) -> tf.distribute.Strategy:
    """MultiWorkerMirroredStrategy that fails plainly when the workers cannot meet.

    While the constructor waits for the other workers: a start-up deadline
    (`plan.startup_timeout`, through TensorFlow's coordination service), and
    TensorFlow's errors become `tfdp.distribute.startup.StartupError`s naming the
    workers that did not answer (see `tfdp.distribute.startup`).
    """
    from tfdp._upstream import coordination

    if config is not None and plan.startup_timeout is not None:
        coordination.configure_startup_deadline(
            config.cluster, config.task_type, plan.startup_timeout)
    with startup.explain_startup_failure(config, plan.startup_timeout):
        return tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=_cluster_resolver(os.environ),
            communication_options=_communication_options(plan),
        )


def build_strategy(plan: StrategyPlan) -> tf.distribute.Strategy:
    """Builds the TensorFlow strategy `plan` describes; logs its fallbacks."""
    for warning in plan.warnings:
        logging.warning("tfdp.make_strategy: %s", warning)
    if plan.memory_growth:
        devices.configure_gpu_memory_growth()  # before any strategy initialises the GPUs
    if plan.kind == "default":
        return tf.distribute.get_strategy()
    if plan.kind == "one_device":
        return tf.distribute.OneDeviceStrategy(plan.devices[0])
    if plan.kind == "parameter_server":
        from tfdp.distribute import parameter_server

        config = parameter_server.cluster_from_environment()
        if config.task_type in parameter_server.SERVER_TASK_TYPES:
            parameter_server.serve(config)  # never returns
        return parameter_server.build_strategy(config)
    if plan.kind == "multi_worker":
        config = _cluster_config(os.environ)
        # In a second, before the Keras fixes below are imported.
        startup.check_own_port(config)
    # Imported here: only strategies that all-reduce with collectives need
    # the fixes, and only they pay for importing Keras internals.
    from tfdp._upstream import keras_multi_worker

    if plan.kind == "mirrored":
        from tfdp._upstream import strategy_internals

        # MirroredStrategy all-reduces with collectives on CPUs, which hit the
        # tf.cond capture bug under steps_per_execution > 1 too.
        keras_multi_worker.apply()
        device_list = None if plan.devices is None else list(plan.devices)
        strategy_internals.reserve_collective_keys()
        return tf.distribute.MirroredStrategy(
            devices=device_list, cross_device_ops=_cross_device_ops(plan)
        )
    keras_multi_worker.apply()
    return _build_multi_worker(plan, config)


def plan_from_environment(kind: str = "auto", **kwargs) -> StrategyPlan:
    """`plan_strategy` for this host's GPUs and this job's cluster.

    Reads the physical GPU list (without initialising TensorFlow's devices),
    TF_CONFIG or the Slurm environment (validating TF_CONFIG), and
    `TFDP_STARTUP_TIMEOUT` when `startup_timeout` is not given. Lets a
    program check batch sizes against `plan.num_replicas` before
    `make_strategy` starts any collective.

    Args:
        kind: see `make_strategy`.
        **kwargs: `make_strategy`'s other arguments.

    Returns:
        A `StrategyPlan`.

    Raises:
        ValueError: as `plan_strategy`, or `TFDP_STARTUP_TIMEOUT` is not a
            positive number of seconds.
    """
    kwargs["startup_timeout"] = startup.resolve_startup_timeout(kwargs.get("startup_timeout"))
    num_gpus = len(tf.config.list_physical_devices("GPU"))
    plan = plan_strategy(
        kind,
        num_gpus=num_gpus,
        # A parameter-server cluster is read (and checked) when it is built.
        num_workers=1 if kind == "parameter_server" else _num_workers(os.environ),
        **kwargs,
    )
    assigned = visible_gpus.visible_gpus()
    if assigned and num_gpus < len(assigned):
        # E.g. a CPU-only TensorFlow build, or a UUID that names no GPU: the worker
        # would otherwise train on fewer devices (or the CPU) without a word.
        plan = dataclasses.replace(plan, warnings=plan.warnings + (
            f"CUDA_VISIBLE_DEVICES names {len(assigned)} GPU(s) ({','.join(assigned)}) but "
            f"TensorFlow sees {num_gpus}, so this process trains on "
            f"{'the CPU' if num_gpus == 0 else f'{num_gpus} GPU(s)'}. Check that this "
            "TensorFlow is built with CUDA (`pip install tensorflow[and-cuda]`), that the "
            "driver works (`nvidia-smi`), and that every entry names a GPU of this host.",))
    return plan


def make_strategy(
    kind: str = "auto",
    *,
    cpu_replicas: int | None = None,
    cross_device_ops: str = "auto",
    communication: str = "auto",
    bytes_per_pack: int | None = None,
    timeout_seconds: float | None = None,
    num_packs: int = 1,
    startup_timeout: float | None = None,
    memory_growth: bool = False,
) -> tf.distribute.Strategy:
    """Builds the distribution strategy for this host and cluster.

    Call it once, at the start of the program, before any other TensorFlow
    work (MultiWorkerMirroredStrategy and `cpu_replicas` both configure the
    TensorFlow runtime). Arguments are validated before anything is built, so
    a bad value fails in a second rather than in a hung cluster.

    Args:
        kind: `"auto"` (default) picks MultiWorkerMirroredStrategy when
            TF_CONFIG or a Slurm job describes more than one worker,
            MirroredStrategy when there is more than one local GPU or
            `cpu_replicas > 1`, else the default strategy. Or one of
            `"default"`, `"one_device"`, `"mirrored"`, `"multi_worker"`, or
            `"parameter_server"`: asynchronous training with
            `tf.distribute.experimental.ParameterServerStrategy`, from a
            TF_CONFIG with one `"chief"`, `"worker"` tasks and `"ps"` tasks.
            On the chief it returns the strategy (train it with
            `tfdp.Trainer`; Keras' `fit` cannot run it); on a worker or ps
            task it runs that task's server and never returns
            (`tfdp.distribute.parameter_server.serve`), so one program
            serves every task. Takes none of the all-reduce arguments.
        cpu_replicas: split the CPU into this many logical devices and
            mirror over them (for running multi-replica code without GPUs).
            Defaults to `None`: one CPU device.
        cross_device_ops: MirroredStrategy's all-reduce: `"auto"` (NCCL on
            several GPUs, ring collectives on CPUs), `"nccl"`,
            `"hierarchical_copy"`, `"reduce_to_one"` or `"collective"`.
            NCCL and hierarchical copy fall back to ring collectives, with one
            logged warning, where there are no GPUs.
        communication: MultiWorkerMirroredStrategy's collectives: `"auto"`,
            `"nccl"` (falls back to `"ring"` with a warning without GPUs) or
            `"ring"`.
        bytes_per_pack: MultiWorkerMirroredStrategy: all-reduce gradients in
            packs of at least this many bytes; 0 is TensorFlow's default (one
            pack). Defaults to `None`: 4 MiB on workers without GPUs (faster
            and steadier over gRPC; see `CPU_BYTES_PER_PACK`), 0 on GPU
            workers.
        timeout_seconds: MultiWorkerMirroredStrategy: fail a collective that
            takes longer than this many seconds (a dead or stuck peer) instead
            of waiting forever. Defaults to `None`.
        num_packs: MirroredStrategy with `"nccl"` or `"hierarchical_copy"`:
            number of packs gradients are concatenated into. Defaults to 1.
        startup_timeout: MultiWorkerMirroredStrategy: seconds every worker
            waits for all the others to start before failing with the
            addresses that did not answer. Defaults to `None`: the
            `TFDP_STARTUP_TIMEOUT` environment variable, else 120 s.
        memory_growth: let TensorFlow allocate GPU memory as needed instead
            of reserving almost all of every visible GPU's memory at start
            (`tf.config.experimental.set_memory_growth` on each GPU). Defaults
            to False, as in TensorFlow. No effect without GPUs.

    The GPUs are the ones this process can see: under `tfdp-launch
    --nproc_per_node N` each worker sees only its own share of the node's
    GPUs (`CUDA_VISIBLE_DEVICES`), and mirrors over those.

    Returns:
        A `tf.distribute.Strategy`. On the chief, its `strategy_info` is
        logged once.

    Raises:
        ValueError: an argument is invalid or contradicts the cluster, or
            TF_CONFIG is malformed (the message names the field).
        RuntimeError: `cpu_replicas` or `memory_growth` was asked for after
            TensorFlow had already initialised its devices.
        tfdp.distribute.startup.StartupError: MultiWorkerMirroredStrategy: this
            worker's port is in use, or other workers did not answer within
            `startup_timeout` (the message names their addresses).

    Example:

    >>> strategy = tfdp.make_strategy(cpu_replicas=2)  # doctest: +SKIP
    >>> with strategy.scope():                          # doctest: +SKIP
    ...     model = build_model()
    ...     model.compile(optimizer="sgd", loss="mse")
    """
    plan = plan_from_environment(
        kind,
        cpu_replicas=cpu_replicas,
        cross_device_ops=cross_device_ops,
        num_packs=num_packs,
        communication=communication,
        bytes_per_pack=bytes_per_pack,
        timeout_seconds=timeout_seconds,
        startup_timeout=startup_timeout,
        memory_growth=memory_growth,
    )
    if plan.kind == "mirrored" and plan.devices is not None:
        devices.configure_cpu_devices(len(plan.devices))
    strategy = build_strategy(plan)
    info = strategy_info(strategy)
    if info.is_chief:
        logging.info("tfdp strategy: %s", info.describe())
    return strategy


