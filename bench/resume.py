"""How long a resume takes to reach its position, late in an epoch: seek against skip.

A resumed run rebuilds its input and must start the epoch at batch `b`.
`pipelines.make_dataset`'s datasets seek there (`start_at_batch`,
`tfdp.pipelines.seekable_order`): nothing before the position is decoded or
preprocessed. Before, `fit` and `tfdp.Trainer` advanced the distributed
iterator `b` times (`advance` here does the same) through the whole pipeline
(read, decode, shuffle, preprocess, batch, split and copy to the
replicas); this measures that path on the previous
pipeline (read -> shuffle buffer -> preprocess, which `make_dataset` still
builds for sources it cannot address), against the seek.

Timed: from building the epoch's dataset to its first batch at the position
(what a restarted worker waits before its first step; the same for step 0,
the floor any restart pays), on two sources of
`--num_examples` 32x32 RGB images: synthetic JPEG images decoded in
`preprocess` (an indexed source) and PNG `tf.train.Example`s in 50 TFRecord
files (`TFRecordSource`, decoded by its parse). Also the time of one whole
epoch in each order, to show the new order costs nothing in throughput.
Alternating old/new, best of `--repeats`.

    python -m tfdp.bench.resume                  # 50,000 examples, resume at 90%
    python -m tfdp.bench.resume --num_examples=5000 --repeats=1
"""

from __future__ import annotations

import contextlib
import os
import time

import tensorflow as tf
from absl import app
from absl import flags

import tfdp
from tfdp import pipelines
from tfdp.bench import machine
from tfdp.pipelines import input_pipeline

_NUM_EXAMPLES = flags.DEFINE_integer("num_examples", 50_000, "Examples in the split.")
_GLOBAL_BATCH = flags.DEFINE_integer("global_batch", 256, "Examples per step.")
_FRACTION = flags.DEFINE_float("at", 0.9, "Where in the epoch to resume (fraction of its steps).")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Measurements per path, alternating.")
_DATA_DIR = flags.DEFINE_string("data_dir", "/tmp/tfdp_bench_resume", "Where the TFRecord "
                                "files are written (once).")
_EPOCH = flags.DEFINE_boolean("epoch", True, "Also time one whole epoch in each order.")

IMAGE_SHAPE = (32, 32, 3)
NUM_FILES = 50


@contextlib.contextmanager
def previous_pipeline():
    """`make_dataset` builds the pipeline it built before the seek (read -> shuffle
    buffer -> preprocess), as it still does for sources it cannot address."""
    original = input_pipeline.InputPipeline.seekable
    input_pipeline.InputPipeline.seekable = lambda self, mode: False
    try:
        yield
    finally:
        input_pipeline.InputPipeline.seekable = original


def write_tfrecords(directory: str, num_examples: int) -> str:
    """`num_examples` PNG image examples in `NUM_FILES` files (written once); their glob."""
    pattern = os.path.join(directory, f"images-{num_examples}-*.tfrecord")
    if len(tf.io.gfile.glob(pattern)) == NUM_FILES:
        return pattern
    os.makedirs(directory, exist_ok=True)
    source = pipelines.SyntheticImages(num_examples=num_examples, image_shape=IMAGE_SHAPE,
                                       encoding="png", num_distinct=256)
    examples = source.read("train").as_numpy_iterator()
    per_file = -(-num_examples // NUM_FILES)
    for index in range(NUM_FILES):
        path = os.path.join(directory, f"images-{num_examples}-{index:05d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for _, (encoded, label) in zip(range(per_file), examples):
                writer.write(tf.train.Example(features=tf.train.Features(feature={
                    "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(
                        value=[encoded])),
                    "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(
                        value=[int(label)])),
                })).SerializeToString())
    return pattern


def sources(num_examples: int, data_dir: str) -> dict:
    """name -> (source, preprocess)."""
    augment = pipelines.for_images(training=True, augment=True)
    jpeg = pipelines.SyntheticImages(num_examples=num_examples, image_shape=IMAGE_SHAPE,
                                     encoding="jpeg", num_distinct=256)
    files = pipelines.TFRecordSource(files={"train": write_tfrecords(data_dir, num_examples)},
                                     count_cache_dir=data_dir)
    return {
        "synthetic JPEG (indexed)": (
            jpeg, pipelines.compose(pipelines.decode_image(shape=IMAGE_SHAPE[:2]), augment)),
        "TFRecord PNG files": (files, augment),
    }


@tf.function
def advance(iterator, count):
    """What `fit` and `Trainer` did before the seek: consume `count` distributed batches."""
    for _ in tf.range(count):
        next(iterator)


def time_to_position(build, batch: int, *, seek: bool) -> float:
    """Seconds from building the dataset to its batch `batch` in hand."""
    start = time.perf_counter()
    dataset = build()
    if seek:
        iterator = iter(dataset.start_at_batch(batch))
    else:
        iterator = iter(dataset)
        advance(iterator, tf.constant(batch))
    next(iterator)
    return time.perf_counter() - start


def time_epoch(build) -> float:
    start = time.perf_counter()
    for _ in build():
        pass
    return time.perf_counter() - start


def main(argv) -> None:
    del argv
    strategy = tfdp.make_strategy(cpu_replicas=2)
    num_examples, global_batch = _NUM_EXAMPLES.value, _GLOBAL_BATCH.value
    steps = num_examples // global_batch
    batch = int(_FRACTION.value * steps)
    info = machine.describe()
    print(f"machine: {info['cpu']}, {info['cores']} cores, load average "
          f"{machine.load_average()}; TensorFlow {tf.__version__}")
    print(f"{num_examples} examples, global batch {global_batch} on 2 CPU replicas: "
          f"{steps} steps per epoch, resume at step {batch} ({batch / steps:.0%})")
    for name, (source, preprocess) in sources(num_examples, _DATA_DIR.value).items():
        def build():
            return pipelines.make_dataset(source, strategy=strategy, global_batch=global_batch,
                                          seed=0, preprocess=preprocess)

        build()  # counts the files once, traces nothing timed
        old, new, first, old_epoch, new_epoch = [], [], [], [], []
        for _ in range(_REPEATS.value):
            with previous_pipeline():
                old.append(time_to_position(build, batch, seek=False))
            new.append(time_to_position(build, batch, seek=True))
            first.append(time_to_position(build, 0, seek=False))
            if _EPOCH.value:
                with previous_pipeline():
                    old_epoch.append(time_epoch(build))
                new_epoch.append(time_epoch(build))
        print(f"{name}: resume at step {batch}: previous (iterator advanced {batch} times) "
              f"{min(old):.2f} s, seek {min(new):.2f} s ({min(old) / min(new):.1f}x); "
              f"an epoch's first batch (no resume): {min(first):.2f} s"
              + (f"; one whole epoch: previous order {min(old_epoch):.1f} s, "
                 f"new order {min(new_epoch):.1f} s" if _EPOCH.value else ""), flush=True)
    print(f"load average after: {machine.load_average()}")


if __name__ == "__main__":
    app.run(main)
