"""The `stragglers` case: 2 workers, one held at half a CPU; the equal split against balanced batches.

This module owns the comparison of issue 35: the digits job of
`tfdp.bench.time_to_accuracy` (the registered `cnn`, global batch 64, SGD with
momentum 0.9 at 0.05, the whole test split evaluated after every epoch) on 2
workers, run with

- `equal`: `tfdp.compile` as is, the synchronous equal split (Keras shards
  each global batch per worker);
- `balanced`: `tfdp.compile(..., balance_batches=BalanceOptions(replan_every=
  steps_per_execution))`: every worker reads each global batch whole and
  computes the share its measured speed earns (`tfdp.training.balanced_batches`),

each with one worker in a CPU cgroup at `cpu_fraction` of a CPU
(`tfdp.bench.straggler`, a real CFS quota: `python -m tfdp.bench.straggler
--rank R --cpu_fraction F -- python -m tfdp.bench.worker ...` under
`tfdp-launch`) and again with no straggler. Every run trains `epochs` epochs
(it does not stop at the target, so that every run times the same epochs):

- images/s: training images over training seconds (each epoch from its start
  to the start of its evaluation) over the epochs after `warmup_epochs`
  (tracing, and the balanced plan's first windows);
- seconds to 0.95: from the start of the first epoch to the end of the first
  evaluation at 0.95 or above (tracing included), as `time_to_accuracy`
  times it;
- the accuracy of every epoch, so "at the same accuracy" can be read.

The straggler is the chief (rank 0) by default: the chief writes the result,
so it records the cgroup it ran in and the kernel's count of throttled CFS
periods (`nr_throttled`) as proof that the quota bit. The balanced runs also
record the planner's view: every plan adopted, each window's mean share and
compute seconds per step per worker, and the fitted fixed and per-example
costs.

Each round runs the four launches (straggler: equal, balanced; none: equal,
balanced); `summarize` reports medians and ranges over the rounds, and the
ratios balanced ÷ equal of the medians and per round. Without root or a CPU
cgroup controller the case is skipped with the reason. It does not start
processes itself (`tfdp.bench.procs`) nor judge the ratios
(`tfdp.bench.targets`).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

from tfdp.bench import time_to_accuracy as tta

#: How each global batch is split between the workers.
METHODS = ("equal", "balanced")
_DEFAULTS = {"per_replica_batch": 32, "learning_rate": 0.05, "momentum": 0.9, "epochs": 15,
             "warmup_epochs": 3, "target": 0.95, "threads": 1, "seed": 0,
             # One epoch (22 steps) per tf.function call, one planning window per call.
             "steps_per_execution": None, "replan_every": None}


def measure(spec: dict) -> dict:
    """One 2-worker run (a `tfdp.bench.worker` job on every worker): spec `method`, `data`.

    Returns:
        `time_to_accuracy._summary`'s fields (over all `epochs`, the target
        not stopping the run) plus `"train_seconds"` per epoch,
        `"images_per_second"` over the epochs after `warmup_epochs`,
        `"cgroup"` (this process's straggler group, or None),
        `"throttled_periods"` and, for `balanced`, `"balance"`: the plans
        adopted `[(step, shares)]`, the planner's windows (mean shares and
        compute seconds per step, per worker) and its fitted costs.
    """
    spec = {**_DEFAULTS, **spec}
    import keras
    import numpy as np
    import tfdp
    from tfdp.bench import straggler
    from tfdp.training import balanced_batches

    if spec["method"] not in METHODS:
        raise ValueError(f"`method` must be one of {', '.join(METHODS)}. "
                         f"Received: method={spec['method']!r}")
    group = straggler.current_group()
    strategy = tfdp.make_strategy()
    global_batch = spec["per_replica_batch"] * strategy.num_replicas_in_sync
    steps = len(np.load(spec["data"])["y_train"]) // global_batch  # as _fit_to_target
    arguments = {}
    if spec["method"] == "balanced":
        every = spec["replan_every"] or spec["steps_per_execution"] or steps
        arguments["balance_batches"] = balanced_batches.BalanceOptions(replan_every=every)
    starts, test_starts = [], []

    class TrainClock(keras.callbacks.Callback):
        """Each epoch's training span: its start to the start of its evaluation."""

        def on_epoch_begin(self, epoch, logs=None):
            starts.append(time.perf_counter())

        def on_test_begin(self, logs=None):
            test_starts.append(time.perf_counter())

    holder = {}

    def compile_model(model, **kwargs):
        tfdp.compile(model, **kwargs, **arguments)
        holder["model"] = model

    result = tta._fit_to_target({**spec, "max_epochs": spec["epochs"]}, strategy, global_batch,
                                compile_model, callbacks=[TrainClock()], stop_at_target=False)
    train_seconds = [end - start for start, end in zip(starts, test_starts)]
    skip = min(spec["warmup_epochs"], max(len(train_seconds) - 1, 0))
    timed = train_seconds[skip:]
    result.update({
        "framework": "tfdp", "method": spec["method"], "straggler": spec.get("straggler"),
        "workers": tfdp.strategy_info(strategy).num_workers, "global_batch": global_batch,
        "steps_per_epoch": steps, "train_seconds": train_seconds, "timed_from_epoch": skip + 1,
        "images_per_second": (steps * global_batch * len(timed) / sum(timed)) if timed else None,
        "cgroup": group and group.path,
        "cpu_fraction": group and group.cpu_fraction,
        "throttled_periods": group and group.throttled_periods(),
        "balance": _planner_record(getattr(holder["model"], "tfdp_balanced_batches", None)),
    })
    return result


