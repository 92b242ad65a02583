"""Keeping a multi-replica step from writing into the user's NumPy arrays.

Upstream (TensorFlow 2.21, seen here 2026-11-26; no upstream issue found):
a tensor that TensorFlow makes from a NumPy array can share the array's
memory (no copy when the array is 64-byte aligned). Batches from Python
(`keras.utils.PyDataset`, a generator, `tf.data.Dataset.from_generator`)
arrive that way: `fit`/`evaluate` under a `MirroredStrategy` or
`MultiWorkerMirroredStrategy` with 2 or more replicas split each such batch
into per-replica slices that still point into the array, and the runtime
lets an elementwise op reuse a slice's memory for its output (buffer
forwarding) when nothing else reads the slice, although that memory is the
array's. So the step writes its intermediate results into the caller's
array: `(y_pred - y)**2` into the labels under `mse`, `Rescaling` into the
images. Whole batches (one replica) were never overwritten in these tests.

What it costs a user (stock Keras `model.compile` + `model.fit` as much as
tfdp's steps before this module): labels or inputs silently changed after
`evaluate`, and from the second epoch of `fit` on, training on the changed
arrays. `tests/_upstream/test_numpy_aliased_inputs.py` reproduces it with
TensorFlow alone (a `from_generator` dataset, a `MirroredStrategy` of two
CPU devices, `t * 2.0` in the step: the array doubles) and checks that
`own_inputs` prevents it; it fails when TensorFlow no longer overwrites, so
that this copy can go.

`own_inputs` gives each replica step its own copy of its dense tensors
(`tf.raw_ops.DeepCopy`, which always allocates; `tf.identity` and
`Snapshot` forward the same memory and do not help). `needed()` limits it
to strategies whose replicas are all CPUs: on GPUs and TPUs the input
pipeline has copied each batch to the device already (not run on a GPU
here). The cost is one copy of each replica's batch per step: 0.024 ms for
a 32x32x32x3 float32 batch, 5.1 ms for 128x224x224x3 (about 15 GB/s; AMD
EPYC family 26, 2026-11-27).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf


def _owned(value):
    if not isinstance(value, tf.Tensor) or isinstance(value, tf.Variable):
        return value  # None, NumPy, ragged and sparse values, variables: as they are
    return tf.raw_ops.DeepCopy(x=value)


def own_inputs(data: Any) -> Any:
    """`data` (a nest of tensors) with every dense tensor replaced by a fresh copy.

    Call it first in a function run under `strategy.run` with 2 or more
    replicas, on the replica's batch, before anything else reads it.
    """
    return tf.nest.map_structure(_owned, data)


def on_host_only(devices) -> bool:
    """Whether every device name in `devices` is a CPU (where batches stay in host memory)."""
    return all(tf.DeviceSpec.from_string(device).device_type == "CPU" for device in devices)


def needed() -> bool:
    """Whether the replica step being traced can receive slices of a caller's array.

    True with 2 or more replicas in sync (the batches are split) whose
    devices are all CPUs. One replica reads whole batches, which the runtime
    does not overwrite; on GPUs and TPUs the input pipeline has copied each
    batch to the device (and XLA, which GPU users may turn on, has no
    `DeepCopy`; tfdp refuses `jit_compile` on several CPU replicas).
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync < 2:
        return False
    return on_host_only(tf.distribute.get_strategy().extended.worker_devices)
