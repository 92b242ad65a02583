"""The devices a process trains on: logical CPU devices, GPU memory, and what XLA can compile.

This module owns three device facts: splitting the host CPU into logical
devices (`configure_cpu_devices`, so every multi-replica path runs without
GPUs), GPU memory growth (`configure_gpu_memory_growth`), and refusing
`jit_compile` where TensorFlow's XLA cannot run the strategy's devices
(`check_jit_compile_supported`). Which GPUs a process sees is decided before
it starts (`CUDA_VISIBLE_DEVICES`, set per worker by `tfdp-launch`); which
strategy to build over the devices is `tfdp.distribute.strategy`'s.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp import _checks


def configure_cpu_devices(count: int) -> None:
    """Splits the host CPU into `count` logical devices.

    Lets every multi-replica code path run on a machine without GPUs: a
    MirroredStrategy over `count` logical CPUs behaves like one over `count`
    GPUs, with the CPU cores shared between them.

    Must run before TensorFlow initialises its devices (before the first op,
    tensor, model or strategy). When TensorFlow is already initialised with at
    least `count` logical CPUs, this does nothing.

    Args:
        count: number of logical CPU devices, >= 1.

    Raises:
        ValueError: `count` is not a positive integer.
        RuntimeError: TensorFlow already initialised its devices with fewer
            than `count` logical CPUs.
    """
    _checks.check_int("cpu_replicas", count)
    cpu = tf.config.list_physical_devices("CPU")[0]
    configured = tf.config.get_logical_device_configuration(cpu) or []
    if len(configured) >= count:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)]
        )
    except RuntimeError as error:
        available = len(tf.config.list_logical_devices("CPU"))
        if available >= count:
            return
        raise RuntimeError(
            f"cpu_replicas={count} needs {count} logical CPU devices, but "
            f"TensorFlow has already initialised its devices with {available}. "
            f"Call tfdp.make_strategy(cpu_replicas={count}) (or "
            f"tfdp.configure_cpu_devices({count})) at the start of the program, "
            f"before any TensorFlow op runs or any tensor, model or strategy is "
            f"created."
        ) from error


def configure_gpu_memory_growth() -> int:
    """Makes TensorFlow allocate GPU memory as needed instead of all of it at start.

    By default TensorFlow reserves almost all the memory of every GPU it can
    see when it initialises them; with memory growth on (TensorFlow's
    `tf.config.experimental.set_memory_growth`, the same as
    `TF_FORCE_GPU_ALLOW_GROWTH=true`) it starts small and grows, so other
    processes can share the GPU, at the cost of fragmentation. Memory once
    taken is not given back. Applies to every GPU this process sees (see
    `CUDA_VISIBLE_DEVICES`); without GPUs it does nothing.

    Must run before TensorFlow initialises its devices (before the first op,
    tensor, model or strategy).

    Returns:
        The number of GPUs configured (0 without GPUs).

    Raises:
        RuntimeError: TensorFlow already initialised its GPUs without memory
            growth.
    """
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        try:
            tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError as error:
            if tf.config.experimental.get_memory_growth(gpu):
                continue  # already on: nothing to change
            raise RuntimeError(
                "GPU memory growth must be set before TensorFlow initialises its GPUs, "
                "but they are already initialised. Call tfdp.make_strategy(memory_growth="
                "True) (or tfdp.distribute.devices.configure_gpu_memory_growth()) at the "
                "start of the program, before any TensorFlow op runs or any tensor, model "
                "or strategy is created, or set TF_FORCE_GPU_ALLOW_GROWTH=true in the "
                "environment."
            ) from error
    return len(gpus)


def check_jit_compile_supported(strategy: tf.distribute.Strategy) -> None:
    """Raises when XLA cannot compile a train step under `strategy`.

    Two TensorFlow limitations, both on CPU devices:

    - a MirroredStrategy over several CPU devices fails at run time with
      "Trying to access resource ... located in device CPU:1 from device
      CPU:0" (https://www.tensorflow.org/xla/known_issues#tfvariable_on_a_different_device);
      Keras' own `jit_compile=True` fails the same way;
    - a MultiWorkerMirroredStrategy on CPU workers fails at its first step with
      "UnimplementedError: Collectives are not yet implemented for CPU devices
      when compiling with XLA" (TensorFlow 2.21, b/194942685), and the peers
      then fail with "Collective ops is aborted".

    One device, and GPUs under either strategy, are fine.

    Raises:
        ValueError: `strategy` all-reduces between CPU devices.
    """
    mirrored = (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy)
    if not isinstance(strategy, mirrored):
        return  # default, OneDeviceStrategy
    devices = tuple(strategy.extended.worker_devices)
    on_cpu = any("CPU" in d.upper() for d in devices)
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        if on_cpu and strategy.num_replicas_in_sync > 1:
            raise ValueError(
                "jit_compile=True cannot run on a MultiWorkerMirroredStrategy over CPU "
                "workers: XLA has no CPU implementation of the collectives that "
                "all-reduce the gradients (TensorFlow limitation, b/194942685). Use "
                "jit_compile=False here; XLA works on GPU workers and on one device."
            )
        return
    if len(devices) > 1 and on_cpu:
        raise ValueError(
            f"jit_compile=True cannot run on a MirroredStrategy over {len(devices)} CPU "
            f"devices: XLA cannot reach variables on another logical CPU device "
            f"(TensorFlow limitation). Use jit_compile=False here; XLA works on GPUs "
            f"and on one device."
        )
