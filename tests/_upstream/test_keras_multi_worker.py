"""Tests for `tfdp/_upstream/keras_multi_worker.py`.

Two kinds of test:

- With the patches, two real worker processes (`tfdp-launch
  --nproc_per_node 2`) fit, evaluate and predict under
  MultiWorkerMirroredStrategy, and the results are compared with one device
  training on the same global batches (`keras_multi_worker_job.py` holds the
  model, data and feed both sides use).
- Without them, each upstream bug must still be there. When one of those
  tests fails, upstream has fixed the bug: drop that patch.

Plus in-process tests of the patch mechanics (idempotence, version gate) and
of the TensorFlow bug behind the `steps_per_execution > 1` failure.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from multiworker import python_command, run_launch

import tfdp
from tfdp.distribute import strategy as strategy_lib
from tfdp._upstream import keras_multi_worker

JOB_SCRIPT = Path(__file__).with_name("keras_multi_worker_job.py")
LAUNCH_TIMEOUT_SECONDS = 300
NUM_WORKERS = 2
# Two workers sum two half-batch gradients where one device averages one
# batch: equal up to float32 rounding.
ATOL = 1e-5


def _load_job():
    spec = importlib.util.spec_from_file_location("keras_multi_worker_job", JOB_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


job = _load_job()


@pytest.fixture
def patch_state(monkeypatch):
    """Starts unpatched, with Keras faked into the known range; restores after."""
    before = keras_multi_worker.applied()
    keras_multi_worker.remove()
    monkeypatch.setattr(keras, "__version__", "3.15.1")
    yield
    keras_multi_worker.remove()
    monkeypatch.undo()
    if before:
        keras_multi_worker.apply(before)


def _targets():
    from keras.src.backend.tensorflow import trainer
    from tensorflow.python.ops import control_flow_v2_func_graphs

    return {
        "symbolic_build_batch": (trainer.TensorFlowTrainer, "_maybe_symbolic_build"),
        "reduce_logs_mean": (trainer, "reduce_per_replica"),
        "cond_call_time_captures": (
            control_flow_v2_func_graphs.CondBranchFuncGraph,
            "capture_call_time_value",
        ),
    }


# ---------------------------------------------------------------- in-process


@pytest.mark.parametrize(
    "version, needed",
    [
        ("3.0.0", True),
        ("3.7.0.dev2024120303", True),
        ("3.15.0rc1", True),
        ("3.15.1", True),
        ("3.16.0", False),
        ("3.16.0.dev2026010100", False),
        ("2.15.0", False),
        ("4.0.0", False),
    ],
)
def test_is_needed_follows_the_keras_version_gate(version, needed):
    assert keras_multi_worker.is_needed(version) is needed


def test_is_needed_reads_the_installed_version(monkeypatch):
    monkeypatch.setattr(keras, "__version__", "3.16.2")
    assert not keras_multi_worker.is_needed()
    monkeypatch.setattr(keras, "__version__", "3.12.0")
    assert keras_multi_worker.is_needed()


def test_is_needed_rejects_a_malformed_version():
    with pytest.raises(ValueError, match=r"keras_version=.*'nightly'"):
        keras_multi_worker.is_needed("nightly")


def test_apply_is_idempotent_and_remove_restores_the_originals(patch_state):
    targets = _targets()
    originals = {name: vars(owner).get(attr) for name, (owner, attr) in targets.items()}

    assert keras_multi_worker.apply() is True
    assert keras_multi_worker.applied() == keras_multi_worker.PATCHES
    patched = {name: vars(owner)[attr] for name, (owner, attr) in targets.items()}
    for name in targets:
        assert patched[name] is not originals[name], name

    assert keras_multi_worker.apply() is False
    for name, (owner, attr) in targets.items():
        assert vars(owner)[attr] is patched[name], f"{name} was patched twice"

    assert keras_multi_worker.remove() is True
    assert keras_multi_worker.applied() == ()
    for name, (owner, attr) in targets.items():
        assert vars(owner).get(attr) is originals[name], name
    # TensorFlow's cond branch graph inherits the method: no leftover override.
    owner, attr = targets["cond_call_time_captures"]
    assert attr not in vars(owner)
    assert keras_multi_worker.remove() is False


def test_apply_and_remove_single_patches(patch_state):
    assert keras_multi_worker.apply(["reduce_logs_mean"]) is True
    assert keras_multi_worker.applied() == ("reduce_logs_mean",)
    assert keras_multi_worker.apply() is True  # adds the other two
    assert keras_multi_worker.applied() == keras_multi_worker.PATCHES
    assert keras_multi_worker.remove(["symbolic_build_batch"]) is True
    assert keras_multi_worker.applied() == ("reduce_logs_mean", "cond_call_time_captures")


def test_apply_outside_the_known_range_patches_nothing_and_warns_once(
    patch_state, monkeypatch, caplog
):
    monkeypatch.setattr(keras, "__version__", "3.16.0")
    monkeypatch.setattr(keras_multi_worker, "_skip_logged", False)
    caplog.set_level(logging.INFO, logger="absl")
    originals = {name: vars(owner).get(attr) for name, (owner, attr) in _targets().items()}

    with pytest.warns(RuntimeWarning) as warned:
        assert keras_multi_worker.apply() is False
        assert keras_multi_worker.apply() is False

    assert len(warned) == 1  # once, loudly
    said = str(warned[0].message)
    for expected in ("Keras 3.16.0", "keras-team/keras#20585", "tensorflow/tensorflow#72388",
                     "tfdp.Trainer", "keras<=3.15"):
        assert expected in said, said
    assert keras_multi_worker.applied() == ()
    for name, (owner, attr) in _targets().items():
        assert vars(owner).get(attr) is originals[name], name
    skipped = [r for r in caplog.records if "are not applied" in r.getMessage()]
    assert len(skipped) == 1, [r.getMessage() for r in caplog.records]
    assert skipped[0].levelno == logging.WARNING and "3.16.0" in skipped[0].getMessage()


@pytest.mark.parametrize(
    "patches, error, match",
    [
        (["no_such_patch"], ValueError, r"unknown: 'no_such_patch'"),
        ("reduce_logs_mean", TypeError, r"not a string.*patches=\['reduce_logs_mean'\]"),
    ],
)
def test_patch_names_are_validated(patch_state, patches, error, match):
    with pytest.raises(error, match=match):
        keras_multi_worker.apply(patches)
    with pytest.raises(error, match=match):
        keras_multi_worker.remove(patches)
    assert keras_multi_worker.applied() == ()


def _nested_function_with_call_time_capture_in_cond():
    """TensorFlow alone: the mechanism behind the steps_per_execution failure.

    `inner` takes a call-time capture, as every MultiWorkerMirroredStrategy
    collective does for its instance key; `outer` calls it in a `tf.cond`
    branch, as Keras' steps_per_execution loop calls its step function.
    """
    value = tf.constant(7)

    @tf.function
    def inner():
        graph = tf.compat.v1.get_default_graph()
        return graph.capture_call_time_value(lambda: value, tf.TensorSpec([], tf.int32)) + 0

    @tf.function
    def outer(pred):
        return tf.cond(pred, inner, lambda: tf.constant(-1))

    return outer(tf.constant(True))


def test_tensorflow_still_drops_call_time_captures_in_cond_branches(patch_state):
    # Fails when TensorFlow forwards a cond branch's call-time captures (as
    # while_v2 does): then drop the "cond_call_time_captures" patch.
    with pytest.raises(
        tf.errors.InvalidArgumentError, match="You must feed a value for placeholder"
    ):
        _nested_function_with_call_time_capture_in_cond()


def test_cond_patch_feeds_call_time_captures_in_cond_branches(patch_state):
    keras_multi_worker.apply(["cond_call_time_captures"])
    assert int(_nested_function_with_call_time_capture_in_cond()) == 7


def _fit_weights(strategy, *, steps_per_execution):
    data = job.make_data()
    with strategy.scope():
        model = job.build_model(data["initial_weights"], steps_per_execution=steps_per_execution)
    history = model.fit(
        job.make_dataset(data["x_train"], data["y_train"]), epochs=job.EPOCHS, verbose=0
    )
    return model.get_weights(), history.history


@pytest.mark.slow
def test_mirrored_steps_per_execution_matches_one_device(patch_state):
    # On CPUs MirroredStrategy all-reduces with collectives too, so the same
    # TensorFlow bug breaks steps_per_execution > 1 there (not run unpatched
    # here: a failed collective step can poison later ones in this process).
    keras_multi_worker.apply()
    reference, reference_history = _fit_weights(
        tfdp.make_strategy("one_device"), steps_per_execution=1
    )
    mirrored = tfdp.make_strategy("mirrored", cpu_replicas=2)
    for spe in job.STEPS_PER_EXECUTION:
        weights, history = _fit_weights(mirrored, steps_per_execution=spe)
        for got, want in zip(weights, reference):
            np.testing.assert_allclose(got, want, atol=ATOL, err_msg=f"steps_per_execution={spe}")
        np.testing.assert_allclose(history["loss"], reference_history["loss"], atol=ATOL)


class _CountingEpochIterator:
    """Stands in for Keras' epoch iterator: yields one batch, counts the batches pulled."""

    def __init__(self, batch):
        self.batch = batch
        self.pulled = 0

    def __iter__(self):
        def batches():
            self.pulled += 1
            yield self.batch

        yield 0, 0, batches()


