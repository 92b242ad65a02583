"""Times the ways to train the benchmark CNN, side by side in one process.

This module owns the in-process measurement behind the scaling and overhead
cases: it builds one model per training *path* under the job's strategy
(`tfdp.make_strategy()`: the default strategy on one worker,
MultiWorkerMirroredStrategy on several), warms each path up (tracing), then
times them in alternation, `repeats` rounds of `steps` optimizer steps each,
so a burst of load on a shared machine hits every path alike. Each call is
timed in steady state (between its executions) and whole (see `measure`).
Every worker of
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
- `tfdp_fit_buckets`: `tfdp_fit` with `bucket_cap_mb=spec["bucket_cap_mb"]`
  (default 0.05 MiB: the CNN's 291 KB in about 6 buckets; DDP's default 25
  MiB, first bucket 1 MiB, would make one): each bucket all-reduced as soon
  as its gradients exist, during the rest of the backward pass
  (`tfdp.training.exchanges.bucketed`);
- `tfdp_fit_bf16`: `tfdp_fit` with `all_reduce_dtype="bfloat16"` (gradients
  summed in bfloat16: half the bytes; `tfdp.distribute.reduction`);
- `tfdp_fit_per_replica`: `tfdp_fit` with `loss_normalization="per_replica"`:
  each replica's own mean, so the two differ by what the global loss counts
  cost (`tfdp.training.loss_normalization`; with this CNN's static batch
  they are constants and no collective of their own);
- `tfdp_fit_powersgd`, `tfdp_fit_topk`, `tfdp_fit_float8`: `tfdp_fit` with
  `gradient_compression=tfdp.compression.PowerSGD(rank=spec["compression_rank"])`,
  `TopK(fraction=spec["topk_fraction"])` or `"float8"` (E4M3 with a per-tensor
  scale and error feedback: a quarter of float32's bytes; `tfdp.compression`);
- `tfdp_fit_local_sgd`, `tfdp_fit_diloco`: `tfdp_fit` with local steps and
  no gradient all-reduce: `sync_every=spec["local_sgd_sync_every"]` (the
  weights averaged), or `sync_every=spec["diloco_sync_every"]` with DiLoCo's
  outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9;
  `tfdp.distribute.local_sync`). Each timed `fit` call is one epoch, which
  also ends a window;
- `tfdp_fit_diloco_overlap`: `tfdp_fit_diloco` with `overlap_sync=True`: each
  window's all-reduce runs in a background thread during the next window and
  is applied one window late (`tfdp.distribute.overlapped_sync`); needs
  `steps_per_execution` dividing `diloco_sync_every`. The epoch's end waits
  for the last all-reduce (in the whole call's time, not the steady state's);
- `trainer`: `tfdp.Trainer(..., steps_per_loop=N)`, with an accuracy metric;
- `loop_1`: a hand-written loop, one `strategy.run` step per `tf.function`
  call, no metrics;
- `loop_n`: a hand-written loop, N steps per `tf.function` call, no metrics;
- `loop_n_local`: `loop_n` without the gradient all-reduce (each worker
  applies its own gradients): what the workers cost each other without
  communicating (two processes sharing the cores and memory);
- `loop_n_sync`: `loop_n_local` plus one 4-byte all-reduce per step, which
  waits for the gradients: synchronisation (waiting for the slower worker) and
  collective latency, without the gradients' bytes;
- `loop_n_overlap`: `loop_n` with the gradients all-reduced in two buckets,
  last layers first (dense, conv6, conv5: 77% of the bytes), so the first
  bucket's all-reduce can run during the backward pass of conv4..conv1;
- `input`: no training, only N batches pulled from the distributed iterator
  per `tf.function` call (what the input costs a step).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

PATHS = ("keras_fit", "keras_fit_n", "tfdp_fit", "tfdp_fit_buckets", "tfdp_fit_bf16", "tfdp_fit_per_replica",
         "tfdp_fit_powersgd", "tfdp_fit_topk", "tfdp_fit_float8", "tfdp_fit_local_sgd", "tfdp_fit_diloco", "tfdp_fit_diloco_overlap", "trainer", "loop_1", "loop_n",
         "loop_n_local", "loop_n_sync", "loop_n_overlap", "input")

#: How the hand-written loops exchange gradients (see the module docstring).
_EXCHANGES = {"loop_1": "all_reduce", "loop_n": "all_reduce", "loop_n_local": "none",
              "loop_n_sync": "sync", "loop_n_overlap": "two_buckets"}
#: `loop_n_overlap`'s first bucket: the CNN's variables from conv5 on.
_OVERLAP_FIRST_LAYER = "conv5"

_DEFAULTS = {
    "per_replica_batch": 64,
    "steps_per_execution": 10,
    "steps": 100,
    "repeats": 3,
    "learning_rate": 0.01,
    "compression_rank": 4,
    "topk_fraction": 0.01,
    "local_sgd_sync_every": 8,
    "diloco_sync_every": 16,
    "bucket_cap_mb": 0.05,
    "model": "cnn",
}
#: Values of the `model` spec entry: the benchmark CNN, or the ≈10 M-parameter
#: MLP whose 40 MB of gradients make communication the step's largest part.
MODELS = ("cnn", "mlp")


def _check_spec(spec: dict) -> dict:
    spec = {**_DEFAULTS, **spec}
    unknown = [p for p in spec.get("paths", ()) if p not in PATHS]
    if unknown or not spec.get("paths"):
        raise ValueError(
            f"`paths` must be a non-empty list of {', '.join(PATHS)}. "
            f"Received: paths={spec.get('paths')!r}"
        )
    if spec["steps"] % spec["steps_per_execution"] or spec["steps"] < 2 * spec[
        "steps_per_execution"
    ]:
        raise ValueError(
            f"`steps` must be a multiple of `steps_per_execution`, at least two "
            f"executions, so every path runs whole executions and a steady state can be "
            f"timed between them. Received: steps={spec['steps']}, "
            f"steps_per_execution={spec['steps_per_execution']}"
        )
    if spec["model"] not in MODELS:
        raise ValueError(f"`model` must be one of {', '.join(MODELS)}. "
                         f"Received: model={spec['model']!r}")
    if spec["model"] != "cnn" and "loop_n_overlap" in spec["paths"]:
        raise ValueError("`loop_n_overlap` splits the CNN's layers; it needs model='cnn'.")
    return spec


def _build_model(spec):
    from tfdp.bench import workloads

    return workloads.build_cnn() if spec["model"] == "cnn" else workloads.build_mlp()


def _feature_shape(spec):
    from tfdp.bench import workloads

    return workloads.IMAGE_SHAPE if spec["model"] == "cnn" else (workloads.MLP_INPUT,)


def _loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _optimizer(spec):
    import keras

    return keras.optimizers.SGD(spec["learning_rate"], momentum=0.9)


def _fit_runner(strategy, dataset, spec, *, use_tfdp: bool, steps_per_execution: int,
                mark: Callable[[], None], all_reduce_dtype: str | None = None,
                loss_normalization: str = "global",
                compression: str | None = None,
                bucket_cap_mb: float | None = None) -> Callable[[int], None]:
    """`run(steps)`: `steps` steps of `model.fit`; `compression` also names the local-step paths."""
    import keras
    import tfdp

    with strategy.scope():
        model = _build_model(spec)
        arguments = dict(optimizer=_optimizer(spec), loss=_loss(), metrics=["accuracy"],
                         steps_per_execution=steps_per_execution)
        if use_tfdp:
            compressor = None
            if compression == "powersgd":
                compressor = tfdp.compression.PowerSGD(rank=spec["compression_rank"])
            elif compression == "topk":
                compressor = tfdp.compression.TopK(fraction=spec["topk_fraction"])
            elif compression == "float8":
                compressor = "float8"
            local = {}
            if compression == "local_sgd":
                local = dict(sync_every=spec["local_sgd_sync_every"])
            elif compression in ("diloco", "diloco_overlap"):
                from tfdp.distribute import local_sync

                local = dict(sync_every=spec["diloco_sync_every"],
                             outer_optimizer=local_sync.diloco_outer_optimizer(0.7, 0.9),
                             overlap_sync=compression == "diloco_overlap")
            tfdp.compile(model, all_reduce_dtype=all_reduce_dtype,
                         loss_normalization=loss_normalization,
                         gradient_compression=compressor, bucket_cap_mb=bucket_cap_mb,
                         **local, **arguments)
        else:
            model.compile(**arguments)

    # Marks the start of every execution (one train-function call).
    clock = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: mark())

    def run(steps: int) -> None:
        model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[clock])

    return run


def _trainer_runner(strategy, dataset, spec, *, mark) -> Callable[[int], None]:
    import tfdp

    with strategy.scope():
        model = _build_model(spec)
        optimizer = _optimizer(spec)
    trainer = tfdp.Trainer(
        model, optimizer=optimizer, loss=_loss(), strategy=strategy,
        batch=tfdp.BatchConfig(spec["per_replica_batch"], strategy.num_replicas_in_sync),
        metrics=["accuracy"], steps_per_loop=spec["steps_per_execution"],
    )
    # Marks the start of every loop (one tf.function call of steps_per_loop
    # steps), through Trainer's own hook.
    trainer.train_loop_begin = mark

    def run(steps: int) -> None:
        # One "epoch" per call, so each call starts at offset 0 (no skipping).
        trainer.train(dataset, steps=trainer.global_step + steps, steps_per_epoch=steps)

    return run


def _exchange_gradients(gradients, variables, exchange: str):
    """Gradients to apply, after `exchange` (replica context; see `_EXCHANGES`).

    Returns `(gradients, reduced)`: `reduced` says whether the optimizer's own
    all-reduce must be skipped (the gradients were exchanged here, or are
    deliberately left local).
    """
    import tensorflow as tf

    if exchange == "all_reduce":
        return gradients, False
    context = tf.distribute.get_replica_context()
    if exchange == "none":
        return gradients, True
    if exchange == "sync":
        # 4 bytes that depend on every gradient: the all-reduce waits for the
        # backward pass, as the gradient all-reduce does.
        token = tf.add_n([tf.reduce_sum(g[..., :1]) for g in gradients]) * 0.0
        token = context.all_reduce(tf.distribute.ReduceOp.SUM, token)
        with tf.control_dependencies([token]):
            return [tf.identity(g) for g in gradients], True
    first = next(i for i, v in enumerate(variables)
                 if v.path.split("/")[-2] == _OVERLAP_FIRST_LAYER)
    late = context.all_reduce(tf.distribute.ReduceOp.SUM, gradients[first:])
    early = context.all_reduce(tf.distribute.ReduceOp.SUM, gradients[:first])
    return list(early) + list(late), True


def _loop_runner(strategy, dataset, spec, *, steps_per_call: int, exchange: str,
                 mark) -> Callable[[int], None]:
    import tensorflow as tf
    from tfdp._upstream import keras_optimizer_reduction

    with strategy.scope():
        model = _build_model(spec)
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
        gradients, reduced = _exchange_gradients(
            tape.gradient(loss, variables), variables, exchange)
        if reduced and strategy.num_replicas_in_sync > 1:
            with keras_optimizer_reduction.gradients_already_reduced(optimizer):
                optimizer.apply_gradients(zip(gradients, variables))
        else:
            optimizer.apply_gradients(zip(gradients, variables))

    @tf.function
    def loop(iterator, num_steps):
        for _ in tf.range(num_steps):
            strategy.run(replica_step, args=(next(iterator),))

    def run(steps: int) -> None:
        iterator = iter(distributed)
        count = tf.constant(steps_per_call)
        for _ in range(steps // steps_per_call):
            mark()
            loop(iterator, count)
        optimizer.iterations.numpy()  # a host sync, as every path ends with

    return run


def _input_runner(strategy, dataset, spec, *, mark) -> Callable[[int], None]:
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
            mark()
            pull(iterator, count).numpy()

    return run


def _runner(path, strategy, dataset, spec, mark):
    if path.startswith(("keras_fit", "tfdp_fit")):
        return _fit_runner(
            strategy, dataset, spec, use_tfdp=path.startswith("tfdp"), mark=mark,
            steps_per_execution=1 if path == "keras_fit" else spec["steps_per_execution"],
            all_reduce_dtype="bfloat16" if path == "tfdp_fit_bf16" else None,
            loss_normalization="per_replica" if path == "tfdp_fit_per_replica" else "global",
            compression=_COMPRESSION_OF_PATH.get(path),
            bucket_cap_mb=spec["bucket_cap_mb"] if path == "tfdp_fit_buckets" else None,
        )
    if path == "trainer":
        return _trainer_runner(strategy, dataset, spec, mark=mark)
    if path in _EXCHANGES:
        return _loop_runner(strategy, dataset, spec, mark=mark, exchange=_EXCHANGES[path],
                            steps_per_call=_steps_per_call(path, spec))
    return _input_runner(strategy, dataset, spec, mark=mark)


_COMPRESSION_OF_PATH = {"tfdp_fit_powersgd": "powersgd", "tfdp_fit_topk": "topk",
                        "tfdp_fit_float8": "float8",
                        "tfdp_fit_local_sgd": "local_sgd", "tfdp_fit_diloco": "diloco",
                        "tfdp_fit_diloco_overlap": "diloco_overlap"}


def _steps_per_call(path: str, spec: dict) -> int:
    return 1 if path in ("keras_fit", "loop_1") else spec["steps_per_execution"]


def _summary(samples: dict, global_batch: int) -> dict:
    """Best and median of a path's samples (see `measure`)."""
    steady, calls, overheads = samples["samples"], samples["call_samples"], samples["overhead_samples"]
    return {
        **samples,
        "images_per_second": max(steady),
        "median_images_per_second": statistics.median(steady),
        "step_ms": 1000.0 * global_batch / max(steady),
        "call_images_per_second": max(calls),
        "call_overhead_ms": 1000.0 * statistics.median(overheads),
    }


