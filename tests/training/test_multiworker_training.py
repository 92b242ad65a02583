"""tfdp.compile and tfdp.Trainer on two real MultiWorkerMirroredStrategy workers.

One launch (`multiworker_training_job.py`) trains the same tiny model several
ways: `model.fit` through `tfdp.compile` with accumulation, LARS, LAMB, a
warmup schedule, mixed precision and XLA; a `Trainer` stopped and resumed;
a padded evaluation; the 2-worker subset of the option-pair matrix (every
exchange × accumulation and × mixed_float16). Every result is compared with
one device on the same global batches, or with its reference where the
exchange is lossy, and each worker counts the gradient all-reduces it ran.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from multiworker import python_command, run_launch

import loss_forms

JOB_SCRIPT = Path(__file__).with_name("multiworker_training_job.py")
_spec = importlib.util.spec_from_file_location("multiworker_training_job", JOB_SCRIPT)
job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job)

pytestmark = pytest.mark.slow

ONE_EPOCH = ((0, job.STEPS_PER_EPOCH),)
# 9 steps at 6 per epoch: all of epoch 0, then 3 steps of epoch 1.
TRAINER_EPOCHS = ((0, job.STEPS_PER_EPOCH), (1, job.TOTAL_STEPS - job.STEPS_PER_EPOCH))


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    out = tmp_path_factory.mktemp("mw_training")
    result = run_launch(python_command(JOB_SCRIPT, str(out)), nproc=2, timeout=420, cwd=out)
    assert result.returncode == 0, result.describe()
    print(f"2-worker training job: {result.elapsed:.1f} s")
    records = []
    for rank in range(2):
        with np.load(out / f"rank{rank}.npz") as data:
            records.append(dict(data))
    return out, records


def _one_device_fit(make_optimizer=job.optimizer, epochs_and_steps=ONE_EPOCH):
    """One device, no accumulation, Keras fit over the same global batches."""
    model = job.build_model()
    model.compile(optimizer=make_optimizer(), loss=job.loss(), metrics=["accuracy"])
    for epoch, steps in epochs_and_steps:
        model.fit(job.global_batches(epoch).take(steps), epochs=1, verbose=0)
    return model


def _assert_weights(record, name, want, atol):
    for i, w in enumerate(want):
        np.testing.assert_allclose(record[f"{name}_weight{i}"], w, atol=atol, rtol=0,
                                   err_msg=f"{name}_weight{i}")


def _max_difference(record, name, weights):
    return max(np.abs(record[f"{name}_weight{i}"] - w).max() for i, w in enumerate(weights))


def test_fit_with_accumulation_on_two_workers_equals_one_device(workers):
    _, records = workers
    reference = _one_device_fit()
    for record in records:
        assert int(record["fit_iterations"]) == job.STEPS_PER_EPOCH
        _assert_weights(record, "fit", reference.get_weights(), atol=1e-5)


@pytest.mark.parametrize("name", sorted(job.OPTIMIZER_CASES))
def test_large_batch_optimizer_fit_on_two_workers_equals_one_device(workers, name):
    """LARS (no accumulation) and LAMB (accum_steps=2): trust ratios see the global gradient."""
    _, records = workers
    make_optimizer, _ = job.OPTIMIZER_CASES[name]
    reference = _one_device_fit(make_optimizer)
    initial = job.build_model().get_weights()
    assert max(np.abs(w - w0).max() for w, w0 in zip(reference.get_weights(), initial)) > 0.1
    for record in records:
        assert str(record[f"{name}_optimizer"]).startswith("tfdp.training.optimizers.")
        assert int(record[f"{name}_iterations"]) == job.STEPS_PER_EPOCH
        _assert_weights(record, name, reference.get_weights(), atol=1e-5)


class _ScheduleAtMicroBatches(keras.optimizers.schedules.LearningRateSchedule):
    """The schedule indexed by micro-batches, as Keras' own accumulation indexes it."""

    def __init__(self, schedule, accum_steps):
        self.schedule, self.accum_steps = schedule, accum_steps

    def __call__(self, step):
        return self.schedule(step * self.accum_steps)


