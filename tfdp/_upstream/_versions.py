"""The version gate every `tfdp._upstream` module shares: is this Keras in a known range?

Each module here was written against a range of Keras (major, minor)
versions (its `KNOWN_KERAS_RANGE`) and asks `keras_in_range` before it
touches anything private.
"""

from __future__ import annotations

import re

import keras


def major_minor(version: str) -> tuple[int, int]:
    """`(3, 15)` for `"3.15.1"` (pre-releases and dev builds included).

    Raises:
        ValueError: `version` does not start with `MAJOR.MINOR`.
    """
    match = re.match(r"^\s*(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(
            f"`keras_version` must look like 'MAJOR.MINOR[.PATCH...]'. "
            f"Received: keras_version={version!r}"
        )
    return int(match.group(1)), int(match.group(2))


def keras_in_range(known_range: tuple[tuple[int, int], tuple[int, int]],
                   keras_version: str | None = None) -> bool:
    """Whether `keras_version` (default: the installed one) is in `known_range`, inclusive.

    Raises:
        ValueError: `keras_version` does not start with `MAJOR.MINOR`.
    """
    version = keras.__version__ if keras_version is None else keras_version
    low, high = known_range
    return low <= major_minor(version) <= high
