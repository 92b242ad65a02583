"""Case 6: the input pipeline (`pipelines.make_dataset`) against a naive one.

This module owns one thing: running the existing input benchmark,
`python -m tfdp.bench.input_pipeline_run`, in a subprocess and reading its three result
lines (`tests/bench/test_input_pipeline_run.py` pins their labels). It runs as a
subprocess because `tfdp` does not import `pipelines` (tests/test_layout.py);
what is measured is documented in `bench/input_pipeline_run.py`.
"""

from __future__ import annotations

import re
import sys

from tfdp.bench import procs

_LINES = {
    "naive pipeline": "naive_examples_per_second",
    "make_dataset pipeline": "pipelined_examples_per_second",
    "speed-up": "speedup",
}


def parse(stdout: str) -> dict:
    """Reads `tfdp.bench.input_pipeline_run`'s output into numbers.

    Args:
        stdout: the benchmark's standard output.

    Returns:
        `{"setup", "naive_examples_per_second", "pipelined_examples_per_second",
        "speedup"}`.

    Raises:
        ValueError: a result line is missing (the output format changed).
    """
    result = {"setup": stdout.strip().splitlines()[0] if stdout.strip() else ""}
    for label, key in _LINES.items():
        match = re.search(rf"^{re.escape(label)}:\s*([0-9.]+)", stdout, re.MULTILINE)
        if match is None:
            raise ValueError(
                f"`python -m tfdp.bench.input_pipeline_run` printed no {label!r} line; its output "
                f"format changed. Update tfdp.bench.input_pipeline.parse. Output:\n{stdout}"
            )
        result[key] = float(match.group(1))
    return result


def run(*, num_examples: int = 2048, image_size: int = 128, global_batch: int = 128,
        epochs: int = 2, repeats: int = 5, timeout: float = 300.0) -> dict:
    """Runs `python -m tfdp.bench.input_pipeline_run` with these flags and parses its result.

    Args:
        num_examples, image_size, global_batch, epochs, repeats: the
            benchmark's flags (see `tfdp.bench.input_pipeline_run.run_benchmark`).
        timeout: seconds before the subprocess is stopped.

    Returns:
        The case's result (`parse`'s fields plus `"status": "ok"` and the flags).

    Raises:
        procs.JobFailed: the benchmark failed or timed out.
    """
    flags = {"num_examples": num_examples, "image_size": image_size,
             "global_batch": global_batch, "epochs": epochs, "repeats": repeats}
    command = [sys.executable, "-m", "tfdp.bench.input_pipeline_run",
               *(f"--{name}={value}" for name, value in flags.items())]
    result = parse(procs.run_command(command, timeout=timeout))
    return {"status": "ok", **flags, **result}