def measure(spec: dict) -> dict:
    """Times every path in `spec["paths"]` (a `tfdp.bench.worker` job).

    Each timed call (`model.fit(steps_per_epoch=steps)`, `trainer.train(...)`,
    or `steps / N` loop calls) is measured two ways: steady state, from the
    start of its first execution (one `tf.function` call of N steps, or one
    step for `keras_fit` / `loop_1`) to the start of its last, so per-step
    costs (host syncs, log reductions, callbacks) count and per-call set-up
    does not; and the whole call, whose excess over its executions is the
    per-call (per-epoch) overhead: iterator creation, callbacks, epoch-end
    metric reads.

    Args:
        spec: `paths` (names from `PATHS`), and optionally
            `per_replica_batch` (examples per replica per step, default 64),
            `steps_per_execution` (N above, default 10), `steps` (optimizer
            steps per timed call, a multiple of N, at least 2 executions;
            default 100), `repeats` (timed calls per path, default 3),
            `learning_rate` (0.01), `model` (`"cnn"`, default, or `"mlp"`:
            `tfdp.bench.workloads`; "images" are then MLP examples).

    Returns:
        `{"strategy", "num_workers", "num_replicas", "global_batch",
        "paths": {path: {"images_per_second": best steady-state global
        images/s, "median_images_per_second", "step_ms": ms per optimizer
        step at the best, "call_images_per_second": best whole-call
        images/s, "call_overhead_ms": median per-call overhead, "samples",
        "call_samples", "overhead_samples", "warmup_seconds"}}}`.

    Raises:
        ValueError: `spec` is invalid.
    """
    spec = _check_spec(spec)
    import tfdp
    from tfdp.bench import workloads

    strategy = tfdp.make_strategy()
    info = tfdp.strategy_info(strategy)
    global_batch = spec["per_replica_batch"] * strategy.num_replicas_in_sync
    dataset = workloads.synthetic_dataset(_feature_shape(spec), global_batch)
    marks: list[float] = []

    def mark() -> None:
        marks.append(time.perf_counter())

    runners, warmup = {}, {}
    for path in spec["paths"]:
        start = time.perf_counter()
        runners[path] = _runner(path, strategy, dataset, spec, mark)
        runners[path](spec["steps"])  # traces and warms up
        warmup[path] = time.perf_counter() - start
    samples = {path: {"samples": [], "call_samples": [], "overhead_samples": []}
               for path in runners}
    for _ in range(spec["repeats"]):
        for path, run in runners.items():
            marks.clear()
            start = time.perf_counter()
            run(spec["steps"])
            seconds = time.perf_counter() - start
            executions = spec["steps"] // _steps_per_call(path, spec)
            if len(marks) != executions:
                raise RuntimeError(
                    f"path {path!r}: expected {executions} executions of "
                    f"{_steps_per_call(path, spec)} step(s) in {spec['steps']} steps, "
                    f"counted {len(marks)}."
                )
            cycle = (marks[-1] - marks[0]) / (executions - 1)
            samples[path]["samples"].append(_steps_per_call(path, spec) * global_batch / cycle)
            samples[path]["call_samples"].append(spec["steps"] * global_batch / seconds)
            samples[path]["overhead_samples"].append(seconds - executions * cycle)
    return {
        "strategy": info.strategy,
        "num_workers": info.num_workers,
        "num_replicas": strategy.num_replicas_in_sync,
        "per_replica_batch": spec["per_replica_batch"],
        "global_batch": global_batch,
        "steps_per_execution": spec["steps_per_execution"],
        "steps": spec["steps"],
        "paths": {
            path: {**_summary(values, global_batch), "warmup_seconds": warmup[path]}
            for path, values in samples.items()
        },
    }


