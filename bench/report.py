"""Writes the suite's results: `results.json`, `results.md`, `results.png`.

This module owns the three output files and nothing else: the JSON is
`tfdp.bench.suite.run_suite`'s dictionary as is; the Markdown is one table
per case under the machine description and the targets; the PNG (matplotlib,
Agg backend, no display needed) plots throughput against workers, the
step-time breakdown at 2 workers, all-reduce latency against message size
with the ring bound, and accumulation's time per global batch.
"""

from __future__ import annotations

import json
import os

from tfdp.bench import stragglers
from tfdp.bench.time_to_accuracy import KERAS_FLOOR

#: The issue's numbers, measured before tfdp on this machine (one thread per
#: worker, same kind of CNN, per-replica batch 64): global images/s.
ISSUE_BASELINE = {
    "Keras 3 model.fit": (1300, 1330),
    "hand-written loop, 1 step per tf.function": (1620, 2570),
    "hand-written loop, 10 steps per tf.function": (2270, 3400),
    "PyTorch DDP (gloo, CPU)": (1480, 2370),
}

PATH_LABELS = {
    "keras_fit": "Keras fit (steps_per_execution=1)",
    "keras_fit_n": "Keras fit (model.compile, steps_per_execution=N)",
    "tfdp_fit": "tfdp fit (tfdp.compile, steps_per_execution=N)",
    "tfdp_fit_bf16": "tfdp fit, gradients all-reduced in bfloat16",
    "tfdp_fit_buckets": "tfdp fit, gradients all-reduced in buckets during the backward pass",
    "tfdp_fit_per_replica": "tfdp fit, per-replica loss (no global counts)",
    "tfdp_fit_powersgd": "tfdp fit, PowerSGD (rank 4) gradient compression",
    "tfdp_fit_topk": "tfdp fit, Top-K (1%) gradient compression",
    "tfdp_fit_float8": "tfdp fit, float8 (E4M3, per-tensor scale) gradient compression",
    "tfdp_fit_local_sgd": "tfdp fit, local SGD (weights averaged every 8 steps)",
    "tfdp_fit_diloco": "tfdp fit, DiLoCo (every 16 steps, Nesterov outer step)",
    "trainer": "tfdp Trainer (steps_per_loop=N)",
    "loop_1": "hand-written loop, 1 step per call",
    "loop_n": "hand-written loop, N steps per call",
    "loop_n_local": "loop, N steps per call, no gradient all-reduce (diagnostic)",
    "loop_n_sync": "loop, N steps per call, 4-byte all-reduce only (diagnostic)",
    "loop_n_overlap": "loop, N steps per call, two buckets overlapping backprop",
}

#: The parts of a step (`tfdp.bench.scaling.breakdown`), in stacking order.
BREAKDOWN_PARTS = (
    ("compute_ms", "compute (loop_n, 1 worker)"),
    ("two_processes_ms", "two processes on the machine"),
    ("synchronisation_ms", "synchronisation + collective latency"),
    ("gradient_bytes_ms", "gradient bytes"),
    ("framework_ms", "framework"),
)


def _f(value, digits=0, suffix=""):
    if value is None:
        return "–"
    return f"{value:,.{digits}f}{suffix}"


def _status_line(case: dict) -> str | None:
    if case.get("status") == "skipped":
        return f"*Skipped: {case.get('reason')}*"
    if case.get("status") == "error":
        first = (case.get("error") or "").strip().splitlines()[:3]
        return "*Failed:* `" + " ".join(first)[:400] + "`"
    return None


def _machine(results) -> list[str]:
    m, c = results["machine"], results["config"]
    return [
        "| machine | |", "|---|---|",
        f"| CPU | {m['cpu']} |",
        f"| cores | {m['cores']} |",
        f"| memory | {m['memory_gib']} GiB |",
        f"| Python / TensorFlow / Keras / PyTorch | {m['python']} / {m['tensorflow']} / "
        f"{m['keras']} / {m['torch'] or 'not installed'} |",
        f"| load average (1/5/15 min) at start, at end | {m['load_average_at_start']}, "
        f"{results.get('load_average_at_end')} |",
        f"| mode | {'quick (smoke test: few steps, numbers are rough)' if c['quick'] else 'full'}"
        f", {c['threads']} intra-/inter-op thread(s) per worker, suite took "
        f"{results.get('seconds', 0):.0f} s |",
        f"| link between workers | {_link(c)} |",
        f"| date | {results.get('date', '–')} |",
        f"| command | `{results.get('command', '–')}` |",
    ]


