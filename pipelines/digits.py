"""The offline default dataset: the UCI 8x8 handwritten digits, as TFDS.

This module owns the `digits` TFDS builder and preparing it on first use.
The 1,797 digits (8x8 grey images, intensities 0-16, labels 0-9) ship inside
tfdp as `digits.npz` (`load_arrays`), so nothing is downloaded. The builder
writes them once into a TFDS data directory as `NUM_SHARDS` TFRecord files
per split, so `make_dataset("digits", ...)` goes through exactly the TFDS
reading and file sharding path any other TFDS dataset does.

Fixed split (stratified by label): `train` has 1,437 examples, `test` 360.
The test indices are stored in `digits.npz` beside the images. Pixels are
stored as uint8 in [0, 255] (the original 0-16 intensities times 255/16,
rounded), so the same image normalisation as MNIST applies.

The data are the UCI "Optical Recognition of Handwritten Digits" test set
(E. Alpaydin and C. Kaynak, 1998; https://doi.org/10.24432/C50P49, CC BY
4.0) in the form scikit-learn's `load_digits` gives them, with the split its
`train_test_split(test_size=360, random_state=0, stratify=labels)` gives.
tfdp bundles them instead of depending on scikit-learn: Keras imports
scikit-learn whenever it is installed (`keras.src.wrappers`), which cost
every TensorFlow process about a sixth of its import time.

Where: `data_dir` if given, else `$TFDP_DATA_DIR`, else
`~/tensorflow_datasets` (`default_data_dir`). Preparing is idempotent and safe
when several worker processes start at once on one host or a shared POSIX file
system: they serialise on a lock file, and TFDS writes into a temporary
directory it renames into place.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import io
import os

import numpy as np
import tensorflow_datasets as tfds
from absl import logging

NAME = "digits"
NUM_SHARDS = 8
TEST_SIZE = 360
DATA_DIR_ENV = "TFDP_DATA_DIR"
#: The bundled arrays: `images` uint8 (1797, 8, 8) in [0, 16], `labels` uint8
#: (1797,), `test` int16 (360,) sorted indices of the test split.
ARRAYS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "digits.npz")


def default_data_dir() -> str:
    """Where tfdp keeps the datasets it generates: `$TFDP_DATA_DIR`, else
    `~/tensorflow_datasets`."""
    return os.environ.get(DATA_DIR_ENV) or os.path.expanduser("~/tensorflow_datasets")


#: The splits `Digits` writes, known before it is prepared.
SPLITS = ("test", "train")


@functools.lru_cache(maxsize=1)
def _arrays() -> dict[str, np.ndarray]:
    with np.load(ARRAYS_PATH) as stored:
        arrays = {name: stored[name] for name in ("images", "labels", "test")}
    for array in arrays.values():
        array.flags.writeable = False  # shared by every caller
    return arrays


def load_arrays() -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 digits: `(images, labels)`, uint8 (1797, 8, 8) in [0, 16] and uint8 (1797,).

    The same arrays as `sklearn.datasets.load_digits()`'s `images` and
    `target` (there float64 and int64), read-only.
    """
    arrays = _arrays()
    return arrays["images"], arrays["labels"]


def split_indices() -> dict[str, np.ndarray]:
    """Indices into `load_arrays()` of each split (`SPLITS`), sorted int64 arrays."""
    test = _arrays()["test"].astype(np.int64)
    train = np.setdiff1d(np.arange(len(_arrays()["labels"])), test)
    return {"train": train, "test": test}


class Digits(tfds.core.GeneratorBasedBuilder):
    """The 8x8 UCI handwritten digits bundled with tfdp (`load_arrays`)."""

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
                "8x8 grey images of handwritten digits 0-9 (the UCI optdigits "
                "test set, as sklearn.datasets.load_digits gives it), scaled to "
                "uint8 [0, 255]."
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
        del dl_manager  # Nothing to download: tfdp bundles the data.
        return {
            split: self._generate_examples(indices)
            for split, indices in split_indices().items()
        }

    def _generate_examples(self, indices):
        images, labels = load_arrays()
        for index in indices:
            image = np.round(images[index] * (255.0 / 16.0)).astype(np.uint8)
            yield int(index), {"image": image[..., None], "label": int(labels[index])}


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
