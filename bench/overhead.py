"""Case 2: what each way of training costs next to the others, same strategy.

This module owns the overhead summary of the throughput runs: at each worker
count, every path's images/s and its ratio to tfdp's custom loop
(`tfdp.Trainer`) and to the leanest hand-written loop (`loop_n`), in steady
state, and the per-call (per-epoch) overhead each adds on top. Plain Keras
fit (`keras_fit`, one step per call), tfdp's fit (`tfdp_fit`,
`steps_per_execution=N`) and the loops all ran in the same processes, in
alternation (`tfdp.bench.throughput`).
"""

from __future__ import annotations


def summarize(runs: dict) -> dict:
    """Overhead table from `throughput.run`'s result.

    Args:
        runs: `{str(n): throughput result}`.

    Returns:
        `{"status": "ok", "workers": {n: {"strategy", "rows": [{"path",
        "images_per_second", "median_images_per_second", "step_ms",
        "call_images_per_second", "call_overhead_ms", "vs_trainer",
        "vs_loop_n"}], "loss_counts_cost"}}}`; `loss_counts_cost` is
        `tfdp_fit`'s step time ÷ `tfdp_fit_per_replica`'s − 1 (what the
        global loss counts cost), None without both; throughputs are steady state (see
        `tfdp.bench.throughput.measure`), ratios of the best.
    """
    workers = {}
    for n, run in runs.items():
        paths = run["paths"]
        rows = []
        for path, row in paths.items():
            if path == "input":
                continue
            rows.append({
                "path": path,
                "images_per_second": row["images_per_second"],
                "median_images_per_second": row["median_images_per_second"],
                "step_ms": row["step_ms"],
                "call_images_per_second": row["call_images_per_second"],
                "call_overhead_ms": row["call_overhead_ms"],
                "vs_trainer": (row["images_per_second"] / paths["trainer"]["images_per_second"]
                               if "trainer" in paths else None),
                "vs_loop_n": (row["images_per_second"] / paths["loop_n"]["images_per_second"]
                              if "loop_n" in paths else None),
            })
        counts_cost = None
        if "tfdp_fit" in paths and "tfdp_fit_per_replica" in paths:
            counts_cost = (paths["tfdp_fit"]["step_ms"]
                           / paths["tfdp_fit_per_replica"]["step_ms"] - 1.0)
        workers[n] = {
            "strategy": run["strategy"],
            "loss_counts_cost": counts_cost,
            "global_batch": run["global_batch"],
            "input_images_per_second": paths.get("input", {}).get("images_per_second"),
            "rows": rows,
        }
    return {"status": "ok", "workers": workers}