def test_warmup_schedule_with_accumulation_on_two_workers_follows_optimizer_steps(workers):
    """accum_steps=4: step s uses schedule(s), not schedule(4 s), on every worker."""
    _, records = workers
    reference = _one_device_fit(job.warmup_optimizer)
    micro_indexed = _one_device_fit(
        lambda: job.warmup_optimizer(
            _ScheduleAtMicroBatches(job.warmup_schedule(), job.WARMUP_ACCUM_STEPS))
    )
    for record in records:
        assert int(record["warmup_iterations"]) == job.STEPS_PER_EPOCH
        _assert_weights(record, "warmup", reference.get_weights(), atol=1e-5)
        # The comparison can tell the two schedule positions apart.
        assert _max_difference(record, "warmup", micro_indexed.get_weights()) > 1e-2


# Where the half-precision runs may differ from one device under the same
# policy (measured: 9e-4 for bfloat16, 1.2e-4 for float16; weights move 0.3).
MIXED_ATOL = {"mixed_bfloat16": 5e-3, "mixed_float16": 1e-3}


@pytest.mark.parametrize("policy", job.MIXED_POLICIES)
def test_mixed_precision_fit_on_two_workers_is_finite_and_matches_one_device(workers, policy):
    _, records = workers
    keras.config.set_dtype_policy(policy)
    try:
        reference = _one_device_fit().get_weights()
    finally:
        keras.config.set_dtype_policy("float32")
    for record in records:
        assert np.isfinite(record[f"{policy}_loss"]).all()
        # No step skipped for an overflow, none lost.
        assert int(record[f"{policy}_iterations"]) == job.STEPS_PER_EPOCH
        _assert_weights(record, policy, reference, atol=MIXED_ATOL[policy])
    if policy == "mixed_float16":
        # tfdp's, whose replicas agree on skipping a step.
        for record in records:
            assert bool(record[f"{policy}_consistent_loss_scale"])
    for i in range(len(reference)):
        np.testing.assert_array_equal(records[0][f"{policy}_weight{i}"],
                                      records[1][f"{policy}_weight{i}"])


# One all-reduce per optimizer step, the gradients': with static batches and
# no mask the loss's global counts are constants
# (tfdp.training.loss_normalization), whatever accum_steps is.
GRADIENT_ALL_REDUCES = {
    "fit": job.STEPS_PER_EPOCH,  # accum_steps=2, steps_per_execution=2
    "lars": job.STEPS_PER_EPOCH,
    "lamb": job.STEPS_PER_EPOCH,
    "warmup": job.STEPS_PER_EPOCH,  # accum_steps=4
    "mixed_bfloat16": job.STEPS_PER_EPOCH,
    "mixed_float16": job.STEPS_PER_EPOCH,
    "trainer": job.TOTAL_STEPS,  # accum_steps=2, over both Trainers
}


@pytest.mark.parametrize("name", sorted(GRADIENT_ALL_REDUCES))
def test_one_gradient_all_reduce_per_optimizer_step_on_two_workers(workers, name):
    _, records = workers
    for record in records:
        assert int(record[f"{name}_grad_allreduces"]) == GRADIENT_ALL_REDUCES[name]


@pytest.mark.parametrize("form_name, path", loss_forms.MULTIWORKER_CELLS)
def test_loss_forms_on_two_workers_equal_one_device(workers, form_name, path):
    """Uneven masks and weights across the two workers: weights and loss as on one device."""
    _, records = workers
    form = loss_forms.FORMS_BY_NAME[form_name]
    initial, expected, history = loss_forms.keras_one_device(form)
    key = f"lossform_{form_name}_{path}"
    for record in records:
        final = [record[f"{key}_weight{i}"] for i in range(len(expected))]
        assert loss_forms.relative_deviation(initial, expected, final) < 1e-5
        np.testing.assert_allclose(float(record[f"{key}_loss"]), history["loss"][-1], rtol=1e-5)