def run(*, workers=(1, 2), paths=PATHS, rounds: int = 1, threads: int | None = 1,
        timeout: float = 600.0, inter_op_threads: int | None = None, **spec) -> dict:
    """Measures `paths` on each worker count, `rounds` times in alternation.

    Every round launches `tfdp-launch --nproc_per_node n` once per
    worker count (1, 2, 1, 2, ... for two rounds), so slow phases of a shared
    machine hit every count; per path, the samples of all rounds are pooled.

    Args:
        workers: worker counts.
        paths: names from `PATHS`.
        rounds: launches per worker count.
        threads: TensorFlow intra-/inter-op threads per worker.
        inter_op_threads: inter-op threads per worker instead, or None.
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
                "throughput", {**spec, "paths": list(paths), "threads": threads,
                               "inter_op_threads": inter_op_threads},
                nproc=n, timeout=timeout,
            )
            previous = results.get(str(n))
            if previous is not None:
                for path, row in measured["paths"].items():
                    pooled = {key: previous["paths"][path][key] + row[key]
                              for key in ("samples", "call_samples", "overhead_samples")}
                    measured["paths"][path] = {
                        **_summary(pooled, measured["global_batch"]),
                        "warmup_seconds": previous["paths"][path]["warmup_seconds"],
                    }
            results[str(n)] = measured
    return results
