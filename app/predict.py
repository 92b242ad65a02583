"""`tfdp-predict`: score a registered dataset with a `tfdp-train` run's model, data-parallel.

    tfdp-predict --model_dir runs/digits --dataset=digits --split=test --output_dir preds/
    tfdp-predict --model_dir runs/mine --dataset=tfrecord --files='new/*.tfrecord' --output_dir preds/
    tfdp-launch --nproc_per_node 2 -- tfdp-predict --model_dir runs/digits --output_dir preds/

The model is rebuilt from the run's `summary.json` (model name, the dataset it
was trained on) and its final weights are restored from the run's checkpoint
with `tf.train.Checkpoint`: TensorFlow's own reader, never pickle. Every
worker scores its own shards into `--output_dir` (`tfdp.predict`); a rerun of
the same command scores only the shards that are not complete, so
`tfdp-launch --max_restarts N` resumes a killed job. Read the result with
`tfdp.read_predictions(output_dir)`.

Bad input exits 2 with one line before anything is written: a `--model_dir`
without a finished run, a dataset whose examples do not fit the model, an
`--output_dir` holding another model's predictions or one that cannot be
written.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from tfdp.app import compatibility  # noqa: E402
from tfdp.app import data_description  # noqa: E402
from tfdp.app import user_data  # noqa: E402
from tfdp.app.run_model import UsageError  # noqa: E402
from tfdp.app.run_model import finished_run  # noqa: E402
from tfdp.app.run_model import restore_model  # noqa: E402
from tfdp.app.process_logging import configure_logging  # noqa: E402
from tfdp.app.process_logging import process_is_chief  # noqa: E402
from tfdp.distribute import peer_failures  # noqa: E402
from tfdp.distribute import startup  # noqa: E402
from tfdp.distribute import strategy as strategy_lib  # noqa: E402

flags.DEFINE_string("model_dir", None, "A finished tfdp-train run: its summary.json names the "
                    "model, its checkpoint holds the weights.")
flags.DEFINE_string("dataset", None, "Registered dataset to score (default: the one the run "
                    "was trained on).")
flags.DEFINE_string("split", None, "Split of --dataset to score (default: the split the run "
                    "evaluated on, for the run's own dataset; else test, else validation).")
flags.DEFINE_string("files", None, "With --dataset=tfrecord: glob(s), comma-separated, of the "
                    "TFRecord files of tf.train.Example records to score, in order.")
flags.DEFINE_string("image_key", None, "With --dataset=tfrecord: the feature holding the JPEG "
                    "or PNG bytes (default: the run's, else image/encoded).")
flags.DEFINE_integer("image_size", None, "With --dataset=tfrecord: resize images to this square "
                     "size (default: the run's).")
flags.DEFINE_integer("image_channels", None, "With --dataset=tfrecord: channels to decode to "
                     "(default: the run's, else 3).")
flags.DEFINE_string("data_dir", None, "TFDS data directory (default: $TFDP_DATA_DIR or "
                    "~/tensorflow_datasets).")
flags.DEFINE_string("output_dir", None, "Where the prediction shards and index.json go.")
flags.DEFINE_enum("output_format", "tfrecord", ["tfrecord", "npz", "parquet"],
                  "tfrecord: a tf.train.Example per example; npz: NumPy archives; parquet: "
                  "needs pyarrow.")
flags.DEFINE_integer("batch_size", None, "Examples per step over all replicas of all workers "
                     "(default: 32 per replica).")
flags.DEFINE_integer("shard_size", None, "Examples per output shard (default: the size recorded "
                     "in --output_dir, else about 4 shards per worker).")
flags.DEFINE_enum("strategy", "auto", strategy_lib.KINDS, "Distribution strategy.")
flags.DEFINE_integer("cpu_replicas", None, "Split the CPU into this many replicas (one process, "
                     "no GPU).")
flags.DEFINE_float("log_every_seconds", 10.0, "Seconds between the chief's progress lines.")
flags.mark_flags_as_required(["model_dir", "output_dir"])

FLAGS = flags.FLAGS


def _tfrecord_options(run_config: dict):
    """`--dataset=tfrecord --files=...`, decoded as the run decoded its training files."""
    if not FLAGS.files:
        raise UsageError("--dataset=tfrecord needs --files (a glob of TFRecord files of "
                         "tf.train.Example records to score).")
    trained_on_files = run_config.get("dataset") == user_data.TFRECORD

    def run_default(name, default):
        value = getattr(FLAGS, name)
        if value is not None:
            return value
        return run_config.get(name, default) if trained_on_files else default

    try:
        return user_data.TFRecordOptions(
            files={"predict": FLAGS.files}, label_key=None,
            image_key=run_default("image_key", "image/encoded"),
            image_size=run_default("image_size", None),
            image_channels=run_default("image_channels", 3),
        )
    except user_data.UserDataError as error:
        raise UsageError(str(error)) from None


def _default_split(name: str, source, summary: dict) -> str:
    """The run's evaluation split on its own dataset; else test, else validation."""
    if name == summary["config"]["dataset"] and summary.get("eval_split"):
        return summary["eval_split"]
    builder = getattr(source, "builder", None)  # a TFDS source lists its splits
    splits = (tuple(sorted(builder.info.splits)) if builder is not None and builder.info.splits
              else None)
    described = data_description.DataDescription(name=name, shape=None, dtype=None,
                                                 num_classes=None, splits=splits)
    try:
        return compatibility.eval_split(None, described, flag="--split")
    except compatibility.IncompatibleError as error:
        raise UsageError(str(error)) from None