def test_lossless_powersgd_on_two_workers_equals_one_device(workers):
    _, records = workers
    reference = _one_device_fit()
    for record in records:
        _assert_weights(record, "psgd_lossless", reference.get_weights(), atol=1e-5)


@pytest.mark.parametrize("name, per_step", [("psgd_rank1", 2), ("topk", 0)])
def test_compressed_training_on_two_workers_keeps_the_workers_identical(workers, name, per_step):
    """Each worker keeps its own error memory, yet both apply the same update."""
    _, records = workers
    first, second = records
    assert int(first[f"{name}_iterations"]) == job.STEPS_PER_EPOCH
    weights = [k for k in first if k.startswith(f"{name}_weight")]
    assert weights
    for key in weights:
        assert np.all(np.isfinite(first[key]))
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
    # The loss counts: one all-reduce per step (the distributed batches have
    # no static size, and a compressor's collectives do not carry them).
    # PowerSGD: the plain all-reduce for start_step=2 steps, then P and Q;
    # Top-K all-gathers (not counted here) and all-reduces nothing else.
    counts = job.STEPS_PER_EPOCH
    expected = counts + (0 if not per_step else 2 + per_step * (job.STEPS_PER_EPOCH - 2))
    assert int(first[f"{name}_grad_allreduces"]) == expected


@pytest.mark.parametrize("name", list(job.LOCAL_CASES))
def test_local_steps_on_two_workers_equal_two_replicas_in_one_process(workers, name):
    """Local SGD / DiLoCo across processes (no merge_call) equal the same on 2 logical replicas.

    The logical-replica path is checked against a NumPy simulation in
    tests/training/test_local_sync.py; here each worker must end with the
    same synchronised weights, after one all-reduce of the weights per
    window and none between. Overlapped (`diloco_overlap`), each worker's
    all-reduce runs in a background thread while its main thread computes
    (and launches the per-step collectives of scalars Keras and the
    distributed iterator make): the reference is the same on 2 logical
    replicas, checked against the delayed algorithm's NumPy simulation in
    tests/training/test_overlapped_sync.py.
    """
    import tfdp

    sync_every, make_outer, accum_steps, syncs = job.LOCAL_CASES[name]
    strategy = tfdp.make_strategy(cpu_replicas=2)
    with strategy.scope():
        model = job.build_model()
        tfdp.compile(model, optimizer=job.optimizer(), loss=job.loss(), accum_steps=accum_steps,
                     sync_every=sync_every, outer_optimizer=make_outer and make_outer(),
                     overlap_sync=name in job.OVERLAPPED)
    model.fit(job.global_batches(), epochs=1, verbose=0)
    _, records = workers
    for record in records:
        assert int(record[f"{name}_iterations"]) == job.STEPS_PER_EPOCH
        _assert_weights(record, name, model.get_weights(), atol=1e-5)
        assert int(record[f"{name}_grad_allreduces"]) == syncs


def test_unequal_shares_of_each_global_batch_on_two_workers_equal_one_device(workers):
    """Worker 0 reads 11 and worker 1 reads 5 examples of every global batch of 16.

    The ground of balanced per-worker batches (issue 35): global loss
    normalisation divides every worker's numerators by the examples of the
    whole global batch, summed in the gradients' own all-reduce (the batch
    dimension is unknown), so any split is one device's step.
    """
    _, records = workers
    reference = _one_device_fit()
    for record in records:
        assert int(record["unequal_iterations"]) == job.STEPS_PER_EPOCH
        _assert_weights(record, "unequal", reference.get_weights(), atol=1e-5)
        # The examples ride in the gradients' all-reduce: no extra collective.
        assert int(record["unequal_grad_allreduces"]) == job.STEPS_PER_EPOCH
        # Negative control: Keras' mean of the two workers' means weights
        # worker 1's 5 examples as much as worker 0's 11, and the comparison
        # tells that apart.
        assert _max_difference(record, "unequal_keras", reference.get_weights()) > 1e-3