@pytest.mark.parametrize("built", [False, True])
def test_symbolic_build_pulls_a_batch_only_when_something_is_unbuilt(
    patch_state, monkeypatch, built
):
    # Every evaluate() (each epoch's validation) calls _maybe_symbolic_build;
    # once everything is built a pulled batch is a distributed iterator made
    # and dropped for nothing. MWMS cannot be made in-process next to the
    # other tests: the patch is told this MirroredStrategy is one.
    keras_multi_worker.apply(["symbolic_build_batch"])
    monkeypatch.setattr(keras_multi_worker, "_is_multi_worker", lambda strategy: True)
    strategy = tfdp.make_strategy("mirrored", cpu_replicas=2)
    x = np.ones((4, 3), np.float32)
    y = np.zeros((4, 1), np.float32)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    if built:
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    epoch_iterator = _CountingEpochIterator((tf.constant(x), tf.constant(y)))

    model._maybe_symbolic_build(iterator=epoch_iterator)

    assert epoch_iterator.pulled == (0 if built else 1)
    assert model._compile_metrics.built and model.optimizer.built


class _DatasetEpochIterator(_CountingEpochIterator):
    """A `_CountingEpochIterator` whose dataset Keras' TFEpochIterator would hold."""

    def __init__(self, batch, dataset):
        super().__init__(batch)
        self._dataset = dataset

    def _get_iterator(self):
        return self._dataset


