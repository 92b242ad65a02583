"""Case 1: throughput on 1 and 2 workers, and where a 2-worker step's time goes.

This module owns the scaling summary of the throughput runs
(`tfdp.bench.throughput.run`, the CNN at a fixed per-replica batch, one
worker process per replica started by `tfdp-launch`): per training
path, global images/s at each worker count and the scaling efficiency
`throughput(n) / (n × throughput(1))`. It also splits a 2-worker step into parts, each the difference of two
paths timed in the same processes (`tfdp.bench.throughput`):

- compute: the 1-worker step of `loop_n` (a hand-written loop, N steps per
  `tf.function` call, no metrics);
- two processes: `loop_n_local` at 2 workers (no gradient all-reduce) minus
  that: the workers slowing each other down on a shared machine;
- synchronisation: `loop_n_sync` (a 4-byte all-reduce per step) minus
  `loop_n_local`: waiting for the slower worker and the collective's latency;
- gradient bytes: `loop_n` minus `loop_n_sync`: moving the gradients;
- framework: the path minus `loop_n`, both at 2 workers (metrics, logs,
  callbacks, Python per call).

The gradient all-reduce timed alone (the all-reduce case, `bytes_per_pack=0`)
is reported beside them.
"""

from __future__ import annotations

#: Paths whose scaling the targets are about.
TARGET_PATHS = ("tfdp_fit", "trainer")


def summarize(runs: dict, *, paths=None) -> dict:
    """Scaling table from `throughput.run`'s result.

    Args:
        runs: `{str(n): throughput result}`; must include "1".
        paths: paths to include. Defaults to every path measured except `input`.

    Returns:
        `{"status": "ok", "per_replica_batch", "rows": [{"path", "workers":
        {n: images/s}, "efficiency": {n: efficiency}}]}`.
    """
    one = runs["1"]["paths"]
    if paths is None:
        paths = [p for p in one if p != "input"]
    rows = []
    for path in paths:
        throughput = {n: run["paths"][path]["images_per_second"] for n, run in runs.items()}
        rows.append({
            "path": path,
            "workers": throughput,
            "efficiency": {
                n: value / (int(n) * throughput["1"]) for n, value in throughput.items()
            },
        })
    return {
        "status": "ok",
        "per_replica_batch": runs["1"]["per_replica_batch"],
        "steps_per_execution": runs["1"]["steps_per_execution"],
        "strategies": {n: run["strategy"] for n, run in runs.items()},
        "rows": rows,
    }


#: Paths that only serve to split the step (not trained with for real).
DIAGNOSTIC_PATHS = ("loop_n_local", "loop_n_sync", "input")
#: Paths whose gradients are compressed: the breakdown's parts do not apply.
COMPRESSED_PATHS = ("tfdp_fit_powersgd", "tfdp_fit_topk", "tfdp_fit_float8",
                    "tfdp_fit_local_sgd", "tfdp_fit_diloco")


def breakdown(runs: dict, all_reduce: dict | None, *, workers: str = "2") -> dict:
    """Splits each path's `workers`-worker step time (ms) into measured parts.

    Args:
        runs: `throughput.run`'s result with "1" and `workers`, including the
            paths `loop_n`, `loop_n_local` and `loop_n_sync`.
        all_reduce: the all-reduce case's result, or None (then no
            `gradient_all_reduce_alone_ms`).
        workers: the worker count to explain. Defaults to "2".

    Returns:
        `{path: {"step_ms", "compute_ms", "two_processes_ms",
        "synchronisation_ms", "gradient_bytes_ms", "framework_ms",
        "gradient_all_reduce_alone_ms"}}`, or `{}` when a needed path or
        worker count was not measured. The parts sum to `step_ms`; a
        negative part is within the noise.
    """
    needed = ("loop_n", "loop_n_local", "loop_n_sync")
    if workers not in runs or "1" not in runs or any(
        path not in runs[workers]["paths"] for path in needed
    ) or "loop_n" not in runs["1"]["paths"]:
        return {}
    many = {path: row["step_ms"] for path, row in runs[workers]["paths"].items()}
    compute = runs["1"]["paths"]["loop_n"]["step_ms"]
    alone = None
    if all_reduce and all_reduce.get("status") == "ok":
        alone = 1000.0 * next(
            row["seconds"] for row in all_reduce["packs"]
            if row["model"] == "cnn" and row["bytes_per_pack"] == 0
        )
    parts = {}
    for path, step in many.items():
        if path in DIAGNOSTIC_PATHS or path in COMPRESSED_PATHS:
            continue  # compressed paths send other bytes than the loops' (see communication)
        parts[path] = {
            "step_ms": step,
            "compute_ms": compute,
            "two_processes_ms": many["loop_n_local"] - compute,
            "synchronisation_ms": many["loop_n_sync"] - many["loop_n_local"],
            "gradient_bytes_ms": many["loop_n"] - many["loop_n_sync"],
            "framework_ms": step - many["loop_n"],
            "gradient_all_reduce_alone_ms": alone,
        }
    return parts