def _link(config) -> str:
    if not config.get("link"):
        return "loopback, unshaped"
    return f"loopback shaped to {config['link']} (tc tbf in a network namespace)"


def _targets(results) -> list[str]:
    lines = ["| target | measured | required | met |", "|---|---|---|---|"]
    for t in results["targets"]:
        met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
        lines.append(f"| {t['description']} | {_f(t['value'], 3)} | {t['threshold']} | {met} |")
    return lines


def _scaling(case, config) -> list[str]:
    lines = [f"CNN (`bench/workloads.py`), per-replica batch {config['per_replica_batch']}, "
             f"N = {config['steps_per_execution']}, one worker process per replica "
             f"(`tfdp-launch`), best of {config['repeats']} × {config['rounds']} timed "
             f"calls of {config['steps']} steps. Strategies: {case.get('strategies')}.", "",
             "| path | 1 worker (img/s) | 2 workers (img/s) | scaling efficiency |",
             "|---|---|---|---|"]
    for row in case["rows"]:
        lines.append(f"| {PATH_LABELS.get(row['path'], row['path'])} | "
                     f"{_f(row['workers'].get('1'))} | {_f(row['workers'].get('2'))} | "
                     f"{_f(100 * row['efficiency'].get('2', 0), 1, '%')} |")
    return lines


def _overhead(case) -> list[str]:
    lines = ["Steady state: from the first execution's start to the last's (per-step "
             "costs, host syncs and log reductions included); whole call: "
             "`fit(steps_per_epoch=S)` / `train(S steps)` / S/N loop calls, set-up included; "
             "per-call overhead: the whole call minus its executions."]
    for n in sorted(case["workers"]):
        run = case["workers"][n]
        lines += ["", f"**{n} worker(s)** ({run['strategy']}, global batch {run['global_batch']})",
                  "", "| path | steady img/s (median) | ÷ Trainer | ÷ loop_n | whole call img/s | "
                  "per-call overhead (ms) |", "|---|---|---|---|---|---|"]
        for row in run["rows"]:
            lines.append(
                f"| {PATH_LABELS.get(row['path'], row['path'])} | "
                f"{_f(row['images_per_second'])} ({_f(row['median_images_per_second'])}) | "
                f"{_f(row['vs_trainer'], 3)} | {_f(row['vs_loop_n'], 3)} | "
                f"{_f(row['call_images_per_second'])} | {_f(row['call_overhead_ms'])} |")
        if run.get("loss_counts_cost") is not None:
            lines += ["", f"Global loss counts (one all-reduce of a few scalars per step): "
                          f"tfdp fit's step time ÷ the per-replica loss's − 1 = "
                          f"{_f(100 * run['loss_counts_cost'], 2, '%')}."]
        if run["input_images_per_second"]:
            lines += ["", f"Input alone (batches pulled from the distributed iterator, no "
                          f"training): {_f(run['input_images_per_second'])} img/s."]
    return lines


def _breakdown(parts) -> list[str]:
    lines = ["Each part is the difference of two paths timed in the same processes "
             "(`bench/scaling.py`): two processes = `loop_n_local` (no gradient "
             "all-reduce) at 2 workers − `loop_n` at 1; synchronisation = `loop_n_sync` "
             "(a 4-byte all-reduce per step) − `loop_n_local`; gradient bytes = `loop_n` − "
             "`loop_n_sync`; framework = the path − `loop_n`. A negative part is within "
             "the noise.", "",
             "| path (2 workers) | step | " + " | ".join(label for _, label in BREAKDOWN_PARTS)
             + " | gradient all-reduce alone |",
             "|---|---|" + "---|" * (len(BREAKDOWN_PARTS) + 1)]
    for path, p in parts.items():
        lines.append(
            f"| {PATH_LABELS.get(path, path)} | {_f(p['step_ms'], 1)} | "
            + " | ".join(_f(p[name], 1) for name, _ in BREAKDOWN_PARTS)
            + f" | {_f(p.get('gradient_all_reduce_alone_ms'), 1)} |")
    return lines


