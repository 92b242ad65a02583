"""Case 11: the README's main job against the same job in plain Keras, start to exit.

This module owns the fixed-costs comparison of issue 32: what a user pays
around the training steps. In one run, on the same machine, it times from
process start to exit, `repeats` times in rounds (each job once, then again):

- `tfdp_fit`: the README's main command, `tfdp-launch --nproc_per_node 2 --
  tfdp-train --dataset=digits --model=cnn --model_dir=DIR` (`model.fit`
  through `tfdp.compile`, tfdp's BackupAndRestore every epoch, evaluation at
  the end), with `--epochs`; wall time from starting the launcher to its
  exit, and the chief's time by phase from its `summary.json`
  (`tfdp.app.phase_clock`).
- `tfdp_custom`: the same command with `--loop=custom` (`tfdp.Trainer`).
- `keras`: the same job in plain one-process Keras
  (`tfdp.bench.plain_keras_digits`): the same registered `cnn`, the same TFDS
  digits train split, batch 64, SGD with momentum 0.9 and cosine decay from
  0.05 (`tfdp-train`'s defaults, read from `RunConfig`), Keras'
  `BackupAndRestore` every epoch, one evaluation at the end.

The digits dataset is prepared once before the first timed job, in a data
directory every job shares, so no job pays for writing it. Multi-worker jobs
run on the host's loopback (not through `--link`). It does not judge the
ratio (`tfdp.bench.targets`).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

from tfdp.bench import procs

#: The jobs, in the order each round runs them.
JOBS = ("tfdp_fit", "keras", "tfdp_custom")
#: The tfdp jobs: their `tfdp-train` loop.
TFDP_LOOPS = {"tfdp_fit": "fit", "tfdp_custom": "custom"}


def _tfdp_train_command() -> list[str]:
    """`tfdp-train` beside this interpreter (as the README runs it), else the module."""
    script = os.path.join(os.path.dirname(sys.executable), "tfdp-train")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "tfdp.app.train"]


def _timed(command: list[str], timeout: float) -> float:
    """Runs `command` (`tfdp.bench.procs.run_command`); returns its wall seconds."""
    start = time.perf_counter()
    procs.run_command(command, timeout=timeout)
    return time.perf_counter() - start


def run_tfdp(loop: str, *, epochs: int, data_dir: str, model_dir: str, timeout: float) -> dict:
    """The README's main command with `--loop=loop` on 2 local workers; wall time and phases."""
    command = [sys.executable, "-m", "tfdp.launch", "--nproc_per_node", "2", "--",
               *_tfdp_train_command(), "--dataset=digits", "--model=cnn",
               f"--model_dir={model_dir}", f"--data_dir={data_dir}", f"--epochs={epochs}",
               f"--loop={loop}"]
    wall = _timed(command, timeout)
    with open(os.path.join(model_dir, "summary.json")) as f:
        summary = json.load(f)
    return {"wall_seconds": wall, "accuracy": summary["eval"].get("accuracy"),
            "phases": summary["phases"]}


def run_keras(*, epochs: int, data_dir: str, backup_dir: str, timeout: float) -> dict:
    """`tfdp.bench.plain_keras_digits` with `tfdp-train`'s defaults; wall time and its parts."""
    from tfdp.app import run_config

    defaults = run_config.RunConfig()
    if (defaults.optimizer, defaults.decay) != ("momentum", "cosine"):
        raise ValueError(
            f"tfdp-train's defaults changed (optimizer {defaults.optimizer!r}, decay "
            f"{defaults.decay!r}); make tfdp.bench.plain_keras_digits match them.")
    out = os.path.join(backup_dir, "result.json")
    command = [sys.executable, "-m", "tfdp.bench.plain_keras_digits", f"--data_dir={data_dir}",
               f"--backup_dir={os.path.join(backup_dir, 'backup')}", f"--out={out}",
               f"--epochs={epochs}", f"--batch={run_config.DEFAULT_GLOBAL_BATCH}",
               f"--learning_rate={defaults.base_lr}", "--momentum=0.9",
               f"--seed={defaults.seed}"]
    wall = _timed(command, timeout)
    with open(out) as f:
        result = json.load(f)
    return {"wall_seconds": wall, "accuracy": result["eval"].get("accuracy"),
            "seconds": result["seconds"], "epoch_seconds": result["epoch_seconds"]}


