"""Times the ways to train the benchmark CNN, side by side in one process.

This module owns the in-process measurement behind the scaling and overhead
cases: it builds one model per training *path* under the job's strategy
(`tfdp.make_strategy()`: the default strategy on one worker,
MultiWorkerMirroredStrategy on several), warms each path up (tracing), then
times them in alternation, `repeats` rounds of `steps` optimizer steps each,
so a burst of load on a shared machine hits every path alike. Every worker of
a multi-worker job runs the same calls (their collectives must pair up); rank
0's timings are reported. It does not start processes (`tfdp.bench.procs`)
or judge the numbers (`tfdp.bench.scaling`, `tfdp.bench.overhead`).

Paths (all SGD with momentum 0.9, sparse categorical cross-entropy on logits,
per-replica batch `per_replica_batch`, global batch that times the replicas):

- `keras_fit`: plain `model.compile` + `model.fit`, one step per call
  (Keras' default `steps_per_execution=1`), with an accuracy metric;
- `keras_fit_n`: plain `model.compile(..., steps_per_execution=N)` +
  `model.fit` (Keras' own train function), with an accuracy metric;
- `tfdp_fit`: `tfdp.compile(..., steps_per_execution=N)` + `model.fit`, with
  an accuracy metric;
- `trainer`: `tfdp.Trainer(..., steps_per_loop=N)`, with an accuracy metric;
- `loop_1`: a hand-written loop, one `strategy.run` step per `tf.function`
  call, no metrics;
- `loop_n`: a hand-written loop, N steps per `tf.function` call, no metrics;
- `input`: no training, only N batches pulled from the distributed iterator
  per `tf.function` call (what the input costs a step).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

PATHS = ("keras_fit", "keras_fit_n", "tfdp_fit", "trainer", "loop_1", "loop_n", "input")

_DEFAULTS = {
    "per_replica_batch": 64,
    "steps_per_execution": 10,
    "steps": 100,
    "repeats": 3,
    "learning_rate": 0.01,
}


def _check_spec(spec: dict) -> dict:
    spec = {**_DEFAULTS, **spec}
    unknown = [p for p in spec.get("paths", ()) if p not in PATHS]
    if unknown or not spec.get("paths"):
        raise ValueError(
            f"`paths` must be a non-empty list of {', '.join(PATHS)}. "
            f"Received: paths={spec.get('paths')!r}"
        )
    if spec["steps"] % spec["steps_per_execution"]:
        raise ValueError(
            f"`steps` must be a multiple of `steps_per_execution` so every path runs "
            f"whole executions. Received: steps={spec['steps']}, "
            f"steps_per_execution={spec['steps_per_execution']}"
        )
    return spec


def _loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _optimizer(spec):
    import keras

    return keras.optimizers.SGD(spec["learning_rate"], momentum=0.9)


def _fit_runner(strategy, dataset, spec, *, use_tfdp: bool,
                steps_per_execution: int) -> Callable[[int], None]:
    import tfdp
    from tfdp.bench import workloads

    with strategy.scope():
        model = workloads.build_cnn()
        compile_fn = tfdp.compile if use_tfdp else type(model).compile
        compile_fn(model, optimizer=_optimizer(spec), loss=_loss(), metrics=["accuracy"],
                   steps_per_execution=steps_per_execution)

    def run(steps: int) -> None:
        model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)

    return run


def _trainer_runner(strategy, dataset, spec) -> Callable[[int], None]:
    import tfdp
    from tfdp.bench import workloads

    with strategy.scope():
        model = workloads.build_cnn()
        optimizer = _optimizer(spec)
    trainer = tfdp.Trainer(
        model, optimizer=optimizer, loss=_loss(), strategy=strategy,
        batch=tfdp.BatchConfig(spec["per_replica_batch"], strategy.num_replicas_in_sync),
        metrics=["accuracy"], steps_per_loop=spec["steps_per_execution"],
    )

    def run(steps: int) -> None:
        # One "epoch" per call, so each call starts at offset 0 (no skipping).
        trainer.train(dataset, steps=trainer.global_step + steps, steps_per_epoch=steps)

    return run


def _loop_runner(strategy, dataset, spec, *, steps_per_call: int) -> Callable[[int], None]:
    import tensorflow as tf
    from tfdp.bench import workloads

    with strategy.scope():
        model = workloads.build_cnn()
        optimizer = _optimizer(spec)
        optimizer.build(model.trainable_variables)
    global_batch = float(spec["per_replica_batch"] * strategy.num_replicas_in_sync)
    distributed = strategy.experimental_distribute_dataset(dataset)

    def replica_step(data):
        x, y = data
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            losses = tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
            loss = tf.reduce_sum(losses) / global_batch
        variables = model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))

    @tf.function
    def loop(iterator, num_steps):
        for _ in tf.range(num_steps):
            strategy.run(replica_step, args=(next(iterator),))

    def run(steps: int) -> None:
        iterator = iter(distributed)
        count = tf.constant(steps_per_call)
        for _ in range(steps // steps_per_call):
            loop(iterator, count)
        optimizer.iterations.numpy()  # a host sync, as every path ends with

    return run


def _input_runner(strategy, dataset, spec) -> Callable[[int], None]:
    import tensorflow as tf

    distributed = strategy.experimental_distribute_dataset(dataset)
    steps_per_call = spec["steps_per_execution"]

    @tf.function
    def pull(iterator, num_steps):
        total = tf.constant(0.0)
        for _ in tf.range(num_steps):
            x, _ = next(iterator)
            total += tf.add_n([tf.reduce_sum(v[:1, :1, :1, :1])
                               for v in strategy.experimental_local_results(x)])
        return total

    def run(steps: int) -> None:
        iterator = iter(distributed)
        count = tf.constant(steps_per_call)
        for _ in range(steps // steps_per_call):
            pull(iterator, count).numpy()

    return run


def _runner(path, strategy, dataset, spec):
    if path in ("keras_fit", "keras_fit_n", "tfdp_fit"):
        return _fit_runner(
            strategy, dataset, spec, use_tfdp=path == "tfdp_fit",
            steps_per_execution=1 if path == "keras_fit" else spec["steps_per_execution"],
        )
    if path == "trainer":
        return _trainer_runner(strategy, dataset, spec)
    if path == "loop_1":
        return _loop_runner(strategy, dataset, spec, steps_per_call=1)
    if path == "loop_n":
        return _loop_runner(strategy, dataset, spec, steps_per_call=spec["steps_per_execution"])
    return _input_runner(strategy, dataset, spec)


def measure(spec: dict) -> dict:
    """Times every path in `spec["paths"]` (a `tfdp.bench.worker` job).

    Args:
        spec: `paths` (names from `PATHS`), and optionally
            `per_replica_batch` (examples per replica per step, default 64),
            `steps_per_execution` (N above, default 10), `steps` (optimizer
            steps per timed call, a multiple of N; default 100), `repeats`
            (timed calls per path, default 3), `learning_rate` (0.01).

    Returns:
        `{"strategy", "num_workers", "num_replicas", "global_batch",
        "paths": {path: {"images_per_second": best, "median_images_per_second",
        "step_ms": ms per optimizer step at the best throughput, "samples": [images/s, ...],
        "warmup_seconds"}}}`.

    Raises:
        ValueError: `spec` is invalid.
    """
    spec = _check_spec(spec)
    import tfdp
    from tfdp.bench import workloads

    strategy = tfdp.make_strategy()
    info = tfdp.strategy_info(strategy)
    global_batch = spec["per_replica_batch"] * strategy.num_replicas_in_sync
    dataset = workloads.synthetic_dataset(workloads.IMAGE_SHAPE, global_batch)
    runners, warmup = {}, {}
    for path in spec["paths"]:
        start = time.perf_counter()
        runners[path] = _runner(path, strategy, dataset, spec)
        runners[path](spec["steps"])  # traces and warms up
        warmup[path] = time.perf_counter() - start
    samples = {path: [] for path in runners}
    for _ in range(spec["repeats"]):
        for path, run in runners.items():
            start = time.perf_counter()
            run(spec["steps"])
            samples[path].append(spec["steps"] * global_batch / (time.perf_counter() - start))
    return {
        "strategy": info.strategy,
        "num_workers": info.num_workers,
        "num_replicas": strategy.num_replicas_in_sync,
        "per_replica_batch": spec["per_replica_batch"],
        "global_batch": global_batch,
        "steps_per_execution": spec["steps_per_execution"],
        "steps": spec["steps"],
        "paths": {
            path: {
                "images_per_second": max(values),
                "median_images_per_second": statistics.median(values),
                "step_ms": 1000.0 * global_batch / max(values),
                "samples": values,
                "warmup_seconds": warmup[path],
            }
            for path, values in samples.items()
        },
    }


def run(*, workers=(1, 2), paths=PATHS, rounds: int = 1, threads: int | None = 1,
        timeout: float = 600.0, **spec) -> dict:
    """Measures `paths` on each worker count, `rounds` times in alternation.

    Every round launches `python -m launch --nproc_per_node n` once per
    worker count (1, 2, 1, 2, ... for two rounds), so slow phases of a shared
    machine hit every count; per path, the samples of all rounds are pooled.

    Args:
        workers: worker counts.
        paths: names from `PATHS`.
        rounds: launches per worker count.
        threads: TensorFlow intra-/inter-op threads per worker.
        timeout: seconds per launch.
        **spec: `measure`'s other spec entries (`steps`, `repeats`, ...).

    Returns:
        `{str(n): measure's result}`, samples pooled over rounds.

    Raises:
        procs.JobFailed: a launch failed.
    """
    from tfdp.bench import procs

    results: dict = {}
    for _ in range(rounds):
        for n in workers:
            measured = procs.run_job(
                "throughput", {**spec, "paths": list(paths), "threads": threads},
                nproc=n, timeout=timeout,
            )
            previous = results.get(str(n))
            if previous is not None:
                for path, row in measured["paths"].items():
                    row["samples"] = previous["paths"][path]["samples"] + row["samples"]
                    row["warmup_seconds"] = previous["paths"][path]["warmup_seconds"]
            for row in measured["paths"].values():
                row["images_per_second"] = max(row["samples"])
                row["median_images_per_second"] = statistics.median(row["samples"])
                row["step_ms"] = 1000.0 * measured["global_batch"] / row["images_per_second"]
            results[str(n)] = measured
    return results