def _peer(case) -> list[str]:
    lines = [f"{case.get('framework')}, torch {next(iter(case['workers'].values()))['torch_version']}"
             ", same CNN (built from `CNN_LAYERS`), same per-replica batch, one thread per process.",
             "", "| workers | DDP img/s | DDP scaling efficiency | tfdp fit ÷ DDP | Trainer ÷ DDP |",
             "|---|---|---|---|---|"]
    for n, row in sorted(case["workers"].items()):
        ratios = case.get("tfdp_over_torch", {}).get(n, {})
        lines.append(f"| {n} | {_f(row['images_per_second'])} | "
                     f"{_f(100 * case.get('torch_efficiency', {}).get(n, 0), 1, '%')} | "
                     f"{_f(ratios.get('tfdp_fit'), 2)} | {_f(ratios.get('trainer'), 2)} |")
    return lines


def _communication(case) -> list[str]:
    lines = [f"2 workers, the CNN; PowerSGD rank {case['rank']} (DDP: `powerSGD_hook` at the "
             f"same rank), Top-K {_f(100 * case['fraction'], 1, '%')}. Bytes: what each worker "
             "puts into the gradient collectives per step. ÷ no all-reduce: images/s over the "
             "diagnostic loop that never communicates "
             f"({_f(case.get('no_all_reduce_images_per_second'))} img/s).", "",
             "| framework | gradient exchange | img/s (median) | bytes per step | ÷ no all-reduce |",
             "|---|---|---|---|---|"]
    for r in case["rows"]:
        name = PATH_LABELS.get(r["path"], r["path"]) if r["framework"] == "tfdp" else (
            {"none": "all-reduce (no hook)", "fp16": "`fp16_compress_hook`",
             "powersgd": "`powerSGD_hook`",
             "local_sgd": "post-local SGD (`PeriodicModelAverager`)"}[r["path"]])
        lines.append(f"| {r['framework']} | {name} | {_f(r['images_per_second'])} "
                     f"({_f(r['median_images_per_second'])}) | {r['bytes_per_step']:,} | "
                     f"{_f(r['vs_no_all_reduce'], 2)} |")
    mlp = case.get("mlp") or {}
    if mlp.get("status") == "ok":
        lines += ["", "The ≈10 M-parameter MLP (40 MB of gradients), tfdp only, 2 workers; "
                  "÷ plain: examples/s over the plain all-reduce's.", "",
                  "| gradient exchange | examples/s (median) | bytes per step | ÷ plain |",
                  "|---|---|---|---|"]
        for r in mlp["rows"]:
            lines.append(f"| {PATH_LABELS.get(r['path'], r['path'])} | "
                         f"{_f(r['examples_per_second'])} "
                         f"({_f(r['median_examples_per_second'])}) | {r['bytes_per_step']:,} | "
                         f"{_f(r['vs_plain'], 2)} |")
    elif mlp and "MLP launch" not in case.get("failed_parts", {}):
        lines += ["", f"MLP launch: {mlp.get('status')}: {mlp.get('error') or mlp.get('reason')}"]
    for part, error in case.get("failed_parts", {}).items():
        lines += ["", f"**{part} failed** (their rows are missing): {error}"]
    return lines


#: How the time-to-accuracy case names DDP's hooks.
TTA_HOOK_LABELS = {"none": "all-reduce (no hook)", "fp16": "`fp16_compress_hook`",
                   "powersgd": "`powerSGD_hook` (rank 4)",
                   "local_sgd": "post-local SGD (`PeriodicModelAverager`, every 8 steps)"}
TTA_METHOD_LABELS = {"plain": "plain all-reduce", "bfloat16": "bfloat16 all-reduce",
                     "powersgd": "PowerSGD (rank 4)", "topk": "Top-K (1%)",
                     "local_sgd": "local SGD (every 8 steps)",
                     "diloco": "DiLoCo (every 16 steps)"}


def _spread(spread, digits=1) -> str:
    if not spread or spread.get("median") is None:
        return "–"
    return (f"{spread['median']:,.{digits}f} ({spread['min']:,.{digits}f}–"
            f"{spread['max']:,.{digits}f})")


