"""Time to 0.95 digits accuracy at 2 workers: tfdp's gradient exchanges and DDP's hooks.

This module owns the time-to-accuracy comparison of the communication issue:
the registered `cnn` (`tfdp.models`) on the offline digits split
(`tfdp.pipelines.digits`: 1,437 training and 360 test images, 8x8), global
batch 64 (32 per worker), SGD with momentum 0.9 at a constant learning rate
of 0.05, evaluated on the whole test split after every epoch, until the eval
accuracy reaches `target` or `max_epochs` pass. The same network in PyTorch
(`build_torch_digits_cnn`, the same layers and initial-weight scheme left to
each framework) trains under DDP with each of its hooks on the same arrays,
the same batch, optimizer, evaluation and stopping rule.

Timing, the same for both: wall clock from the start of the first epoch
(after start-up, before any tracing: tfdp's first epoch includes building
its `tf.function`s, DDP has nothing to build) to the end of the evaluation
that first reaches the target; every epoch's end is recorded too, so the
steady epoch time (the median epoch after the first) is reported beside it.
Each run is one launch of 2 workers over the suite's link.

    python -m tfdp.bench.time_to_accuracy                  # loopback
    python -m tfdp.bench.time_to_accuracy --link 100mbit   # a shaped link (root)
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

#: tfdp methods: name -> tfdp.compile arguments (built in the job).
TFDP_METHODS = ("plain", "bfloat16", "powersgd", "topk", "local_sgd", "diloco")
#: DDP hooks (`tfdp.bench.peer_torch.HOOKS`).
DDP_HOOKS = ("none", "fp16", "powersgd")
_DEFAULTS = {"per_replica_batch": 32, "learning_rate": 0.05, "momentum": 0.9,
             "max_epochs": 30, "target": 0.95, "threads": 1, "seed": 0, "rank": 4,
             "fraction": 0.01, "local_sgd_sync_every": 8, "diloco_sync_every": 16,
             "outer_learning_rate": 0.7, "outer_momentum": 0.5}


def write_digits(path: str) -> None:
    """Writes the digits train and test arrays (float32 in [0, 1], NHWC) to `path` (.npz)."""
    import numpy as np
    from sklearn import datasets

    from tfdp.pipelines import digits as digits_lib

    data = datasets.load_digits()
    # As the TFDS builder stores them (uint8), then scaled as tfdp's pipeline does.
    images = np.round(data.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
    images = images.astype(np.float32) / 255.0
    split = digits_lib.split_indices()
    np.savez(path, x_train=images[split["train"]], y_train=data.target[split["train"]],
             x_test=images[split["test"]], y_test=data.target[split["test"]])


def _summary(epoch_ends: list, accuracies: list, target: float) -> dict:
    """Seconds and epochs to `target` from per-epoch end times and eval accuracies."""
    reached = next((i for i, a in enumerate(accuracies) if a >= target), None)
    durations = [b - a for a, b in zip([0.0] + epoch_ends[:-1], epoch_ends)]
    return {
        "epochs_to_target": None if reached is None else reached + 1,
        "seconds_to_target": None if reached is None else epoch_ends[reached],
        "steady_epoch_seconds": statistics.median(durations[1:]) if len(durations) > 1 else None,
        "accuracies": accuracies,
        "epoch_ends": epoch_ends,
    }


def _compile_arguments(method: str, spec: dict) -> dict:
    import keras
    import tfdp

    if method == "plain":
        return {}
    if method == "bfloat16":
        return {"gradient_compression": "bfloat16"}
    if method == "powersgd":
        return {"gradient_compression": tfdp.compression.PowerSGD(rank=spec["rank"])}
    if method == "topk":
        return {"gradient_compression": tfdp.compression.TopK(fraction=spec["fraction"])}
    if method == "local_sgd":
        return {"sync_every": spec["local_sgd_sync_every"]}
    if method == "diloco":
        return {"sync_every": spec["diloco_sync_every"],
                "outer_optimizer": keras.optimizers.SGD(
                    spec["outer_learning_rate"], momentum=spec["outer_momentum"], nesterov=True)}
    raise ValueError(f"`method` must be one of {', '.join(TFDP_METHODS)}. "
                     f"Received: method={method!r}")


def measure_tfdp(spec: dict) -> dict:
    """One tfdp run (a `tfdp.bench.worker` job on every worker): spec `method`, `data`."""
    spec = {**_DEFAULTS, **spec}
    import keras
    import numpy as np
    import tensorflow as tf
    import tfdp
    from tfdp import models

    strategy = tfdp.make_strategy()
    data = np.load(spec["data"])
    global_batch = spec["per_replica_batch"] * strategy.num_replicas_in_sync
    train = (tf.data.Dataset.from_tensor_slices((data["x_train"], data["y_train"]))
             .shuffle(len(data["y_train"]), seed=spec["seed"], reshuffle_each_iteration=True)
             .batch(global_batch, drop_remainder=True))
    test = tf.data.Dataset.from_tensor_slices((data["x_test"], data["y_test"])).batch(global_batch)
    keras.utils.set_random_seed(spec["seed"])
    with strategy.scope():
        model = models.get("cnn", input_shape=(8, 8, 1), num_classes=10)
        tfdp.compile(model, optimizer=keras.optimizers.SGD(spec["learning_rate"],
                                                           momentum=spec["momentum"]),
                     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                     metrics=["accuracy"], **_compile_arguments(spec["method"], spec))
    epoch_ends, accuracies = [], []

    class Clock(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            epoch_ends.append(time.perf_counter() - self.start)
            accuracies.append(float(logs["val_accuracy"]))
            # Equal on every worker (a global evaluation): all stop together.
            if accuracies[-1] >= spec["target"]:
                self.model.stop_training = True

    model.fit(train, validation_data=test, epochs=spec["max_epochs"], verbose=0,
              callbacks=[Clock()])
    return {"framework": "tfdp", "method": spec["method"],
            "workers": tfdp.strategy_info(strategy).num_workers,
            **_summary(epoch_ends, accuracies, spec["target"])}


def build_torch_digits_cnn():
    """The registered `cnn` for 8x8x1 digits in PyTorch (NCHW): the same layers and sizes."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Dropout(0.25),
        nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Dropout(0.25),
        nn.Linear(128, 10),
    )


