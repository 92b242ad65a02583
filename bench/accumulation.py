"""Case 4: gradient accumulation against all-reducing every micro-batch.

This module owns the accumulation case. The workload is communication bound
on purpose: the ≈10 M-parameter MLP of `tfdp.bench.workloads` (40 MB of
float32 gradients per all-reduce) with a small micro-batch, on two workers
(MultiWorkerMirroredStrategy over loopback). For each k in `accum_steps`:

- accumulated: `tfdp.compile(accum_steps=k)`, one global batch of
  micro_batch × replicas × k examples per optimizer step, one all-reduce;
- per micro-batch: the same model with `accum_steps=1` on micro-batches
  (the k = 1 run), one optimizer step and one all-reduce per micro-batch, so
  a global batch costs k of its steps.

Time: one launch (`measure_times`) builds a model per k and times them in
alternation, round after round, so every k sees the same minutes of a shared
machine. On the shared 2-core VM the suite was written on, interference only
ever adds time, in bursts that can double a call (a 1-worker k = 8 run took
0.118 to 0.256 s per global batch), so, as the throughput case does, the
speed-up compares the fastest calls: k × (fastest k = 1 time) ÷ (fastest time
at k). The median over rounds of the same ratio within each round is
reported beside it. Memory: each configuration runs in fresh worker
processes (`measure`), so its peak memory is its own: the process's peak
resident set (`VmHWM` in
/proc/self/status) and TensorFlow's CPU allocator peak
(`tf.config.experimental.get_memory_info`, which does track host memory),
both after warm-up minus before, and in total. A separate single process
(`count_all_reduces`) counts the all-reduces per global batch the way
`tests/training/test_accumulation.py` does: a MirroredStrategy over two logical CPUs
whose cross-device ops count every reduction they launch.
"""

from __future__ import annotations

import statistics
import time

from tfdp.bench import procs

_DEFAULTS = {"micro_batch": 16, "steps": 20, "repeats": 3, "learning_rate": 0.01}