def _time_to_accuracy(case) -> list[str]:
    lines = ["The registered `cnn` on the offline digits split (1,437 training, 360 test "
             "images), 2 workers, global batch 64 (22 steps per epoch), SGD (lr 0.05, "
             "momentum 0.9), evaluated on the whole test split after every epoch until 0.95. "
             "Each peer at its own best settings: tfdp `steps_per_execution` = one epoch and "
             "a repeated training set (one iterator per run); DDP its plain per-step loop. "
             "Wall clock from the start of the first epoch (tfdp's tracing included) to the "
             "end of the evaluation that first reaches 0.95; each method launched "
             f"{case.get('repeats')} time(s), in rounds; median (min–max) over the launches.",
             "", "| framework | gradient exchange | seconds to 0.95 | epochs | first epoch (s) | "
             "steady epoch (s) | reached | load average (1 min) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in case["rows"]:
        labels = (TTA_METHOD_LABELS if r["framework"] == "tfdp" else
                  {"none": "none (no strategy, no tfdp)"} if r["framework"] == KERAS_FLOOR
                  else TTA_HOOK_LABELS)
        lines.append(
            f"| {r['framework']} | {labels.get(r['method'], r['method'])} | "
            f"{_spread(r['seconds_to_target_spread'])} | {_spread(r['epochs_to_target'], 0)} | "
            f"{_spread(r['first_epoch_seconds'])} | {_spread(r['steady_epoch_seconds'], 2)} | "
            f"{r['reached']}/{r['runs']} | {_spread(r.get('load_average_1min'))} |")
    lines += ["", f"Best tfdp method: {case.get('best_tfdp')}; tfdp plain ÷ it "
                  f"{_f(case.get('plain_over_best_tfdp'), 2)}; DDP's best "
                  f"({case.get('best_ddp')}) ÷ it {_f(case.get('best_ddp_over_best_tfdp'), 2)} "
                  "(above 1: the tfdp method is sooner)."]
    if case.get("best_ddp_over_keras_floor") is not None:
        lines += ["", f"The floor: plain Keras in one process, with nothing to exchange, takes "
                      f"{_f(1 / case['best_ddp_over_keras_floor'], 2)}x DDP's best to reach 0.95; "
                      "its first epoch is Keras building and first running its train and test "
                      "functions, which every Keras toolkit pays."]
    if case.get("ddp_skipped"):
        lines += ["", f"*DDP not run: {case['ddp_skipped']}*"]
    return lines


FIXED_COSTS_LABELS = {
    "tfdp_fit": "tfdp: `tfdp-launch --nproc_per_node 2 -- tfdp-train --dataset=digits "
                "--model=cnn --model_dir=DIR`",
    "tfdp_custom": "tfdp: the same with `--loop=custom` (`tfdp.Trainer`)",
    "keras": "plain Keras, one process (`tfdp.bench.plain_keras_digits`)",
}


def _fixed_costs(case) -> list[str]:
    lines = [f"The README's main job and the same job in plain one-process Keras (same `cnn`, "
             f"same TFDS digits split, batch 64, SGD with momentum and cosine decay, "
             f"BackupAndRestore every epoch, one evaluation at the end), "
             f"{case.get('epochs')} epochs, wall time from process start to exit, each job "
             f"run {case.get('repeats')} time(s) in rounds: best (median, max).", "",
             "| job | wall (s) | ÷ plain Keras (best) | eval accuracy |", "|---|---|---|---|"]
    for r in case["rows"]:
        wall = r["wall_seconds"]
        lines.append(f"| {FIXED_COSTS_LABELS.get(r['job'], r['job'])} | {wall['best']:.1f} "
                     f"({wall['median']:.1f}, {wall['max']:.1f}) | {_f(r['over_keras'], 2)} | "
                     f"{_f(r['accuracy'], 3)} |")
    tfdp_jobs = [job for job in case["phases"] if job in case.get("counts", {})]
    if tfdp_jobs:
        names = list(dict.fromkeys(n for job in tfdp_jobs for n in case["phases"][job]))
        lines += ["", "Where the chief's time went (seconds, the best run; `summary.json`'s "
                      "`phases`):", "", "| phase | " + " | ".join(tfdp_jobs) + " |",
                  "|---|" + "---|" * len(tfdp_jobs)]
        for name in names:
            lines.append(f"| {name} | " + " | ".join(
                _f(case["phases"][job].get(name), 2) for job in tfdp_jobs) + " |")
        for count in ("train_pipeline_builds", "eval_pipeline_builds", "step_calls"):
            lines.append(f"| *{count.replace('_', ' ')}* | " + " | ".join(
                str(case["counts"][job].get(count, "–")) for job in tfdp_jobs) + " |")
        lines.append("| *per epoch outside the steps (median after the first)* | " + " | ".join(
            _f(case["epoch_outside_seconds"].get(job), 2) for job in tfdp_jobs) + " |")
        lines.append("| *per epoch, its first training call (median after the first; in "
                     "steps)* | " + " | ".join(
                         _f(case["epoch_first_call_seconds"].get(job), 2) for job in tfdp_jobs)
                     + " |")
    if "keras" in case["phases"]:
        lines += ["", "Plain Keras, its own parts (s): " + ", ".join(
            f"{name} {value:.2f}" for name, value in case["phases"]["keras"].items())
            + " (the rest of its wall time is the interpreter's start and exit)."]
    return lines


def _accumulation(case) -> list[str]:
    mb = 1e6
    lines = [case["workload"] + f"; every k timed in one launch, in alternation, "
             f"{case['rounds']} rounds: time per global batch of the fastest round, speed-up "
             "k × (fastest k = 1 time) ÷ (fastest time at k), in brackets the median over "
             "rounds of each round's ratio; peaks per worker process, each k in fresh "
             "processes.", "",
             "| k | global batch | accumulated (s) | all-reduce every micro-batch (s) | "
             "speed-up (median) | "
             "all-reduces per global batch (accum / per micro) | TF peak MB (÷ k=1) | "
             "VmHWM MB (÷ k=1) | VmHWM growth in training MB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in case["rows"]:
        lines.append(
            f"| {r['accum_steps']} | {r['global_batch']} | "
            f"{_f(r['accumulated_seconds_per_global_batch'], 3)} | "
            f"{_f(r['per_micro_batch_seconds_per_global_batch'], 3)} | {_f(r['speedup'], 2)}× "
            f"({_f(r.get('median_speedup'), 2)}×) | "
            f"{_f(r['all_reduces_accumulated'])} / {_f(r['all_reduces_per_micro_batch'])} | "
            f"{_f(r['tf_peak_bytes'] and r['tf_peak_bytes'] / mb)} "
            f"({_f(r['tf_peak_ratio'], 2)}) | "
            f"{_f(r['peak_rss_bytes'] / mb)} ({_f(r['peak_rss_ratio'], 2)}) | "
            f"{_f(r['rss_growth_bytes'] / mb)} |")
    return lines


def _allreduce(case) -> list[str]:
    lines = [f"{case['implementation']}, {case['num_workers']} workers; ring bound "
             f"2(n−1)/n·S/B with B = {_f(case['link_gbytes_per_second'], 3)} GB/s "
             f"({case['link_source']}).", "",
             "| message | latency (ms) | bus bandwidth (GB/s) | ring bound (ms) | ÷ bound |",
             "|---|---|---|---|---|"]
    for r in case["rows"]:
        lines.append(f"| {r['bytes']:,} B | {_f(1000 * r['seconds'], 2)} | "
                     f"{_f(r['bus_gbytes_per_second'], 3)} | "
                     f"{_f(1000 * r['ring_lower_bound_seconds'], 3)} | {_f(r['ratio_to_bound'], 1)} |")
    lines += ["", "| gradients | bytes_per_pack | batch all-reduce (ms) |", "|---|---|---|"]
    for r in case["packs"]:
        lines.append(f"| {r['model']} ({r['tensors']} tensors, {r['bytes'] / 1e6:.2f} MB) | "
                     f"{r['bytes_per_pack'] or '0 (one pack)'} | {_f(1000 * r['seconds'], 1)} |")
    return lines


def _pipeline(case) -> list[str]:
    return [case["setup"], "",
            "| pipeline | examples/s |", "|---|---|",
            f"| naive (sequential map, no prefetch) | {_f(case['naive_examples_per_second'])} |",
            f"| `pipelines.make_dataset` | {_f(case['pipelined_examples_per_second'])} |",
            f"| speed-up | {_f(case['speedup'], 2)}× |"]


def _predict(case) -> list[str]:
    rows = case["rows"]
    lines = ["Synthetic MLP (64 → 1024 → 1024 → 10); best of the timed calls; the whole call "
             "on the chief (tfdp: reading, scoring and writing TFRecord shards; Keras: "
             "returning every prediction to every worker).", "",
             "| path | workers | examples/s | peak RSS per worker (MB) |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['path']} | {r['num_workers']} | {_f(r['examples_per_second'])} | "
                     f"{_f(r['peak_rss_mb'])} |")
    lines += ["", f"Scaling at 2 workers: tfdp {_f(case['scaling']['tfdp'], 2)}, Keras "
                  f"{_f(case['scaling']['keras'], 2)}; two independent processes reach "
                  f"{_f(case['ceiling'], 2)} of 2× one (this machine's ceiling), tfdp "
                  f"{_f(case['tfdp_over_ceiling'], 2)} of that."]
    growth = case.get("memory_growth")
    if growth:
        lines += ["", "| peak RSS per worker, 1,000 floats per example | small output | "
                      "10× output | ratio |", "|---|---|---|---|"]
        for path, g in growth.items():
            lines.append(f"| {path} | {_f(g['small_mb'])} MB | {_f(g['large_mb'])} MB | "
                         f"{_f(g['ratio'], 2)} |")
    return lines


def _mb(value):
    return None if value is None else value / 1e6


def _memory_rows(comparison, labels) -> list[str]:
    lines = ["| | " + " | ".join(labels) + " |", "|---|---|---|"]
    rows = (
        ("step time, median over rounds (s)", lambda s: _f(s["median_step_seconds"], 3)),
        ("step time by round (s)",
         lambda s: ", ".join(_f(v, 3) for v in s["step_seconds_by_round"])),
        ("peak resident set, worst worker (MB, median over rounds)",
         lambda s: _f(_mb(s["peak_rss_bytes"]))),
        ("peak resident set by round (MB)",
         lambda s: ", ".join(_f(_mb(v)) for v in s["peak_rss_bytes_by_round"])),
        ("TensorFlow allocator peak, worst worker (MB, BFC)", lambda s: _f(_mb(s["tf_peak_bytes"]))),
        ("weights (MB)", lambda s: _f(_mb(s["weight_bytes"]), 1)),
        ("optimizer state (MB)", lambda s: _f(_mb(s["optimizer_state_bytes"]), 1)),
        ("shard variables (MB)", lambda s: _f(_mb(s["shard_scratch_bytes"]), 1)),
    )
    for label, cell in rows:
        lines.append(f"| {label} | {cell(comparison['off'])} | {cell(comparison['on'])} |")
    return lines


def _memory(case) -> list[str]:
    zero = case["zero"]
    off = zero["off"]
    lines = [f"ZeRO-1: an MLP of {off['parameters']:,} parameters with Adam, "
             f"{off['num_replicas']} workers (MultiWorkerMirroredStrategy, `tfdp-launch`), "
             "tiny input; each configuration in fresh processes, timing launches alternating "
             "unsharded and sharded. Per worker; the state is counted from the optimizer's "
             "variables, the shard variables (this replica's chunk of every weight, scratch "
             "for the inner optimizer) apart; the allocator peak from launches with "
             "`TF_CPU_ALLOCATOR_USE_BFC=true` (the default CPU allocator keeps no "
             "statistics).", "",
             *_memory_rows(zero, ("unsharded", "`shard_optimizer_state=True`")), "",
             f"Optimizer state sharded ÷ unsharded {_f(zero['optimizer_state_ratio'], 3)} "
             f"({_f(zero['optimizer_state_and_scratch_ratio'], 3)} with the shard variables); "
             f"peak resident set saved ÷ unsharded state "
             f"{_f(zero['peak_rss_saving_over_state'], 3)} (by round: "
             + ", ".join(_f(v, 3) for v in zero["peak_rss_saving_over_state_by_round"])
             + f"), allocator peak saved ÷ state {_f(zero['tf_peak_saving_over_state'], 3)}; "
             f"step time sharded ÷ unsharded {_f(zero['step_time_ratio'], 3)} (by round: "
             + ", ".join(_f(v, 3) for v in zero["step_time_ratio_by_round"]) + ")."]
    remat = case["remat"]
    lines += [""]
    if remat.get("status") != "ok":
        return lines + [f"*Remat: skipped: {remat.get('reason')}*"]
    lines += [f"Remat: the registered transformer ({remat['off']['parameters']:,} parameters), "
              "one process, Adam; activation memory = allocator peak − weights − optimizer "
              "state (gradients and the step's temporaries included).", "",
              *_memory_rows(remat, ("without remat", "`remat=True`")),
              f"| activation memory (MB) | {_f(_mb(remat['off']['activation_bytes']))} | "
              f"{_f(_mb(remat['on']['activation_bytes']))} |", "",
              f"Activation memory 1 − with ÷ without {_f(remat['activation_reduction'], 3)}; "
              f"step time with ÷ without {_f(remat['step_time_ratio'], 3)} (by round: "
              + ", ".join(_f(v, 3) for v in remat["step_time_ratio_by_round"]) + ")."]
    return lines


def markdown(results: dict) -> str:
    """The Markdown report of `results`."""
    cases, config = results["cases"], results["config"]
    sections = [
        ("1. Scaling: 1 vs 2 workers", "scaling", lambda c: _scaling(c, config)),
        ("2. Overhead: fit vs Keras fit vs custom loops, same strategy", "overhead", _overhead),
        ("3. Peer: PyTorch DDP on the same network", "peer_torch", _peer),
        ("4. Communication: gradient compression, tfdp and DDP's hooks", "communication",
         _communication),
        ("5. Gradient accumulation on a communication-bound MLP", "accumulation", _accumulation),
        ("6. All-reduce latency and bandwidth", "allreduce", _allreduce),
        ("7. Input pipeline vs naive", "input_pipeline", _pipeline),
        ("8. Batch inference: tfdp.predict vs Keras predict", "predict", _predict),
        ("9. Memory: ZeRO-1 and activation recomputation", "memory", _memory),
        ("10. Time to accuracy: digits, tfdp's gradient exchanges and DDP's hooks",
         "time_to_accuracy", _time_to_accuracy),
        ("11. Fixed costs: the README's job against plain Keras, start to exit", "fixed_costs",
         _fixed_costs),
        ("12. Stragglers: one of 2 workers at half a CPU, equal split vs balanced batches",
         "stragglers", stragglers.markdown_lines),
    ]
    lines = ["# tfdp benchmark results", "", *_machine(results), "", "## Targets", "",
             *_targets(results)]
    for title, name, render in sections:
        lines += ["", f"## {title}", ""]
        status = _status_line(cases[name])
        lines += [status] if status else render(cases[name])
        if cases[name].get("load_average_at_start"):
            lines += ["", f"*Load average (1/5/15 min) when this case started: "
                          f"{tuple(cases[name]['load_average_at_start'])}; it took "
                          f"{cases[name].get('seconds', 0):.0f} s.*"]
        if name == "overhead" and results.get("breakdown"):
            lines += ["", "### Where a 2-worker step's time goes (ms per optimizer step)", "",
                      *_breakdown(results["breakdown"])]
    lines += ["", "## Reference: the issue's numbers before tfdp (global img/s)", "",
              "Measured with the issue's own 6-conv-layer CNN, not `CNN_LAYERS`: compare "
              "ratios (fit vs loops, 2 vs 1 workers, tfdp vs DDP), not absolute numbers.", "",
              "| | 1 worker | 2 workers |", "|---|---|---|"]
    lines += [f"| {name} | {one:,} | {two:,} |" for name, (one, two) in ISSUE_BASELINE.items()]
    return "\n".join(lines) + "\n"


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = results["cases"]
    figure, axes = plt.subplots(2, 2, figsize=(13, 9))
    (throughput_ax, breakdown_ax), (allreduce_ax, accum_ax) = axes

    if cases["scaling"].get("status") == "ok":
        for row in cases["scaling"]["rows"]:
            workers = sorted(row["workers"], key=int)
            throughput_ax.plot([int(n) for n in workers], [row["workers"][n] for n in workers],
                               marker="o", label=PATH_LABELS.get(row["path"], row["path"]))
        trainer = next((r for r in cases["scaling"]["rows"] if r["path"] == "trainer"), None)
        if trainer:
            throughput_ax.plot([1, 2], [trainer["workers"]["1"], 2 * trainer["workers"]["1"]],
                               "k:", label="linear scaling of the Trainer")
    if cases["peer_torch"].get("status") == "ok":
        workers = sorted(cases["peer_torch"]["workers"], key=int)
        throughput_ax.plot([int(n) for n in workers],
                           [cases["peer_torch"]["workers"][n]["images_per_second"] for n in workers],
                           marker="s", linestyle="--", label="PyTorch DDP")
    throughput_ax.set(title="CNN throughput vs workers", xlabel="workers",
                      ylabel="global images/s", xticks=[1, 2])
    if throughput_ax.get_legend_handles_labels()[0]:
        throughput_ax.legend(fontsize=7)

    parts = results.get("breakdown") or {}
    if parts:
        bottoms = [0.0] * len(parts)
        for name, label in BREAKDOWN_PARTS:
            values = [max(p[name], 0.0) for p in parts.values()]
            breakdown_ax.bar(list(parts), values, bottom=bottoms, label=label)
            bottoms = [b + v for b, v in zip(bottoms, values)]
        breakdown_ax.legend(fontsize=7)
    breakdown_ax.set(title="Step time at 2 workers", ylabel="ms per optimizer step")
    breakdown_ax.tick_params(axis="x", labelsize=7)

    if cases["allreduce"].get("status") == "ok":
        rows = cases["allreduce"]["rows"]
        sizes = [r["bytes"] for r in rows]
        allreduce_ax.loglog(sizes, [r["seconds"] * 1000 for r in rows], marker="o",
                            label="measured")
        allreduce_ax.loglog(sizes, [r["ring_lower_bound_seconds"] * 1000 for r in rows], "k:",
                            label="ring bound 2(n−1)/n·S/B")
        latency = cases["allreduce"]["latency_seconds"]
        allreduce_ax.loglog(sizes, [(latency + r["ring_lower_bound_seconds"]) * 1000 for r in rows],
                            "k--", linewidth=0.8, label="smallest-message latency + bound")
        allreduce_ax.legend(fontsize=7)
    allreduce_ax.set(title="All-reduce latency (2 workers, ring)", xlabel="message bytes",
                     ylabel="ms")

    if cases["accumulation"].get("status") == "ok":
        rows = cases["accumulation"]["rows"]
        ks = [str(r["accum_steps"]) for r in rows]
        xs = range(len(rows))
        accum_ax.bar([x - 0.2 for x in xs], [r["accumulated_seconds_per_global_batch"] for r in rows],
                     width=0.4, label="accumulate (1 all-reduce)")
        accum_ax.bar([x + 0.2 for x in xs],
                     [r["per_micro_batch_seconds_per_global_batch"] for r in rows],
                     width=0.4, label="all-reduce every micro-batch")
        accum_ax.set_xticks(list(xs), ks)
        accum_ax.legend(fontsize=7)
    accum_ax.set(title="Accumulation, 10M-parameter MLP", xlabel="k (micro-batches per step)",
                 ylabel="s per global batch")

    figure.suptitle(f"tfdp benchmarks — {results['machine']['cpu']}, "
                    f"{results['machine']['cores']} cores"
                    + (" (quick mode)" if results["config"]["quick"] else ""))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write(results: dict, out_dir: str) -> dict:
    """Writes results.json, results.md and results.png into `out_dir`.

    Args:
        results: `run_suite`'s dictionary.
        out_dir: directory, created if missing.

    Returns:
        `{"json", "markdown", "png"}`: the paths written.
    """
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, f"results.{ext}")
             for name, ext in (("json", "json"), ("markdown", "md"), ("png", "png"))}
    with open(paths["json"], "w") as f:
        json.dump(results, f, indent=1)
    with open(paths["markdown"], "w") as f:
        f.write(markdown(results))
    _plot(results, paths["png"])
    return paths
