"""Case: data-parallel batch inference, `tfdp.predict` against Keras' `predict`.

Two measurements, each in fresh processes (`tfdp.bench.worker` job
`predict`):

1. **Throughput** (examples/s) of scoring `num_examples` synthetic examples
   with an MLP (64 → 1024 → 1024 → 10), on 1 worker and on 2
   workers (MultiWorkerMirroredStrategy through `tfdp-launch`):
   - `tfdp`: `tfdp.predict` into TFRecord shards (reading, scoring and
     writing the files);
   - `keras`: `model.predict` on the same strategy and batch (which returns
     the outputs of the global input on every worker, in memory);
   - `independent` (2 workers only): each process scores its half with
     `tfdp.predict` on its own, with no strategy across processes. This is
     the most 2 processes can do here, the ceiling `tfdp` is compared with.
   Each job scores once untimed (tracing) and then `repeats` timed times; the
   best call counts. Timed: the whole call on the chief (rank 0), which
   returns last (it waits for the other worker's shards).
2. **Peak memory per worker** (VmHWM, MB) when the output is large: the
   same model with a 1,000-wide head scoring a small and a large input
   (`memory_examples`, e.g. 20k and 200k rows: 80 MB and 800 MB of float32
   predictions), on 2 workers. `tfdp.predict` writes and forgets; Keras
   holds everything.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

from tfdp.bench import procs

INPUT_DIM = 64
HIDDEN = 1024


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _dataset(num_examples: int, *, start: int = 0):
    """Unbatched synthetic examples, made 256 at a time: a per-example `map`
    would cost ~55 us per example here, more than the model."""
    import tensorflow as tf

    def features(indices):
        angles = tf.cast(indices, tf.float32)[:, None] * 0.1
        return tf.sin(angles + tf.range(INPUT_DIM, dtype=tf.float32))

    dataset = tf.data.Dataset.range(start, start + num_examples).batch(256).map(features).unbatch()
    # As a user who knows the size would: no counting pass.
    return dataset.apply(tf.data.experimental.assert_cardinality(num_examples))


def _model(outputs: int):
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((INPUT_DIM,)),
        keras.layers.Dense(HIDDEN, activation="relu"),
        keras.layers.Dense(HIDDEN, activation="relu"),
        keras.layers.Dense(outputs),
    ])


def measure(spec: dict) -> dict:
    """One predict job on this process's worker(s) (a `tfdp.bench.worker` job).

    Args:
        spec: `path` ("tfdp", "keras" or "independent"), `num_examples`,
            `outputs` (head width), `batch_size` (global), `repeats` (timed
            calls; 0: one call, timed, for memory), `output_format`.

    Returns:
        `{"path", "num_workers", "num_examples", "seconds": [...],
        "examples_per_second" (best), "peak_rss_mb" (this process)}`.
    """
    import tensorflow as tf

    import tfdp

    path = spec["path"]
    num_examples = spec["num_examples"]
    rank = int(os.environ.get("TFDP_RANK", "0"))
    world = int(os.environ.get("TFDP_WORLD_SIZE", "1"))
    if path == "independent" or world == 1:
        strategy = tf.distribute.get_strategy()
    else:
        strategy = tfdp.make_strategy("multi_worker")
    with strategy.scope():
        model = _model(spec["outputs"])
    if path == "independent":  # this process's half, alone
        share = num_examples // world
        source = _dataset(share, start=rank * share)
        batch_size = spec["batch_size"] // world
    else:
        source = _dataset(num_examples)
        batch_size = spec["batch_size"]
    scratch = tempfile.mkdtemp(prefix="tfdp-bench-predict-")
    shared = os.environ.get("TFDP_BENCH_SHARED_DIR", scratch)

    def call(index: int) -> float:
        started = time.perf_counter()
        if path == "keras":
            outputs = model.predict(source.batch(batch_size), verbose=0)
            assert len(outputs) == num_examples, len(outputs)
        else:
            output_dir = os.path.join(shared if path == "tfdp" else scratch, f"call-{index}")
            tfdp.predict(model, source, output_dir=output_dir, strategy=strategy,
                         batch_size=batch_size, output_format=spec.get("output_format", "tfrecord"),
                         verbose=0)
        return time.perf_counter() - started

    try:
        if spec["repeats"]:
            call(-1)  # traces; untimed
        seconds = [call(i) for i in range(max(spec["repeats"], 1))]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "path": path, "num_workers": world, "num_examples": num_examples,
        "outputs": spec["outputs"], "batch_size": spec["batch_size"], "seconds": seconds,
        "examples_per_second": num_examples / min(seconds),
        "median_examples_per_second": num_examples / statistics.median(seconds),
        "peak_rss_mb": round(_peak_rss_mb(), 1),
    }


def run(*, num_examples: int = 100_000, batch_size: int = 512, repeats: int = 3,
        memory_examples: tuple[int, ...] = (20_000, 200_000), memory_outputs: int = 1000,
        threads: int | None = 1, timeout: float = 600.0) -> dict:
    """Runs the predict case; see the module docstring.

    Args:
        num_examples: examples scored per throughput call.
        batch_size: global examples per step.
        repeats: timed calls per throughput job.
        memory_examples: input sizes of the memory jobs (smallest first).
        memory_outputs: head width of the memory jobs.
        threads: TensorFlow threads per process.
        timeout: seconds per job.

    Returns:
        `{"rows": [...throughput jobs], "memory": [...], "scaling", "ceiling",
        "tfdp_over_ceiling", "tfdp_over_keras", "memory_growth"}`.
    """
    def job(path, nproc, **extra):
        spec = {"path": path, "num_examples": num_examples, "outputs": 10,
                "batch_size": batch_size, "repeats": repeats, "threads": threads, **extra}
        with tempfile.TemporaryDirectory(prefix="tfdp-bench-predict-shared-") as shared:
            return procs.run_job("predict", spec, nproc=nproc, timeout=timeout,
                                 env={"TFDP_BENCH_SHARED_DIR": shared})

    rows = [job("tfdp", 1), job("keras", 1), job("tfdp", 2), job("keras", 2),
            job("independent", 2)]
    memory = [job(path, 2, num_examples=n, outputs=memory_outputs, repeats=0)
              for n in memory_examples for path in ("tfdp", "keras")]
    return summarize(rows, memory)


def summarize(rows: list[dict], memory: list[dict]) -> dict:
    """Ratios from the jobs' results (every row as `measure` returns it)."""
    def rate(path, workers):
        return next(r["examples_per_second"] for r in rows
                    if r["path"] == path and r["num_workers"] == workers)

    def peak(path, n):
        return next(r["peak_rss_mb"] for r in memory if r["path"] == path and r["num_examples"] == n)

    sizes = sorted({r["num_examples"] for r in memory})
    result = {
        "rows": rows, "memory": memory,
        "scaling": {p: rate(p, 2) / (2 * rate(p, 1)) for p in ("tfdp", "keras")},
        "ceiling": rate("independent", 2) / (2 * rate("tfdp", 1)),
        "tfdp_over_ceiling": rate("tfdp", 2) / rate("independent", 2),
        "tfdp_over_keras": {str(w): rate("tfdp", w) / rate("keras", w) for w in (1, 2)},
    }
    if len(sizes) >= 2:
        small, large = sizes[0], sizes[-1]
        result["memory_growth"] = {
            p: {"small_mb": peak(p, small), "large_mb": peak(p, large),
                "ratio": peak(p, large) / peak(p, small)}
            for p in ("tfdp", "keras")
        }
    return result