def _dataset(name: str, split: str | None, data_dir, summary: dict):
    """The split's raw examples, the preprocessing tfdp-train applied to the run's
    data (images scaled and resized to --image_size, tokens padded to the model's
    length), and the split's name.

    Raises:
        UsageError: unknown dataset or split, or examples the model cannot read.
    """
    from tfdp import pipelines

    run_config = summary["config"]
    try:
        if name == user_data.TFRECORD:
            source, split = _tfrecord_options(run_config).source(), "predict"
        else:
            pipelines.check_source_name(name)
            source = pipelines.get_source(name, data_dir=data_dir)
            split = split or _default_split(name, source, summary)
        source.check_split(split)
    except ValueError as error:
        raise UsageError(f"--dataset/--split: {error}") from None
    if name == user_data.TFRECORD:
        # Raw records in: each worker decodes only the images it scores.
        parse, normalize = source.parse_function(), pipelines.for_images(training=False)
        return source.records(split), lambda record: normalize(*parse(record)), split
    dataset = source.read(split)
    features = dataset.element_spec[0]
    data = data_description.describe_source(name, source, features, source.num_classes())
    model_info = summary.get("model") or {}
    input_shape = model_info.get("input_shape") or [None]
    try:
        plan = compatibility.check(
            run_config["model"], data, image_size=run_config.get("image_size"),
            sequence_length=input_shape[0] if data.kind == "tokens" else None,
            num_classes=model_info.get("num_classes"), hints=False)
    except compatibility.IncompatibleError as error:
        raise UsageError(f"{error} (--model is the model of --model_dir={FLAGS.model_dir})"
                         ) from None
    return dataset, plan.preprocess(features, training=False), split


def run_predict() -> dict:
    """Scores `--dataset` with the model of `--model_dir`; returns the chief's summary."""
    import dataclasses

    import tfdp
    from tfdp.inference import shard_formats
    from tfdp.inference.shard_store import ShardStore

    summary = finished_run(FLAGS.model_dir)
    run_config = summary["config"]
    try:
        shard_formats.check_format(FLAGS.output_format)
    except ValueError as error:
        raise UsageError(f"--output_format: {error}") from None
    try:  # before any collective
        ShardStore(FLAGS.output_dir, FLAGS.output_format).check_writable()
    except ValueError as error:
        raise UsageError(f"--output_dir: {error}") from None
    strategy = strategy_lib.make_strategy(FLAGS.strategy, cpu_replicas=FLAGS.cpu_replicas)
    dataset_name = FLAGS.dataset or run_config["dataset"]
    data_dir = FLAGS.data_dir if FLAGS.data_dir is not None else run_config.get("data_dir")
    dataset, preprocess, split = _dataset(dataset_name, FLAGS.split, data_dir, summary)
    model, checkpoint = restore_model(FLAGS.model_dir, run_config, strategy, data_dir=data_dir,
                                      model_info=summary.get("model"))
    try:
        result = tfdp.predict(
            model, dataset, output_dir=FLAGS.output_dir, strategy=strategy,
            batch_size=FLAGS.batch_size, output_format=FLAGS.output_format,
            shard_size=FLAGS.shard_size, preprocess=preprocess,
            model_identity={"name": run_config["model"],
                            "checkpoint": os.path.abspath(checkpoint)},
            log_every_seconds=FLAGS.log_every_seconds,
        )
    except ValueError as error:
        raise UsageError(f"{error} (--model_dir={FLAGS.model_dir}, --dataset={dataset_name}, "
                         f"--split={split})") from None
    return dataclasses.asdict(result)


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    try:
        configure_logging(process_is_chief())
        with peer_failures.explain_peer_failures(collective_timeout=None):
            run_predict()
    except UsageError as error:
        print(f"tfdp-predict: error: {error}", file=sys.stderr)
        sys.exit(2)
    except startup.StartupError as error:
        # 44 when this worker's own port was taken (the launcher retries it), else 1.
        print(f"tfdp-predict: error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    except peer_failures.PeerFailureError as error:
        # 43 for a lost peer (schedulers retry it), 1 for a stuck one.
        print(f"tfdp-predict: error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)


def run() -> None:
    """Console-script entry point (`tfdp-predict`)."""
    app.run(main)


if __name__ == "__main__":
    run()
