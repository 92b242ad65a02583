"""Entry point of one measurement process: `python -m tfdp.bench.worker JOB`.

The suite (`tfdp.bench.procs.run_job`) starts this module alone or on every
worker of a `tfdp-launch` job. It reads the job's JSON spec, limits
TensorFlow's thread pools (`"threads"` in the spec) before TensorFlow
initialises, runs the job's function, and on rank 0 (`TFDP_RANK`) writes the
returned dictionary as JSON to `--out`. The measurements themselves live in
the case modules listed in `JOBS`.

    python -m tfdp.bench.worker throughput --spec '{"paths": ["trainer"]}' --out r.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Sequence

#: job name -> (module, function, framework). The function takes the spec
#: dictionary and returns a JSON-serialisable dictionary.
JOBS = {
    "throughput": ("tfdp.bench.throughput", "measure", "tensorflow"),
    "accumulation": ("tfdp.bench.accumulation", "measure", "tensorflow"),
    "accumulation_times": ("tfdp.bench.accumulation", "measure_times", "tensorflow"),
    "count_all_reduces": ("tfdp.bench.accumulation", "count_all_reduces", "tensorflow"),
    "all_reduce": ("tfdp.bench.allreduce", "measure", "tensorflow"),
    "torch_ddp": ("tfdp.bench.peer_torch", "measure", "torch"),
    "time_to_accuracy_tfdp": ("tfdp.bench.time_to_accuracy", "measure_tfdp", "tensorflow"),
    "time_to_accuracy_torch": ("tfdp.bench.time_to_accuracy", "measure_torch", "torch"),
    "time_to_accuracy_keras": ("tfdp.bench.time_to_accuracy", "measure_keras", "tensorflow"),
    "stragglers": ("tfdp.bench.stragglers", "measure", "tensorflow"),
    "input_pipeline": ("tfdp.bench.input_pipeline", "measure", "tensorflow"),
    "predict": ("tfdp.bench.predict", "measure", "tensorflow"),
    "memory_zero": ("tfdp.bench.memory", "measure_zero", "tensorflow"),
    "memory_remat": ("tfdp.bench.memory", "measure_remat", "tensorflow"),
    "bucket_trace": ("tfdp.bench.bucket_trace", "measure", "tensorflow"),
}


def configure_tensorflow_threads(threads: int | None, inter_op_threads: int | None = None) -> None:
    """Limits TensorFlow's intra- and inter-op pools to `threads` each (None: leave).

    `inter_op_threads`, when given, sets the inter-op pool alone: the
    all-reduce in buckets (`bucket_cap_mb`) needs a second inter-op thread
    to start a bucket's collective while the backward pass runs
    (`tfdp.training.exchanges.bucketed`).
    """
    import tensorflow as tf

    if threads is not None:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    if inter_op_threads is not None:
        tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfdp.bench.worker")
    parser.add_argument("job", choices=sorted(JOBS))
    parser.add_argument("--spec", default="{}", help="the job's arguments, as JSON")
    parser.add_argument("--out", required=True, help="where rank 0 writes the result JSON")
    args = parser.parse_args(argv)
    spec = json.loads(args.spec)
    module_name, function_name, framework = JOBS[args.job]
    if framework == "tensorflow":
        os.environ.setdefault("KERAS_BACKEND", "tensorflow")
        configure_tensorflow_threads(spec.get("threads"), spec.get("inter_op_threads"))
    function = getattr(importlib.import_module(module_name), function_name)
    result = function(spec)
    if int(os.environ.get("TFDP_RANK", "0")) == 0:
        temporary = args.out + ".tmp"
        with open(temporary, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(temporary, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
