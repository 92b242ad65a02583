"""Case 7: ways to exchange gradients at 2 workers, tfdp's and PyTorch DDP's hooks.

This module owns the comparison of gradient communication on the benchmark
CNN at 2 workers (over the suite's link: loopback, or `--link RATE`):
tfdp's `tfdp_fit` paths with the plain all-reduce, bfloat16, PowerSGD,
Top-K and float8 (timed by `tfdp.bench.throughput` in the suite's scaling launches,
beside the no-all-reduce diagnostic loop), and PyTorch DDP with no hook
(the peer case), `fp16_compress_hook` (its `bf16_compress_hook` needs CUDA
and NCCL) and `powerSGD_hook` at the same rank
(`tfdp.bench.peer_torch`, launched here), each timed its own way as those
modules say: best of `repeats` timed calls of `steps` steps after a warm-up.
Per path it reports images/s and the bytes each worker puts into the
collectives per optimizer step, counted from the compressors' own
arithmetic (`values_sent`; DDP's PowerSGD compresses the same matrices by
the same rule, `min_compression_rate=2`).

It also reports local SGD and DiLoCo (`tfdp_fit_local_sgd`,
`tfdp_fit_diloco`), whose bytes are the weights once per window, and the
same tfdp paths on the ≈10 M-parameter MLP (`summarize_mlp`, one more
2-worker launch: 40 MB of gradients per step, where communication is most
of the step). Time to accuracy is `tfdp.bench.time_to_accuracy`, run on its
own (`python -m tfdp.bench.time_to_accuracy`), not part of the suite yet.
"""

from __future__ import annotations

TFDP_PATHS = ("tfdp_fit", "tfdp_fit_bf16", "tfdp_fit_powersgd", "tfdp_fit_topk",
              "tfdp_fit_float8", "tfdp_fit_local_sgd", "tfdp_fit_diloco")
#: Steps between synchronisations of the local-step paths (`tfdp.bench.throughput`'s spec).
SYNC_EVERY = {"local_sgd": 8, "diloco": 16}
DDP_HOOKS = ("fp16", "powersgd", "local_sgd")


#: The paths of the MLP launch: every tfdp exchange and the no-all-reduce loop.
MLP_PATHS = TFDP_PATHS + ("loop_n_local",)
#: The MLP paths `--quick` measures: those of the PowerSGD target.
MLP_QUICK_PATHS = ("tfdp_fit", "tfdp_fit_powersgd")


def bytes_per_step(compression: str, *, rank: int = 4, fraction: float = 0.01,
                   model: str = "cnn") -> int:
    """Bytes one worker contributes to the gradient (or weight) collectives per step, on the CNN.

    Local steps send the float32 weights once per window (`SYNC_EVERY`), the
    cost per step is that over the window; a window also ends with each
    timed call (an epoch), which this average leaves out.
    """
    import tfdp
    from tfdp.bench import workloads

    build = workloads.build_cnn if model == "cnn" else workloads.build_mlp
    variables = build().trainable_variables
    values = sum(int(v.shape.num_elements()) for v in variables)
    if compression == "none":
        return 4 * values
    if compression == "bfloat16":
        return 2 * values
    if compression == "powersgd":
        return 4 * tfdp.compression.PowerSGD(rank=rank).values_sent(variables)
    if compression == "topk":
        return 4 * tfdp.compression.TopK(fraction=fraction).values_sent(variables)
    if compression == "float8":
        return 4 * tfdp.compression.Float8().values_sent(variables)
    if compression in SYNC_EVERY:
        return round(4 * values / SYNC_EVERY[compression])
    raise ValueError(f"Unknown compression {compression!r}.")


_TFDP_COMPRESSION = {"tfdp_fit": "none", "tfdp_fit_bf16": "bfloat16",
                     "tfdp_fit_powersgd": "powersgd", "tfdp_fit_topk": "topk",
                     "tfdp_fit_float8": "float8", "tfdp_fit_local_sgd": "local_sgd",
                     "tfdp_fit_diloco": "diloco"}
_DDP_COMPRESSION = {"none": "none", "fp16": "bfloat16", "powersgd": "powersgd",  # 2 B/value
                    "local_sgd": "local_sgd"}  # the weights every SYNC_EVERY["local_sgd"] steps


