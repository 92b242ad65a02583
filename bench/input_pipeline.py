"""Case 6: the input pipeline alone, `pipelines.make_dataset` against a naive tf.data pipeline.

Times the input pipeline alone (no model) on a decode-heavy source: synthetic
JPEG images, decoded, randomly cropped and flipped, and normalised per
example. The naive pipeline runs the same per-example work with none of the
throughput features (sequential map, no prefetch, tf.data's automatic
parallelisation and prefetch injection switched off); the other is
`make_dataset` (parallel map and batch with AUTOTUNE, prefetch). Both see the
same examples in the same global batches.

This module owns the measurement (`run_benchmark`), its job for the suite's
measurement processes (`measure`, run by `tfdp.bench.worker` through `run`,
in a fresh process like every other case) and a command line:

    python -m tfdp.bench.input_pipeline                      # defaults below
    python -m tfdp.bench.input_pipeline --num_examples=8192 --image_size=224 --epochs=3

Prints examples/s for both (best of `--repeats` alternating measurements,
which discounts interference on a shared machine) and their ratio.
"""

from __future__ import annotations

import dataclasses
import time

import tensorflow as tf

from tfdp import pipelines
from tfdp.bench import procs
from tfdp.pipelines import preprocess as preprocess_lib
from tfdp.pipelines import synthetic


@dataclasses.dataclass(frozen=True)
class BenchmarkResult:
    """Throughput of both pipelines, in examples per second.

    Attributes:
        naive: the sequential pipeline.
        pipelined: `make_dataset`.
        examples: examples per measurement (all epochs).
    """

    naive: float
    pipelined: float
    examples: int

    @property
    def ratio(self) -> float:
        """`pipelined / naive`."""
        return self.pipelined / self.naive

    def describe(self) -> str:
        return (
            f"naive pipeline:        {self.naive:10.1f} examples/s\n"
            f"make_dataset pipeline: {self.pipelined:10.1f} examples/s\n"
            f"speed-up:              {self.ratio:10.2f}x"
        )


def _time_epochs(dataset, epochs: int) -> tuple[int, float]:
    """Iterates `dataset` `epochs` times after a one-batch warm-up."""
    next(iter(dataset))  # Builds the iterator machinery; not timed.
    examples = 0
    start = time.perf_counter()
    for _ in range(epochs):
        for features, _ in dataset:
            examples += int(features.shape[0])
    return examples, time.perf_counter() - start


def naive_dataset(source, preprocess, global_batch: int) -> tf.data.Dataset:
    """The baseline: read -> sequential map -> batch, no prefetch."""
    seeds = tf.data.Dataset.random(seed=0).batch(2)
    dataset = tf.data.Dataset.zip((source.read("train"), seeds)).map(
        lambda example, seed: preprocess(*example, seed)
    )
    dataset = dataset.batch(global_batch, drop_remainder=True)
    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.map_parallelization = False
    options.experimental_optimization.inject_prefetch = False
    return dataset.with_options(options)


