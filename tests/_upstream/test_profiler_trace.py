"""Pins the private XPlane layout `tfdp/_upstream/profiler_trace.py` reads.

When this fails after a TensorFlow upgrade, update that module (and only
that one); `tfdp.bench.bucket_trace` cannot say when ops ran meanwhile.
"""

import tensorflow as tf

from tfdp._upstream import profiler_trace


def test_installed_tensorflow_is_in_the_known_range():
    assert profiler_trace.is_supported(), (
        f"TensorFlow {tf.__version__} is outside KNOWN_TF_RANGE "
        f"{profiler_trace.KNOWN_TF_RANGE}: check the XPlane layout and widen it.")
    assert not profiler_trace.is_supported("2.99.0")


def test_a_profiled_functions_op_is_found_with_its_time(tmp_path):
    @tf.function
    def square_sum(x):
        return tf.reduce_sum(tf.square(x, name="tfdp_canary_square"))

    x = tf.ones([64, 64])
    square_sum(x)  # traced outside the profile
    tf.profiler.experimental.start(str(tmp_path))
    square_sum(x).numpy()
    tf.profiler.experimental.stop()
    events = profiler_trace.host_events(str(tmp_path))
    mine = [e for e in events if "tfdp_canary_square" in e[2] and e[2].endswith(":Square")]
    assert mine, sorted({e[2] for e in events})[:40]
    start, end, _ = mine[0]
    assert 0 <= start <= end
