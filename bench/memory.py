"""Case: memory per worker, ZeRO-1 (`shard_optimizer_state`) and activation recomputation.

This module owns the memory case. Two measurements, each configuration in
fresh processes (`tfdp.bench.worker` jobs `memory_zero` and `memory_remat`):

1. **ZeRO-1** on 2 workers (MultiWorkerMirroredStrategy through
   `tfdp-launch`): a wide MLP of ≥ 50 M parameters (`ZERO_WIDTH`, 32 → 4096
   → 4096 → 4096 → 4096 → 10) with Adam, compiled with `tfdp.compile`, with
   and without `shard_optimizer_state=True`. The input is 32 floats and the
   per-replica batch 8, so activations are negligible beside the 200 MB of
   weights. Per worker:
   - peak resident set (`VmHWM` in /proc/self/status), in launches with
     TensorFlow's default CPU allocator (what a user's run sees);
   - TensorFlow's allocator peak: `tf.config.experimental.get_memory_info`
     answers "Allocator stats not available" for the default CPU allocator,
     so separate launches run with `TF_CPU_ALLOCATOR_USE_BFC=true`, which
     makes TensorFlow's CPU allocator a BFC allocator that keeps
     statistics (its `peak`, bytes in live tensors);
   - optimizer-state bytes counted from the optimizer's variables (every
     replica copy on this worker), and apart from them the shard variables
     sharding adds (scratch copies of this replica's chunk of every weight);
   - step time: each launch runs `warmup_steps` (tracing included), then
     `steps` steps in one `fit` call, each step timed from one
     `on_train_batch_end` to the next (a step's function call returns when
     its work is done); the launch reports the median step. Launches
     alternate plain, sharded, plain, ... for `rounds` rounds, so both see
     the same minutes of a shared machine; the ratio is of the medians over
     rounds, its spread the range of the per-round ratios.
2. **Activation recomputation** on the registered transformer
   (`tfdp.models.get("transformer", remat=...)`), one process, Adam: the
   allocator peak (BFC, as above) minus the weights and the optimizer state
   counted from the variables is the activation memory (gradients and the
   step's temporaries included, the same in both); step time as above, in
   default-allocator launches alternating without and with remat.
"""

from __future__ import annotations

import os
import statistics
import time

from tfdp.bench import procs

#: The ZeRO model: input width, hidden layers, hidden width, classes.
ZERO_INPUT = 32
ZERO_LAYERS = 4
ZERO_WIDTH = 4096
ZERO_CLASSES = 10
#: The transformer of the remat measurement (`tfdp.models.transformer` options).
REMAT_MODEL = {"sequence_length": 256, "vocab_size": 1000, "num_layers": 4, "num_heads": 4,
               "hidden": 256, "dropout": 0.1}
_BFC = {"TF_CPU_ALLOCATOR_USE_BFC": "true"}


def zero_parameter_count(width: int = ZERO_WIDTH, layers: int = ZERO_LAYERS) -> int:
    """Parameters of the ZeRO MLP (weights and biases)."""
    count, previous = 0, ZERO_INPUT
    for units in (*([width] * layers), ZERO_CLASSES):
        count += previous * units + units
        previous = units
    return count


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not found in /proc/self/status (memory figures need Linux).")


def _allocator(device: str) -> dict | None:
    """TensorFlow's CPU allocator stats (`current`, `peak`), or None where it keeps none."""
    import tensorflow as tf

    try:
        return tf.config.experimental.get_memory_info(device)
    except ValueError:
        return None


def _local_bytes(strategy, variables) -> int:
    """Bytes of every copy of `variables` held by this worker's replicas."""
    total = 0
    for variable in variables:
        value = getattr(variable, "value", variable)
        for component in strategy.experimental_local_results(value):
            total += int(component.shape.num_elements()) * component.dtype.size
    return total


def _step_timer():
    import keras

    class StepTimer(keras.callbacks.Callback):
        """Seconds between consecutive `on_train_batch_end` calls."""

        def __init__(self):
            super().__init__()
            self.ends = []

        def on_train_begin(self, logs=None):
            self.ends = [time.perf_counter()]

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

        @property
        def seconds(self) -> list[float]:
            return [b - a for a, b in zip(self.ends, self.ends[1:])]

    return StepTimer()