def _planner_record(balance) -> dict | None:
    """What the planner saw and chose, for the record (None when not balancing)."""
    if balance is None:
        return None
    planner = balance.planner
    return {
        "plans": [[step, list(shares)] for step, shares in balance.history],
        "final_shares": [int(s) for s in balance.plan.numpy()],
        "windows": [{"shares": p[0], "step_seconds": p[1], "whole_step_seconds": whole}
                    for p, whole in zip(planner.points, planner.whole_steps)]
        if planner else [],
        # This worker's own (the chief's: the straggler), per step since the
        # warm-up: what the shares scale, and what they do not.
        "this_worker_per_step_ms": _per_step_ms(balance.spans.numpy()),
        "fixed_seconds": planner and planner.fixed_seconds,
        "seconds_per_example": planner and planner.seconds_per_example,
        "fixed_examples": planner and planner.fixed_examples,
        "relative_noise": planner and planner.cost and planner.cost.relative_noise,
        "required_gain": planner and planner.required_gain(),
    }


def _per_step_ms(spans) -> dict | None:
    """`BalancedBatches.spans` as milliseconds per step: compute, busy, exchange."""
    compute, busy, exchange, steps = (float(v) for v in spans)
    if steps < 1:
        return None
    return {"compute": 1e3 * compute / steps, "busy": 1e3 * busy / steps,
            "exchange": 1e3 * exchange / steps, "steps": int(steps)}