def _vm_hwm_bytes() -> int:
    """This process's peak resident set size, in bytes (Linux /proc)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not found in /proc/self/status (peak memory needs Linux).")


def _compiled_mlp(strategy, accum_steps: int, spec: dict):
    import keras
    import tfdp
    from tfdp.bench import workloads

    with strategy.scope():
        model = workloads.build_mlp()
        tfdp.compile(
            model, optimizer=keras.optimizers.SGD(spec["learning_rate"], momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            accum_steps=accum_steps,
        )
    return model


def _local_device(strategy) -> str:
    from tfdp.distribute import strategy_info as strategy_info_lib

    return strategy_info_lib.strategy_info(strategy).devices[0]


def measure(spec: dict) -> dict:
    """Times and sizes one accumulation configuration (a `tfdp.bench.worker` job).

    Args:
        spec: `accum_steps` (k), and optionally `micro_batch` (examples per
            replica per micro-batch, default 16), `steps` (optimizer steps per
            timed call, default 20), `repeats` (timed calls, default 3).

    Returns:
        `{"accum_steps", "global_batch", "seconds_per_global_batch"` (median),
        `"best_seconds_per_global_batch", "samples", "peak_rss_bytes",
        "rss_growth_bytes", "tf_peak_bytes", "tf_growth_bytes"}`; the growths
        are peaks during training minus the level after the model was built.
    """
    spec = {**_DEFAULTS, **spec}
    import tensorflow as tf
    import tfdp
    from tfdp.bench import workloads

    strategy = tfdp.make_strategy()
    k = spec["accum_steps"]
    global_batch = spec["micro_batch"] * strategy.num_replicas_in_sync * k
    model = _compiled_mlp(strategy, k, spec)
    dataset = workloads.synthetic_dataset((workloads.MLP_INPUT,), global_batch)
    device = _local_device(strategy)
    rss_before = _vm_hwm_bytes()
    tf_before = _allocator_bytes(device, "current")
    if tf_before is not None:
        tf.config.experimental.reset_memory_stats(device)
    model.fit(dataset, epochs=1, steps_per_epoch=spec["steps"], verbose=0)  # warm-up
    samples = []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        model.fit(dataset, epochs=1, steps_per_epoch=spec["steps"], verbose=0)
        samples.append((time.perf_counter() - start) / spec["steps"])
    rss_peak = _vm_hwm_bytes()
    tf_peak = _allocator_bytes(device, "peak")
    return {
        "accum_steps": k,
        "micro_batch": spec["micro_batch"],
        "num_replicas": strategy.num_replicas_in_sync,
        "global_batch": global_batch,
        "parameters": int(model.count_params()),
        "seconds_per_global_batch": statistics.median(samples),
        "best_seconds_per_global_batch": min(samples),
        "samples": samples,
        "peak_rss_bytes": rss_peak,
        "rss_growth_bytes": rss_peak - rss_before,
        "tf_peak_bytes": tf_peak,
        "tf_growth_bytes": None if tf_peak is None else tf_peak - tf_before,
    }


def _allocator_bytes(device: str, key: str) -> int | None:
    """TensorFlow's CPU allocator `current` or `peak` bytes, or None where it keeps no stats.

    Some TensorFlow CPU builds and machines answer "Allocator stats not
    available" (seen on an AMD EPYC VM, TensorFlow 2.21); the resident-set
    figures still stand there.
    """
    import tensorflow as tf

    try:
        return tf.config.experimental.get_memory_info(device)[key]
    except ValueError:
        return None


def measure_times(spec: dict) -> dict:
    """Times every k in one launch, in alternation (a `tfdp.bench.worker` job).

    Args:
        spec: `accum_steps` (list of k), and optionally `micro_batch`,
            `steps` (optimizer steps per timed call), `repeats` (rounds; each
            round times every k once, in order).

    Returns:
        `{"num_replicas", "samples": {str(k): [seconds per global batch, one
        per round]}, "warmup_seconds": {str(k): ...}}`.
    """
    spec = {**_DEFAULTS, **spec}
    import tfdp
    from tfdp.bench import workloads

    strategy = tfdp.make_strategy()
    runners, warmup = {}, {}
    for k in spec["accum_steps"]:
        start = time.perf_counter()
        model = _compiled_mlp(strategy, k, spec)
        dataset = workloads.synthetic_dataset(
            (workloads.MLP_INPUT,), spec["micro_batch"] * strategy.num_replicas_in_sync * k)
        model.fit(dataset, epochs=1, steps_per_epoch=spec["steps"], verbose=0)  # warm-up
        runners[k] = (model, dataset)
        warmup[str(k)] = time.perf_counter() - start
    samples = {str(k): [] for k in runners}
    for _ in range(spec["repeats"]):
        for k, (model, dataset) in runners.items():
            start = time.perf_counter()
            model.fit(dataset, epochs=1, steps_per_epoch=spec["steps"], verbose=0)
            samples[str(k)].append((time.perf_counter() - start) / spec["steps"])
    return {"num_replicas": strategy.num_replicas_in_sync, "samples": samples,
            "warmup_seconds": warmup}


def _counting_strategy():
    """MirroredStrategy over /cpu:0, /cpu:1 counting the reductions it launches."""
    import tensorflow as tf
    from tfdp._upstream import strategy_internals

    counter = tf.Variable(0, dtype=tf.int64, trainable=False)

    class CountingReduction(tf.distribute.ReductionToOneDevice):
        def batch_reduce(self, reduce_op, value_destination_pairs, options=None):
            with tf.control_dependencies([counter.assign_add(1)]):
                return super().batch_reduce(reduce_op, value_destination_pairs, options)

        def reduce(self, reduce_op, per_replica_value, destinations, options=None):
            with tf.control_dependencies([counter.assign_add(1)]):
                return super().reduce(reduce_op, per_replica_value, destinations, options)

    strategy_internals.reserve_collective_keys()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], CountingReduction())
    return strategy, counter


def count_all_reduces(spec: dict) -> dict:
    """All-reduces per global batch, accumulated and per micro-batch (a worker job).

    Args:
        spec: `accum_steps` (list of k), and optionally `micro_batch` and
            `steps` (global batches to train, default 3).

    Returns:
        `{"accumulated": {k: all-reduces per global batch},
        "per_micro_batch": {k: ...}}`.
    """
    import tfdp

    tfdp.configure_cpu_devices(2)
    from tfdp.bench import workloads

    micro, steps = spec.get("micro_batch", 4), spec.get("steps", 3)
    result = {"accumulated": {}, "per_micro_batch": {}}
    for k in spec["accum_steps"]:
        for mode, accum, batch, num_steps in (
            ("accumulated", k, micro * 2 * k, steps),
            ("per_micro_batch", 1, micro * 2, steps * k),
        ):
            strategy, counter = _counting_strategy()
            model = _compiled_mlp(strategy, accum, {**_DEFAULTS, **spec})
            dataset = workloads.synthetic_dataset((workloads.MLP_INPUT,), batch)
            model.fit(dataset, epochs=1, steps_per_epoch=num_steps, verbose=0)
            result[mode][str(k)] = int(counter.numpy()) / steps
    return result


def run(*, accum_steps=(1, 4, 8), micro_batch: int = 16, steps: int = 20, repeats: int = 3,
        rounds: int = 5, nproc: int = 2, threads: int | None = 1,
        timeout: float = 300.0) -> dict:
    """Runs the accumulation case: one `nproc`-worker job timing every k in
    alternation, then one fresh job per k for its peak memory.

    Args:
        accum_steps: values of k; must include 1 (the per-micro-batch baseline).
        micro_batch: examples per replica per micro-batch.
        steps: optimizer steps per timed call.
        repeats: timed calls per memory job (their median is reported as
            "separate launches").
        rounds: alternating rounds of the timing job.
        nproc: worker processes.
        threads: TensorFlow intra-/inter-op threads per worker (None: default).
        timeout: seconds per job.

    Returns:
        The case's result: per-k measurements, the speed-up of accumulating
        over all-reducing every micro-batch, memory ratios and all-reduce counts.

    Raises:
        ValueError: `accum_steps` does not include 1.
        procs.JobFailed: a job failed.
    """
    if 1 not in accum_steps:
        raise ValueError(
            f"`accum_steps` must include 1, the per-micro-batch baseline. "
            f"Received: accum_steps={tuple(accum_steps)!r}"
        )
    times = procs.run_job(
        "accumulation_times",
        {"accum_steps": list(accum_steps), "micro_batch": micro_batch, "steps": steps,
         "repeats": rounds, "threads": threads},
        nproc=nproc, timeout=timeout,
    )["samples"]
    runs = {}
    for k in accum_steps:
        runs[k] = procs.run_job(
            "accumulation",
            {"accum_steps": k, "micro_batch": micro_batch, "steps": steps,
             "repeats": repeats, "threads": threads},
            nproc=nproc, timeout=timeout,
        )
    counts = procs.run_job("count_all_reduces", {"accum_steps": list(accum_steps)},
                           timeout=timeout)
    base = runs[1]
    rows = []
    for k, measured in runs.items():
        timed = times[str(k)]
        # Per round: k steps of k = 1 against one step of k, seconds apart.
        speedups = [k * one / mine for one, mine in zip(times["1"], timed)]
        rows.append({
            "accum_steps": k,
            "global_batch": measured["global_batch"],
            "accumulated_seconds_per_global_batch": min(timed),
            "median_accumulated_seconds_per_global_batch": statistics.median(timed),
            "per_micro_batch_seconds_per_global_batch": k * min(times["1"]),
            "speedup": k * min(times["1"]) / min(timed),
            "median_speedup": statistics.median(speedups),
            "speedup_samples": speedups,
            "separate_launch_seconds_per_global_batch": measured["seconds_per_global_batch"],
            "peak_rss_bytes": measured["peak_rss_bytes"],
            "rss_growth_bytes": measured["rss_growth_bytes"],
            "tf_peak_bytes": measured["tf_peak_bytes"],
            "tf_growth_bytes": measured["tf_growth_bytes"],
            "peak_rss_ratio": measured["peak_rss_bytes"] / base["peak_rss_bytes"],
            "tf_peak_ratio": (measured["tf_peak_bytes"] / base["tf_peak_bytes"]
                              if measured["tf_peak_bytes"] and base["tf_peak_bytes"] else None),
            "all_reduces_accumulated": counts["accumulated"][str(k)],
            "all_reduces_per_micro_batch": counts["per_micro_batch"][str(k)],
        })
    return {
        "status": "ok",
        "workload": (f"MLP {base['parameters']:,} parameters "
                     f"({4 * base['parameters'] / 1e6:.1f} MB of gradients), micro-batch "
                     f"{micro_batch} per replica, {base['num_replicas']} workers"),
        "parameters": base["parameters"],
        "micro_batch": micro_batch,
        "num_replicas": base["num_replicas"],
        "rounds": rounds,
        "rows": rows,
        "times": times,
        "runs": {str(k): v for k, v in runs.items()},
    }