def test_sharded_optimizer_state_on_two_workers_equals_one_device(workers):
    """ZeRO-1 across processes: the gradients reduce-scattered by all-to-all, each worker
    updates its half of AdamW's state, then the workers all-gather the weights."""
    _, records = workers
    reference = _one_device_fit(job.adamw_optimizer)
    first, second = records
    for record in records:
        assert int(record["zero_iterations"]) == job.STEPS_PER_EPOCH
        _assert_weights(record, "zero", reference.get_weights(), atol=1e-5)
    for key in (k for k in first if k.startswith("zero_weight")):
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
    assert bool(first["zero_scatters"]) and bool(second["zero_scatters"])
    # No gradient all-reduce at all (the count skips single numbers such as
    # the one-float non-finite verdict on the chunks).
    assert int(first["zero_grad_allreduces"]) == 0
    # Keras' own .keras file would hold one worker's chunks only: refused.
    for record in records:
        assert "cannot be saved into a .keras file" in str(record["zero_keras_save_error"])
        assert "on 2 workers" in str(record["zero_keras_save_error"])


@pytest.mark.parametrize("name", list(job.RESUME_CASES))
def test_per_replica_state_resumes_exactly_on_two_workers(workers, name):
    """Each worker writes and reads back its own error memories / momentum: resume is exact."""
    _, records = workers
    for record in records:
        assert int(record[f"{name}_steps"]) == job.TOTAL_STEPS
        assert float(record[f"{name}_difference"]) == 0.0
    assert list(records[0][f"{name}_files"]) == ["worker-0-of-2.npz", "worker-1-of-2.npz"]


def test_sharded_state_of_two_workers_resumes_on_one_worker_of_two_replicas(workers, tmp_path):
    """ZeRO-1 chunks written by 2 workers, read back by 1 process with 2 replicas (or 1).

    Exact only if worker w's chunk is replica w's, as `replica_id_in_sync_group`
    numbers them: swapped chunks would put each half of the momentum on the
    other half of the weights.
    """
    import shutil

    import tfdp

    out, _ = workers
    steps = job.TOTAL_STEPS + 3

    def train(replicas, directory):
        strategy = tfdp.make_strategy(cpu_replicas=replicas)
        with strategy.scope():
            model = job.build_model()
            optimizer = keras.optimizers.SGD(job.LEARNING_RATE, momentum=0.9)
        trainer = tfdp.Trainer(
            model, optimizer=optimizer, loss=job.loss(), strategy=strategy,
            batch=tfdp.BatchConfig.from_global(job.GLOBAL_BATCH, replicas),
            model_dir=directory, checkpoint_every=job.RESUME_AT, shard_optimizer_state=True)
        trainer.train(job.global_batches, steps=steps)
        assert trainer.global_step == steps
        return model.get_weights()

    straight = train(2, None)
    for replicas in (2, 1):
        directory = tmp_path / f"on_{replicas}"
        shutil.copytree(out / "zero_resume_resumed", directory)
        for got, want in zip(train(replicas, str(directory)), straight):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_bfloat16_gradients_on_two_workers_train_as_one_device(workers):
    """The float32 counts take their own all-reduce beside the bfloat16 gradients'."""
    _, records = workers
    reference = _one_device_fit()
    for record in records:
        assert int(record["bf16_iterations"]) == job.STEPS_PER_EPOCH
        _assert_weights(record, "bf16", reference.get_weights(), atol=2e-2)
        assert int(record["bf16_grad_allreduces"]) == 2 * job.STEPS_PER_EPOCH