def run(*, repeats: int = 3, epochs: int = 15, warmup_epochs: int = 3,
        cpu_fraction: float = 0.5, straggler_rank: int = 0, timeout: float = 600.0,
        log=None, **spec) -> dict:
    """Every method with and without a straggler, `repeats` rounds, 2 workers each.

    Args:
        repeats: rounds; each runs the four launches, so a burst of load
            hits them alike.
        epochs: epochs of every run.
        warmup_epochs: epochs left out of images/s.
        cpu_fraction: the straggler's CPUs' worth of time (0.5: half a CPU).
        straggler_rank: the slowed worker (0, the chief, records the proof).
        timeout: seconds per launch.
        log: receives one line per launch (None: silent).
        **spec: overrides of the job defaults (`steps_per_execution`, ...).

    Returns:
        `summarize(runs)` plus `"runs"` (each with `"round"` and
        `"load_average_at_start"`), `"repeats"`, `"cpu_fraction"`,
        `"straggler_rank"`; or `{"status": "skipped", "reason"}` where no
        CPU cgroup can be made.

    Raises:
        tfdp.bench.procs.JobFailed: a launch failed or timed out.
    """
    from tfdp.bench import machine
    from tfdp.bench import procs
    from tfdp.bench import straggler

    reason = straggler.why_unavailable()
    if reason is not None:
        return {"status": "skipped", "reason": reason}
    straggler.check_fraction(cpu_fraction)
    spec = {"threads": _DEFAULTS["threads"], **spec, "epochs": epochs,
            "warmup_epochs": warmup_epochs}
    wrapper = [sys.executable, "-m", "tfdp.bench.straggler", "--rank", str(straggler_rank),
               "--cpu_fraction", str(cpu_fraction), "--"]
    runs = []
    with tempfile.TemporaryDirectory(prefix="tfdp-stragglers-") as directory:
        data = os.path.join(directory, "digits.npz")
        tta.write_digits(data)
        for round_index in range(repeats):
            for slowed in (True, False):
                for method in METHODS:
                    load = machine.load_average()
                    row = procs.run_job(
                        "stragglers", {**spec, "method": method, "data": data,
                                       "straggler": slowed},
                        nproc=2, timeout=timeout, wrap=wrapper if slowed else ())
                    runs.append({**row, "round": round_index, "load_average_at_start": load})
                    if log:
                        log(f"[tfdp.bench] stragglers: round {round_index + 1}, "
                            f"{'straggler' if slowed else 'no straggler'}, {method}: "
                            f"{row['images_per_second'] or 0:.0f} images/s, to "
                            f"{row['seconds_to_target']} s to the target "
                            f"(load average {load})")
    return {**summarize(runs), "runs": runs, "repeats": repeats, "epochs": epochs,
            "warmup_epochs": warmup_epochs, "cpu_fraction": cpu_fraction,
            "straggler_rank": straggler_rank}


def _ratio(a, b):
    return a / b if a is not None and b else None


def summarize(runs: list) -> dict:
    """Rows per (straggler, method) and the balanced ÷ equal ratios.

    Args:
        runs: `measure` results, each with `"straggler"` and `"round"`.

    Returns:
        `{"rows": [{"straggler", "method", "runs", "reached",
        "images_per_second", "seconds_to_target", "epochs_to_target",
        "last_accuracy", "load_average_1min" (each median/min/max)}],
        "with_straggler": {...}, "without_straggler": {...}}`; each of the
        last two holds `"images_per_second_ratio"` (balanced ÷ equal, of the
        medians), `"images_per_second_ratio_per_round"`,
        `"seconds_to_target_ratio"` (balanced ÷ equal; below 1: balanced is
        sooner; None unless every run of both reached the target) and
        `"images_per_second_cost"` (1 − the images/s ratio). With a
        straggler also `"straggler_cost"`: 1 − equal's images/s with it ÷
        without it (what the straggler took from the equal split), and
        `"images_per_second_ceiling"`: equal's images/s without it ÷ with
        it, the most any split could win back (a straggler that costs
        the equal split 14% leaves balancing at most 1.16x, whatever it
        measures).
    """
    groups: dict = {}
    for run in runs:
        groups.setdefault((bool(run["straggler"]), run["method"]), []).append(run)
    rows = []
    for (slowed, method), group in groups.items():
        reached = sum(r["seconds_to_target"] is not None for r in group)
        seconds = tta._spread([r["seconds_to_target"] for r in group])
        rows.append({
            "straggler": slowed, "method": method, "runs": len(group), "reached": reached,
            "images_per_second": tta._spread([r["images_per_second"] for r in group]),
            "seconds_to_target": seconds if reached == len(group) else {
                **seconds, "median": None},
            "epochs_to_target": tta._spread([r["epochs_to_target"] for r in group]),
            "last_accuracy": tta._spread([r["accuracies"][-1] if r["accuracies"] else None
                                          for r in group]),
            "load_average_1min": tta._spread([(r.get("load_average_at_start") or [None])[0]
                                              for r in group]),
        })

    def row(slowed, method):
        return next((r for r in rows if r["straggler"] == slowed and r["method"] == method),
                    None)

    def compare(slowed):
        equal, balanced = row(slowed, "equal"), row(slowed, "balanced")
        if equal is None or balanced is None:
            return {}
        ratio = _ratio(balanced["images_per_second"]["median"],
                       equal["images_per_second"]["median"])
        per_round = {}
        for run in runs:
            if bool(run["straggler"]) == slowed:
                per_round.setdefault(run["round"], {})[run["method"]] = run["images_per_second"]
        return {
            "images_per_second_ratio": ratio,
            "images_per_second_cost": None if ratio is None else 1 - ratio,
            "images_per_second_ratio_per_round": [
                _ratio(r.get("balanced"), r.get("equal")) for _, r in sorted(per_round.items())],
            "seconds_to_target_ratio": _ratio(balanced["seconds_to_target"]["median"],
                                              equal["seconds_to_target"]["median"]),
        }

    with_straggler = compare(True)
    equal_slowed, equal_free = row(True, "equal"), row(False, "equal")
    if with_straggler and equal_free is not None:
        ratio = _ratio(equal_slowed["images_per_second"]["median"],
                       equal_free["images_per_second"]["median"])
        with_straggler["straggler_cost"] = None if ratio is None else 1 - ratio
        # No split of the work can make the slowed pair faster than the
        # unslowed pair's equal split: the most balancing can win here.
        with_straggler["images_per_second_ceiling"] = None if not ratio else 1 / ratio
    return {"rows": rows, "with_straggler": with_straggler,
            "without_straggler": compare(False)}


