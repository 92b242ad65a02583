"""`python -m tfdp.bench` (or `tfdp-bench`): the performance suite, side by side.

Reads flags, builds a `SuiteConfig`, runs `tfdp.bench.suite.run_suite` and
writes `results.json`, `results.md` and `results.png` into `--out_dir`.
Exits 1 when a case failed, or a launch that some of its rows need (the
case's other rows are still reported), with the error in the files; 0
otherwise. A skipped case (PyTorch not installed) is not a failure.

    python -m tfdp.bench                       # full suite; not timed whole since memory (18 min alone) and time to accuracy (12 min) joined
    python -m tfdp.bench --quick --out_dir /tmp/bench   # every case, a few steps each, ~15 min on 2 cores
    python -m tfdp.bench --smoke --out_dir /tmp/bench   # the suite's wiring only: its figures measure nothing
    python -m tfdp.bench --link 100mbit        # multi-worker cases over a 100 Mbit/s link
    python -m tfdp.bench --link 1gbit --cases communication,time_to_accuracy   # two cases only
    python -m tfdp.bench --cases fixed_costs   # the README's job vs plain Keras, start to exit
    python -m tfdp.bench --cases stragglers    # one of 2 workers at half a CPU: equal vs balanced (root)
"""

from __future__ import annotations

import sys

from absl import app
from absl import flags

_OUT_DIR = flags.DEFINE_string("out_dir", "bench_results", "Where the three result files go.")
_QUICK = flags.DEFINE_boolean("quick", False, "Every case with a few steps each.")
_SMOKE = flags.DEFINE_boolean(
    "smoke", False, "Every case and path of --quick at the smallest sizes: checks that the "
    "suite runs here (a few minutes); its figures measure nothing.")
_THREADS = flags.DEFINE_integer(
    "threads", 1, "TensorFlow intra- and inter-op threads (torch threads) per worker.",
    lower_bound=1)
_STEPS = flags.DEFINE_integer(
    "steps", None, "Optimizer steps per timed call (multiple of --steps_per_execution). "
    "Defaults to 100 (20 with --quick, 4 with --smoke).", lower_bound=1)
_STEPS_PER_EXECUTION = flags.DEFINE_integer(
    "steps_per_execution", None, "N: steps_per_execution / steps_per_loop. Defaults to 10 "
    "(2 with --smoke).", lower_bound=1)
_REPEATS = flags.DEFINE_integer(
    "repeats", None, "Timed calls per path per launch. Defaults to 3 (1 with --quick or --smoke).",
    lower_bound=1)
_ROUNDS = flags.DEFINE_integer(
    "rounds", None, "Launches per worker count, alternating. Defaults to 2 (1 with --quick or --smoke).",
    lower_bound=1)
_LINK = flags.DEFINE_float(
    "link_gbytes_per_second", None,
    "Link bandwidth B for the ring bound, GB/s. Defaults to the largest message's bus bandwidth.")
_SHAPED_LINK = flags.DEFINE_string(
    "link", None, "Run every multi-worker case over a loopback shaped to this rate, e.g. "
    "100mbit or 1gbit (a network namespace with tc tbf; needs root, ip and tc). "
    "Defaults to the unshaped loopback.")
_CASES = flags.DEFINE_list(
    "cases", None, "Run only these cases (comma-separated: scaling, overhead, peer_torch, "
    "communication, time_to_accuracy, accumulation, allreduce, input_pipeline, predict, "
    "memory, fixed_costs, stragglers); the others are reported as skipped. Defaults to every case.")
_TIMEOUT_SCALE = flags.DEFINE_float(
    "timeout_scale", 1.0, "Multiplies every subprocess deadline (busy or slow machines). "
    "A --link slower than 1gbit already stretches them by 1 Gbit/s ÷ its rate (10x at 100mbit).")


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    if _QUICK.value and _SMOKE.value:
        raise app.UsageError("--quick and --smoke are two sizes of the suite: pass one of them.")
    from tfdp.bench import link

    if _SHAPED_LINK.value is not None:  # before TensorFlow is imported: a second, not ten
        try:
            link.check_rate(_SHAPED_LINK.value)
        except ValueError as error:
            raise app.UsageError(str(error)) from None
        _exit_if_the_link_cannot_be_shaped(link.why_unavailable())
    from tfdp.bench import report
    from tfdp.bench import suite

    overrides = {
        "threads": _THREADS.value,
        "link_gbytes_per_second": _LINK.value,
        "timeout_scale": _TIMEOUT_SCALE.value,
        "link": _SHAPED_LINK.value,
    }
    for name, flag in (("steps", _STEPS), ("steps_per_execution", _STEPS_PER_EXECUTION),
                       ("repeats", _REPEATS), ("rounds", _ROUNDS)):
        if flag.value is not None:
            overrides[name] = flag.value
    if _CASES.value is not None:
        overrides["cases"] = tuple(_CASES.value)
    try:
        if _SMOKE.value:
            config = suite.SuiteConfig.smoke_config(**overrides)
        elif _QUICK.value:
            config = suite.SuiteConfig.quick_config(**overrides)
        else:
            config = suite.SuiteConfig(**overrides)
    except ValueError as error:
        raise app.UsageError(str(error)) from None
    try:
        results = suite.run_suite(config)
    except link.LinkUnavailable as error:
        _exit_if_the_link_cannot_be_shaped(str(error))
    results["command"] = " ".join(["python -m tfdp.bench", *sys.argv[1:]])
    paths = report.write(results, _OUT_DIR.value)
    print(report.markdown(results))
    print(f"[tfdp.bench] wrote {', '.join(paths.values())}")
    failed = suite.failed_cases(results)
    if failed:
        print(f"[tfdp.bench] failed cases: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


def _exit_if_the_link_cannot_be_shaped(reason: str | None) -> None:
    """Exits with status 2 and one line saying why, when there is a `reason`."""
    if reason is not None:
        print(f"[tfdp.bench] --link={_SHAPED_LINK.value}: cannot shape the link: {reason}",
              file=sys.stderr)
        sys.exit(2)


def run() -> None:
    """Console-script entry point (`tfdp-bench`)."""
    app.run(main)


if __name__ == "__main__":
    run()