def _assert_workers_identical_and_finite(records, name):
    first, second = records
    weights = [k for k in first if k.startswith(f"{name}_weight")]
    assert weights, name
    for key in weights:
        assert np.all(np.isfinite(first[key])), key
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
    for record in records:
        assert np.isfinite(record[f"{name}_loss"]).all(), name
        assert int(record[f"{name}_iterations"]) == job.STEPS_PER_EPOCH, name


def _weights(record, name):
    return [record[k] for k in sorted((k for k in record if k.startswith(f"{name}_weight")),
                                      key=lambda k: int(k.rsplit("weight", 1)[1]))]


# float8's sums differ from float32's by E4M3's rounding (3 mantissa bits) of
# what each replica sends, the error memories carry the rest to the next
# step: measured 2.7e-3 after 6 steps, where the weights move 0.3.
FLOAT8_ATOL = 1e-2


def test_float8_on_two_workers_keeps_the_workers_identical_near_the_exact_sum(workers):
    """Each worker keeps its own error memories, yet both apply the same decoded sum."""
    _, records = workers
    _assert_workers_identical_and_finite(records, "float8")
    reference = _one_device_fit().get_weights()
    for record in records:
        _assert_weights(record, "float8", reference, atol=FLOAT8_ATOL)
        # Used, not ignored: the 8-bit sums move the weights away from float32's.
        assert _max_difference(record, "float8", reference) > 1e-5
        # The codes and scales go by all-gather (not counted); the loss counts
        # take their one all-reduce per step, as for Top-K.
        assert int(record["float8_grad_allreduces"]) == job.STEPS_PER_EPOCH


#: Exchange × accumulation (`job.PAIR_CASES`) -> the same exchange without it (the large
#: batch, also on 2 workers in the launch).
ACCUMULATION_PAIRS = {"float8_accum": "float8", "bf16_accum": "bf16", "topk_accum": "topk",
                      "local_sgd_accum": "local_sgd"}


@pytest.mark.parametrize("name", list(ACCUMULATION_PAIRS))
def test_accumulation_with_each_exchange_on_two_workers_equals_the_large_batch(workers, name):
    """accum_steps=2 sums two micro-batches' gradients before the exchange, in float32.

    So whatever the exchange does to the sum (bfloat16, Top-K, float8 rounding,
    local steps), it gets the large batch's sum to float32's rounding, and the
    result is the large batch's to 1e-5, with no collective added. The plain
    all-reduce, PowerSGD, ZeRO-1 and DiLoCo with accumulation are checked above
    (`fit`, `psgd_rank1`, `zero`, `diloco`).
    """
    _, records = workers
    large_batch = ACCUMULATION_PAIRS[name]
    _assert_workers_identical_and_finite(records, name)
    for record in records:
        _assert_weights(record, name, _weights(record, large_batch), atol=1e-5)
        assert (int(record[f"{name}_grad_allreduces"])
                == int(record[f"{large_batch}_grad_allreduces"]))


def _two_replicas_in_one_process(name):
    """`job.PAIR_CASES[name]` (local steps) trained on 2 logical replicas in this process."""
    import tfdp

    policy, arguments = job.PAIR_CASES[name]
    make_outer = arguments.get("make_outer_optimizer")
    strategy = tfdp.make_strategy(cpu_replicas=2)
    keras.config.set_dtype_policy(policy or "float32")
    try:
        with strategy.scope():
            model = job.build_model()
            tfdp.compile(model, optimizer=job.optimizer(), loss=job.loss(),
                         accum_steps=arguments["accum_steps"], sync_every=arguments["sync_every"],
                         outer_optimizer=make_outer and make_outer())
        model.fit(job.global_batches(), epochs=1, verbose=0)
    finally:
        keras.config.set_dtype_policy("float32")
    return model.get_weights()