def _per_worker(strategy, values: list[float]) -> list[list[float]]:
    """`values` of every worker, rank order (one small all-gather; one worker: itself)."""
    import tensorflow as tf

    if int(os.environ.get("TFDP_WORLD_SIZE", "1")) == 1:
        return [list(values)]

    def gather():
        context = tf.distribute.get_replica_context()
        return context.all_gather(tf.constant([values], tf.float64), axis=0)

    gathered = strategy.experimental_local_results(strategy.run(gather))[0]
    return gathered.numpy().tolist()


def _train_and_measure(strategy, model, dataset, spec: dict, state_bytes) -> dict:
    """Warm-up, timed steps, and the memory figures of this process."""
    from tfdp.distribute import strategy_info as strategy_info_lib

    device = strategy_info_lib.strategy_info(strategy).devices[0]
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    weights = _local_bytes(strategy, model.weights)
    state, scratch = state_bytes(model)
    before = _allocator(device)
    rss_built = _status_bytes("VmRSS")
    model.fit(dataset, epochs=1, steps_per_epoch=spec["warmup_steps"], verbose=0,
              shuffle=False)
    timer = _step_timer()
    model.fit(dataset, epochs=1, steps_per_epoch=spec["steps"], verbose=0, callbacks=[timer],
              shuffle=False)
    peak = _allocator(device)
    fields = {
        "peak_rss_bytes": _status_bytes("VmHWM"),
        "rss_after_build_bytes": rss_built,
        "tf_peak_bytes": -1 if peak is None else peak["peak"],
        "tf_before_training_bytes": -1 if before is None else before["current"],
        "weight_bytes": weights,
        "optimizer_state_bytes": state,
        "shard_scratch_bytes": scratch,
    }
    rows = _per_worker(strategy, list(map(float, fields.values())))
    per_worker = [{name: (None if value < 0 else int(value))
                   for name, value in zip(fields, row)} for row in rows]
    return {
        "timed": spec.get("timed", True),
        "num_replicas": strategy.num_replicas_in_sync,
        "allocator": "bfc" if os.environ.get("TF_CPU_ALLOCATOR_USE_BFC") else "default",
        "parameters": int(model.count_params()),
        "step_seconds": timer.seconds,
        "median_step_seconds": statistics.median(timer.seconds),
        "workers": per_worker,
    }


def measure_zero(spec: dict) -> dict:
    """One ZeRO configuration on this process's worker(s) (a `tfdp.bench.worker` job).

    Args:
        spec: `sharded` (bool), `width`, `layers` (the MLP), `per_replica_batch`,
            `warmup_steps`, `steps` (timed), and optionally `cpu_replicas`
            (one process mirrored over this many logical CPUs; tests).

    Returns:
        `{"sharded", "num_replicas", "allocator", "parameters", "step_seconds",
        "median_step_seconds", "workers": [per worker: "peak_rss_bytes",
        "rss_after_build_bytes", "tf_peak_bytes" (None without allocator
        stats), "tf_before_training_bytes", "weight_bytes",
        "optimizer_state_bytes", "shard_scratch_bytes"]}`.
    """
    import keras
    import tfdp
    from tfdp.bench import workloads

    strategy = tfdp.make_strategy(cpu_replicas=spec.get("cpu_replicas"))
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((ZERO_INPUT,))]
            + [keras.layers.Dense(spec["width"], activation="relu")
               for _ in range(spec["layers"])]
            + [keras.layers.Dense(ZERO_CLASSES)])
        tfdp.compile(model, optimizer=keras.optimizers.Adam(1e-5),
                     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                     shard_optimizer_state=spec["sharded"])
    dataset = workloads.synthetic_dataset(
        (ZERO_INPUT,), spec["per_replica_batch"] * strategy.num_replicas_in_sync)

    def state_bytes(model):
        # tfdp.compile wraps the optimizer (nonfinite="skip"): its exchange's ZeRO-1 state.
        sharding = model.optimizer.sharding
        shards = sharding.shards if sharding is not None else []
        return (_local_bytes(strategy, model.optimizer.variables),
                _local_bytes(strategy, shards))

    result = _train_and_measure(strategy, model, dataset, spec, state_bytes)
    return {"sharded": bool(spec["sharded"]), **result}