def run(*, epochs: int = 10, repeats: int = 1, timeout: float = 600.0,
        log=lambda line: None) -> dict:
    """Runs every job `repeats` times in rounds; returns `summarize`'s table and the runs.

    Args:
        epochs: epochs of every job. Defaults to 10 (`tfdp-train`'s default).
        repeats: rounds (each job once per round). Defaults to 1.
        timeout: seconds each job may take.
        log: receives one line per job run.

    Returns:
        `summarize(runs)` plus `"runs": {job: [run, ...]}`, `"epochs"` and `"repeats"`.

    Raises:
        tfdp.bench.procs.JobFailed: a job failed or ran past `timeout`.
    """
    runs: dict = {job: [] for job in JOBS}
    with tempfile.TemporaryDirectory(prefix="tfdp-bench-fixed-") as directory:
        data_dir = os.path.join(directory, "tfds")
        procs.run_command([sys.executable, "-c", "from tfdp.pipelines import digits; "
                           f"digits.prepare({data_dir!r})"], timeout=timeout)
        for round_ in range(repeats):
            for job in JOBS:
                where = os.path.join(directory, f"{job}-{round_}")
                if job == "keras":
                    os.makedirs(where)
                    result = run_keras(epochs=epochs, data_dir=data_dir, backup_dir=where,
                                       timeout=timeout)
                else:
                    result = run_tfdp(TFDP_LOOPS[job], epochs=epochs, data_dir=data_dir,
                                      model_dir=where, timeout=timeout)
                log(f"[tfdp.bench] fixed_costs: {job} round {round_ + 1}/{repeats}: "
                    f"{result['wall_seconds']:.1f} s")
                runs[job].append(result)
    return {**summarize(runs), "runs": runs, "epochs": epochs, "repeats": repeats}


def _spread(values: list[float]) -> dict:
    return {"best": min(values), "median": statistics.median(values), "max": max(values)}


def summarize(runs: dict) -> dict:
    """The case's table from `{job: [run, ...]}`.

    Returns:
        `{"rows": [{"job", "runs", "wall_seconds": {"best", "median", "max"},
        "over_keras" (best ÷ keras' best), "accuracy" (last run)}], "phases":
        {job: the best run's phase seconds}, "counts": {job: its counts},
        "epoch_outside_seconds": {job: the best run's median seconds per epoch
        outside its training calls, first epoch excluded},
        "epoch_first_call_seconds": {job: the same for each epoch's first
        training call}}`.
    """
    keras_best = min(r["wall_seconds"] for r in runs["keras"]) if runs.get("keras") else None
    rows, phases, counts, outside, first_calls = [], {}, {}, {}, {}
    for job, job_runs in runs.items():
        if not job_runs:
            continue
        walls = [r["wall_seconds"] for r in job_runs]
        rows.append({"job": job, "runs": len(job_runs), "wall_seconds": _spread(walls),
                     "over_keras": min(walls) / keras_best if keras_best else None,
                     "accuracy": job_runs[-1]["accuracy"]})
        best = min(job_runs, key=lambda r: r["wall_seconds"])
        if "phases" in best:
            phases[job] = best["phases"]["seconds"]
            counts[job] = best["phases"]["counts"]
            later = best["phases"]["epochs"][1:]
            outside[job] = (statistics.median(row["outside_seconds"] for row in later)
                            if later else None)
            calls = [row["first_call_seconds"] for row in later
                     if row["first_call_seconds"] is not None]
            first_calls[job] = statistics.median(calls) if calls else None
        else:
            phases[job] = best["seconds"]
    return {"rows": rows, "phases": phases, "counts": counts,
            "epoch_outside_seconds": outside, "epoch_first_call_seconds": first_calls}