#: Exchange × mixed_float16 (`job.PAIR_CASES`, accum_steps=2) -> (its reference, tolerance,
#: the case whose all-reduce count it keeps). The reference is a case of the launch, or
#: "two replicas" (`_two_replicas_in_one_process`). Lossless PowerSGD and ZeRO-1 must equal
#: the plain all-reduce under the same policy (`mixed_float16`); bfloat16 and float8 are
#: held to their format's rounding of it; Top-K (5%) to mixed_float16's own rounding of
#: its float32 run (measured 1.4e-4, as `MIXED_ATOL`); local SGD and DiLoCo to the same
#: run on two logical replicas (measured equal).
MIXED_FLOAT16_PAIRS = {
    "psgd_mf16": ("mixed_float16", 1e-5, "psgd_lossless"),
    "zero_mf16": ("mixed_float16", 1e-5, "zero"),
    "bf16_mf16": ("mixed_float16", MIXED_ATOL["mixed_bfloat16"], "bf16"),
    "float8_mf16": ("mixed_float16", FLOAT8_ATOL, "float8"),
    "topk_mf16": ("topk", MIXED_ATOL["mixed_float16"], "topk"),
    "local_sgd_mf16": ("two replicas", 1e-5, "local_sgd"),
    "diloco_mf16": ("two replicas", 1e-5, "diloco"),
}


@pytest.mark.parametrize("name", list(MIXED_FLOAT16_PAIRS))
def test_mixed_float16_with_each_exchange_on_two_workers(workers, name):
    """Dynamic loss scaling beside each exchange: no step skipped, the workers agree, the
    result is its reference's, and loss scaling adds no collective to the exchange's."""
    _, records = workers
    reference, atol, counted = MIXED_FLOAT16_PAIRS[name]
    _assert_workers_identical_and_finite(records, name)
    want = _two_replicas_in_one_process(name) if reference == "two replicas" else None
    for record in records:
        assert bool(record[f"{name}_consistent_loss_scale"]), name
        expected = want if want is not None else _weights(record, reference)
        _assert_weights(record, name, expected, atol=atol)
        if name in ("bf16_mf16", "float8_mf16"):
            # The 16- or 8-bit sums are used, not ignored.
            assert _max_difference(record, name, expected) > 1e-5
        assert int(record[f"{name}_grad_allreduces"]) == int(record[f"{counted}_grad_allreduces"])
    if name == "zero_mf16":
        assert all(bool(record["zero_mf16_scatters"]) for record in records)


def test_the_all_reduce_counter_counts_every_loop_iteration(workers):
    # Negative control: an all-reduce inside a tf.while_loop in replica
    # context, where the accumulation loop must not put one, runs and is
    # counted once per iteration (1 per step above is not a trace-time count).
    _, records = workers
    for record in records:
        assert int(record["control_grad_allreduces"]) == job.CONTROL_LOOP_STEPS
        np.testing.assert_array_equal(record["control_total"], [2 * job.CONTROL_LOOP_STEPS] * 2)


def test_trainer_resumed_on_two_workers_equals_one_device(workers):
    out, records = workers
    reference = _one_device_fit(epochs_and_steps=TRAINER_EPOCHS)
    for record in records:
        assert int(record["trainer_restored_step"]) == 0  # the second Trainer starts fresh
        assert int(record["trainer_steps"]) == job.TOTAL_STEPS
        _assert_weights(record, "trainer", reference.get_weights(), atol=1e-5)
    # Only the chief wrote into model_dir, and the last checkpoint is the end.
    model_dir = out / "model_dir"
    assert tf.train.latest_checkpoint(str(model_dir)).endswith(f"ckpt-{job.TOTAL_STEPS}")
    assert sorted(p.name for p in model_dir.iterdir() if p.is_dir()) == ["train"]


def test_trainer_resumed_on_two_workers_sees_each_example_once_per_epoch(workers):
    """The first TOTAL_STEPS global batches of the per-epoch orders, each example once.

    The counts are summed over both workers' replicas: an example trained on
    by both workers, or re-read after the resume, counts 2.
    """
    _, records = workers
    consumed = [e * job.NUM_EXAMPLES + i
                for e in range(job.COUNTED_EPOCHS) for i in job.epoch_order(e)]
    expected = np.zeros(job.COUNTED_EPOCHS * job.NUM_EXAMPLES)
    expected[consumed[: job.TOTAL_STEPS * job.GLOBAL_BATCH]] = 1
    for record in records:
        np.testing.assert_array_equal(record["trainer_seen"], expected)