def measure_remat(spec: dict) -> dict:
    """The transformer with or without remat, one process (a `tfdp.bench.worker` job).

    Args:
        spec: `remat` (bool), `model` (`tfdp.models.transformer` options,
            `sequence_length` among them), `batch`, `warmup_steps`, `steps`.

    Returns:
        As `measure_zero`, with `"remat"` instead of `"sharded"`.
    """
    import keras
    import numpy as np
    import tensorflow as tf
    import tfdp
    from tfdp import models

    options = dict(spec["model"])
    length = options.pop("sequence_length")
    strategy = tf.distribute.get_strategy()
    keras.utils.set_random_seed(0)
    extra = {"remat": True} if spec["remat"] else {}
    model = models.get("transformer", input_shape=(length,), num_classes=10, **options, **extra)
    tfdp.compile(model, optimizer=keras.optimizers.Adam(1e-4),
                 loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, options["vocab_size"], size=(4 * spec["batch"], length), dtype="int32")
    labels = rng.integers(0, 10, size=(4 * spec["batch"],), dtype="int32")
    dataset = tf.data.Dataset.from_tensor_slices((tokens, labels)).batch(
        spec["batch"], drop_remainder=True).cache().repeat()

    def state_bytes(model):
        return _local_bytes(strategy, model.optimizer.variables), 0

    result = _train_and_measure(strategy, model, dataset, spec, state_bytes)
    return {"remat": bool(spec["remat"]), **result}


def run(*, width: int = ZERO_WIDTH, layers: int = ZERO_LAYERS, per_replica_batch: int = 8,
        warmup_steps: int = 3, steps: int = 10, rounds: int = 3,
        remat_model: dict | None = None, remat_batch: int = 16, remat_rounds: int | None = None,
        allocator_launches: bool = True, threads: int | None = 1,
        timeout: float = 600.0) -> dict:
    """Runs the memory case; see the module docstring.

    Args:
        width, layers: the ZeRO MLP's hidden width and depth.
        per_replica_batch: ZeRO examples per replica per step.
        warmup_steps: untimed steps per launch (tracing included).
        steps: timed steps per launch.
        rounds: alternating plain/sharded timing launches.
        remat_model: the transformer's options (`REMAT_MODEL` by default).
            The remat half is skipped (and says so) when the registered
            transformer has no `remat` option.
        remat_batch: transformer examples per step.
        remat_rounds: alternating timing launches for remat. Defaults to `rounds`.
        allocator_launches: measure the allocator peak in launches of their
            own (True, default); False: the timing launches run with the BFC
            allocator and give every figure (fewer launches, for `--quick`).
        threads: TensorFlow threads per process.
        timeout: seconds per launch.

    Returns:
        `summarize`'s dictionary.
    """
    zero_spec = {"width": width, "layers": layers, "per_replica_batch": per_replica_batch,
                 "warmup_steps": warmup_steps, "steps": steps, "threads": threads}
    zero_runs = _launches("memory_zero", "sharded", zero_spec, rounds, allocator_launches,
                          nproc=2, timeout=timeout)
    remat_runs = None
    if remat_available():
        remat_spec = {"model": dict(remat_model or REMAT_MODEL), "batch": remat_batch,
                      "warmup_steps": warmup_steps, "steps": steps, "threads": threads}
        remat_runs = _launches("memory_remat", "remat", remat_spec, remat_rounds or rounds,
                               allocator_launches, nproc=None, timeout=timeout)
    return summarize(zero_runs, remat_runs)


def _launches(job: str, key: str, spec: dict, rounds: int, allocator_launches: bool, *,
              nproc: int | None, timeout: float) -> list[dict]:
    """Timing launches alternating `key` off and on, then one allocator launch each."""
    env = None if allocator_launches else _BFC
    runs = [procs.run_job(job, {**spec, key: flag}, nproc=nproc, timeout=timeout, env=env)
            for _ in range(rounds) for flag in (False, True)]
    if allocator_launches:
        runs += [procs.run_job(job, {**spec, key: flag, "steps": 2, "timed": False},
                               nproc=nproc, timeout=timeout, env=_BFC)
                 for flag in (False, True)]
    return runs


