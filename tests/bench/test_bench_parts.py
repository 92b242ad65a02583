"""Fast tests of the benchmark suite's parts: workloads, processes, parsing, report.

No timing is asserted anywhere: only that the pieces fit together.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from tfdp.bench import peer_torch
from tfdp.bench import procs
from tfdp.bench import report
from tfdp.bench import scaling
from tfdp.bench import suite
from tfdp.bench import targets
from tfdp.bench import workloads


def test_keras_cnn_matches_its_definition():
    model = workloads.build_cnn()
    assert model.count_params() == workloads.cnn_parameter_count() == 288_298
    assert tuple(model.output_shape) == (None, workloads.NUM_CLASSES)
    strides = [layer.strides[0] for layer in model.layers if "conv" in layer.name]
    assert strides == [layer.stride for layer in workloads.CNN_LAYERS]


def test_torch_cnn_is_the_same_network():
    torch = pytest.importorskip("torch")
    model = peer_torch.build_torch_cnn()
    assert sum(p.numel() for p in model.parameters()) == workloads.cnn_parameter_count()
    height, width, channels = workloads.IMAGE_SHAPE
    assert tuple(model(torch.zeros(2, channels, height, width)).shape) == (2, workloads.NUM_CLASSES)


@pytest.mark.parametrize("hook", ["fp16", "powersgd", "local_sgd"])
def test_ddp_runs_with_its_communication_hooks_on_two_workers(hook):
    """The peer's hooks run (2 gloo processes, a few steps); nothing is timed."""
    pytest.importorskip("torch")
    result = peer_torch.run(workers=(2,), steps=3, repeats=1, hook=hook, rank=2, timeout=240)
    row = result["workers"]["2"]
    assert row["hook"] == hook and row["channels_last"] and row["images_per_second"] > 0


def test_ddp_refuses_an_unknown_hook():
    with pytest.raises(ValueError, match="`hook` must be one of none, fp16, powersgd, local_sgd"):
        peer_torch.register_hook(None, "bf16", 4)


def test_mlp_is_about_ten_million_parameters():
    assert workloads.build_mlp().count_params() == workloads.mlp_parameter_count()
    assert 9_500_000 < workloads.mlp_parameter_count() < 10_500_000


def test_synthetic_dataset_yields_global_batches():
    x, y = next(iter(workloads.synthetic_dataset((4,), 8)))
    assert tuple(x.shape) == (8, 4) and tuple(y.shape) == (8,)


@pytest.mark.slow
def test_a_command_past_its_deadline_is_stopped_with_its_group(tmp_path):
    marker = tmp_path / "child.pid"
    script = (
        "import os, subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(marker)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    with pytest.raises(procs.JobFailed, match="did not finish within 3 s"):
        procs.run_command([sys.executable, "-c", script], timeout=3)
    assert time.monotonic() - start < 30
    child = int(marker.read_text())
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}"), "the grandchild outlived the deadline"


