"""Case 1: throughput on 1 and 2 workers, and where a 2-worker step's time goes.

This module owns the scaling summary of the throughput runs
(`tfdp.bench.throughput.run`, the CNN at a fixed per-replica batch, one
worker process per replica started by `python -m launch`): per training
path, global images/s at each worker count and the scaling efficiency
`throughput(n) / (n × throughput(1))`. It also splits a 2-worker step into
parts measured separately:

- compute: the 1-worker step of the leanest path (`loop_n`, a hand-written
  loop with N steps per `tf.function` call and no metrics);
- framework, 1 worker: the path's 1-worker step minus that (metrics, logs,
  callbacks, Python per call);
- gradient all-reduce: the CNN's gradient list all-reduced alone (from the
  all-reduce case, `bytes_per_pack=0`, TensorFlow's default);
- other multi-worker cost: what remains of the 2-worker step (small
  all-reduces for logs and metrics, host syncs, waiting for the slower
  worker, two processes sharing the machine).
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


def breakdown(runs: dict, all_reduce: dict | None, *, workers: str = "2") -> dict:
    """Splits each path's `workers`-worker step time (ms) into measured parts.

    Args:
        runs: `throughput.run`'s result with "1" and `workers`, including
            `loop_n`.
        all_reduce: the all-reduce case's result, or None (the all-reduce
            part is then folded into "other").
        workers: the worker count to explain. Defaults to "2".

    Returns:
        `{path: {"step_ms", "compute_ms", "framework_1_worker_ms",
        "gradient_all_reduce_ms", "other_multi_worker_ms"}}`.
    """
    if workers not in runs or "loop_n" not in runs["1"]["paths"]:
        return {}
    compute = runs["1"]["paths"]["loop_n"]["step_ms"]
    gradient_ms = 0.0
    if all_reduce and all_reduce.get("status") == "ok":
        gradient_ms = 1000.0 * next(
            row["seconds"] for row in all_reduce["packs"]
            if row["model"] == "cnn" and row["bytes_per_pack"] == 0
        )
    parts = {}
    for path, row in runs[workers]["paths"].items():
        if path == "input":
            continue
        one_worker = runs["1"]["paths"][path]["step_ms"]
        parts[path] = {
            "step_ms": row["step_ms"],
            "compute_ms": compute,
            "framework_1_worker_ms": one_worker - compute,
            "gradient_all_reduce_ms": gradient_ms,
            "other_multi_worker_ms": row["step_ms"] - one_worker - gradient_ms,
        }
    if "input" in runs[workers]["paths"]:
        for part in parts.values():
            part["input_ms"] = runs[workers]["paths"]["input"]["step_ms"]
    return parts