def test_non_chief_checkpoint_scratch_directories_are_removed(workers):
    _, records = workers
    chief, other = records
    assert int(chief["scratch_created"]) == 0
    # Saves at steps 2, 4 (first Trainer), 6, 8 and 9 (second Trainer).
    assert int(other["scratch_created"]) == 5
    for record in records:
        assert list(record["scratch_left"]) == []


def test_evaluate_on_two_workers_is_exact(workers):
    _, records = workers
    reference = _one_device_fit(epochs_and_steps=TRAINER_EPOCHS)
    x, y = job.arrays(job.EVAL_EXAMPLES, seed=1)
    logits = reference(x, training=False)
    accuracy = float(np.mean(np.argmax(logits, axis=1) == y))
    loss = float(np.mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)))
    # The loss is one device's `evaluate` on the same padded batches: Keras'
    # default reduction divides by every example, zero-weight padding
    # included, and the model's L2 penalty is added.
    loss = loss * job.EVAL_EXAMPLES / job.EVAL_PADDED + float(sum(reference.losses))
    for record in records:
        assert float(record["eval_accuracy"]) == pytest.approx(accuracy, abs=1e-6)
        assert float(record["eval_loss"]) == pytest.approx(loss, rel=1e-5)


def test_validation_passes_share_one_iterator_with_keras_own_logs(workers):
    """fit's validation reads one distributed iterator for all its passes, exactly.

    Keras' loop asks for two iterators per pass, training and validation
    alike (one it reads, one it builds at the pass's end and throws away);
    tfdp asks for one per training epoch and none for validation (its one
    iterator of the input repeated is built once, outside Keras' count).
    The logs, validation and training alike, must be Keras' own to the bit.
    """
    _, records = workers
    epochs = job.VALIDATION_EPOCHS
    for record in records:
        for key in ("loss", "val_loss", "val_accuracy"):
            np.testing.assert_array_equal(record[f"validation_kept_{key}"],
                                          record[f"validation_keras_{key}"], err_msg=key)
        assert len(record["validation_kept_val_loss"]) == epochs
        # One element_spec read at fit's start (tfdp's symbolic build), then
        # per epoch: Keras 2 for training + 2 for validation; tfdp 1 + 0.
        assert int(record["validation_keras_builds"]) == 1 + 4 * epochs
        assert int(record["validation_kept_builds"]) == 1 + epochs


def test_jit_compile_on_cpu_workers_is_refused_with_the_reason(workers):
    # TensorFlow 2.21 has no XLA collectives on CPU (b/194942685): tried, the
    # first step fails with UnimplementedError and the peer aborts. tfdp.compile
    # refuses before anything runs.
    _, records = workers
    for record in records:
        error = str(record["jit_error"])
        assert error.startswith("ValueError: jit_compile=True cannot run on a "
                                "MultiWorkerMirroredStrategy over CPU workers"), error


def test_local_steps_with_nan_on_one_worker_stop_both_workers_alike(workers):
    """Issue 33, finding 2: each worker skips its own NaN steps (no per-step collective); the
    one that reaches the limit must not raise alone while the other waits in the next
    synchronisation. Both raise the same NonFiniteError after the same step: the
    synchronisation that carried the request to stop (step 4, sync_every=4)."""
    _, records = workers
    for record in records:
        error = str(record["local_nan_error"])
        assert error.startswith("NonFiniteError:"), error
        assert "stopped on every worker at the next synchronisation" in error, error
        # Steps 1-3 reached their batch ends; step 4 (the synchronisation) raised.
        assert record["local_nan_batches"].tolist() == [0, 1, 2]

