"""Time to 0.95 digits accuracy at 2 workers: tfdp's gradient exchanges and DDP's hooks.

This module owns the time-to-accuracy comparison of the communication issue:
the registered `cnn` (`tfdp.models`) on the offline digits split
(`tfdp.pipelines.digits`: 1,437 training and 360 test images, 8x8), global
batch 64 (32 per worker, 22 steps per epoch), SGD with momentum 0.9 at a
constant learning rate of 0.05, evaluated on the whole test split after every
epoch, until the eval accuracy reaches `target` or `max_epochs` pass. The
same network in PyTorch (`build_torch_digits_cnn`, the same layers and
initial-weight scheme left to each framework) trains under DDP with each of
its hooks on the same arrays, the same batch, optimizer, evaluation and
stopping rule. It does not start processes (`tfdp.bench.procs`) or judge the
ratios (`tfdp.bench.targets`).

Each peer runs at its own best settings, as its users would write it:

- tfdp: `tfdp.compile(..., steps_per_execution=S)` with S the steps of one
  epoch (one `tf.function` call per epoch and one per evaluation; on this
  tiny CNN a call costs more than a step), and the training set repeated
  with `fit(steps_per_epoch=S)`, so Keras keeps one distributed iterator
  instead of creating one per epoch. `spec["steps_per_execution"]` = 1
  gives Keras' default for comparison.
- DDP: the plain PyTorch loop (one Python call per step is how DDP runs;
  there is nothing to batch), evaluation on the 360 images in one forward
  pass under `no_grad`.

Timing, the same for both: wall clock from the start of the first epoch
(after start-up and the process group's rendezvous, before any tracing:
tfdp's first epoch includes building its `tf.function`s, DDP has nothing to
build) to the end of the evaluation that first reaches the target; every
epoch's end is recorded too, so the first epoch and the steady epoch (the
median epoch after the first) are reported beside it. Each run is one launch
of 2 workers over the current link; `run(repeats=R)` runs every method R
times, in rounds (every method once, then again), and `summarize` reports
the median and the range per method.

    python -m tfdp.bench.time_to_accuracy                  # loopback, 3 repeats
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
DDP_HOOKS = ("none", "fp16", "powersgd", "local_sgd")
#: The framework name of the one-process plain-Keras row (`measure_keras`).
KERAS_FLOOR = "Keras, one process"
_DEFAULTS = {"per_replica_batch": 32, "learning_rate": 0.05, "momentum": 0.9,
             "max_epochs": 30, "target": 0.95, "threads": 1, "seed": 0, "rank": 4,
             "fraction": 0.01, "local_sgd_sync_every": 8, "diloco_sync_every": 16,
             "outer_learning_rate": 0.7, "outer_momentum": 0.5,
             # None: the steps of one epoch per tf.function call (see above).
             "steps_per_execution": None}


def write_digits(path: str) -> None:
    """Writes the digits train and test arrays (float32 in [0, 1], NHWC) to `path` (.npz)."""
    import numpy as np

    from tfdp.pipelines import digits as digits_lib

    images, labels = digits_lib.load_arrays()
    labels = labels.astype(np.int64)
    # As the TFDS builder stores them (uint8), then scaled as tfdp's pipeline does.
    images = np.round(images * (255.0 / 16.0)).astype(np.uint8)[..., None]
    images = images.astype(np.float32) / 255.0
    split = digits_lib.split_indices()
    np.savez(path, x_train=images[split["train"]], y_train=labels[split["train"]],
             x_test=images[split["test"]], y_test=labels[split["test"]])


def _summary(epoch_ends: list, accuracies: list, target: float) -> dict:
    """Seconds and epochs to `target` from per-epoch end times and eval accuracies."""
    reached = next((i for i, a in enumerate(accuracies) if a >= target), None)
    durations = [b - a for a, b in zip([0.0] + epoch_ends[:-1], epoch_ends)]
    return {
        "epochs_to_target": None if reached is None else reached + 1,
        "seconds_to_target": None if reached is None else epoch_ends[reached],
        "first_epoch_seconds": durations[0] if durations else None,
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


def _fit_to_target(spec: dict, strategy, global_batch: int, compile_model, *,
                   callbacks=(), stop_at_target: bool = True) -> dict:
    """Trains the digits `cnn` with `model.fit` until `spec["target"]`; the timing both Keras rows share.

    Args:
        spec: the job spec, defaults merged.
        strategy: the `tf.distribute.Strategy` whose scope builds the model.
        global_batch: examples per step over all replicas.
        compile_model: `compile_model(model, steps_per_execution=S, **compile_kwargs)`,
            `tfdp.compile` or `keras.Model.compile`.
        callbacks: more Keras callbacks for `fit`, after the clock.
        stop_at_target: stop after the first evaluation at the target
            (else run all of `spec["max_epochs"]`).

    Returns:
        `_summary` of the run plus `"steps_per_execution"`.
    """
    import keras
    import numpy as np
    import tensorflow as tf
    from tfdp import models

    data = np.load(spec["data"])
    steps = len(data["y_train"]) // global_batch  # drop the remainder, as DDP's loop does
    # Repeated, with steps_per_epoch: one iterator for the whole run; each
    # pass is one reshuffled epoch of `steps` whole batches.
    train = (tf.data.Dataset.from_tensor_slices((data["x_train"], data["y_train"]))
             .shuffle(len(data["y_train"]), seed=spec["seed"], reshuffle_each_iteration=True)
             .batch(global_batch, drop_remainder=True).repeat())
    test = tf.data.Dataset.from_tensor_slices((data["x_test"], data["y_test"])).batch(global_batch)
    steps_per_execution = spec["steps_per_execution"] or steps
    keras.utils.set_random_seed(spec["seed"])
    with strategy.scope():
        model = models.get("cnn", input_shape=(8, 8, 1), num_classes=10)
        compile_model(model, optimizer=keras.optimizers.SGD(spec["learning_rate"],
                                                            momentum=spec["momentum"]),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], steps_per_execution=steps_per_execution)
    epoch_ends, accuracies = [], []

    class Clock(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            epoch_ends.append(time.perf_counter() - self.start)
            accuracies.append(float(logs["val_accuracy"]))
            # Equal on every worker (a global evaluation): all stop together.
            if stop_at_target and accuracies[-1] >= spec["target"]:
                self.model.stop_training = True

    model.fit(train, steps_per_epoch=steps, validation_data=test,
              epochs=spec["max_epochs"], verbose=0,
              callbacks=[Clock(), *callbacks])
    return {"steps_per_execution": steps_per_execution,
            **_summary(epoch_ends, accuracies, spec["target"])}


def measure_tfdp(spec: dict) -> dict:
    """One tfdp run (a `tfdp.bench.worker` job on every worker): spec `method`, `data`."""
    spec = {**_DEFAULTS, **spec}
    import tfdp

    strategy = tfdp.make_strategy()
    arguments = _compile_arguments(spec["method"], spec)
    result = _fit_to_target(
        spec, strategy, spec["per_replica_batch"] * strategy.num_replicas_in_sync,
        lambda model, **kwargs: tfdp.compile(model, **kwargs, **arguments))
    return {"framework": "tfdp", "method": spec["method"],
            "workers": tfdp.strategy_info(strategy).num_workers, **result}


def measure_keras(spec: dict) -> dict:
    """The floor: plain Keras in one process, no strategy and no tfdp (spec `data`).

    The same model, data, global batch (`per_replica_batch` x 2), optimizer,
    steps per call, evaluation and stopping rule as the 2-worker rows, on
    one process with the same threads as one worker. Nothing is exchanged,
    so its first epoch is what Keras on TensorFlow costs before any
    communication (building and first running the train and test
    functions), whichever toolkit distributes it.
    """
    spec = {**_DEFAULTS, **spec}
    import tensorflow as tf

    result = _fit_to_target(spec, tf.distribute.get_strategy(), spec["per_replica_batch"] * 2,
                            lambda model, **kwargs: model.compile(**kwargs))
    return {"framework": KERAS_FLOOR, "method": "none", "workers": 1, **result}


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
        optimizer = peer_torch.make_optimizer(
            model, spec["hook"], lr=spec["learning_rate"], momentum=spec["momentum"],
            period=spec["local_sgd_sync_every"])
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
            if spec["hook"] == "local_sgd":  # as tfdp's windows, each epoch ends averaged
                from torch.distributed.algorithms.model_averaging import utils as averaging

                averaging.average_parameters(model.parameters(), dist.group.WORLD)
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


def run(*, tfdp_methods=TFDP_METHODS, ddp_hooks=DDP_HOOKS, keras_floor: bool = True,
        repeats: int = 1, timeout: float = 900.0, **spec) -> dict:
    """Every method at 2 workers, `repeats` times (over the current link, `procs.through_link`).

    Args:
        tfdp_methods: names from `TFDP_METHODS`.
        ddp_hooks: names from `DDP_HOOKS` (skipped without PyTorch).
        keras_floor: also run `measure_keras` (one process, no link) in
            every round: the time no Keras-on-TensorFlow toolkit can beat.
        repeats: launches per method, in rounds: every method once, then
            again, so a burst of load on a shared machine hits them alike.
        timeout: seconds per launch.
        **spec: overrides of the job defaults (`max_epochs`, `target`, ...).

    Returns:
        `summarize(runs)` plus `"runs"` (every launch's result, with its
        `"round"` and the 1/5/15-minute `"load_average_at_start"`),
        `"repeats"` and `"ddp_skipped"` (why DDP did not run, or None).

    Raises:
        ValueError: an unknown method or hook, or `repeats` < 1.
        tfdp.bench.procs.JobFailed: a launch failed or timed out.
    """
    from tfdp.bench import machine
    from tfdp.bench import peer_torch
    from tfdp.bench import procs

    unknown = [m for m in tfdp_methods if m not in TFDP_METHODS] + [
        h for h in ddp_hooks if h not in DDP_HOOKS]
    if unknown:
        raise ValueError(f"`tfdp_methods` must be among {', '.join(TFDP_METHODS)} and "
                         f"`ddp_hooks` among {', '.join(DDP_HOOKS)}. Received: {unknown!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"`repeats` must be a positive integer. Received: repeats={repeats!r}")
    ddp_skipped = peer_torch.torch_missing_reason()
    # The worker limits TensorFlow's pools from the spec it is given, before
    # the job merges `_DEFAULTS`: pass the thread count DDP gets explicitly.
    spec = {"threads": _DEFAULTS["threads"], **spec}
    runs = []
    with tempfile.TemporaryDirectory(prefix="tfdp-tta-") as directory:
        data = os.path.join(directory, "digits.npz")
        write_digits(data)
        for round_index in range(repeats):
            if keras_floor:
                load = machine.load_average()
                row = procs.run_job("time_to_accuracy_keras", {**spec, "data": data},
                                    nproc=None, timeout=timeout)
                runs.append({**row, "round": round_index, "load_average_at_start": load})
            for method in tfdp_methods:
                load = machine.load_average()
                row = procs.run_job("time_to_accuracy_tfdp",
                                    {**spec, "method": method, "data": data},
                                    nproc=2, timeout=timeout)
                runs.append({**row, "round": round_index, "load_average_at_start": load})
            for hook in ddp_hooks if ddp_skipped is None else ():
                load = machine.load_average()
                row = procs.run_job(
                    "time_to_accuracy_torch",
                    {**spec, "hook": hook, "data": data, "port": procs.free_port()},
                    nproc=2, timeout=timeout)
                runs.append({**row, "round": round_index, "load_average_at_start": load})
    return {**summarize(runs), "runs": runs, "repeats": repeats, "ddp_skipped": ddp_skipped}


def _spread(values: list) -> dict:
    """Median, min and max of `values` (None entries dropped; all None if none is left)."""
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: list) -> dict:
    """One row per (framework, method) over its repeated runs, and `compare` of those rows.

    A method's `seconds_to_target` is the median over its runs when every
    run reached the target, else None (its `reached` says how many did):
    a method that sometimes misses is not "sooner".

    Args:
        runs: `measure_tfdp` / `measure_torch` results.

    Returns:
        `{"rows": [{"framework", "method", "runs", "reached",
        "seconds_to_target" (median or None), "seconds_to_target_spread",
        "epochs_to_target", "first_epoch_seconds", "steady_epoch_seconds",
        "last_accuracy", "load_average_1min" (each a median/min/max dict)}],
        **compare(rows)}`, rows in the order the methods first ran.
    """
    groups: dict = {}
    for run in runs:
        groups.setdefault((run["framework"], run["method"]), []).append(run)
    rows = []
    for (framework, method), group in groups.items():
        reached = sum(r["seconds_to_target"] is not None for r in group)
        seconds = _spread([r["seconds_to_target"] for r in group])
        rows.append({
            "framework": framework, "method": method, "runs": len(group), "reached": reached,
            "seconds_to_target": seconds["median"] if reached == len(group) else None,
            "seconds_to_target_spread": seconds,
            "epochs_to_target": _spread([r["epochs_to_target"] for r in group]),
            "first_epoch_seconds": _spread([r.get("first_epoch_seconds") for r in group]),
            "steady_epoch_seconds": _spread([r["steady_epoch_seconds"] for r in group]),
            "last_accuracy": _spread([r["accuracies"][-1] if r["accuracies"] else None
                                      for r in group]),
            "load_average_1min": _spread([(r.get("load_average_at_start") or [None])[0]
                                          for r in group]),
        })
    return {"rows": rows, **compare(rows)}


def compare(rows: list) -> dict:
    """The best tfdp method and how much sooner it reaches the target than plain and DDP's best.

    Args:
        rows: dictionaries with `framework`, `method` and `seconds_to_target`
            (None: did not reach the target), e.g. `summarize`'s rows.

    Returns:
        `{"best_tfdp", "plain_over_best_tfdp", "best_ddp",
        "best_ddp_over_best_tfdp", "best_ddp_over_keras_floor"}`: ratios of
        seconds to target (above 1: the best tfdp method, or the one-process
        Keras floor, is sooner); None where a side has no row or did not
        reach the target. `best_ddp_over_keras_floor` bounds what any Keras
        toolkit can reach: `best_ddp_over_best_tfdp` cannot exceed it by
        more than the two workers' halved compute gives.
    """
    def seconds(row):
        return row["seconds_to_target"] if row["seconds_to_target"] is not None else float("inf")

    tfdp_rows = [r for r in rows if r["framework"] == "tfdp"]
    ddp_rows = [r for r in rows if r["framework"] not in ("tfdp", KERAS_FLOOR)]
    floor = next((r for r in rows if r["framework"] == KERAS_FLOOR), None)
    best = min(tfdp_rows, key=seconds, default=None)
    plain = next((r for r in tfdp_rows if r["method"] == "plain"), None)
    best_ddp = min(ddp_rows, key=seconds, default=None)
    finite = best is not None and seconds(best) < float("inf")
    floor_finite = floor is not None and seconds(floor) < float("inf")
    return {
        "best_tfdp": best and best["method"],
        "plain_over_best_tfdp": (seconds(plain) / seconds(best)
                                 if finite and plain is not None else None),
        "best_ddp": best_ddp and best_ddp["method"],
        "best_ddp_over_best_tfdp": (seconds(best_ddp) / seconds(best)
                                    if finite and best_ddp is not None else None),
        "best_ddp_over_keras_floor": (seconds(best_ddp) / seconds(floor)
                                      if floor_finite and best_ddp is not None else None),
    }


def _cell(spread: dict, digits: int = 1) -> str:
    if spread["median"] is None:
        return "-"
    return (f"{spread['median']:.{digits}f} ({spread['min']:.{digits}f}-"
            f"{spread['max']:.{digits}f})")


def main(argv=None) -> int:
    import argparse
    import contextlib

    from tfdp.bench import link as link_lib
    from tfdp.bench import machine
    from tfdp.bench import procs

    parser = argparse.ArgumentParser(prog="python -m tfdp.bench.time_to_accuracy")
    parser.add_argument("--link", default=None, help="shape the workers' loopback, e.g. 100mbit")
    parser.add_argument("--max_epochs", type=int, default=_DEFAULTS["max_epochs"])
    parser.add_argument("--repeats", type=int, default=3, help="launches per method")
    parser.add_argument("--methods", default=",".join(TFDP_METHODS),
                        help="tfdp methods, comma-separated")
    parser.add_argument("--hooks", default=",".join(DDP_HOOKS),
                        help="DDP hooks, comma-separated (empty: none)")
    parser.add_argument("--no_keras_floor", dest="keras_floor", action="store_false",
                        help="leave out the one-process plain-Keras row")
    parser.add_argument("--steps_per_execution", type=int, default=None,
                        help="tfdp steps per tf.function call (default: one epoch)")
    args = parser.parse_args(argv)
    if args.link:
        try:
            link_lib.check_rate(args.link)
        except ValueError as error:
            parser.error(str(error))
    context = contextlib.nullcontext(None)
    load_before = machine.load_average()
    try:
        if args.link:
            context = link_lib.shaped_link(args.link)
        with context as prefix, (procs.through_link(prefix) if prefix
                                 else contextlib.nullcontext()):
            result = run(tfdp_methods=[m for m in args.methods.split(",") if m],
                         ddp_hooks=[h for h in args.hooks.split(",") if h],
                         keras_floor=args.keras_floor, repeats=args.repeats, max_epochs=args.max_epochs,
                         steps_per_execution=args.steps_per_execution)
    except (ValueError, link_lib.LinkUnavailable) as error:
        print(f"python -m tfdp.bench.time_to_accuracy: {error}", file=sys.stderr)
        return 2
    print(f"time to {_DEFAULTS['target']} digits eval accuracy, 2 workers, link "
          f"{args.link or 'loopback'}, {machine.describe().get('cpu')}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, load average {load_before} -> "
          f"{machine.load_average()}, {args.repeats} launch(es) per method; "
          f"median (min-max)")
    print("| framework | method | seconds to target | epochs | first epoch (s) | "
          "steady epoch (s) | reached | load average (1 min) |")
    print("|---|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        print(f"| {row['framework']} | {row['method']} | "
              f"{_cell(row['seconds_to_target_spread'])} | "
              f"{_cell(row['epochs_to_target'], 0)} | {_cell(row['first_epoch_seconds'])} | "
              f"{_cell(row['steady_epoch_seconds'], 2)} | {row['reached']}/{row['runs']} | "
              f"{_cell(row['load_average_1min'])} |")
    print({k: v for k, v in result.items() if k not in ("rows", "runs")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