def test_symbolic_build_reads_the_shapes_from_the_element_spec_without_a_batch(
    patch_state, monkeypatch
):
    # A distributed dataset's spec holds one spec per local replica: the
    # first one builds the model, and no iterator is made.
    keras_multi_worker.apply(["symbolic_build_batch"])
    monkeypatch.setattr(keras_multi_worker, "_is_multi_worker", lambda strategy: True)
    strategy = tfdp.make_strategy("mirrored", cpu_replicas=2)
    x = np.ones((8, 3), np.float32)
    y = np.zeros((8, 1), np.float32)
    distributed = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(8))
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    epoch_iterator = _DatasetEpochIterator((tf.constant(x), tf.constant(y)), distributed)

    model._maybe_symbolic_build(iterator=epoch_iterator)

    assert epoch_iterator.pulled == 0
    assert model._compile_metrics.built and model.optimizer.built
    spec = keras_multi_worker._local_batch_spec(epoch_iterator)
    assert [s.shape.as_list()[1:] for s in spec] == [[3], [1]]  # a replica's batch
    # A spec it cannot take apart: a batch is read, as before.
    ragged = tf.data.Dataset.from_tensors(tf.ragged.constant([[1.0], [2.0, 3.0]]))
    assert keras_multi_worker._local_batch_spec(_DatasetEpochIterator(None, ragged)) is None