def summarize_mlp(runs: dict | None, *, rank: int = 4, fraction: float = 0.01) -> dict:
    """The MLP rows from `throughput.run(workers=(2,), paths=MLP_PATHS, model="mlp")`.

    Returns:
        `{"status": "ok", "rows": [{"path", "examples_per_second",
        "median_examples_per_second", "bytes_per_step", "vs_plain"}],
        "powersgd_over_plain"}`, or a skip record.
    """
    two = (runs or {}).get("2", {}).get("paths", {})
    plain = two.get("tfdp_fit", {}).get("images_per_second")
    rows = []
    for path in MLP_PATHS:
        if path not in two:
            continue
        compression = "none" if path == "loop_n_local" else _TFDP_COMPRESSION[path]
        rows.append({
            "path": path,
            "examples_per_second": two[path]["images_per_second"],
            "median_examples_per_second": two[path]["median_images_per_second"],
            "bytes_per_step": 0 if path == "loop_n_local" else bytes_per_step(
                compression, rank=rank, fraction=fraction, model="mlp"),
            "vs_plain": two[path]["images_per_second"] / plain if plain else None,
        })
    powersgd = next((r for r in rows if r["path"] == "tfdp_fit_powersgd"), None)
    if not rows:
        return {"status": "skipped", "reason": "the MLP launch measured no path"}
    return {"status": "ok", "rows": rows,
            "powersgd_over_plain": powersgd and powersgd["vs_plain"]}


def run_ddp_hooks(*, per_replica_batch: int, steps: int, repeats: int, threads: int,
                  timeout: float, rank: int = 4) -> dict:
    """DDP at 2 workers with each of `DDP_HOOKS`: `{hook: peer_torch row}`, or a skip record."""
    from tfdp.bench import peer_torch

    reason = peer_torch.torch_missing_reason()
    if reason is not None:
        return {"status": "skipped", "reason": reason}
    rows = {}
    for hook in DDP_HOOKS:
        rows[hook] = peer_torch.run(workers=(2,), per_replica_batch=per_replica_batch,
                                    steps=steps, repeats=repeats, threads=threads,
                                    timeout=timeout, hook=hook, rank=rank,
                                    period=SYNC_EVERY["local_sgd"])["workers"]["2"]
    return {"status": "ok", "rows": rows}


def summarize(runs: dict | None, peer: dict, hooks: dict, *, rank: int = 4,
              fraction: float = 0.01) -> dict:
    """The case's rows from the suite's 2-worker runs, the peer case and `run_ddp_hooks`.

    Returns:
        `{"status": "ok", "rows": [{"framework", "path", "images_per_second",
        "median_images_per_second", "bytes_per_step", "vs_no_all_reduce"}],
        "best_tfdp", "best_tfdp_vs_no_all_reduce", "best_ddp"}`.
    """
    two = (runs or {}).get("2", {}).get("paths", {})
    local = two.get("loop_n_local", {}).get("images_per_second")
    rows = []
    for path in TFDP_PATHS:
        if path in two:
            rows.append({"framework": "tfdp", "path": path,
                         "images_per_second": two[path]["images_per_second"],
                         "median_images_per_second": two[path]["median_images_per_second"],
                         "bytes_per_step": bytes_per_step(_TFDP_COMPRESSION[path], rank=rank,
                                                          fraction=fraction)})
    ddp = {}
    if peer.get("status") == "ok" and "2" in peer.get("workers", {}):
        ddp["none"] = peer["workers"]["2"]
    if hooks.get("status") == "ok":
        ddp.update(hooks["rows"])
    for hook, row in ddp.items():
        rows.append({"framework": "PyTorch DDP", "path": hook,
                     "images_per_second": row["images_per_second"],
                     "median_images_per_second": row["median_images_per_second"],
                     "bytes_per_step": bytes_per_step(_DDP_COMPRESSION[hook], rank=rank)})
    for row in rows:
        row["vs_no_all_reduce"] = row["images_per_second"] / local if local else None
    tfdp_rows = [r for r in rows if r["framework"] == "tfdp"]
    ddp_rows = [r for r in rows if r["framework"] != "tfdp"]
    best = max(tfdp_rows, key=lambda r: r["images_per_second"], default=None)
    best_ddp = max(ddp_rows, key=lambda r: r["images_per_second"], default=None)
    return {
        "status": "ok" if rows else "skipped",
        **({} if rows else {"reason": "no 2-worker tfdp paths or DDP rows were measured"}),
        "rows": rows,
        "no_all_reduce_images_per_second": local,
        "best_tfdp": best and best["path"],
        "best_tfdp_vs_no_all_reduce": best and best["vs_no_all_reduce"],
        "best_tfdp_over_best_ddp": (best["images_per_second"] / best_ddp["images_per_second"]
                                    if best and best_ddp else None),
        "rank": rank, "fraction": fraction,
    }
