"""The offline default dataset: scikit-learn's 8x8 handwritten digits, as TFDS.

This module owns the `digits` TFDS builder and preparing it on first use.
scikit-learn ships the 1,797 UCI handwritten digits (8x8 grey images, labels
0-9) inside its package, so nothing is downloaded. The builder writes them
once into a TFDS data directory as `NUM_SHARDS` TFRecord files per split, so
`make_dataset("digits", ...)` goes through exactly the TFDS reading and file
sharding path any other TFDS dataset does.

Fixed split (stratified by label, `random_state=0`): `train` has 1,437
examples, `test` 360. Pixels are stored as uint8 in [0, 255] (the original
0-16 intensities times 255/16, rounded), so the same image normalisation as
MNIST applies.

Where: `data_dir` if given, else `$TFDP_DATA_DIR`, else
`~/tensorflow_datasets` (`default_data_dir`). Preparing is idempotent and safe
when several worker processes start at once on one host or a shared POSIX file
system: they serialise on a lock file, and TFDS writes into a temporary
directory it renames into place.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os

import numpy as np
import tensorflow_datasets as tfds
from absl import logging

NAME = "digits"
NUM_SHARDS = 8
TEST_SIZE = 360
SPLIT_SEED = 0
DATA_DIR_ENV = "TFDP_DATA_DIR"


def default_data_dir() -> str:
    """Where tfdp keeps the datasets it generates: `$TFDP_DATA_DIR`, else
    `~/tensorflow_datasets`."""
    return os.environ.get(DATA_DIR_ENV) or os.path.expanduser("~/tensorflow_datasets")


#: The splits `Digits` writes, known before it is prepared.
SPLITS = ("test", "train")


def split_indices() -> dict[str, np.ndarray]:
    """Indices into `sklearn.datasets.load_digits()` of each split (`SPLITS`), sorted."""
    from sklearn import datasets, model_selection

    labels = datasets.load_digits().target
    train, test = model_selection.train_test_split(
        np.arange(len(labels)),
        test_size=TEST_SIZE,
        random_state=SPLIT_SEED,
        stratify=labels,
    )
    return {"train": np.sort(train), "test": np.sort(test)}


class Digits(tfds.core.GeneratorBasedBuilder):
    """scikit-learn's bundled 8x8 handwritten digits (UCI ML digits)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Stratified 1437/360 train/test split, 8 shards."}
    # TFDS looks for a checksums file next to the builder's code through
    # `code_path`, which (tensorflow-datasets 4.9) imports `importlib_resources`
    # without declaring it as a dependency:
    # https://github.com/tensorflow/datasets/issues/11212. Digits downloads
    # nothing, so it has no checksums file and no need for the lookup.
    code_path = None

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "8x8 grey images of handwritten digits 0-9 from "
                "sklearn.datasets.load_digits, scaled to uint8 [0, 255]."
            ),
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(8, 8, 1)),
                    "label": tfds.features.ClassLabel(num_classes=10),
                }
            ),
            supervised_keys=("image", "label"),
            homepage="https://archive.ics.uci.edu/dataset/80",
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Nothing to download: scikit-learn bundles the data.
        return {
            split: self._generate_examples(indices)
            for split, indices in split_indices().items()
        }

    def _generate_examples(self, indices):
        from sklearn import datasets

        digits = datasets.load_digits()
        for index in indices:
            image = np.round(digits.images[index] * (255.0 / 16.0)).astype(np.uint8)
            yield int(index), {"image": image[..., None], "label": int(digits.target[index])}


@contextlib.contextmanager
def _file_lock(path: str):
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def prepare(data_dir: str | None = None) -> str:
    """Writes the digits dataset into `data_dir` unless it is already there.

    Args:
        data_dir: TFDS data directory; created if missing. Defaults to
            `default_data_dir()`.

    Returns:
        The data directory used.
    """
    data_dir = os.path.abspath(os.path.expanduser(data_dir or default_data_dir()))
    os.makedirs(data_dir, exist_ok=True)
    builder = Digits(data_dir=data_dir)
    if builder.is_prepared():
        return data_dir
    with _file_lock(os.path.join(data_dir, f".{NAME}.lock")):
        builder = Digits(data_dir=data_dir)  # Re-check: another process may have won.
        if not builder.is_prepared():
            logging.info("pipelines: writing the digits dataset to %s", data_dir)
            # TFDS prints "Downloading and preparing ..." to stdout: whichever
            # worker wins the lock would print it, and only the chief may
            # print. The log line above says the same.
            with contextlib.redirect_stdout(io.StringIO()):
                builder.download_and_prepare(
                    download_config=tfds.download.DownloadConfig(
                        num_shards=NUM_SHARDS, try_download_gcs=False
                    )
                )
    return data_dir
