"""A small data-parallel training run on synthetic data, for a first try.

Runs in one process or under `python -m launch`; the strategy comes from the
environment (`tfdp.make_strategy("auto")`: TF_CONFIG set by the launcher makes
it multi-worker). Only the chief prints. The `tfdp-train` CLI replaces this
once models and datasets exist.

    python -m launch --nproc_per_node 2 -- python -m tfdp.quickstart
"""

from __future__ import annotations

import time
from typing import Sequence

from absl import app
from absl import flags

_STEPS = flags.DEFINE_integer("steps", 40, "Optimizer steps to train.", lower_bound=1)
_GLOBAL_BATCH = flags.DEFINE_integer(
    "global_batch", 64, "Examples per optimizer step, over all replicas.", lower_bound=1
)
_CPU_REPLICAS = flags.DEFINE_integer(
    "cpu_replicas", None, "Split the CPU into this many replicas (one process).", lower_bound=1
)


def train(*, steps: int, global_batch: int, cpu_replicas: int | None = None) -> dict:
    """Fits a small classifier on a learnable synthetic task.

    Args:
        steps: optimizer steps.
        global_batch: examples per step over all replicas; must divide by the
            number of replicas.
        cpu_replicas: see `tfdp.make_strategy`.

    Returns:
        `{"first_loss", "last_loss", "accuracy", "examples_per_second"}`.
    """
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdp

    strategy = tfdp.make_strategy(cpu_replicas=cpu_replicas)
    info = tfdp.strategy_info(strategy)
    if global_batch % strategy.num_replicas_in_sync:
        raise ValueError(
            f"`global_batch` must divide by the {strategy.num_replicas_in_sync} "
            f"replicas in sync. Received: global_batch={global_batch}"
        )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * global_batch, 16)).astype("float32")
    y = (x[:, :4].sum(axis=1) > 0).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch).repeat()
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(2)]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    start = time.perf_counter()
    history = model.fit(
        dataset, epochs=2, steps_per_epoch=steps // 2 or 1, verbose=2 if info.is_chief else 0
    )
    elapsed = time.perf_counter() - start
    result = {
        "first_loss": float(history.history["loss"][0]),
        "last_loss": float(history.history["loss"][-1]),
        "accuracy": float(history.history["accuracy"][-1]),
        "examples_per_second": 2 * (steps // 2 or 1) * global_batch / elapsed,
    }
    if info.is_chief:
        print(info.describe())
        print(
            "quickstart: loss {first_loss:.4f} -> {last_loss:.4f}, accuracy "
            "{accuracy:.3f}, {examples_per_second:.0f} examples/s".format(**result)
        )
    return result


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    train(steps=_STEPS.value, global_batch=_GLOBAL_BATCH.value, cpu_replicas=_CPU_REPLICAS.value)


if __name__ == "__main__":
    app.run(main)