def measure_torch(spec: dict) -> dict:
    """One DDP run (a `tfdp.bench.worker` job on every worker): spec `hook`, `port`, `data`."""
    spec = {**_DEFAULTS, **spec}
    import numpy as np
    import torch
    import torch.distributed as dist

    from tfdp.bench import peer_torch

    rank, world = peer_torch.join_gloo_group(spec["threads"], spec["port"])
    try:
        data = np.load(spec["data"])
        x_train = torch.from_numpy(data["x_train"]).permute(0, 3, 1, 2).contiguous()
        y_train = torch.from_numpy(data["y_train"]).long()
        x_test = torch.from_numpy(data["x_test"]).permute(0, 3, 1, 2).contiguous()
        y_test = torch.from_numpy(data["y_test"]).long()
        torch.manual_seed(spec["seed"])  # the same initial weights on every rank
        model = peer_torch.wrap_ddp(build_torch_digits_cnn(), spec["hook"], spec["rank"])
        optimizer = torch.optim.SGD(model.parameters(), lr=spec["learning_rate"],
                                    momentum=spec["momentum"])
        loss_fn = torch.nn.CrossEntropyLoss()
        batch = spec["per_replica_batch"]
        steps = len(y_train) // (batch * world)  # drop the remainder, as tfdp's input does
        epoch_ends, accuracies = [], []
        dist.barrier()
        start = time.perf_counter()
        for epoch in range(spec["max_epochs"]):
            order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(
                spec["seed"] + epoch))
            model.train()
            for step in range(steps):
                rows = order[(step * world + rank) * batch:(step * world + rank + 1) * batch]
                optimizer.zero_grad(set_to_none=True)
                loss_fn(model(x_train[rows]), y_train[rows]).backward()
                optimizer.step()
            model.eval()
            with torch.no_grad():  # every rank holds the same weights
                accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
            epoch_ends.append(time.perf_counter() - start)
            accuracies.append(accuracy)
            if accuracy >= spec["target"]:
                break
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {"framework": "PyTorch DDP", "method": spec["hook"], "workers": world,
            "torch_version": torch.__version__,
            **_summary(epoch_ends, accuracies, spec["target"])}


