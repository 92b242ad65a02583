"""When the gradient all-reduces run against the backward pass, from a TensorFlow profiler trace.

This module owns one question about `tfdp.compile(bucket_cap_mb=...)`
(`tfdp.training.exchanges.bucketed`): does a bucket's collective really start
before the backward pass ends, on these workers, over this link? A graph
that allows it is not proof: the executor, its thread pools and the
collective executor decide. It trains the bench CNN (`tfdp.bench.workloads`)
with `tfdp.compile` one step per call, profiles `steps` steps with
`tf.profiler.experimental`, and reads rank 0's host trace
(`tfdp._upstream.profiler_trace`): per
step, when the backward pass ran (the ops under `gradient_tape/`) and when
each `CollectiveReduceV2` ran, relative to the step's first backward op.

    python -m tfdp.launch --nproc_per_node 2 -- python -m tfdp.bench.worker bucket_trace \
        --spec '{"bucket_cap_mb": 0.05}' --out trace.json

It does not time throughput (`tfdp.bench.throughput`'s `tfdp_fit_buckets`).
"""

from __future__ import annotations

import statistics
import tempfile


def _steps(events, count: int) -> list[dict]:
    """Per step: the backward pass's span and each collective's, in ms from the backward's start."""
    backward = [e for e in events if "gradient_tape/" in e[2] and ":" in e[2]]
    collectives = [e for e in events if e[2].endswith(":CollectiveReduceV2")]
    # A step's backward pass starts with the loss's gradient: the first op of
    # a run of them (more than 5 ms after the previous one).
    losses = [e[0] for e in backward if "SparseSoftmaxCrossEntropyWithLogits" in e[2]]
    starts = [t for i, t in enumerate(losses) if i == 0 or t - losses[i - 1] > 5.0]
    steps = []
    for i, start in enumerate(starts[-count:]):
        following = starts[starts.index(start) + 1] if start != starts[-1] else float("inf")
        ops = [e for e in backward if start <= e[0] < following]
        mine = [e for e in collectives if start <= e[0] < following]
        end = max(e[1] for e in ops)
        steps.append({
            "backward_ms": end - start,
            "collectives": [{"start_ms": c[0] - start, "end_ms": c[1] - start} for c in mine],
            "started_before_backward_end": sum(c[0] < end for c in mine),
            "communication_ms_during_backward": sum(
                max(0.0, min(c[1], end) - max(c[0], start)) for c in mine),
        })
    return steps


def measure(spec: dict) -> dict:
    """Profiles `spec["steps"]` (default 5) steps of the CNN with `spec["bucket_cap_mb"]` (None: plain).

    Returns:
        `{"bucket_cap_mb", "steps": [{"backward_ms", "collectives": [{"start_ms",
        "end_ms"}], "started_before_backward_end", "communication_ms_during_backward"}],
        "median_backward_ms", "median_started_before_backward_end"}` on rank 0.
    """
    import keras
    import tensorflow as tf
    import tfdp
    from tfdp._upstream import profiler_trace
    from tfdp.bench import workloads

    steps = int(spec.get("steps", 5))
    strategy = tfdp.make_strategy()
    global_batch = int(spec.get("per_replica_batch", 64)) * strategy.num_replicas_in_sync
    dataset = workloads.synthetic_dataset(workloads.IMAGE_SHAPE, global_batch)
    with strategy.scope():
        model = workloads.build_cnn()
        tfdp.compile(model, optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                     bucket_cap_mb=spec.get("bucket_cap_mb"))
    model.fit(dataset, epochs=1, steps_per_epoch=10, verbose=0)  # traces and warms up
    with tempfile.TemporaryDirectory(prefix="tfdp-bucket-trace-") as logdir:
        tf.profiler.experimental.start(logdir)
        model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)
        tf.profiler.experimental.stop()
        events = profiler_trace.host_events(logdir)
        if events is None:
            raise RuntimeError(
                f"TensorFlow {tf.__version__} is outside tfdp._upstream.profiler_trace."
                "KNOWN_TF_RANGE: its trace layout is unchecked. Update that module.")
        per_step = _steps(events, steps)
    return {
        "bucket_cap_mb": spec.get("bucket_cap_mb"),
        "steps": per_step,
        "median_backward_ms": statistics.median(s["backward_ms"] for s in per_step),
        "median_started_before_backward_end": statistics.median(
            s["started_before_backward_end"] for s in per_step),
    }