# ------------------------------------------------------------ two workers


def _launch_job(out_dir: Path, mode: str):
    result = run_launch(
        python_command(JOB_SCRIPT, mode, str(out_dir)),
        nproc=NUM_WORKERS,
        timeout=LAUNCH_TIMEOUT_SECONDS,
        cwd=out_dir,
    )
    if result.returncode != 0:
        hint = ""
        if mode == "fixed" and not keras_multi_worker.is_needed():
            hint = (
                f"Keras {keras.__version__} is outside KNOWN_KERAS_RANGE, so tfdp "
                f"applied no patch and the job failed: the bugs are still there, "
                f"widen the range in tfdp/_upstream/keras_multi_worker.py.\n"
            )
        pytest.fail(f"{hint}2-worker job ({mode}) failed.\n{result.describe()}")
    ranks = []
    for rank in range(NUM_WORKERS):
        with open(out_dir / f"rank{rank}.json") as f:
            record = json.load(f)
        npz = out_dir / f"rank{rank}.npz"
        if npz.exists():
            with np.load(npz) as arrays:
                record["arrays"] = dict(arrays)
        ranks.append(record)
    return ranks, result.elapsed


@pytest.fixture(scope="module")
def fixed_run(tmp_path_factory):
    """Both workers' results of `keras_multi_worker_job.py fixed` (one launch)."""
    ranks, elapsed = _launch_job(tmp_path_factory.mktemp("keras_mwms_fixed"), "fixed")
    print(f"2-worker fixed job: {elapsed:.1f} s")
    return ranks


@pytest.fixture(scope="module")
def reference():
    """One device, same model, data, initial weights and global batches."""
    data = job.make_data()
    strategy = tfdp.make_strategy("one_device")
    train = job.make_dataset(data["x_train"], data["y_train"])
    evaluation = job.make_dataset(data["x_eval"], data["y_eval"])
    with strategy.scope():
        model = job.build_model(data["initial_weights"])
    initial_eval = model.evaluate(evaluation, return_dict=True, verbose=0)
    batch_logs = job.batch_logs_callback()
    history = model.fit(
        train, epochs=job.EPOCHS, validation_data=evaluation, callbacks=[batch_logs], verbose=0
    )
    return {
        "initial_eval": initial_eval,
        "history": history.history,
        "batch_logs": batch_logs.logs,
        "evaluate": model.evaluate(evaluation, return_dict=True, verbose=0),
        "weights": model.get_weights(),
        "predict": model.predict(job.make_dataset(data["x_eval"]), verbose=0),
    }


def _single_process(weights):
    """Evaluate and predict with `weights` on one device, on the global eval data."""
    data = job.make_data()
    with tfdp.make_strategy("one_device").scope():
        model = job.build_model(weights)
    evaluation = job.make_dataset(data["x_eval"], data["y_eval"])
    return (
        model.evaluate(evaluation, return_dict=True, verbose=0),
        model.predict(job.make_dataset(data["x_eval"]), verbose=0),
    )


def _weights(rank_record, spe):
    arrays = rank_record["arrays"]
    return [arrays[f"spe{spe}_weight{i}"] for i in range(len(job.make_data()["initial_weights"]))]


SPES = [pytest.param(spe, id=f"steps_per_execution={spe}") for spe in job.STEPS_PER_EXECUTION]


