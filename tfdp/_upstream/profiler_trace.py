"""The host op events of a TensorFlow profiler trace, read from its private XPlane protobuf.

`tf.profiler.experimental.start(logdir)` / `stop()` write a trace as
`<logdir>/plugins/profile/<run>/<host>.xplane.pb`, an `XSpace` protobuf
whose message class lives only in a private module
(`tensorflow.tsl.profiler.protobuf.xplane_pb2`; TensorBoard's profile plugin
reads it the same way). tfdp's benchmarks read it to see when an op ran
(`tfdp.bench.bucket_trace`: whether a gradient bucket's all-reduce starts
before the backward pass ends). Host events are named `"<node name>:<op
type>"`; each line (a thread) has a start in ns and its events' offsets and
durations in ps.

`host_events` is the only reader. It answers `None` outside
`KNOWN_TF_RANGE`. `tests/_upstream/test_profiler_trace.py` is the canary: it
profiles a small function and finds its op.
"""

from __future__ import annotations

import glob
import os

import tensorflow as tf

from tfdp._upstream import _versions

#: TensorFlow (major, minor) versions the XPlane layout was read from, inclusive.
KNOWN_TF_RANGE = ((2, 21), (2, 21))


def is_supported(tf_version: str | None = None) -> bool:
    """Whether `tf_version` (default: the installed one) is in `KNOWN_TF_RANGE`."""
    version = _versions.major_minor(tf.__version__ if tf_version is None else tf_version)
    low, high = KNOWN_TF_RANGE
    return low <= version <= high


def host_events(logdir: str) -> list[tuple[float, float, str]] | None:
    """`(start ms, end ms, name)` of every event of the newest trace under `logdir`, by start.

    Args:
        logdir: the directory given to `tf.profiler.experimental.start`.

    Returns:
        The events, in ms on the trace's one clock (every thread's line), or None when this
        TensorFlow is outside `KNOWN_TF_RANGE`.

    Raises:
        FileNotFoundError: no `.xplane.pb` under `logdir`.
    """
    if not is_supported():
        return None
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=import-outside-toplevel

    paths = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        raise FileNotFoundError(f"No profiler trace (*.xplane.pb) under {logdir}: was "
                                "tf.profiler.experimental.stop() called?")
    space = xplane_pb2.XSpace()
    with open(paths[-1], "rb") as f:
        space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        names = {key: value.name for key, value in plane.event_metadata.items()}
        for line in plane.lines:
            base = line.timestamp_ns * 1e-6
            for event in line.events:
                start = base + event.offset_ps * 1e-9
                events.append((start, start + event.duration_ps * 1e-9,
                               names.get(event.metadata_id, "")))
    return sorted(events)