def remat_available() -> bool:
    """Whether the registered transformer takes `remat` (without importing TensorFlow)."""
    import ast
    import pathlib

    source = pathlib.Path(__file__).resolve().parents[1] / "models" / "transformer.py"
    tree = ast.parse(source.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "transformer":
            return any(a.arg == "remat" for a in node.args.kwonlyargs)
    return False


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _compare(runs: list[dict], key: str) -> dict:
    """Step time and memory of the `key` = False and True runs (see the module docstring)."""
    timing = [r for r in runs if r["timed"]]
    bfc = {r[key]: r for r in runs if r["allocator"] == "bfc"}
    rounds = [timing[i:i + 2] for i in range(0, len(timing) - 1, 2)]
    ratios = [b["median_step_seconds"] / a["median_step_seconds"] for a, b in rounds
              if not a[key] and b[key]]

    def side(flag: bool) -> dict:
        own = [r for r in timing if r[key] == flag]
        first = own[0]["workers"]
        worst = [max(w["peak_rss_bytes"] for w in r["workers"]) for r in own]
        allocator = bfc.get(flag)
        tf_peaks = ([w["tf_peak_bytes"] for w in allocator["workers"]]
                    if allocator else [])
        return {
            "median_step_seconds": _median([r["median_step_seconds"] for r in own]),
            "step_seconds_by_round": [r["median_step_seconds"] for r in own],
            "peak_rss_bytes": _median(worst),
            "peak_rss_bytes_by_round": worst,
            "peak_rss_bytes_by_worker": [w["peak_rss_bytes"] for w in first],
            "tf_peak_bytes": max(tf_peaks) if tf_peaks and None not in tf_peaks else None,
            "tf_peak_bytes_by_worker": tf_peaks,
            "weight_bytes": max(w["weight_bytes"] for w in first),
            "optimizer_state_bytes": max(w["optimizer_state_bytes"] for w in first),
            "shard_scratch_bytes": max(w["shard_scratch_bytes"] for w in first),
            "parameters": own[0]["parameters"],
            "num_replicas": own[0]["num_replicas"],
        }

    off, on = side(False), side(True)
    return {
        "off": off, "on": on,
        "step_time_ratio": on["median_step_seconds"] / off["median_step_seconds"],
        "step_time_ratio_by_round": ratios,
    }


def summarize(zero_runs: list[dict], remat_runs: list[dict] | None = None) -> dict:
    """The case's ratios from the launches' results (each as `measure_*` returns it).

    Returns:
        `{"zero": {...}, "remat": {...} or {"status": "skipped", "reason"},
        "zero_runs", "remat_runs"}`.
    """
    zero = _compare(zero_runs, "sharded")
    off, on = zero["off"], zero["on"]
    state = off["optimizer_state_bytes"]
    zero["optimizer_state_ratio"] = on["optimizer_state_bytes"] / state
    zero["optimizer_state_and_scratch_ratio"] = (
        (on["optimizer_state_bytes"] + on["shard_scratch_bytes"]) / state)
    zero["peak_rss_saving_over_state"] = (off["peak_rss_bytes"] - on["peak_rss_bytes"]) / state
    zero["peak_rss_saving_over_state_by_round"] = [
        (a - b) / state for a, b in zip(off["peak_rss_bytes_by_round"],
                                        on["peak_rss_bytes_by_round"])]
    zero["tf_peak_saving_over_state"] = (
        None if off["tf_peak_bytes"] is None or on["tf_peak_bytes"] is None
        else (off["tf_peak_bytes"] - on["tf_peak_bytes"]) / state)
    result = {"zero": zero, "zero_runs": zero_runs, "remat_runs": remat_runs}
    if remat_runs is None:
        result["remat"] = {"status": "skipped",
                           "reason": "the registered transformer has no `remat` option yet"}
        return result
    remat = _compare(remat_runs, "remat")
    for side in (remat["off"], remat["on"]):
        side["activation_bytes"] = (
            None if side["tf_peak_bytes"] is None
            else side["tf_peak_bytes"] - side["weight_bytes"] - side["optimizer_state_bytes"])
    before, after = remat["off"]["activation_bytes"], remat["on"]["activation_bytes"]
    remat["activation_reduction"] = (None if before is None or after is None
                                     else 1 - after / before)
    remat["status"] = "ok"
    result["remat"] = remat
    return result