def run(*, tfdp_methods=TFDP_METHODS, ddp_hooks=DDP_HOOKS, timeout: float = 900.0,
        **spec) -> dict:
    """Every method at 2 workers (over the current link, `tfdp.bench.procs.through_link`).

    Returns:
        `{"rows": [measure_tfdp / measure_torch results], "best_tfdp",
        "plain_over_best_tfdp", "best_ddp_over_best_tfdp"}` (ratios of
        seconds to target; above 1: the best tfdp method is sooner).
    """
    from tfdp.bench import peer_torch
    from tfdp.bench import procs

    rows = []
    with tempfile.TemporaryDirectory(prefix="tfdp-tta-") as directory:
        data = os.path.join(directory, "digits.npz")
        write_digits(data)
        for method in tfdp_methods:
            rows.append(procs.run_job("time_to_accuracy_tfdp",
                                      {**spec, "method": method, "data": data},
                                      nproc=2, timeout=timeout))
        if peer_torch.torch_missing_reason() is None:
            for hook in ddp_hooks:
                rows.append(procs.run_job(
                    "time_to_accuracy_torch",
                    {**spec, "hook": hook, "data": data, "port": procs.free_port()},
                    nproc=2, timeout=timeout))
    return {"rows": rows, **compare(rows)}


def compare(rows: list) -> dict:
    """The best tfdp method and how much sooner it reaches the target than plain and DDP's best."""
    def seconds(row):
        return row["seconds_to_target"] if row["seconds_to_target"] is not None else float("inf")

    tfdp_rows = [r for r in rows if r["framework"] == "tfdp"]
    ddp_rows = [r for r in rows if r["framework"] != "tfdp"]
    best = min(tfdp_rows, key=seconds, default=None)
    plain = next((r for r in tfdp_rows if r["method"] == "plain"), None)
    best_ddp = min(ddp_rows, key=seconds, default=None)
    finite = best is not None and seconds(best) < float("inf")
    return {
        "best_tfdp": best and best["method"],
        "plain_over_best_tfdp": (seconds(plain) / seconds(best)
                                 if finite and plain is not None else None),
        "best_ddp": best_ddp and best_ddp["method"],
        "best_ddp_over_best_tfdp": (seconds(best_ddp) / seconds(best)
                                    if finite and best_ddp is not None else None),
    }


def main(argv=None) -> int:
    import argparse
    import contextlib

    from tfdp.bench import link as link_lib
    from tfdp.bench import machine
    from tfdp.bench import procs

    parser = argparse.ArgumentParser(prog="python -m tfdp.bench.time_to_accuracy")
    parser.add_argument("--link", default=None, help="shape the workers' loopback, e.g. 100mbit")
    parser.add_argument("--max_epochs", type=int, default=_DEFAULTS["max_epochs"])
    args = parser.parse_args(argv)
    context = contextlib.nullcontext(None)
    if args.link:
        context = link_lib.shaped_link(args.link)
    with context as prefix, (procs.through_link(prefix) if prefix else contextlib.nullcontext()):
        result = run(max_epochs=args.max_epochs)
    print(f"time to 0.95 digits eval accuracy, 2 workers, link {args.link or 'loopback'}, "
          f"{machine.describe().get('cpu')}")
    for row in result["rows"]:
        print(f"{row['framework']:12s} {row['method']:10s} epochs {row['epochs_to_target']} "
              f"seconds {row['seconds_to_target'] and round(row['seconds_to_target'], 1)} "
              f"steady epoch {row['steady_epoch_seconds'] and round(row['steady_epoch_seconds'], 2)} s "
              f"last accuracy {row['accuracies'][-1]:.4f}")
    print({k: v for k, v in result.items() if k != "rows"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
