"""Which benchmark cases run, in which order, with which sizes.

This module owns the suite: a `SuiteConfig` (full or `--quick` sizes) and
`run_suite`, which runs every case in one go so that the ratios between them
come from the same minutes of the same machine, and collects their results,
the machine description and the targets into one dictionary. A case that
fails is recorded with its error and the others still run. Measuring is the
case modules' job, writing files `tfdp.bench.report`'s.

Order: the CNN throughput launches (1 and 2 workers, alternating when
`rounds > 1`) feed the scaling, overhead and communication cases; PyTorch
DDP runs right after them on the same network, without and then with its
communication hooks; then time to accuracy on digits (tfdp's gradient
exchanges and DDP's hooks, each `repeats` times in rounds); then the
all-reduce, accumulation, input-pipeline, batch-inference and memory cases;
then the fixed costs (the README's main job, start to exit, against plain
Keras); last the stragglers (2 workers, one in a CPU cgroup: the equal split
against balanced batches, and both without the straggler).
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from typing import Callable

from tfdp.bench import accumulation
from tfdp.bench import allreduce
from tfdp.bench import communication
from tfdp.bench import fixed_costs
from tfdp.bench import input_pipeline
from tfdp.bench import link as link_lib
from tfdp.bench import machine
from tfdp.bench import memory
from tfdp.bench import overhead
from tfdp.bench import peer_torch
from tfdp.bench import predict
from tfdp.bench import procs
from tfdp.bench import scaling
from tfdp.bench import stragglers
from tfdp.bench import targets
from tfdp.bench import throughput
from tfdp.bench import time_to_accuracy

CASES = ("scaling", "overhead", "peer_torch", "communication", "time_to_accuracy",
         "accumulation", "allreduce", "input_pipeline", "predict", "memory", "fixed_costs",
         "stragglers")
#: The link rate the subprocess deadlines were set for (bits/s); a slower `--link` stretches them.
LINK_DEADLINES_BITS_PER_SECOND = 1e9


@dataclasses.dataclass(frozen=True, kw_only=True)
class SuiteConfig:
    """Sizes of every case.

    Attributes:
        quick: whether this is the `--quick` smoke configuration.
        threads: TensorFlow intra-/inter-op threads (and torch threads) per
            worker process.
        per_replica_batch: CNN examples per replica per step.
        steps_per_execution: N for `tfdp_fit` (`steps_per_execution`),
            `trainer` (`steps_per_loop`) and `loop_n`.
        steps: optimizer steps per timed call (throughput and DDP).
        repeats: timed calls per path per launch.
        rounds: launches per worker count (alternating 1, 2, 1, 2, ...).
        paths: training paths timed (see `tfdp.bench.throughput.PATHS`).
        accum_steps: accumulation values k (1 is the baseline).
        accum_micro_batch: MLP examples per replica per micro-batch.
        accum_steps_timed: optimizer steps per timed call, accumulation case.
        accum_rounds: alternating rounds timing every k, accumulation case.
        all_reduce_sizes: message sizes, bytes.
        all_reduce_iterations: calls timed per small message.
        link_gbytes_per_second: link bandwidth for the ring bound; None measures it.
        pipeline_flags: `tfdp.bench.input_pipeline.run_benchmark` arguments.
        predict_examples: examples per timed `predict` call.
        predict_memory_examples: input sizes of the `predict` memory jobs
            (1,000 floats per prediction).
        memory_width: hidden width of the `memory` case's ZeRO MLP (4 hidden
            layers; 4096: ≈50 M parameters).
        memory_steps: timed steps per `memory` launch, after 2 warm-up steps
            (1 with --quick).
        memory_rounds: alternating timing launches (off, on) per `memory`
            comparison.
        memory_remat_model: the `memory` case's transformer options
            (`tfdp.bench.memory.REMAT_MODEL` by default), as (name, value) pairs.
        timeout_scale: multiplies every subprocess deadline.
        link: run every multi-worker case over a loopback shaped to this
            rate (`"100mbit"`, `"1gbit"`; `tfdp.bench.link`); None: unshaped.
        tta_methods: tfdp methods of the time-to-accuracy case
            (`tfdp.bench.time_to_accuracy.TFDP_METHODS`), each run `repeats`
            times.
        tta_hooks: DDP hooks of the time-to-accuracy case
            (`tfdp.bench.time_to_accuracy.DDP_HOOKS`).
        tta_max_epochs: epochs after which a time-to-accuracy run stops
            short of the target.
        tta_keras_floor: also run the time-to-accuracy job in plain one-process
            Keras each round (`time_to_accuracy.measure_keras`), the floor.
        fixed_costs_epochs: epochs of every `fixed_costs` job (the README's
            main job trains 10), each run `repeats` times.
        stragglers_epochs: epochs of every `stragglers` run (it does not stop
            at 0.95), each of its four launches run `repeats` times.
        stragglers_warmup_epochs: epochs left out of the `stragglers`
            images/s (tracing, the balanced plan's first windows).
        stragglers_cpu_fraction: CPUs' worth of time the straggler gets.
        cases: the cases to run (names from `CASES`; every one by default).
            The others are recorded as skipped. The CNN throughput launches
            run when scaling, overhead, peer_torch or communication is
            selected (they feed all four), PyTorch's plain DDP when
            peer_torch or communication is.
    """

    quick: bool = False
    threads: int = 1
    per_replica_batch: int = 64
    steps_per_execution: int = 10
    steps: int = 100
    repeats: int = 3
    rounds: int = 2
    # Not tfdp_fit_buckets: with the suite's one inter-op thread its buckets
    # cannot overlap the backward pass (tfdp.training.exchanges.bucketed);
    # time it with throughput.run(inter_op_threads=2) instead.
    paths: tuple[str, ...] = tuple(p for p in throughput.PATHS if p != "tfdp_fit_buckets")
    accum_steps: tuple[int, ...] = (1, 4, 8)
    accum_micro_batch: int = 16
    accum_steps_timed: int = 20
    accum_rounds: int = 5
    all_reduce_sizes: tuple[int, ...] = allreduce.DEFAULT_SIZES
    all_reduce_iterations: int = 30
    link_gbytes_per_second: float | None = None
    pipeline_flags: tuple[tuple[str, int], ...] = (
        ("num_examples", 2048), ("image_size", 128), ("global_batch", 128),
        ("epochs", 2), ("repeats", 5),
    )
    predict_examples: int = 100_000
    predict_memory_examples: tuple[int, ...] = (20_000, 200_000)
    memory_width: int = memory.ZERO_WIDTH
    memory_steps: int = 6
    memory_rounds: int = 3
    memory_remat_model: tuple[tuple[str, int | float], ...] = tuple(memory.REMAT_MODEL.items())
    timeout_scale: float = 1.0
    link: str | None = None
    tta_methods: tuple[str, ...] = time_to_accuracy.TFDP_METHODS
    tta_hooks: tuple[str, ...] = time_to_accuracy.DDP_HOOKS
    tta_max_epochs: int = 30
    tta_keras_floor: bool = True
    fixed_costs_epochs: int = 10
    stragglers_epochs: int = 15
    stragglers_warmup_epochs: int = 3
    stragglers_cpu_fraction: float = 0.5
    cases: tuple[str, ...] = CASES

    def __post_init__(self):
        unknown = [c for c in self.cases if c not in CASES]
        if unknown or not self.cases:
            raise ValueError(
                f"`cases` must name one or more of {', '.join(CASES)}. Received: "
                f"cases={','.join(self.cases)!r}"
            )
        if self.link is not None:
            link_lib.check_rate(self.link)
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"`threads` must be a positive integer. Received: threads={self.threads!r}")
        if self.steps % self.steps_per_execution or self.steps < 2 * self.steps_per_execution:
            raise ValueError(
                f"`steps` must be a multiple of `steps_per_execution` and at least two "
                f"executions. Received: steps={self.steps}, "
                f"steps_per_execution={self.steps_per_execution}"
            )
        if 1 not in self.accum_steps:
            raise ValueError(
                f"`accum_steps` must include 1, the baseline. Received: {self.accum_steps!r}"
            )
        unknown = [m for m in self.tta_methods if m not in time_to_accuracy.TFDP_METHODS]
        unknown += [h for h in self.tta_hooks if h not in time_to_accuracy.DDP_HOOKS]
        if unknown or not self.tta_methods:
            raise ValueError(
                f"`tta_methods` must be a non-empty tuple of "
                f"{', '.join(time_to_accuracy.TFDP_METHODS)} and `tta_hooks` a tuple of "
                f"{', '.join(time_to_accuracy.DDP_HOOKS)}. Received: "
                f"tta_methods={self.tta_methods!r}, tta_hooks={self.tta_hooks!r}"
            )
        for name in ("memory_width", "memory_steps", "memory_rounds", "tta_max_epochs",
                     "fixed_costs_epochs", "stragglers_epochs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
        if self.stragglers_warmup_epochs < 0 or not 0.01 <= self.stragglers_cpu_fraction <= 64:
            raise ValueError(
                "`stragglers_warmup_epochs` must be >= 0 and `stragglers_cpu_fraction` in "
                f"[0.01, 64]. Received: stragglers_warmup_epochs={self.stragglers_warmup_epochs!r}"
                f", stragglers_cpu_fraction={self.stragglers_cpu_fraction!r}")
        if self.timeout_scale <= 0:
            raise ValueError(
                f"`timeout_scale` must be positive. Received: timeout_scale={self.timeout_scale!r}"
            )

    @classmethod
    def quick_config(cls, **overrides) -> "SuiteConfig":
        """The smoke-test sizes: every case, a few steps each (~15 min on 2 AMD EPYC cores).

        Time to accuracy: one tfdp method and one DDP hook, 2 epochs each
        (enough to run every part of the case, not to reach the target).
        """
        values = dict(
            quick=True, steps=20, repeats=1, rounds=1,
            paths=("keras_fit_n", "tfdp_fit", "tfdp_fit_bf16", "tfdp_fit_powersgd",
                   "tfdp_fit_topk", "tfdp_fit_float8", "tfdp_fit_local_sgd", "tfdp_fit_diloco", "trainer", "loop_n", "loop_n_local", "loop_n_sync", "input"),
            accum_steps_timed=3, accum_steps=(1, 8), accum_rounds=2, all_reduce_iterations=5,
            all_reduce_sizes=(4, 40_000, 4_000_000),
            pipeline_flags=(("num_examples", 256), ("image_size", 32), ("global_batch", 64),
                            ("epochs", 1), ("repeats", 1)),
            predict_examples=10_000, predict_memory_examples=(2_000, 20_000),
            memory_width=512, memory_steps=2, memory_rounds=1,
            memory_remat_model=tuple({**memory.REMAT_MODEL, "sequence_length": 64,
                                      "num_layers": 2, "hidden": 64}.items()),
            tta_methods=("diloco",), tta_hooks=("powersgd",), tta_max_epochs=2,
            stragglers_epochs=6,
        )
        values.update(overrides)
        return cls(**values)

    @classmethod
    def smoke_config(cls, **overrides) -> "SuiteConfig":
        """`quick_config` at the smallest sizes that still run every part of every case.

        For checking the suite's wiring (the test suite runs it): every case,
        every path and every launch of `--quick`, with per-replica batches of
        8, 2 timed executions of 2 steps, 1,000 predictions, 2 epochs of each
        straggler run and 1 epoch of
        time to accuracy, 2 epochs of each fixed-costs job. Its figures are
        not measurements of anything.
        """
        values = dict(
            per_replica_batch=8, steps_per_execution=2, steps=4, accum_micro_batch=4,
            accum_steps_timed=2, all_reduce_iterations=2,
            predict_examples=1_000, predict_memory_examples=(500, 2_000),
            memory_steps=1, tta_max_epochs=1, fixed_costs_epochs=2, stragglers_epochs=2,
        )
        values.update(overrides)
        return cls.quick_config(**values)

    @property
    def link_slowdown(self) -> float:
        """How much longer the suite's launches may take over `link` than over 1 Gbit/s (≥ 1).

        The deadlines were set for loopback and a 1 Gbit/s link. Over a
        slower link the communication-bound paths slow down in proportion
        to the rate (at 100 Mbit/s the 2-worker CNN launch, with eight paths
        that all-reduce 1.15 MB per step, took more than its 600 s), so the
        deadlines stretch by 1 Gbit/s ÷ the rate: 10× at `100mbit`.
        """
        if self.link is None:
            return 1.0
        return max(1.0, LINK_DEADLINES_BITS_PER_SECOND / link_lib.bits_per_second(self.link))

    def timeout(self, seconds: float) -> float:
        """A subprocess deadline: `seconds` × `timeout_scale` × `link_slowdown`."""
        return seconds * self.timeout_scale * self.link_slowdown


def _guarded(name: str, function: Callable[[], dict], log: Callable[[str], None]) -> dict:
    start = time.monotonic()
    load = machine.load_average()
    log(f"[tfdp.bench] {name}: running (load average {load})")
    try:
        result = function()
    except (procs.JobFailed, ValueError, KeyError, RuntimeError) as error:
        log(f"[tfdp.bench] {name}: FAILED after {time.monotonic() - start:.0f} s: {error}")
        return {"status": "error", "error": str(error),
                "traceback": traceback.format_exc(limit=5), "load_average_at_start": load}
    result.setdefault("status", "ok")
    result["seconds"] = round(time.monotonic() - start, 1)
    result["load_average_at_start"] = load
    log(f"[tfdp.bench] {name}: {result['status']} in {result['seconds']:.0f} s"
        + (f" ({result['reason']})" if result.get("reason") else ""))
    return result


def run_suite(config: SuiteConfig, *, log: Callable[[str], None] = print) -> dict:
    """Runs every case and returns the suite's results.

    Args:
        config: the sizes.
        log: receives one progress line per case. Defaults to `print`.

    Returns:
        `{"machine", "config", "cases": {case: result}, "breakdown",
        "targets", "load_average_at_end", "seconds"}`; every case in `CASES`
        is present, with `"status"` "ok", "skipped" (and `"reason"`) or
        "error" (and `"error"`).

    Raises:
        tfdp.bench.link.LinkUnavailable: `config.link` is set and this
            machine cannot shape a link; nothing was run.
    """
    if config.link is None:
        return _run_cases(config, log)
    with link_lib.shaped_link(config.link) as prefix, procs.through_link(prefix):
        log(f"[tfdp.bench] multi-worker cases run over a loopback shaped to {config.link} "
            f"({' '.join(prefix)})")
        return _run_cases(config, log)


def failed_cases(results: dict) -> list[str]:
    """The cases of `run_suite`'s results that failed, whole or in a launch some rows need."""
    return [name for name, case in results["cases"].items()
            if case["status"] == "error" or case.get("failed_parts")]


def _not_selected(config: SuiteConfig) -> dict:
    return {"status": "skipped",
            "reason": f"not among the selected cases ({','.join(config.cases)})"}


def _run_cases(config: SuiteConfig, log: Callable[[str], None]) -> dict:
    start = time.monotonic()
    results = {"machine": machine.describe(), "config": dataclasses.asdict(config),
               "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    selected = set(config.cases)

    def guarded(case: str, name: str, function: Callable[[], dict]) -> dict:
        """Runs one measurement if `case` is selected; records it as skipped otherwise."""
        return _guarded(name, function, log) if case in selected else _not_selected(config)

    cases: dict = {}
    # The CNN throughput launches feed these four cases, plain DDP the last two.
    runs = _not_selected(config)
    if selected & {"scaling", "overhead", "peer_torch", "communication"}:
        runs = _guarded("throughput (1 and 2 workers)", lambda: {"runs": throughput.run(
            workers=(1, 2), paths=config.paths, rounds=config.rounds, threads=config.threads,
            timeout=config.timeout(600), per_replica_batch=config.per_replica_batch,
            steps_per_execution=config.steps_per_execution, steps=config.steps,
            repeats=config.repeats,
        )}, log)
    if runs["status"] == "ok":
        cases["scaling"] = scaling.summarize(runs["runs"])
        cases["overhead"] = overhead.summarize(runs["runs"])
        cases["scaling"]["runs"] = runs["runs"]  # every sample, for the record
        for name in ("scaling", "overhead"):
            cases[name]["seconds"] = runs["seconds"]
            cases[name]["load_average_at_start"] = runs["load_average_at_start"]
    else:
        cases["scaling"] = cases["overhead"] = runs
    for name in ("scaling", "overhead"):
        if name not in selected:
            cases[name] = _not_selected(config)
    plain_ddp = _not_selected(config)
    if selected & {"peer_torch", "communication"}:
        plain_ddp = _guarded("peer_torch", lambda: peer_torch.run(
            workers=(1, 2), per_replica_batch=config.per_replica_batch, steps=config.steps,
            repeats=config.repeats, threads=config.threads, timeout=config.timeout(300),
        ), log)
    cases["peer_torch"] = (peer_torch.compare(plain_ddp, runs.get("runs"))
                           if "peer_torch" in selected else _not_selected(config))
    if "communication" in selected:
        hooks = _guarded("communication (DDP hooks)", lambda: communication.run_ddp_hooks(
            per_replica_batch=config.per_replica_batch, steps=config.steps,
            repeats=config.repeats, threads=config.threads, timeout=config.timeout(300),
        ), log)
        cases["communication"] = communication.summarize(
            runs.get("runs"), peer_torch.compare(plain_ddp, runs.get("runs")), hooks)
        mlp = _guarded("communication (MLP, 2 workers)", lambda: {"runs": throughput.run(
            # --quick: the two paths of the MLP target only (40 MB all-reduces are slow).
            workers=(2,), paths=(communication.MLP_QUICK_PATHS if config.quick
                                 else communication.MLP_PATHS), rounds=1,
            threads=config.threads,
            timeout=config.timeout(900), per_replica_batch=config.per_replica_batch,
            steps_per_execution=config.steps_per_execution, steps=config.steps,
            repeats=config.repeats, model="mlp",
        )}, log)
        cases["communication"]["mlp"] = (communication.summarize_mlp(mlp["runs"])
                                         if mlp["status"] == "ok" else mlp)
        # A launch the case needs that failed fails the case (the exit status
        # says so), while the rows that were measured are still reported.
        failed_parts = {part: result.get("error") for part, result in (
            ("CNN throughput launches", runs), ("plain DDP launches", plain_ddp),
            ("DDP hook launches", hooks), ("MLP launch", mlp)) if result.get("status") == "error"}
        if failed_parts:
            cases["communication"]["failed_parts"] = failed_parts
    else:
        cases["communication"] = _not_selected(config)
    cases["time_to_accuracy"] = guarded("time_to_accuracy", "time_to_accuracy",
                                        lambda: time_to_accuracy.run(
        tfdp_methods=config.tta_methods, ddp_hooks=config.tta_hooks,
        keras_floor=config.tta_keras_floor, repeats=config.repeats,
        max_epochs=config.tta_max_epochs, threads=config.threads,
        timeout=config.timeout(900),
    ))
    cases["allreduce"] = guarded("allreduce", "allreduce", lambda: allreduce.run(
        nproc=2, sizes=config.all_reduce_sizes, iterations=config.all_reduce_iterations,
        link_gbytes_per_second=config.link_gbytes_per_second, threads=config.threads,
        timeout=config.timeout(300),
    ))
    cases["accumulation"] = guarded("accumulation", "accumulation", lambda: accumulation.run(
        accum_steps=config.accum_steps, micro_batch=config.accum_micro_batch,
        steps=config.accum_steps_timed, repeats=config.repeats, rounds=config.accum_rounds,
        nproc=2,
        threads=config.threads, timeout=config.timeout(300),
    ))
    cases["input_pipeline"] = guarded("input_pipeline", "input_pipeline",
                                      lambda: input_pipeline.run(
        **dict(config.pipeline_flags), timeout=config.timeout(300),
    ))
    cases["predict"] = guarded("predict", "predict", lambda: predict.run(
        num_examples=config.predict_examples, repeats=config.repeats,
        memory_examples=config.predict_memory_examples, threads=config.threads,
        timeout=config.timeout(600),
    ))
    cases["memory"] = guarded("memory", "memory", lambda: memory.run(
        width=config.memory_width, warmup_steps=1 if config.quick else 2,
        steps=config.memory_steps, rounds=config.memory_rounds,
        remat_model=dict(config.memory_remat_model), allocator_launches=not config.quick,
        threads=config.threads,
        timeout=config.timeout(900),
    ))
    cases["fixed_costs"] = guarded("fixed_costs", "fixed_costs", lambda: fixed_costs.run(
        epochs=config.fixed_costs_epochs, repeats=config.repeats, timeout=config.timeout(600),
        log=log,
    ))
    cases["stragglers"] = guarded("stragglers", "stragglers", lambda: stragglers.run(
        repeats=config.repeats, epochs=config.stragglers_epochs,
        warmup_epochs=config.stragglers_warmup_epochs,
        cpu_fraction=config.stragglers_cpu_fraction, threads=config.threads,
        timeout=config.timeout(600), log=log,
    ))
    results["cases"] = {name: cases[name] for name in CASES}
    results["breakdown"] = (
        scaling.breakdown(runs["runs"], cases["allreduce"])
        if runs["status"] == "ok" and cases["allreduce"]["status"] == "ok" else {}
    )
    results["targets"] = targets.check(results["cases"])
    results["load_average_at_end"] = machine.load_average()
    results["seconds"] = round(time.monotonic() - start, 1)
    return results