def _cell(spread, digits=0) -> str:
    if not spread or spread.get("median") is None:
        return "–"
    return (f"{spread['median']:,.{digits}f} ({spread['min']:,.{digits}f}–"
            f"{spread['max']:,.{digits}f})")


def _number(value, digits=2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown_lines(case: dict) -> list[str]:
    """The case's section of `results.md`: one row per (straggler, method), the ratios, the plans."""
    lines = [f"The digits `cnn` of section 10 (global batch 64, 22 steps per epoch, one epoch "
             f"per tf.function call) on 2 workers, each run {case.get('epochs')} epochs "
             f"without stopping at 0.95 (images/s from epoch "
             f"{min(case.get('warmup_epochs') or 0, (case.get('epochs') or 1) - 1) + 1}"
             f"); with a straggler, worker "
             f"{case.get('straggler_rank')} runs in a CPU cgroup at {case.get('cpu_fraction')} "
             f"of a CPU (`tfdp.bench.straggler`). Images/s: training images over training "
             f"seconds after the first epochs; seconds to 0.95: from the first epoch's start, "
             f"tracing included. {case.get('repeats')} round(s); median (min–max).", "",
             "| straggler | split | images/s | seconds to 0.95 | epochs to 0.95 | "
             "last accuracy | reached | load average (1 min) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in case["rows"]:
        lines.append(
            f"| {'yes' if r['straggler'] else 'no'} | {r['method']} | "
            f"{_cell(r['images_per_second'])} | {_cell(r['seconds_to_target'], 1)} | "
            f"{_cell(r['epochs_to_target'])} | {_cell(r['last_accuracy'], 3)} | "
            f"{r['reached']}/{r['runs']} | {_cell(r['load_average_1min'], 1)} |")
    for key, title in (("with_straggler", "With the straggler"),
                       ("without_straggler", "Without a straggler")):
        c = case.get(key) or {}
        per_round = ", ".join(_number(v) for v in c.get("images_per_second_ratio_per_round", []))
        lines += ["", f"{title}: balanced ÷ equal images/s {_number(c.get('images_per_second_ratio'))}"
                      f" (per round: {per_round or '–'}), seconds to 0.95 "
                      f"{_number(c.get('seconds_to_target_ratio'))} (below 1: sooner)"
                      + (f"; the straggler took {_number(100 * c['straggler_cost'], 0)}% of the "
                         "equal split's images/s" if c.get("straggler_cost") is not None else "")
                      + (f", so no split could beat "
                         f"{_number(c['images_per_second_ceiling'])}x"
                         if c.get("images_per_second_ceiling") is not None else "")
                      + "."]
    plans = [(r["round"], r["balance"]["plans"]) for r in case.get("runs", [])
             if r["straggler"] and r.get("balance")]
    if plans:
        lines += ["", "Balanced plans with the straggler (step, shares per worker): "
                      + "; ".join(f"round {i + 1}: {p or 'equal throughout'}" for i, p in plans)
                      + "."]
    return lines
