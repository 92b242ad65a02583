"""Input pipelines for data-parallel training with tf.distribute.

`make_dataset` gives every replica its own slice of each global batch, each
example once per epoch, and every worker the same number of steps, for
`model.fit` and custom loops alike. Sources: TFDS datasets by name, the
offline `digits` dataset, synthetic data, your own TFRecord files
(`TFRecordSource`), or your own `tf.data.Dataset`.

Installed as `tfdp.pipelines` (`from tfdp import pipelines`). It uses the
library (`tfdp.BatchConfig`); the library never imports it.
"""

import os as _os

_os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from tfdp.pipelines.shape_check import check_model_compatible  # noqa: E402
from tfdp.pipelines.distributed_dataset import PlannedDataset  # noqa: E402
from tfdp.pipelines.distributed_dataset import make_dataset  # noqa: E402
from tfdp.pipelines.pipeline_info import PipelineInfo  # noqa: E402
from tfdp.pipelines.digits import default_data_dir  # noqa: E402
from tfdp.pipelines.digits import prepare as prepare_digits  # noqa: E402
from tfdp.pipelines.preprocess import compose  # noqa: E402
from tfdp.pipelines.preprocess import decode_image  # noqa: E402
from tfdp.pipelines.preprocess import for_images  # noqa: E402
from tfdp.pipelines.preprocess import normalize_images  # noqa: E402
from tfdp.pipelines.preprocess import pad_tokens  # noqa: E402
from tfdp.pipelines.preprocess import random_crop_flip  # noqa: E402
from tfdp.pipelines.source import INFINITE  # noqa: E402
from tfdp.pipelines.source import Source  # noqa: E402
from tfdp.pipelines.source import SourceInfo  # noqa: E402
from tfdp.pipelines.source_registry import check_source_name  # noqa: E402
from tfdp.pipelines.source_registry import describe_source  # noqa: E402
from tfdp.pipelines.source_registry import get_source  # noqa: E402
from tfdp.pipelines.source_registry import known_sources  # noqa: E402
from tfdp.pipelines.source_registry import register_source  # noqa: E402
from tfdp.pipelines.synthetic import SyntheticImages  # noqa: E402
from tfdp.pipelines.synthetic import SyntheticTokens  # noqa: E402
from tfdp.pipelines.tfds_source import prepare_tfds  # noqa: E402
from tfdp.pipelines.tfrecord_source import TFRecordSource  # noqa: E402

__all__ = [
    "check_model_compatible",
    "check_source_name",
    "compose",
    "decode_image",
    "default_data_dir",
    "describe_source",
    "for_images",
    "get_source",
    "INFINITE",
    "known_sources",
    "make_dataset",
    "PlannedDataset",
    "normalize_images",
    "pad_tokens",
    "PipelineInfo",
    "prepare_digits",
    "prepare_tfds",
    "random_crop_flip",
    "register_source",
    "Source",
    "SourceInfo",
    "SyntheticImages",
    "SyntheticTokens",
    "TFRecordSource",
]
