"""Worker script: balanced batches under MultiWorkerMirroredStrategy on 2 workers (issue 35).

Run by `test_balanced_batches_multiworker.py` through `tfdp-launch`, worker
1 usually inside a CPU cgroup at a quarter of a CPU (`tfdp.bench.straggler`). Each
worker reads every global batch whole, from the same seeded arrays, and
writes `rank<N>.npz`:

- `fixed_*`: a fixed unequal plan (`FIXED_PLAN`) for one epoch: the weights,
  and the examples each worker computed (the timings' riders);
- `moving_*`: a wider model re-planned every `REPLAN_EVERY` steps: every
  plan adopted (`moving_history`, rows of step, share 0, share 1), the
  final plan and the seconds per example each worker was measured at.
"""

from __future__ import annotations

import os
import sys

import numpy as np

GLOBAL_BATCH = 16
STEPS = 6
FEATURES = 8
LEARNING_RATE = 0.1
FIXED_PLAN = (11, 5)

WIDE_FEATURES = 256
WIDE_UNITS = 512
WIDE_BATCH = 64
WIDE_STEPS = 300
REPLAN_EVERY = 20


def data(steps, batch, features, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps * batch, features)).astype("float32")
    y = rng.integers(0, 4, steps * batch)
    return x, y


def dataset(steps=STEPS, batch=GLOBAL_BATCH, features=FEATURES, seed=35):
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices(data(steps, batch, features, seed)).batch(batch)


def build_model(features=FEATURES, units=16):
    import keras

    keras.utils.set_random_seed(7)
    return keras.Sequential([
        keras.Input((features,)), keras.layers.Dense(units, activation="tanh"),
        keras.layers.Dense(units, activation="tanh"), keras.layers.Dense(4),
    ])


def optimizer():
    import keras

    return keras.optimizers.SGD(LEARNING_RATE, momentum=0.9)


def loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def main(out_dir: str) -> None:
    import tfdp
    from tfdp.training import balanced_batches

    strategy = tfdp.make_strategy("multi_worker", timeout_seconds=60)
    rank = tfdp.strategy_info(strategy).worker_index
    results = {}

    with strategy.scope():
        model = build_model()
        tfdp.compile(model, optimizer=optimizer(), loss=loss(),
                     balance_batches=balanced_batches.BalanceOptions(replan_every=None,
                                                                     shares=FIXED_PLAN))
    model.fit(dataset(), epochs=1, verbose=0)
    for i, w in enumerate(model.get_weights()):
        results[f"fixed_weight{i}"] = w
    results["fixed_totals"] = model.tfdp_balanced_batches.totals.numpy()
    results["fixed_plan"] = model.tfdp_balanced_batches.plan.numpy()

    with strategy.scope():
        model = build_model(WIDE_FEATURES, WIDE_UNITS)
        tfdp.compile(model, optimizer=optimizer(), loss=loss(),
                     balance_batches=balanced_batches.BalanceOptions(replan_every=REPLAN_EVERY))
    model.fit(dataset(WIDE_STEPS, WIDE_BATCH, WIDE_FEATURES, seed=36), epochs=1, verbose=0)
    balance = model.tfdp_balanced_batches
    results["moving_history"] = np.array([(step, *shares) for step, shares in balance.history],
                                         "int64").reshape(-1, 3)
    results["moving_plan"] = balance.plan.numpy()
    results["moving_seconds_per_example"] = np.array(balance.planner.seconds_per_example)
    print(f"rank {rank}: plans {balance.history}, seconds per example "
          f"{balance.planner.seconds_per_example}, fixed seconds "
          f"{balance.planner.fixed_seconds}, noise {balance.planner.cost.relative_noise:.3f}, "
          f"windows (shares, ms per step) "
          f"{[([round(s, 1) for s in p], [round(1000 * t, 2) for t in q]) for p, q in balance.planner.points]}",
          flush=True)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **results)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as multiworker_training_job.py: TF 2.21's exit handlers can abort


if __name__ == "__main__":
    main(sys.argv[1])
