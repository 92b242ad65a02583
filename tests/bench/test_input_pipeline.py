"""Tests for `tfdp.bench.input_pipeline` (plumbing only: timings are never asserted)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tfdp.bench import input_pipeline

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_both_pipelines_see_the_same_examples_and_report_throughput():
    result = input_pipeline.run_benchmark(
        num_examples=64, image_size=16, global_batch=16, epochs=1, repeats=1
    )
    assert result.examples == 64
    assert result.naive > 0 and result.pipelined > 0
    assert result.ratio == result.pipelined / result.naive
    lines = result.describe().splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "naive pipeline", "make_dataset pipeline", "speed-up"
    ]


@pytest.mark.slow
def test_the_suite_job_reports_both_throughputs_and_their_ratio():
    result = input_pipeline.measure(
        {"num_examples": 32, "image_size": 16, "global_batch": 16, "epochs": 1, "repeats": 1,
         "threads": 2})
    assert result["setup"].startswith("32 synthetic 16x16 JPEG images x 1 epoch(s)")
    assert result["naive_examples_per_second"] > 0
    assert result["speedup"] == (result["pipelined_examples_per_second"]
                                 / result["naive_examples_per_second"])


def test_naive_pipeline_has_no_parallelism_or_prefetch():
    source = input_pipeline.synthetic.SyntheticImages(num_examples=8, image_shape=(8, 8, 3), encoding="jpeg")
    preprocess = input_pipeline.preprocess_lib.decode_image(channels=3, shape=(8, 8))
    dataset = input_pipeline.naive_dataset(source, lambda x, y, seed: preprocess(x, y), 4)
    options = dataset.options()
    assert options.autotune.enabled is False
    assert options.experimental_optimization.map_parallelization is False
    assert options.experimental_optimization.inject_prefetch is False


@pytest.mark.slow
def test_command_line_rejects_a_batch_larger_than_the_data():
    completed = subprocess.run(
        [sys.executable, "-m", "tfdp.bench.input_pipeline", "--num_examples=8", "--global_batch=16"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode != 0
    assert "--global_batch (16) must not exceed --num_examples (8)" in completed.stderr