def test_a_failing_job_reports_its_output():
    with pytest.raises(procs.JobFailed, match="exited with status 3"):
        procs.run_command([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"],
                          timeout=30)


@pytest.mark.parametrize("overrides, message", [
    ({"steps": 25, "steps_per_execution": 10}, "multiple of `steps_per_execution`"),
    ({"steps": 10, "steps_per_execution": 10}, "at least two executions"),
    ({"accum_steps": (4, 8)}, "must include 1"),
    ({"threads": 0}, "`threads` must be a positive integer"),
    ({"memory_rounds": 0}, "`memory_rounds` must be a positive integer"),
    ({"memory_steps": True}, "`memory_steps` must be a positive integer"),
    ({"cases": ("communication", "latency")}, "`cases` must name one or more of"),
    ({"cases": ()}, "`cases` must name one or more of"),
])
def test_bad_suite_config_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        suite.SuiteConfig(**overrides)


@pytest.mark.parametrize("selected, launched", [
    (("time_to_accuracy",), ["time_to_accuracy"]),
    (("communication",), ["throughput (1 and 2 workers)", "peer_torch",
                          "communication (DDP hooks)", "communication (MLP, 2 workers)"]),
    (("peer_torch", "allreduce"), ["throughput (1 and 2 workers)", "peer_torch", "allreduce"]),
])
def test_only_the_selected_cases_and_what_feeds_them_run(monkeypatch, selected, launched):
    """`cases=`: the rest is reported skipped, and no measurement of theirs starts."""
    started = []

    def fake_guarded(name, function, log):
        started.append(name)
        return {"status": "error", "error": f"{name} not measured in this test"}

    monkeypatch.setattr(suite, "_guarded", fake_guarded)
    monkeypatch.setattr(suite.machine, "describe", lambda: {})
    results = suite.run_suite(suite.SuiteConfig(cases=selected), log=lambda line: None)
    assert started == launched
    assert set(results["cases"]) == set(suite.CASES)
    for name, case in results["cases"].items():
        if name in selected:  # failed (or, with nothing measured, skipped for that reason)
            assert "not among the selected" not in str(case.get("reason")), name
        else:
            assert case == {"status": "skipped",
                            "reason": f"not among the selected cases ({','.join(selected)})"}
    assert results["breakdown"] == {}


def test_a_failed_launch_fails_the_communication_case_and_keeps_its_other_rows(monkeypatch):
    """Over 100mbit the CNN and MLP launches outlived their deadlines: the run must say so."""
    ddp = {"images_per_second": 100.0, "median_images_per_second": 90.0}

    def fake_guarded(name, function, log):
        if name == "peer_torch":
            return {"status": "ok", "workers": {"1": ddp, "2": ddp}}
        if name == "communication (DDP hooks)":
            return {"status": "ok", "rows": {"fp16": ddp, "powersgd": ddp}}
        return {"status": "error", "error": f"{name} did not finish within 600 s"}

    monkeypatch.setattr(suite, "_guarded", fake_guarded)
    results = suite.run_suite(suite.SuiteConfig(cases=("communication",)), log=lambda line: None)
    case = results["cases"]["communication"]
    assert [r["path"] for r in case["rows"]] == ["none", "fp16", "powersgd"]
    assert case["failed_parts"] == {
        "CNN throughput launches": "throughput (1 and 2 workers) did not finish within 600 s",
        "MLP launch": "communication (MLP, 2 workers) did not finish within 600 s"}
    assert suite.failed_cases(results) == ["communication"]
    text = report.markdown(results)
    assert "**CNN throughput launches failed** (their rows are missing): throughput" in text
    assert text.count("did not finish within 600 s") == 2
    assert "`powerSGD_hook`" in text
    case.pop("failed_parts")
    assert suite.failed_cases(results) == []


def test_targets_of_cases_that_did_not_run_are_not_measured():
    rows = targets.check({name: {"status": "error", "error": "x"} for name in suite.CASES})
    assert [r["met"] for r in rows] == [None] * len(targets.TARGETS)


def test_report_of_a_run_where_every_case_failed_or_was_skipped(tmp_path):
    cases = {name: {"status": "error", "error": "boom\nline two"} for name in suite.CASES}
    cases["peer_torch"] = {"status": "skipped", "reason": "PyTorch is not installed"}
    results = {
        "machine": {"cpu": "Test CPU", "cores": 2, "memory_gib": 1.0, "python": "3",
                    "tensorflow": "2", "keras": "3", "torch": None,
                    "load_average_at_start": (0.1, 0.1, 0.1)},
        "config": {"quick": True, "threads": 1},
        "cases": cases, "breakdown": {}, "targets": targets.check(cases),
        "load_average_at_end": (0.2, 0.2, 0.2), "seconds": 1.0,
    }
    paths = report.write(results, str(tmp_path))
    markdown = open(paths["markdown"]).read()
    assert "*Skipped: PyTorch is not installed*" in markdown
    assert markdown.count("*Failed:*") == len(suite.CASES) - 1
    assert json.load(open(paths["json"]))["cases"]["peer_torch"]["status"] == "skipped"
    assert open(paths["png"], "rb").read(4) == b"\x89PNG"


def _throughput_run(step_ms_by_path: dict, strategy: str) -> dict:
    return {"strategy": strategy, "per_replica_batch": 64, "steps_per_execution": 10,
            "paths": {path: {"step_ms": ms} for path, ms in step_ms_by_path.items()}}


def test_step_breakdown_parts_are_differences_that_add_up_to_the_step():
    runs = {
        "1": _throughput_run({"loop_n": 20.0, "trainer": 21.0}, "default"),
        "2": _throughput_run({"loop_n": 30.0, "loop_n_local": 23.0, "loop_n_sync": 26.5,
                              "trainer": 31.0, "input": 0.1}, "MultiWorkerMirroredStrategy"),
    }
    all_reduce = {"status": "ok", "packs": [
        {"model": "cnn", "bytes_per_pack": 0, "seconds": 0.005},
        {"model": "cnn", "bytes_per_pack": 4194304, "seconds": 0.004}]}
    parts = scaling.breakdown(runs, all_reduce)
    assert set(parts) == {"loop_n", "trainer"}  # diagnostics and input are not explained
    trainer = parts["trainer"]
    assert trainer == pytest.approx({
        "step_ms": 31.0, "compute_ms": 20.0, "two_processes_ms": 3.0,
        "synchronisation_ms": 3.5, "gradient_bytes_ms": 3.5, "framework_ms": 1.0,
        "gradient_all_reduce_alone_ms": 5.0})
    for part in parts.values():
        assert sum(part[name] for name, _ in report.BREAKDOWN_PARTS) == pytest.approx(
            part["step_ms"])
    del runs["2"]["paths"]["loop_n_sync"]
    assert scaling.breakdown(runs, all_reduce) == {}  # cannot split without it


@pytest.mark.parametrize("exchange", ["all_reduce", "none", "sync", "two_buckets"])
def test_gradient_exchanges_of_the_diagnostic_loops(exchange):
    import tensorflow as tf

    import tfdp
    from tfdp.bench import throughput

    strategy = tfdp.make_strategy(cpu_replicas=2)
    with strategy.scope():
        model = workloads.build_cnn()
    variables = model.trainable_variables

    def replica_fn():
        context = tf.distribute.get_replica_context()
        scale = tf.cast(context.replica_id_in_sync_group + 1, tf.float32)
        gradients = [tf.ones(v.shape) * scale for v in variables]
        return throughput._exchange_gradients(gradients, variables, exchange)

    per_replica, reduced = strategy.run(replica_fn)
    assert reduced == (exchange != "all_reduce")
    expected = {"all_reduce": (1.0, 2.0), "none": (1.0, 2.0), "sync": (1.0, 2.0),
                "two_buckets": (3.0, 3.0)}[exchange]
    for gradient in per_replica:
        local = [t.numpy() for t in strategy.experimental_local_results(gradient)]
        assert [float(v.flat[0]) for v in local] == list(expected)
        assert all((v == v.flat[0]).all() for v in local)


def test_communication_rows_bytes_and_ratios():
    from tfdp.bench import communication

    def row(images):
        return {"images_per_second": images, "median_images_per_second": images - 1}

    runs = {"2": {"paths": {"tfdp_fit": row(100.0), "tfdp_fit_powersgd": row(180.0),
                            "tfdp_fit_float8": row(150.0), "loop_n_local": row(200.0)}}}
    peer = {"status": "ok", "workers": {"2": row(90.0)}}
    hooks = {"status": "ok", "rows": {"powersgd": row(120.0), "fp16": row(110.0)}}
    case = communication.summarize(runs, peer, hooks)
    by_path = {(r["framework"], r["path"]): r for r in case["rows"]}
    assert by_path[("tfdp", "tfdp_fit")]["bytes_per_step"] == 4 * 288_298
    assert by_path[("tfdp", "tfdp_fit_powersgd")]["bytes_per_step"] == 4 * 14_430
    assert by_path[("PyTorch DDP", "powersgd")]["bytes_per_step"] == 4 * 14_430
    # float8: one byte per value (four codes to an int32) and a float32 scale
    # per tensor (the CNN has 14): just over a quarter of float32's bytes,
    # half of fp16_compress_hook's.
    assert by_path[("tfdp", "tfdp_fit_float8")]["bytes_per_step"] == 4 * (288_298 // 4 + 1 + 14)
    assert by_path[("PyTorch DDP", "fp16")]["bytes_per_step"] == 2 * 288_298
    assert by_path[("tfdp", "tfdp_fit_float8")]["vs_no_all_reduce"] == 0.75
    assert case["best_tfdp"] == "tfdp_fit_powersgd"
    assert case["best_tfdp_vs_no_all_reduce"] == 0.9
    assert case["best_tfdp_over_best_ddp"] == 1.5
    markdown = report._communication(case)  # pylint: disable=protected-access
    assert any("`powerSGD_hook`" in line and "57,720" in line for line in markdown)
    assert any("float8 (E4M3, per-tensor scale)" in line and "288,356" in line
               for line in markdown)


def test_mlp_communication_rows_bytes_and_ratio():
    from tfdp.bench import communication, workloads

    def row(examples):
        return {"images_per_second": examples, "median_images_per_second": examples - 1}

    runs = {"2": {"paths": {"tfdp_fit": row(100.0), "tfdp_fit_powersgd": row(1200.0),
                            "tfdp_fit_local_sgd": row(300.0), "loop_n_local": row(1500.0)}}}
    case = communication.summarize_mlp(runs)
    by_path = {r["path"]: r for r in case["rows"]}
    parameters = workloads.mlp_parameter_count()
    assert by_path["tfdp_fit"]["bytes_per_step"] == 4 * parameters
    # Rank 4: (784 + 2048)·4 + 2·(2048 + 2048)·4 + (2048 + 10)·4 values for the
    # kernels, the 6,154 biases as they are.
    assert by_path["tfdp_fit_powersgd"]["bytes_per_step"] == 4 * (
        11_328 + 2 * 16_384 + 8_232 + 6_154)
    assert by_path["tfdp_fit_local_sgd"]["bytes_per_step"] == round(4 * parameters / 8)
    assert by_path["loop_n_local"]["bytes_per_step"] == 0
    assert case["powersgd_over_plain"] == 12.0
    markdown = report._communication(  # pylint: disable=protected-access
        {"rank": 4, "fraction": 0.01, "rows": [], "mlp": case})
    assert any("PowerSGD" in line and "12.00" in line for line in markdown)


def test_torch_digits_cnn_is_the_registered_cnn():
    torch = pytest.importorskip("torch")
    from tfdp import models
    from tfdp.bench import time_to_accuracy

    keras_model = models.get("cnn", input_shape=(8, 8, 1), num_classes=10)
    torch_model = time_to_accuracy.build_torch_digits_cnn()
    assert sum(p.numel() for p in torch_model.parameters()) == keras_model.count_params()
    assert tuple(torch_model(torch.zeros(2, 1, 8, 8)).shape) == (2, 10)


def test_time_to_accuracy_reads_the_first_epoch_at_the_target():
    from tfdp.bench import time_to_accuracy

    summary = time_to_accuracy._summary(  # pylint: disable=protected-access
        [5.0, 6.0, 7.5, 8.5], [0.8, 0.93, 0.951, 0.97], 0.95)
    assert (summary["epochs_to_target"], summary["seconds_to_target"]) == (3, 7.5)
    assert summary["first_epoch_seconds"] == 5.0
    assert summary["steady_epoch_seconds"] == 1.0  # median of 1.0, 1.5, 1.0
    never = time_to_accuracy._summary([1.0], [0.5], 0.95)  # pylint: disable=protected-access
    assert never["seconds_to_target"] is None

    def row(framework, method, seconds):
        return {"framework": framework, "method": method, "seconds_to_target": seconds}

    rows = [row("tfdp", "plain", 30.0), row("tfdp", "topk", 10.0), row("tfdp", "diloco", None),
            row("PyTorch DDP", "none", 40.0), row("PyTorch DDP", "powersgd", 20.0)]
    compared = time_to_accuracy.compare(rows)
    assert compared["best_tfdp"] == "topk" and compared["best_ddp"] == "powersgd"
    assert compared["plain_over_best_tfdp"] == 3.0
    assert compared["best_ddp_over_best_tfdp"] == 2.0
    assert compared["best_ddp_over_keras_floor"] is None  # no floor row
    floor = time_to_accuracy.compare(rows + [row(time_to_accuracy.KERAS_FLOOR, "none", 25.0)])
    # The floor is neither a tfdp method nor DDP's best, however fast it is.
    assert (floor["best_tfdp"], floor["best_ddp"]) == ("topk", "powersgd")
    assert floor["best_ddp_over_keras_floor"] == 20.0 / 25.0


def _tta_run(framework, method, epoch_ends, accuracies, load=2.0):
    from tfdp.bench import time_to_accuracy

    return {"framework": framework, "method": method, "load_average_at_start": (load, 1.0, 1.0),
            **time_to_accuracy._summary(epoch_ends, accuracies, 0.95)}  # pylint: disable=protected-access


def test_time_to_accuracy_summary_takes_medians_over_repeats_and_ranks_by_them():
    from tfdp.bench import time_to_accuracy

    runs = [  # two rounds: every method once per round
        _tta_run("tfdp", "plain", [9.0, 12.0, 15.0], [0.5, 0.9, 0.96]),
        _tta_run("tfdp", "diloco", [6.0, 7.0], [0.9, 0.96]),
        _tta_run("PyTorch DDP", "powersgd", [1.0, 2.0, 3.0, 4.0], [0.5, 0.8, 0.9, 0.96]),
        _tta_run("tfdp", "plain", [8.0, 10.0, 12.0], [0.5, 0.9, 0.97], load=3.5),
        _tta_run("tfdp", "diloco", [5.0, 6.5], [0.9, 0.95]),
        _tta_run("PyTorch DDP", "powersgd", [1.0, 2.0, 3.0], [0.5, 0.9, 0.95]),
        _tta_run("tfdp", "plain", [9.0, 11.0, 13.0], [0.5, 0.9, 0.99]),
        _tta_run("tfdp", "diloco", [5.5, 6.0], [0.9, 0.97]),
        _tta_run("PyTorch DDP", "powersgd", [1.0, 2.0, 3.0, 4.0], [0.5, 0.8, 0.9, 0.99]),
    ]
    summary = time_to_accuracy.summarize(runs)
    rows = {(r["framework"], r["method"]): r for r in summary["rows"]}
    assert list(rows) == [("tfdp", "plain"), ("tfdp", "diloco"), ("PyTorch DDP", "powersgd")]
    plain = rows["tfdp", "plain"]
    assert (plain["runs"], plain["reached"], plain["seconds_to_target"]) == (3, 3, 13.0)
    assert plain["seconds_to_target_spread"] == {"median": 13.0, "min": 12.0, "max": 15.0}
    assert plain["first_epoch_seconds"] == {"median": 9.0, "min": 8.0, "max": 9.0}
    assert plain["load_average_1min"] == {"median": 2.0, "min": 2.0, "max": 3.5}
    assert plain["steady_epoch_seconds"] == {"median": 2.0, "min": 2.0, "max": 3.0}  # per run: 3, 2, 2
    assert rows["tfdp", "diloco"]["seconds_to_target"] == 6.5
    assert rows["tfdp", "diloco"]["epochs_to_target"] == {"median": 2, "min": 2, "max": 2}
    assert rows["PyTorch DDP", "powersgd"]["seconds_to_target"] == 4.0
    assert summary["best_tfdp"] == "diloco" and summary["best_ddp"] == "powersgd"
    assert summary["plain_over_best_tfdp"] == pytest.approx(13.0 / 6.5)
    assert summary["best_ddp_over_best_tfdp"] == pytest.approx(4.0 / 6.5)


def test_time_to_accuracy_method_that_sometimes_misses_is_not_sooner():
    from tfdp.bench import time_to_accuracy

    summary = time_to_accuracy.summarize([
        _tta_run("tfdp", "plain", [9.0, 12.0], [0.9, 0.96]),
        _tta_run("tfdp", "topk", [2.0], [0.97]),
        _tta_run("tfdp", "topk", [2.0, 4.0], [0.5, 0.9]),  # stopped short of the target
    ])
    topk = next(r for r in summary["rows"] if r["method"] == "topk")
    assert (topk["reached"], topk["runs"], topk["seconds_to_target"]) == (1, 2, None)
    assert topk["seconds_to_target_spread"]["median"] == 2.0  # the one that reached
    assert summary["best_tfdp"] == "plain" and summary["plain_over_best_tfdp"] == 1.0
    assert summary["best_ddp"] is None and summary["best_ddp_over_best_tfdp"] is None


def test_time_to_accuracy_targets_and_report():
    from tfdp.bench import time_to_accuracy

    case = {**time_to_accuracy.summarize([
        _tta_run("tfdp", "plain", [9.0, 12.0, 15.0], [0.5, 0.9, 0.96]),
        _tta_run("tfdp", "diloco", [4.0, 5.0], [0.9, 0.96]),
        _tta_run("PyTorch DDP", "fp16", [1.0, 2.0, 3.0, 8.0], [0.5, 0.8, 0.9, 0.96]),
    ]), "repeats": 1, "ddp_skipped": None, "status": "ok"}
    measured = {t["name"]: t for t in targets.check({"time_to_accuracy": case})}
    assert measured["tta_plain_over_best_tfdp"]["value"] == 3.0
    assert measured["tta_plain_over_best_tfdp"]["met"] is True
    assert measured["tta_best_ddp_over_best_tfdp"]["value"] == pytest.approx(1.6)
    assert measured["tta_best_ddp_over_best_tfdp"]["met"] is True
    markdown = report._time_to_accuracy(case)  # pylint: disable=protected-access
    assert any("DiLoCo" in line and "5.0 (5.0–5.0)" in line and "1/1" in line
               for line in markdown)
    assert any("`fp16_compress_hook`" in line and "8.0 (8.0–8.0)" in line for line in markdown)
    assert any("tfdp plain ÷ it 3.00" in line and "÷ it 1.60" in line for line in markdown)
    assert not any("The floor" in line for line in markdown)
    case = {**time_to_accuracy.summarize([
        _tta_run("tfdp", "diloco", [4.0, 5.0], [0.9, 0.96]),
        _tta_run(time_to_accuracy.KERAS_FLOOR, "none", [3.0, 4.0], [0.9, 0.96]),
        _tta_run("PyTorch DDP", "fp16", [1.0, 2.0], [0.9, 0.96]),
    ]), "repeats": 1, "ddp_skipped": None, "status": "ok"}
    markdown = report._time_to_accuracy(case)  # pylint: disable=protected-access
    assert any("Keras, one process | none (no strategy, no tfdp) | 4.0 (4.0–4.0)" in line
               for line in markdown)
    assert any("takes 2.00x DDP's best" in line for line in markdown)


@pytest.mark.parametrize("overrides", [{"tta_methods": ()}, {"tta_methods": ("adam",)},
                                       {"tta_hooks": ("bf16",)}, {"tta_max_epochs": 0}])
def test_bad_time_to_accuracy_config_is_refused(overrides):
    with pytest.raises(ValueError, match="tta_"):
        suite.SuiteConfig(**overrides)


def test_predict_summary_ratios():
    from tfdp.bench import predict

    def row(path, workers, rate, rss=500.0, n=1000):
        return {"path": path, "num_workers": workers, "examples_per_second": rate,
                "peak_rss_mb": rss, "num_examples": n}

    rows = [row("tfdp", 1, 100), row("keras", 1, 120), row("tfdp", 2, 171),
            row("keras", 2, 150), row("independent", 2, 180)]
    memory = [row("tfdp", 2, 1, 600, 20), row("keras", 2, 1, 700, 20),
              row("tfdp", 2, 1, 630, 200), row("keras", 2, 1, 1500, 200)]
    summary = predict.summarize(rows, memory)
    assert summary["scaling"] == {"tfdp": pytest.approx(0.855), "keras": pytest.approx(0.625)}
    assert summary["ceiling"] == pytest.approx(0.9)
    assert summary["tfdp_over_ceiling"] == pytest.approx(0.95)
    assert summary["tfdp_over_keras"]["1"] == pytest.approx(100 / 120)
    assert summary["memory_growth"]["tfdp"]["ratio"] == pytest.approx(1.05)
    assert summary["memory_growth"]["keras"]["large_mb"] == 1500
    verdicts = {row["name"]: row for row in targets.check({"predict": summary})}
    assert verdicts["predict_2_workers_vs_independent"]["value"] == pytest.approx(0.95)
    assert verdicts["predict_2_workers_vs_independent"]["met"] is True
    assert verdicts["predict_peak_memory_growth"]["met"] is True


def test_predict_job_scores_in_one_process(tmp_path, monkeypatch):
    from tfdp.bench import predict

    monkeypatch.setenv("TFDP_BENCH_SHARED_DIR", str(tmp_path))
    for path in ("tfdp", "keras"):
        result = predict.measure({"path": path, "num_examples": 300, "outputs": 7,
                                  "batch_size": 64, "repeats": 1})
        assert result["num_workers"] == 1 and len(result["seconds"]) == 1
        assert result["examples_per_second"] > 0 and result["peak_rss_mb"] > 0


def test_zero_model_is_at_least_fifty_million_parameters():
    from tfdp.bench import memory

    assert memory.zero_parameter_count() >= 50_000_000
    assert memory.zero_parameter_count(width=512, layers=4) < 1_000_000
    quick = suite.SuiteConfig.quick_config()
    assert quick.memory_width == 512 and quick.memory_rounds == 1
    assert dict(quick.memory_remat_model)["sequence_length"] == 64


def _memory_run(flag_name, flag, allocator, step, rss, tf_peak, state, scratch=0, weights=100):
    worker = {"peak_rss_bytes": rss, "rss_after_build_bytes": rss // 2,
              "tf_peak_bytes": tf_peak if allocator == "bfc" else None,
              "tf_before_training_bytes": 0, "weight_bytes": weights,
              "optimizer_state_bytes": state, "shard_scratch_bytes": scratch}
    return {flag_name: flag, "allocator": allocator, "timed": allocator == "default",
            "num_replicas": 2, "parameters": 25,
            "step_seconds": [step], "median_step_seconds": step,
            "workers": [worker, {**worker, "peak_rss_bytes": rss - 10}]}


def test_memory_summary_ratios_targets_and_report():
    from tfdp.bench import memory

    zero = [  # two alternating timing rounds, then one allocator launch each
        _memory_run("sharded", False, "default", 1.0, 1000, None, 200),
        _memory_run("sharded", True, "default", 1.1, 900, None, 100, 50),
        _memory_run("sharded", False, "default", 2.0, 1010, None, 200),
        _memory_run("sharded", True, "default", 2.4, 930, None, 100, 50),
        _memory_run("sharded", False, "bfc", 9.0, 5000, 800, 200),
        _memory_run("sharded", True, "bfc", 9.0, 5000, 700, 100, 50),
    ]
    remat = [
        _memory_run("remat", False, "default", 1.0, 600, None, 20, weights=10),
        _memory_run("remat", True, "default", 1.3, 500, None, 20, weights=10),
        _memory_run("remat", False, "bfc", 1.0, 600, 230, 20, weights=10),
        _memory_run("remat", True, "bfc", 1.3, 500, 130, 20, weights=10),
    ]
    case = memory.summarize(zero, remat)
    z = case["zero"]
    assert z["optimizer_state_ratio"] == 0.5
    assert z["optimizer_state_and_scratch_ratio"] == 0.75
    # Worst worker per round: 1000 vs 900, 1010 vs 930; median saving 90 of 200.
    assert z["peak_rss_saving_over_state_by_round"] == [0.5, 0.4]
    assert z["peak_rss_saving_over_state"] == pytest.approx(0.45)
    assert z["tf_peak_saving_over_state"] == pytest.approx(0.5)
    assert z["step_time_ratio"] == pytest.approx(1.75 / 1.5)
    assert z["step_time_ratio_by_round"] == pytest.approx([1.1, 1.2])
    r = case["remat"]
    assert (r["off"]["activation_bytes"], r["on"]["activation_bytes"]) == (200, 100)
    assert r["activation_reduction"] == pytest.approx(0.5)
    assert r["step_time_ratio"] == pytest.approx(1.3)
    verdicts = {row["name"]: row["met"] for row in targets.check({"memory": case})}
    assert verdicts == {**verdicts, "zero_optimizer_state_2_workers": True,
                        "zero_peak_rss_saving_2_workers": True,
                        "zero_tf_peak_saving_2_workers": True,
                        "zero_step_time_2_workers": False,
                        "remat_activation_memory": True, "remat_step_time": True}
    lines = report._memory(case)  # pylint: disable=protected-access
    assert any("optimizer state (MB)" in line for line in lines)
    assert any("activation memory (MB)" in line for line in lines)

    without_remat = memory.summarize(zero)
    assert without_remat["remat"]["status"] == "skipped"
    verdicts = {row["name"]: row["met"] for row in targets.check({"memory": without_remat})}
    assert verdicts["remat_activation_memory"] is None
    assert verdicts["zero_optimizer_state_2_workers"] is True
    assert any("Remat: skipped" in line for line in report._memory(  # pylint: disable=protected-access
        without_remat))


@pytest.mark.slow
def test_zero_memory_job_counts_the_state_of_both_replicas():
    """One process mirrored over 2 logical CPUs: sharding halves the state it holds."""
    from tfdp.bench import memory

    spec = {"width": 64, "layers": 2, "per_replica_batch": 4, "warmup_steps": 1, "steps": 2,
            "cpu_replicas": 2}
    plain = memory.measure_zero({**spec, "sharded": False})
    sharded = memory.measure_zero({**spec, "sharded": True})
    parameters = memory.zero_parameter_count(width=64, layers=2)
    for result in (plain, sharded):
        (worker,) = result["workers"]
        assert result["num_replicas"] == 2 and len(result["step_seconds"]) == 2
        assert worker["weight_bytes"] == 2 * 4 * parameters  # both replicas' copies
        assert worker["peak_rss_bytes"] > 0
    # Adam's m and v: 2 copies of 2 P floats unsharded, of 2 ⌈P/2⌉ sharded (plus scalars).
    state = plain["workers"][0]["optimizer_state_bytes"]
    assert 2 * 2 * 4 * parameters <= state < 2 * 2 * 4 * parameters + 1000
    assert sharded["workers"][0]["optimizer_state_bytes"] < 0.55 * state
    assert sharded["workers"][0]["shard_scratch_bytes"] >= 4 * parameters


@pytest.mark.slow
@pytest.mark.parametrize("remat", [False, True])
def test_remat_memory_job_trains_the_transformer(remat):
    from tfdp.bench import memory

    if remat and not memory.remat_available():
        pytest.skip("the registered transformer has no `remat` option yet")
    model = {**memory.REMAT_MODEL, "sequence_length": 16, "num_layers": 1, "hidden": 32}
    result = memory.measure_remat({"remat": remat, "model": model, "batch": 4,
                                   "warmup_steps": 1, "steps": 2})
    (worker,) = result["workers"]
    assert result["remat"] is remat and len(result["step_seconds"]) == 2
    assert worker["weight_bytes"] == 4 * result["parameters"]
    assert worker["optimizer_state_bytes"] >= 2 * worker["weight_bytes"]  # Adam's m and v


def test_time_to_accuracy_gives_both_peers_the_same_threads(monkeypatch):
    """The worker limits TensorFlow's pools from the spec it is given, so tfdp's needs them."""
    from tfdp.bench import time_to_accuracy

    specs = []

    def fake_run_job(job, spec, *, nproc, timeout):
        specs.append((job, dict(spec), nproc))
        framework = {"time_to_accuracy_tfdp": "tfdp", "time_to_accuracy_torch": "PyTorch DDP",
                     "time_to_accuracy_keras": time_to_accuracy.KERAS_FLOOR}[job]
        return _tta_run(framework, "m", [1.0], [0.96])

    monkeypatch.setattr(procs, "run_job", fake_run_job)
    monkeypatch.setattr(time_to_accuracy, "write_digits", lambda path: None)
    monkeypatch.setattr(peer_torch, "torch_missing_reason", lambda: None)
    time_to_accuracy.run(tfdp_methods=["plain"], ddp_hooks=["none"])
    time_to_accuracy.run(tfdp_methods=["plain"], ddp_hooks=["none"], threads=2,
                         keras_floor=False)
    # The floor is one plain process (no launcher, no TF_CONFIG) with one worker's threads.
    assert [(job, spec["threads"], nproc) for job, spec, nproc in specs] == [
        ("time_to_accuracy_keras", 1, None), ("time_to_accuracy_tfdp", 1, 2),
        ("time_to_accuracy_torch", 1, 2),
        ("time_to_accuracy_tfdp", 2, 2), ("time_to_accuracy_torch", 2, 2)]


def test_smoke_config_keeps_every_case_and_path_of_quick_at_smaller_sizes():
    quick, smoke = suite.SuiteConfig.quick_config(), suite.SuiteConfig.smoke_config()
    assert (smoke.cases, smoke.paths, smoke.tta_methods, smoke.tta_hooks) == (
        quick.cases, quick.paths, quick.tta_methods, quick.tta_hooks)
    assert (smoke.accum_steps, smoke.accum_rounds, smoke.all_reduce_sizes) == (
        quick.accum_steps, quick.accum_rounds, quick.all_reduce_sizes)
    assert smoke.steps * smoke.per_replica_batch < quick.steps * quick.per_replica_batch
    assert smoke.predict_examples < quick.predict_examples
    assert suite.SuiteConfig.smoke_config(steps=8).steps == 8


def test_the_command_line_refuses_quick_and_smoke_together_before_importing_tensorflow():
    code = ("import sys\nfrom tfdp.bench import __main__ as bench\n"
            "sys.argv = ['tfdp-bench', '--quick', '--smoke']\n"
            "try:\n    bench.run()\nexcept SystemExit as e:\n"
            "    print('exit', e.code, 'tensorflow' in sys.modules)")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               timeout=60)
    assert "--quick and --smoke are two sizes of the suite" in completed.stderr, completed.stderr
    assert completed.stdout.split() == ["exit", "1", "False"], completed.stdout


def _fixed_costs_run(wall, *, phases=None):
    run = {"wall_seconds": wall, "accuracy": 0.97}
    if phases is None:
        return {**run, "seconds": {"imports": 3.0, "fit": 4.0}, "epoch_seconds": [1.0, 0.5]}
    return {**run, "phases": {
        "seconds": phases, "counts": {"train_pipeline_builds": 3, "step_calls": 6},
        "epochs": [{"outside_seconds": s, "first_call_seconds": c}
                   for s, c in ((2.0, 3.0), (1.0, None), (0.5, 0.25), (0.75, 0.5))],
        "wall_seconds": wall - 1.0, "unaccounted_seconds": 0.0}}


def test_fixed_costs_rows_are_best_walls_over_plain_keras_and_the_best_runs_phases():
    from tfdp.bench import fixed_costs

    runs = {"tfdp_fit": [_fixed_costs_run(30.0, phases={"imports": 7.0, "steps": 5.0}),
                         _fixed_costs_run(40.0, phases={"imports": 9.0, "steps": 6.0})],
            "keras": [_fixed_costs_run(12.0), _fixed_costs_run(10.0)]}
    case = fixed_costs.summarize(runs)
    assert case["rows"] == [
        {"job": "tfdp_fit", "runs": 2, "accuracy": 0.97, "over_keras": 3.0,
         "wall_seconds": {"best": 30.0, "median": 35.0, "max": 40.0}},
        {"job": "keras", "runs": 2, "accuracy": 0.97, "over_keras": 1.0,
         "wall_seconds": {"best": 10.0, "median": 11.0, "max": 12.0}},
    ]
    assert case["phases"] == {"tfdp_fit": {"imports": 7.0, "steps": 5.0},
                              "keras": {"imports": 3.0, "fit": 4.0}}
    assert case["counts"] == {"tfdp_fit": {"train_pipeline_builds": 3, "step_calls": 6}}
    assert case["epoch_outside_seconds"] == {"tfdp_fit": 0.75}  # median of epochs 1..3
    assert case["epoch_first_call_seconds"] == {"tfdp_fit": 0.375}  # of those that ran one
    text = "\n".join(report._fixed_costs({**case, "epochs": 10, "repeats": 2}))
    assert "| imports | 7.00 |" in text and "| *train pipeline builds* | 3 |" in text
    assert "30.0 (35.0, 40.0) | 3.00 |" in text


def _straggler_run(straggler, method, round_index, images_per_second, seconds):
    return {"straggler": straggler, "method": method, "round": round_index,
            "images_per_second": images_per_second, "seconds_to_target": seconds,
            "epochs_to_target": None if seconds is None else 4,
            "accuracies": [0.9, 0.96], "load_average_at_start": (1.0, 1.0, 1.0),
            "balance": {"plans": [[66, [21, 43]]]} if method == "balanced" else None}


def test_stragglers_summary_ratios_targets_and_report():
    from tfdp.bench import stragglers

    runs = [_straggler_run(True, "equal", 0, 1000.0, 4.0),
            _straggler_run(True, "balanced", 0, 1400.0, 3.0),
            _straggler_run(False, "equal", 0, 2000.0, 2.0),
            _straggler_run(False, "balanced", 0, 1980.0, 2.1),
            _straggler_run(True, "equal", 1, 1100.0, 4.4),
            _straggler_run(True, "balanced", 1, 1650.0, 3.3),
            _straggler_run(False, "equal", 1, 2100.0, 2.0),
            _straggler_run(False, "balanced", 1, 2100.0, None)]
    case = stragglers.summarize(runs)
    assert [(r["straggler"], r["method"]) for r in case["rows"]] == [
        (True, "equal"), (True, "balanced"), (False, "equal"), (False, "balanced")]
    slowed, free = case["with_straggler"], case["without_straggler"]
    assert slowed["images_per_second_ratio"] == pytest.approx(1525 / 1050)
    assert slowed["images_per_second_ratio_per_round"] == pytest.approx([1.4, 1.5])
    assert slowed["seconds_to_target_ratio"] == pytest.approx(3.15 / 4.2)
    assert slowed["straggler_cost"] == pytest.approx(1 - 1050 / 2050)
    assert free["images_per_second_cost"] == pytest.approx(1 - 2040 / 2050)
    # A balanced run without a straggler missed the target: no time ratio, no median.
    assert free["seconds_to_target_ratio"] is None
    assert case["rows"][3]["reached"] == 1 and case["rows"][3]["seconds_to_target"][
        "median"] is None
    measured = {t["name"]: t for t in targets.check({"stragglers": case})}
    assert measured["stragglers_balanced_over_equal"]["met"] is True
    assert measured["stragglers_no_straggler_cost"]["met"] is True
    text = "\n".join(stragglers.markdown_lines(
        {**case, "runs": runs, "repeats": 2, "epochs": 15, "warmup_epochs": 3,
         "cpu_fraction": 0.5, "straggler_rank": 0}))
    assert "| yes | balanced | 1,525 (1,400–1,650) | 3.1 (3.0–3.3) |" in text
    assert "balanced ÷ equal images/s 1.45 (per round: 1.40, 1.50)" in text
    assert "round 1: [[66, [21, 43]]]" in text


def test_stragglers_ceiling_is_what_the_straggler_took_from_the_equal_split():
    from tfdp.bench import stragglers

    runs = [_straggler_run(True, "equal", 0, 1000.0, 4.0),
            _straggler_run(True, "balanced", 0, 1100.0, 3.0),
            _straggler_run(False, "equal", 0, 1160.0, 2.0),
            _straggler_run(False, "balanced", 0, 1150.0, 2.1)]
    case = stragglers.summarize(runs)
    assert case["with_straggler"]["images_per_second_ceiling"] == pytest.approx(1.16)
    assert "images_per_second_ceiling" not in case["without_straggler"]
    text = "\n".join(stragglers.markdown_lines(
        {**case, "runs": runs, "repeats": 1, "epochs": 15, "warmup_epochs": 3,
         "cpu_fraction": 0.5, "straggler_rank": 0}))
    assert "so no split could beat 1.16x" in text


def test_the_stragglers_case_is_skipped_with_the_reason_without_cgroups(monkeypatch):
    from tfdp.bench import straggler
    from tfdp.bench import stragglers

    monkeypatch.setattr(straggler, "why_unavailable", lambda: "no CPU controller here")
    monkeypatch.setattr(procs, "run_job", lambda *a, **k: pytest.fail("launched"))
    assert stragglers.run(repeats=1, epochs=2) == {"status": "skipped",
                                                    "reason": "no CPU controller here"}