def run_benchmark(
    *,
    num_examples: int = 2048,
    image_size: int = 128,
    global_batch: int = 128,
    epochs: int = 2,
    repeats: int = 5,
) -> BenchmarkResult:
    """Times both pipelines over the same synthetic JPEG source.

    Args:
        num_examples: examples per epoch. Defaults to 2048.
        image_size: square image side, in pixels. Defaults to 128.
        global_batch: examples per batch. Defaults to 128.
        epochs: epochs timed per measurement. Defaults to 2.
        repeats: measurements per pipeline, alternating between the two;
            the best of each is reported, which discounts interference from
            other processes on a shared machine. Defaults to 5.

    Returns:
        A `BenchmarkResult`.
    """
    source = synthetic.SyntheticImages(
        num_examples=num_examples,
        image_shape=(image_size, image_size, 3),
        encoding="jpeg",
        num_distinct=64,
    )
    preprocess = preprocess_lib.compose(
        preprocess_lib.decode_image(channels=3, shape=(image_size, image_size)),
        preprocess_lib.random_crop_flip(padding=image_size // 8),
        preprocess_lib.normalize_images(mean=0.5, std=0.25),
    )
    naive = naive_dataset(source, preprocess, global_batch)
    pipelined = pipelines.make_dataset(
        source,
        strategy=tf.distribute.get_strategy(),
        global_batch=global_batch,
        seed=0,
        preprocess=preprocess,
    )
    best = {"naive": 0.0, "pipelined": 0.0}
    counts = set()
    for _ in range(repeats):
        for name, dataset in (("naive", naive), ("pipelined", pipelined)):
            examples, seconds = _time_epochs(dataset, epochs)
            counts.add(examples)
            best[name] = max(best[name], examples / seconds)
    if len(counts) != 1:
        raise RuntimeError(
            f"The pipelines produced different numbers of examples: {sorted(counts)}."
        )
    return BenchmarkResult(
        naive=best["naive"], pipelined=best["pipelined"], examples=counts.pop()
    )


def measure(spec: dict) -> dict:
    """The suite's job (`tfdp.bench.worker input_pipeline`): `run_benchmark(**flags)` as numbers.

    Args:
        spec: `run_benchmark`'s keyword arguments (`"threads"`, for the
            worker, is ignored here).

    Returns:
        `{"setup", "naive_examples_per_second", "pipelined_examples_per_second", "speedup"}`.
    """
    flags = {name: value for name, value in spec.items() if name != "threads"}
    result = run_benchmark(**flags)
    return {
        "setup": describe_setup(**{**_DEFAULTS, **flags}),
        "naive_examples_per_second": result.naive,
        "pipelined_examples_per_second": result.pipelined,
        "speedup": result.ratio,
    }


def run(*, num_examples: int = 2048, image_size: int = 128, global_batch: int = 128,
        epochs: int = 2, repeats: int = 5, timeout: float = 300.0) -> dict:
    """Runs `measure` in a fresh measurement process, as the suite runs every case.

    Args:
        num_examples, image_size, global_batch, epochs, repeats: see `run_benchmark`.
        timeout: seconds before the process is stopped.

    Returns:
        The case's result (`measure`'s fields plus `"status": "ok"` and the flags).

    Raises:
        procs.JobFailed: the benchmark failed or timed out.
    """
    flags = {"num_examples": num_examples, "image_size": image_size,
             "global_batch": global_batch, "epochs": epochs, "repeats": repeats}
    result = procs.run_job("input_pipeline", flags, timeout=timeout)
    return {"status": "ok", **flags, **result}


_DEFAULTS = {"num_examples": 2048, "image_size": 128, "global_batch": 128, "epochs": 2,
             "repeats": 5}


def describe_setup(*, num_examples: int, image_size: int, global_batch: int, epochs: int,
                   repeats: int) -> str:
    """One line saying what is timed."""
    return (f"{num_examples} synthetic {image_size}x{image_size} JPEG images x {epochs} "
            f"epoch(s), global batch {global_batch}, best of {repeats}; decode + random "
            f"crop/flip + normalise per example")


def main(argv=None) -> None:
    from absl import app, flags  # Imported here: only the script needs flags.

    flags.DEFINE_integer("num_examples", 2048, "Examples per epoch.", lower_bound=1)
    flags.DEFINE_integer("image_size", 128, "Square image side, in pixels.", lower_bound=8)
    flags.DEFINE_integer("global_batch", 128, "Examples per batch.", lower_bound=1)
    flags.DEFINE_integer("epochs", 2, "Epochs timed per measurement.", lower_bound=1)
    flags.DEFINE_integer("repeats", 5, "Measurements per pipeline (best is reported).",
                         lower_bound=1)

    def _main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
        config = flags.FLAGS
        if config.global_batch > config.num_examples:
            raise app.UsageError(
                f"--global_batch ({config.global_batch}) must not exceed "
                f"--num_examples ({config.num_examples})."
            )
        print(describe_setup(num_examples=config.num_examples, image_size=config.image_size,
                             global_batch=config.global_batch, epochs=config.epochs,
                             repeats=config.repeats))
        result = run_benchmark(
            num_examples=config.num_examples,
            image_size=config.image_size,
            global_batch=config.global_batch,
            epochs=config.epochs,
            repeats=config.repeats,
        )
        print(result.describe())

    app.run(_main, argv=argv)


if __name__ == "__main__":
    main()