@pytest.mark.slow
def test_job_ran_patched_on_two_replicas(fixed_run):
    for record in fixed_run:
        assert record["applied"] == list(keras_multi_worker.PATCHES)
        assert record["num_replicas_in_sync"] == NUM_WORKERS


@pytest.mark.slow
def test_strategy_info_describes_each_worker(fixed_run):
    for rank, record in enumerate(fixed_run):
        info = record["strategy_info"]
        assert info["strategy"] == "MultiWorkerMirroredStrategy"
        assert (info["num_workers"], info["worker_index"], info["is_chief"]) == (
            NUM_WORKERS, rank, rank == 0
        )
        assert info["num_replicas_in_sync"] == NUM_WORKERS
        assert info["devices"] == [f"/job:worker/replica:0/task:{rank}/device:CPU:0"]
        # CPU workers all-reduce in 4 MiB packs by default (tfdp.distribute.strategy).
        assert info["all_reduce"] == (
            f"collective/ring/bytes_per_pack={strategy_lib.CPU_BYTES_PER_PACK}")


@pytest.mark.slow
def test_each_worker_gets_its_half_of_every_global_batch(fixed_run):
    x_train = job.make_data()["x_train"]
    per_worker = job.GLOBAL_BATCH // NUM_WORKERS
    local = [record["arrays"]["local_train_x"] for record in fixed_run]
    for rank, x in enumerate(local):
        assert x.shape == (job.NUM_TRAIN // NUM_WORKERS, job.NUM_FEATURES), f"rank {rank}"
    for step in range(job.NUM_TRAIN // job.GLOBAL_BATCH):
        halves = [x[step * per_worker:(step + 1) * per_worker] for x in local]
        np.testing.assert_array_equal(
            np.concatenate(halves),
            x_train[step * job.GLOBAL_BATCH:(step + 1) * job.GLOBAL_BATCH],
            err_msg=f"global batch {step}",
        )


@pytest.mark.slow
@pytest.mark.parametrize("spe", SPES)
def test_weights_are_identical_on_every_worker(fixed_run, spe):
    first = _weights(fixed_run[0], spe)
    for rank, record in enumerate(fixed_run[1:], start=1):
        for i, (got, want) in enumerate(zip(_weights(record, spe), first)):
            np.testing.assert_array_equal(got, want, err_msg=f"rank {rank}, weight {i}")


@pytest.mark.slow
@pytest.mark.parametrize("spe", SPES)
def test_two_workers_train_like_one_device_on_the_global_batch(fixed_run, reference, spe):
    # Plain SGD, no dropout: 2 workers x 8 examples per step must end where
    # one device with 16 examples per step does.
    for got, want in zip(_weights(fixed_run[0], spe), reference["weights"]):
        np.testing.assert_allclose(got, want, atol=ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("spe", SPES)
def test_fit_metrics_equal_the_single_device_metrics(fixed_run, reference, spe):
    for rank, record in enumerate(fixed_run):
        history = record["runs"][str(spe)]["history"]
        assert set(history) == set(reference["history"])
        for name, values in reference["history"].items():
            np.testing.assert_allclose(
                history[name], values, atol=ATOL, err_msg=f"rank {rank}: {name}"
            )


@pytest.mark.slow
@pytest.mark.parametrize("spe", SPES)
def test_per_step_logs_are_global_and_agree_across_workers(fixed_run, reference, spe):
    # Keras logs once per execution: after steps 4 and 6 of each 6-step epoch
    # with steps_per_execution=4, after every step with 1.
    steps_per_epoch = job.NUM_TRAIN // job.GLOBAL_BATCH
    last_steps = sorted(
        {min(s + spe, steps_per_epoch) - 1 for s in range(0, steps_per_epoch, spe)}
    )
    expected = [
        reference["batch_logs"][epoch * steps_per_epoch + step]
        for epoch in range(job.EPOCHS)
        for step in last_steps
    ]
    for rank, record in enumerate(fixed_run):
        logs = record["runs"][str(spe)]["batch_logs"]
        assert len(logs) == len(expected), f"rank {rank}"
        for step, (got, want) in enumerate(zip(logs, expected)):
            for name in want:
                np.testing.assert_allclose(
                    got[name], want[name], atol=ATOL, err_msg=f"rank {rank}, log {step}, {name}"
                )


@pytest.mark.slow
def test_loss_decreases(fixed_run, reference):
    for spe in job.STEPS_PER_EXECUTION:
        run = fixed_run[0]["runs"][str(spe)]
        assert run["history"]["loss"][-1] < run["history"]["loss"][0]
        assert run["evaluate"]["loss"] < reference["initial_eval"]["loss"] - 0.05


@pytest.mark.slow
@pytest.mark.parametrize("spe", SPES)
def test_evaluate_equals_one_process_on_the_same_weights_and_data(fixed_run, spe):
    # 45 eval examples: the last batch splits 7 / 6, so a mean of per-worker
    # means would differ from the example-weighted mean checked here.
    expected, _ = _single_process(_weights(fixed_run[0], spe))
    for rank, record in enumerate(fixed_run):
        got = record["runs"][str(spe)]["evaluate"]
        assert set(got) == set(expected)
        for name in expected:
            np.testing.assert_allclose(
                got[name], expected[name], atol=1e-6, err_msg=f"rank {rank}: {name}"
            )


@pytest.mark.slow
@pytest.mark.parametrize("spe", SPES)
def test_predict_returns_the_global_predictions_in_input_order(fixed_run, spe):
    # Under MWMS every worker gets the predictions for the whole (global)
    # input, in input order: what one process returns for the same dataset.
    _, expected = _single_process(_weights(fixed_run[0], spe))
    assert expected.shape == (job.NUM_EVAL, job.NUM_CLASSES)
    for rank, record in enumerate(fixed_run):
        got = record["arrays"][f"spe{spe}_predict"]
        assert got.shape == expected.shape, f"rank {rank}"
        np.testing.assert_allclose(got, expected, atol=1e-6, err_msg=f"rank {rank}")


# ------------------------------------------- two workers, patches removed

STILL_NEEDED = {
    # stage (= the patch it leaves out): (error type, message fragment)
    "symbolic_build_batch": ("ValueError", "Attempt to convert a value (PerReplica"),
    "reduce_logs_mean": (
        "ValueError",
        "Invalid reduction dimension 0 for input with 0 dimensions",
    ),
    "cond_call_time_captures": (
        "InvalidArgumentError",
        "You must feed a value for placeholder tensor",
    ),
}


@pytest.fixture(scope="module")
def unfixed_run(tmp_path_factory):
    """Both workers' stages of `keras_multi_worker_job.py unfixed` (one launch)."""
    ranks, elapsed = _launch_job(tmp_path_factory.mktemp("keras_mwms_unfixed"), "unfixed")
    print(f"2-worker unfixed job: {elapsed:.1f} s")
    return ranks


@pytest.mark.slow
@pytest.mark.parametrize("stage", list(STILL_NEEDED))
def test_upstream_bug_is_still_there_without_its_patch(unfixed_run, stage):
    error_type, fragment = STILL_NEEDED[stage]
    for rank, record in enumerate(unfixed_run):
        outcome = {s["stage"]: s for s in record["stages"]}[stage]
        assert outcome["outcome"] == "error", (
            f"rank {rank}: Keras {keras.__version__} / TensorFlow {tf.__version__} fit "
            f"without the {stage!r} patch (with {outcome['applied']}) now works: upstream "
            f"fixed the bug. Remove that patch from tfdp/_upstream/keras_multi_worker.py."
        )
        assert outcome["type"] == error_type and fragment in outcome["message"], (
            f"rank {rank}: without the {stage!r} patch fit fails, but not with the known "
            f"bug ({error_type}: {fragment!r}); got {outcome['type']}: "
            f"{outcome['message'][-1500:]}"
        )
