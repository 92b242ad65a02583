"""Worker program for tests/training/test_multiworker_training.py (two MWMS workers).

Run as `python multiworker_training_job.py OUT_DIR` under
`tfdp-launch --nproc_per_node 2`. Each worker trains the same tiny model
several ways under one `tfdp.make_strategy("multi_worker")` (one launch: each
costs ~10 s of TensorFlow start-up) and writes what it ends with to
`OUT_DIR/rank{R}.npz`. Every `model.fit` case goes through `tfdp.compile` on
the global batches of `global_batches(0)`, one epoch:

- `fit_*`: momentum SGD, `accum_steps=2`, `steps_per_execution=2`;
- `lars_*`, `lamb_*`: `tfdp.optimizers.LARS` / `LAMB` (`OPTIMIZER_CASES`);
- `warmup_*`: momentum SGD on a `tfdp.WarmupSchedule` (`warmup_schedule`),
  `accum_steps=4`;
- `mixed_bfloat16_*`, `mixed_float16_*`: under that dtype policy;
- `trainer_*`: `tfdp.Trainer(accum_steps=2)` on a model that counts, per
  example id, how often each example was trained on (`SeenCounter`),
  stopped after `RESUME_AT` steps and resumed by a second Trainer from the
  chief's checkpoint to `TOTAL_STEPS`;
- `eval_*`: `Trainer.evaluate` on a zero-weight-padded evaluation set;
- `*_grad_allreduces`: tensor all-reduces each case launched at run time
  (`count_all_reduces`), and `control_*` a loop that all-reduces once per
  iteration, which that count must see;
- `scratch_created`, `scratch_left`: temporary directories this worker
  created (non-chief checkpoint saves) and those still there at the end;
- `lossform_<form>_<path>_*`: `loss_forms.MULTIWORKER_CELLS`, loss forms
  whose replicas hold uneven valid counts and weights, through `tfdp.compile`
  (with and without accumulation) and `tfdp.Trainer`: final weights and
  logged loss;
- `jit_error`: what `tfdp.compile(jit_compile=True)` raised: on CPU workers
  tfdp refuses it (TensorFlow has no XLA collectives on CPU);
- `validation_<kept|keras>_*`: `fit` with `validation_data` for
  `VALIDATION_EPOCHS` epochs, `steps_per_execution=3` over 4 validation
  batches (the last partial), with tfdp's one validation iterator
  (`keras_spare_iterator.keep_validation_iterator`) and with Keras' own loop:
  the logs, and the distributed iterators Keras' loop built;
- `float8_*`, `<exchange>_accum_*`, `<exchange>_mf16_*`: `PAIR_CASES`, the
  exchanges × accumulation and × mixed_float16 not run by the cases above;
- `local_nan_*`: local SGD with NaN on worker 1 only (`nan_on_worker_1`):
  what `fit` raised on each worker and the batches whose end it reached.

The test imports this module too, for the data, models and optimizers (one
source of truth for the workers and the single-device references).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np

FEATURES, CLASSES = 6, 3
GLOBAL_BATCH = 16
NUM_EXAMPLES = 96  # 6 global batches an epoch
STEPS_PER_EPOCH = NUM_EXAMPLES // GLOBAL_BATCH
RESUME_AT, TOTAL_STEPS = 4, 9
COUNTED_EPOCHS = 2  # TOTAL_STEPS reaches into the second epoch
EVAL_EXAMPLES, EVAL_PADDED = 50, 64
ACCUM_STEPS = 2
WARMUP_ACCUM_STEPS = 4
CONTROL_LOOP_STEPS = 3
LEARNING_RATE = 0.5
MIXED_POLICIES = ("mixed_bfloat16", "mixed_float16")


def arrays(n=NUM_EXAMPLES, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(n,)).astype("int32")
    return x, y


def epoch_order(epoch):
    """The order of the examples in `epoch`: depends only on the epoch."""
    return np.random.default_rng(100 + epoch).permutation(NUM_EXAMPLES)


def global_batches(epoch=0):
    """The training data for `epoch`: a seeded order, global batches."""
    import tensorflow as tf

    x, y = arrays()
    order = epoch_order(epoch)
    return tf.data.Dataset.from_tensor_slices((x[order], y[order])).batch(
        GLOBAL_BATCH, drop_remainder=True
    )


def counted_batches(epoch):
    """`global_batches(epoch)` with each example's id, distinct per epoch."""
    import tensorflow as tf

    x, y = arrays()
    order = epoch_order(epoch)
    ids = (epoch * NUM_EXAMPLES + order).astype("int32")
    return tf.data.Dataset.from_tensor_slices(
        ({"features": x[order], "id": ids}, y[order])
    ).batch(GLOBAL_BATCH, drop_remainder=True)


#: Examples of each global batch read by worker 0 and worker 1: unequal shares.
UNEQUAL_PLAN = (11, 5)


def unequal_share_batches(worker, epoch=0):
    """Worker `worker`'s slice of every global batch of `global_batches(epoch)`, per `UNEQUAL_PLAN`.

    Batched without `drop_remainder`, so the batch dimension is unknown: the
    workers hold different numbers of examples.
    """
    import tensorflow as tf

    x, y = arrays()
    order = epoch_order(epoch)
    start = sum(UNEQUAL_PLAN[:worker])
    rows = np.concatenate([order[s * GLOBAL_BATCH + start: s * GLOBAL_BATCH + start
                                 + UNEQUAL_PLAN[worker]] for s in range(STEPS_PER_EPOCH)])
    return tf.data.Dataset.from_tensor_slices((x[rows], y[rows])).batch(UNEQUAL_PLAN[worker])


def padded_eval_batches():
    """The evaluation set for `build_counting_model()` (ids unused), zero-weight padded."""
    import tensorflow as tf

    x, y = arrays(EVAL_EXAMPLES, seed=1)
    pad = EVAL_PADDED - EVAL_EXAMPLES
    xp = np.concatenate([x, np.zeros((pad, FEATURES), "float32")])
    yp = np.concatenate([y, np.zeros((pad,), "int32")])
    wp = np.concatenate([np.ones(EVAL_EXAMPLES, "float32"), np.zeros(pad, "float32")])
    ids = np.zeros((EVAL_PADDED,), "int32")
    return tf.data.Dataset.from_tensor_slices(({"features": xp, "id": ids}, yp, wp)).batch(
        GLOBAL_BATCH
    )


def _hidden_layers():
    import keras

    return [
        keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.01)),
        keras.layers.Dense(CLASSES),
    ]


def build_model():
    import keras

    keras.utils.set_random_seed(11)
    return keras.Sequential([keras.Input((FEATURES,)), *_hidden_layers()])


def seen_counter(size):
    """An identity layer on features that counts, in training, each example id used.

    The counts are a weight synchronised on read with SUM aggregation: every
    replica counts into its own copy and a read sums the copies over all
    replicas of all workers. They are checkpointed and restored with the model.
    """
    import keras
    import tensorflow as tf

    class SeenCounter(keras.layers.Layer):
        def build(self, input_shape):
            self.counts = keras.Variable(
                initializer="zeros", shape=(size,), trainable=False, name="counts",
                aggregation="sum", synchronization="on_read",
            )

        def call(self, inputs, training=False):
            features, ids = inputs
            if training:
                self.counts.assign_add(tf.reduce_sum(tf.one_hot(ids, size), axis=0))
            return features

    return SeenCounter(name="seen_counter")


def build_counting_model():
    """`build_model()` (same initial weights) behind a `seen_counter` on the ids."""
    import keras

    keras.utils.set_random_seed(11)
    features = keras.Input((FEATURES,), name="features")
    ids = keras.Input((), dtype="int32", name="id")
    hidden = seen_counter(COUNTED_EPOCHS * NUM_EXAMPLES)([features, ids])
    for layer in _hidden_layers():
        hidden = layer(hidden)
    return keras.Model({"features": features, "id": ids}, hidden)


def loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def optimizer():
    import keras

    return keras.optimizers.SGD(LEARNING_RATE, momentum=0.5)


def warmup_schedule():
    """3 warmup steps to 0.5, then cosine to 0 at step 8 (epoch: 6 steps)."""
    import tfdp

    return tfdp.WarmupSchedule(LEARNING_RATE, warmup_steps=3, decay="cosine", total_steps=8)


def warmup_optimizer(schedule=None):
    import keras

    return keras.optimizers.SGD(schedule or warmup_schedule(), momentum=0.5)


def adamw_optimizer():
    import keras

    return keras.optimizers.AdamW(0.01, weight_decay=0.05)


def lars_optimizer():
    from tfdp.optimizers import LARS

    return LARS(1.0, momentum=0.9, weight_decay=1e-3, eeta=0.1)


def lamb_optimizer():
    from tfdp.optimizers import LAMB

    return LAMB(0.05, weight_decay=0.01)


#: name -> (optimizer factory, accum_steps) of the LARS / LAMB fit cases.
OPTIMIZER_CASES = {"lars": (lars_optimizer, 1), "lamb": (lamb_optimizer, ACCUM_STEPS)}


def count_all_reduces(strategy):
    """Counts, at run time, the gradient all-reduces `strategy` launches.

    Every all-reduce of a MultiWorkerMirroredStrategy's compute replicas goes
    through `CollectiveAllReduce._all_reduce` (gradients through `merge_call`
    and `batch_reduce`, or straight from replica context), once per local
    replica and call, whatever the number of packs. The wrapper makes that
    collective's inputs depend on `counter.assign_add(1)`, so the counter
    grows each time the collective runs: once per iteration when it sits
    inside a `tf.while_loop`. Only all-reduces of more than one number, in
    traced functions, are counted: each step also all-reduces single numbers
    (the distributed iterator's "replicas with data" flag, Keras' logs, the
    loss-scale finite flag), and reading the metrics at the end of an epoch
    all-reduces their variables (`tfdp.training.metric_reads`, under its
    name scope): neither is counted.

    Returns:
        The counter, an int64 `tf.Variable`.
    """
    import tensorflow as tf

    from tfdp.training import metric_reads

    counter = tf.Variable(0, dtype=tf.int64, trainable=False)
    ops = strategy.extended._cross_device_ops  # pylint: disable=protected-access
    all_reduce = ops._all_reduce  # pylint: disable=protected-access

    def counting_all_reduce(reduce_op, value, replica_id, options):
        flat = tf.nest.flatten(value)
        if (tf.executing_eagerly() or sum(t.shape.num_elements() or 0 for t in flat) <= 1
                or metric_reads.NAME_SCOPE in tf.get_current_name_scope()):
            return all_reduce(reduce_op, value, replica_id, options)
        with tf.control_dependencies([counter.assign_add(1)]):
            flat = [tf.identity(t) for t in flat]
        return all_reduce(reduce_op, tf.nest.pack_sequence_as(value, flat), replica_id, options)

    ops._all_reduce = counting_all_reduce  # pylint: disable=protected-access
    return counter


def _fit_case(tfdp, strategy, counter, name, *, make_optimizer, accum_steps,
              steps_per_execution=1, jit_compile=False, gradient_compression=None,
              sync_every=1, make_outer_optimizer=None, shard_optimizer_state=False,
              overlap_sync=False):
    """Trains `build_model()` for one epoch with tfdp.compile; returns `{name_*: ...}`.

    The trained model stays in `_TRAINED[name]`.
    """
    with strategy.scope():
        model = build_model()
        tfdp.compile(model, optimizer=make_optimizer(), loss=loss(), metrics=["accuracy"],
                     accum_steps=accum_steps, steps_per_execution=steps_per_execution,
                     jit_compile=jit_compile, gradient_compression=gradient_compression,
                     sync_every=sync_every,
                     outer_optimizer=make_outer_optimizer and make_outer_optimizer(),
                     shard_optimizer_state=shard_optimizer_state, overlap_sync=overlap_sync)
    from tfdp.training import nonfinite
    from tfdp._upstream import loss_scale

    # tfdp.compile wraps the optimizer to skip non-finite steps; the one that
    # applies the updates is inside.
    updates = model.optimizer
    if isinstance(updates, nonfinite.NonFiniteGuard):
        updates = updates.inner_optimizer
    before = int(counter.numpy())
    history = model.fit(global_batches(), epochs=1, verbose=0)
    results = {
        f"{name}_iterations": int(model.optimizer.iterations.numpy()),
        f"{name}_grad_allreduces": int(counter.numpy()) - before,
        f"{name}_loss": np.asarray(history.history["loss"], "float64"),
        f"{name}_optimizer": f"{type(updates).__module__}.{type(updates).__name__}",
        f"{name}_consistent_loss_scale": isinstance(model.optimizer,
                                                    loss_scale.LossScaleOptimizer),
    }
    sharding = getattr(model.optimizer, "sharding", None)
    if sharding is not None:
        # ZeRO-1: the gradients go by all-to-all (reduce-scatter), not all-reduce.
        results[f"{name}_scatters"] = bool(sharding.scatters)
    for i, w in enumerate(model.get_weights()):
        results[f"{name}_weight{i}"] = np.asarray(w, "float32")
    _TRAINED[name] = model
    return results


def _unequal_shares_case(tfdp, strategy, counter):
    """`fit` on each worker's unequal share of every global batch (`UNEQUAL_PLAN`).

    `unequal_*`: global loss normalisation (the default); `unequal_keras_*`:
    `loss_normalization="per_replica"`, Keras' mean of per-worker means, the
    negative control.
    """
    results = {}
    for name, normalization in (("unequal", "global"), ("unequal_keras", "per_replica")):
        with strategy.scope():
            model = build_model()
            tfdp.compile(model, optimizer=optimizer(), loss=loss(), metrics=["accuracy"],
                         loss_normalization=normalization)
        dataset = strategy.distribute_datasets_from_function(
            lambda context: unequal_share_batches(context.input_pipeline_id))
        before = int(counter.numpy())
        model.fit(dataset, epochs=1, steps_per_epoch=STEPS_PER_EPOCH, verbose=0)
        results[f"{name}_iterations"] = int(model.optimizer.iterations.numpy())
        results[f"{name}_grad_allreduces"] = int(counter.numpy()) - before
        for i, w in enumerate(model.get_weights()):
            results[f"{name}_weight{i}"] = np.asarray(w, "float32")
    return results


#: The models `_fit_case` trained, by case name.
_TRAINED = {}


#: Epochs of the validation case: enough passes for one iterator to serve several.
VALIDATION_EPOCHS = 3


def validation_batches():
    """`EVAL_EXAMPLES` examples in global batches: 16, 16, 16 and a partial 2."""
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices(arrays(EVAL_EXAMPLES, seed=1)).batch(GLOBAL_BATCH)


def _validation_case(tfdp, strategy):
    """`fit(validation_data=...)` with one kept validation iterator, and with Keras' loop."""
    from keras.src.backend.tensorflow import trainer as keras_tf_trainer
    from tfdp._upstream import keras_spare_iterator

    builds = []
    original = keras_tf_trainer.TFEpochIterator._get_iterator

    def counting(self):
        builds.append(1)
        return original(self)

    keras_tf_trainer.TFEpochIterator._get_iterator = counting
    results = {}
    try:
        for name, install in (("keras", keras_spare_iterator.uninstall),
                              ("kept", keras_spare_iterator.install)):
            with strategy.scope():
                model = build_model()
                tfdp.compile(model, optimizer=optimizer(), loss=loss(), metrics=["accuracy"],
                             steps_per_execution=3)
            install()  # after tfdp.compile, which installs it
            del builds[:]
            history = model.fit(global_batches(), validation_data=validation_batches(),
                                epochs=VALIDATION_EPOCHS, verbose=0)
            results[f"validation_{name}_builds"] = len(builds)
            for key in ("loss", "val_loss", "val_accuracy"):
                results[f"validation_{name}_{key}"] = np.asarray(history.history[key], "float64")
    finally:
        keras_tf_trainer.TFEpochIterator._get_iterator = original
        keras_spare_iterator.install()
    return results


def _keras_save_case(name, path):
    """Tries `model.save(path)` on case `name`'s model; `{name}_keras_save_error` ("" if saved).

    Run after the scratch-directory count: a save Keras gives up on leaves
    its temporary asset directory behind.
    """
    try:
        _TRAINED[name].save(path)
        return {f"{name}_keras_save_error": ""}
    except ValueError as error:
        return {f"{name}_keras_save_error": str(error)}


def _mixed_precision_cases(tfdp, strategy, counter):
    import keras

    results = {}
    for policy in MIXED_POLICIES:
        keras.config.set_dtype_policy(policy)
        try:
            results.update(_fit_case(tfdp, strategy, counter, policy, make_optimizer=optimizer,
                                     accum_steps=ACCUM_STEPS))
        finally:
            keras.config.set_dtype_policy("float32")
    return results


def _control_loop(strategy, counter):
    """All-reduces once per iteration of a `tf.while_loop` in replica context.

    What the accumulation loop must not do; `count_all_reduces` must count
    `CONTROL_LOOP_STEPS` here, or its 1-per-step counts prove nothing.
    """
    import tensorflow as tf

    extended = strategy.extended

    def replica_fn():
        def body(i, total):
            # Straight from replica context (merge_call cannot run in a loop).
            reduced = extended._replica_ctx_all_reduce(  # pylint: disable=protected-access
                tf.distribute.ReduceOp.SUM, tf.ones([2])
            )
            return i + 1, total + reduced

        return tf.while_loop(lambda i, _: i < CONTROL_LOOP_STEPS, body,
                             (tf.constant(0), tf.zeros([2])))[1]

    before = int(counter.numpy())
    total = strategy.run(tf.function(replica_fn))
    total = strategy.experimental_local_results(total)[0].numpy()
    return {"control_grad_allreduces": int(counter.numpy()) - before, "control_total": total}


def _trainer(tfdp, strategy, model_dir):
    with strategy.scope():
        model, opt = build_counting_model(), optimizer()
    batch = tfdp.BatchConfig.from_global(GLOBAL_BATCH, strategy.num_replicas_in_sync, ACCUM_STEPS)
    return tfdp.Trainer(model, optimizer=opt, loss=loss(), strategy=strategy, batch=batch,
                        metrics=["accuracy"], model_dir=model_dir, checkpoint_every=2)


def _trainer_cases(tfdp, strategy, counter, out_dir):
    results = {}
    model_dir = os.path.join(out_dir, "model_dir")
    before = int(counter.numpy())
    first = _trainer(tfdp, strategy, model_dir)
    first.train(counted_batches, steps=RESUME_AT)
    second = _trainer(tfdp, strategy, model_dir)
    results["trainer_restored_step"] = second.global_step  # 0: nothing restored yet
    summary = second.train(counted_batches, steps=TOTAL_STEPS)
    results["trainer_grad_allreduces"] = int(counter.numpy()) - before
    results["trainer_steps"] = summary["steps"]
    counting = second.model.get_layer("seen_counter")
    results["trainer_seen"] = counting.counts.numpy()  # summed over all replicas
    trainable = [w for w in second.model.weights if w.trainable]
    for i, w in enumerate(trainable):
        results[f"trainer_weight{i}"] = w.numpy()
    evaluation = second.evaluate(padded_eval_batches())
    results["eval_loss"] = evaluation["loss"]
    results["eval_accuracy"] = evaluation["accuracy"]
    return results


def _jit_case(tfdp, strategy, counter):
    """Expected to raise on CPU workers; a run that went ahead is recorded too."""
    try:
        return _fit_case(tfdp, strategy, counter, "jit", make_optimizer=optimizer,
                         accum_steps=ACCUM_STEPS, jit_compile=True)
    except Exception as error:  # pylint: disable=broad-except
        return {"jit_error": f"{type(error).__name__}: {error}"[-3000:]}


def _record_scratch_directories(directory):
    """Puts temporary directories under `directory`; returns the list of those created.

    Non-chief workers save checkpoints into such scratch directories
    (`tfdp.training.checkpointing`), which must be gone after each save.
    """
    os.makedirs(directory, exist_ok=True)
    tempfile.tempdir = directory
    created = []
    mkdtemp = tempfile.mkdtemp

    def recording_mkdtemp(*args, **kwargs):
        created.append(mkdtemp(*args, **kwargs))
        return created[-1]

    tempfile.mkdtemp = recording_mkdtemp
    return created


def _loss_form_cases(tfdp, strategy):
    """Every `loss_forms.MULTIWORKER_CELLS` cell on this worker: weights and logged loss."""
    import keras
    import loss_forms  # next to this script

    results = {}
    for form_name, path in loss_forms.MULTIWORKER_CELLS:
        form = loss_forms.FORMS_BY_NAME[form_name]
        accum_steps = 2 if path.endswith("accum2") else 1
        with strategy.scope():
            model = form.model()
            optimizer = keras.optimizers.SGD(loss_forms.LEARNING_RATE)
        if path.startswith("fit"):
            with strategy.scope():
                tfdp.compile(model, optimizer=optimizer, loss=form.loss(), accum_steps=accum_steps,
                             **form.compile_kwargs)
            history = model.fit(form.dataset(), epochs=1, verbose=0, **form.fit_kwargs())
            loss_value = history.history["loss"][-1]
        else:
            trainer = tfdp.Trainer(
                model, optimizer=optimizer, loss=form.loss(), strategy=strategy,
                batch=tfdp.BatchConfig.from_global(loss_forms.GLOBAL_BATCH,
                                                   strategy.num_replicas_in_sync, accum_steps),
            )
            loss_value = trainer.train(form.dataset(), steps=loss_forms.STEPS)["loss"]
        key = f"lossform_{form_name}_{path}"
        results[f"{key}_loss"] = float(loss_value)
        for i, w in enumerate(loss_forms.weights(model)):
            results[f"{key}_weight{i}"] = w
    return results


#: name -> (compressor factory, accum_steps) of the gradient compression fit cases.
COMPRESSION_CASES = {
    # Keeps everything: must equal one device.
    "psgd_lossless": (lambda tfdp: tfdp.compression.PowerSGD(rank=64, min_compression_ratio=0.01),
                      1),
    # Real compression after 2 uncompressed steps (a tf.cond around collectives).
    "psgd_rank1": (lambda tfdp: tfdp.compression.PowerSGD(rank=1, start_step=2), ACCUM_STEPS),
    "topk": (lambda tfdp: tfdp.compression.TopK(fraction=0.05), 1),
    # bfloat16 gradients with the distributed batch's unknown size: the counts
    # cannot ride in the bfloat16 all-reduce.
    "bf16": (lambda tfdp: "bfloat16", 1),
}


def _compression_cases(tfdp, strategy, counter):
    results = {}
    for name, (make, accum_steps) in COMPRESSION_CASES.items():
        results.update(_fit_case(tfdp, strategy, counter, name, make_optimizer=optimizer,
                                 accum_steps=accum_steps, gradient_compression=make(tfdp)))
    return results


def diloco_outer_optimizer():
    from tfdp.distribute import local_sync

    return local_sync.diloco_outer_optimizer(0.7, 0.9)


#: name -> (sync_every, outer optimizer factory, accum_steps, syncs in one epoch) of the
#: local SGD / DiLoCo fit cases (6 steps: a window also ends with the epoch).
LOCAL_CASES = {
    "local_sgd": (4, None, 1, 2),
    "diloco": (2, diloco_outer_optimizer, ACCUM_STEPS, 3),
    # Overlapped: windows end after steps 2, 4 and 6, each all-reduce in a background
    # thread while the next window computes; the epoch's end only applies the last.
    "diloco_overlap": (2, diloco_outer_optimizer, ACCUM_STEPS, 3),
}
#: The LOCAL_CASES trained with overlap_sync=True (tfdp.distribute.overlapped_sync).
OVERLAPPED = {"diloco_overlap"}


def _local_cases(tfdp, strategy, counter):
    results = {}
    for name, (sync_every, make_outer, accum_steps, _) in LOCAL_CASES.items():
        results.update(_fit_case(tfdp, strategy, counter, name, make_optimizer=optimizer,
                                 accum_steps=accum_steps, sync_every=sync_every,
                                 make_outer_optimizer=make_outer,
                                 overlap_sync=name in OVERLAPPED))
    return results


#: The 2-worker subset of the option-pair matrix (tests/training/test_option_pairs.py) that
#: the cases above leave out: every exchange × accumulation and every exchange ×
#: mixed_float16. Already run above, × accumulation: the plain all-reduce (`fit`), PowerSGD
#: (`psgd_rank1`), ZeRO-1 (`zero`), DiLoCo (`diloco`); × mixed_float16: the plain all-reduce
#: (`mixed_float16`, with accumulation). name -> (dtype policy, `_fit_case` arguments; a
#: callable `gradient_compression` is called with `tfdp`). Momentum SGD throughout; the
#: mixed_float16 cases accumulate 2 micro-batches, as `mixed_float16` does, which is their
#: reference where one exists (lossless PowerSGD, ZeRO-1).
PAIR_CASES = {
    "float8": (None, dict(gradient_compression="float8", accum_steps=1)),
    "float8_accum": (None, dict(gradient_compression="float8", accum_steps=ACCUM_STEPS)),
    "bf16_accum": (None, dict(gradient_compression="bfloat16", accum_steps=ACCUM_STEPS)),
    "topk_accum": (None, dict(gradient_compression=lambda tfdp: tfdp.compression.TopK(
        fraction=0.05), accum_steps=ACCUM_STEPS)),
    "local_sgd_accum": (None, dict(sync_every=LOCAL_CASES["local_sgd"][0],
                                   accum_steps=ACCUM_STEPS)),
    "bf16_mf16": ("mixed_float16", dict(gradient_compression="bfloat16",
                                        accum_steps=ACCUM_STEPS)),
    "psgd_mf16": ("mixed_float16", dict(gradient_compression=COMPRESSION_CASES[
        "psgd_lossless"][0], accum_steps=ACCUM_STEPS)),
    "topk_mf16": ("mixed_float16", dict(gradient_compression=lambda tfdp: tfdp.compression.TopK(
        fraction=0.05), accum_steps=ACCUM_STEPS)),
    "float8_mf16": ("mixed_float16", dict(gradient_compression="float8",
                                          accum_steps=ACCUM_STEPS)),
    "zero_mf16": ("mixed_float16", dict(shard_optimizer_state=True, accum_steps=ACCUM_STEPS)),
    "local_sgd_mf16": ("mixed_float16", dict(sync_every=LOCAL_CASES["local_sgd"][0],
                                             accum_steps=ACCUM_STEPS)),
    "diloco_mf16": ("mixed_float16", dict(sync_every=LOCAL_CASES["diloco"][0],
                                          make_outer_optimizer=diloco_outer_optimizer,
                                          accum_steps=ACCUM_STEPS)),
}


def _pair_cases(tfdp, strategy, counter):
    import keras

    results = {}
    for name, (policy, arguments) in PAIR_CASES.items():
        arguments = dict(arguments)
        if callable(arguments.get("gradient_compression")):
            arguments["gradient_compression"] = arguments["gradient_compression"](tfdp)
        keras.config.set_dtype_policy(policy or "float32")
        try:
            results.update(_fit_case(tfdp, strategy, counter, name, make_optimizer=optimizer,
                                     **arguments))
        finally:
            keras.config.set_dtype_policy("float32")
    return results


#: name -> Trainer arguments of the per-replica-state resume cases.
RESUME_CASES = {
    "topk_resume": lambda tfdp: dict(gradient_compression=tfdp.compression.TopK(fraction=0.05)),
    "local_resume": lambda tfdp: dict(sync_every=3),
    # ZeRO-1: each worker's replica keeps its half of the momentum.
    "zero_resume": lambda tfdp: dict(shard_optimizer_state=True),
}


def _resume_cases(tfdp, strategy, out_dir):
    """Trainer with per-replica state (error memories, local momentum), stopped and resumed."""
    import keras

    results = {}
    for name, arguments in RESUME_CASES.items():
        def make(directory):
            with strategy.scope():
                model = build_model()
                opt = keras.optimizers.SGD(LEARNING_RATE, momentum=0.9)
            batch = tfdp.BatchConfig.from_global(GLOBAL_BATCH, strategy.num_replicas_in_sync)
            return tfdp.Trainer(model, optimizer=opt, loss=loss(), strategy=strategy,
                                batch=batch, model_dir=directory, checkpoint_every=RESUME_AT,
                                **arguments(tfdp))

        straight = make(os.path.join(out_dir, f"{name}_straight"))
        straight.train(global_batches, steps=TOTAL_STEPS)
        directory = os.path.join(out_dir, f"{name}_resumed")
        make(directory).train(global_batches, steps=RESUME_AT)
        resumed = make(directory)
        resumed.train(global_batches, steps=TOTAL_STEPS)
        results[f"{name}_difference"] = max(
            float(np.abs(a - b).max())
            for a, b in zip(straight.model.get_weights(), resumed.model.get_weights()))
        results[f"{name}_steps"] = resumed.global_step
        results[f"{name}_files"] = np.array(sorted(os.listdir(
            os.path.join(directory, "replica_state", f"ckpt-{RESUME_AT}"))), dtype=str)
    return results


#: Local SGD whose worker 1 meets NaN in these steps (0-based), with a limit of 2.
LOCAL_NAN_STEPS, LOCAL_NAN_SYNC_EVERY, LOCAL_NAN_LIMIT = (1, 2), 4, 2


def nan_on_worker_1(rank, epoch=0):
    """`global_batches(epoch)`, with NaN features in `LOCAL_NAN_STEPS` on worker 1 only."""
    import tensorflow as tf

    x, y = arrays()
    order = epoch_order(epoch)
    x, y = x[order].copy(), y[order]
    if rank == 1:
        for step in LOCAL_NAN_STEPS:
            x[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH] = np.nan
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH, drop_remainder=True)


def _local_nan_case(tfdp, strategy, rank):
    """Local SGD with NaN on one worker: each skips on its own, and both must stop alike.

    Last of the launch: before issue 33's finding 2 was fixed, worker 1
    raised alone and worker 0 waited in the next synchronisation.
    """
    import keras

    batches = []

    class Batches(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            batches.append(batch)

    with strategy.scope():
        model = build_model()
        tfdp.compile(model, optimizer=optimizer(), loss=loss(), sync_every=LOCAL_NAN_SYNC_EVERY,
                     max_consecutive_nonfinite=LOCAL_NAN_LIMIT)
    try:
        model.fit(nan_on_worker_1(rank), epochs=1, verbose=0, callbacks=[Batches()])
        error = ""
    except Exception as caught:  # pylint: disable=broad-except
        error = f"{type(caught).__name__}: {caught}"[-3000:]
    return {"local_nan_error": error, "local_nan_batches": np.array(batches, "int64")}


def main(out_dir: str) -> None:
    import tfdp

    strategy = tfdp.make_strategy("multi_worker", timeout_seconds=60)
    rank = tfdp.strategy_info(strategy).worker_index
    scratch = _record_scratch_directories(os.path.join(out_dir, f"tmp{rank}"))
    counter = count_all_reduces(strategy)
    results = {}

    def timed(name, fn, *args, **kwargs):
        start = time.perf_counter()
        results.update(fn(*args, **kwargs))
        print(f"case {name}: {time.perf_counter() - start:.1f} s", flush=True)

    timed("fit", _fit_case, tfdp, strategy, counter, "fit", make_optimizer=optimizer,
          accum_steps=ACCUM_STEPS, steps_per_execution=2)
    for name, (make_optimizer, accum_steps) in OPTIMIZER_CASES.items():
        timed(name, _fit_case, tfdp, strategy, counter, name, make_optimizer=make_optimizer,
              accum_steps=accum_steps)
    timed("warmup", _fit_case, tfdp, strategy, counter, "warmup", make_optimizer=warmup_optimizer,
          accum_steps=WARMUP_ACCUM_STEPS)
    timed("mixed", _mixed_precision_cases, tfdp, strategy, counter)
    timed("control", _control_loop, strategy, counter)
    timed("trainer", _trainer_cases, tfdp, strategy, counter, out_dir)
    timed("loss_forms", _loss_form_cases, tfdp, strategy)
    timed("compression", _compression_cases, tfdp, strategy, counter)
    timed("local", _local_cases, tfdp, strategy, counter)
    timed("pairs", _pair_cases, tfdp, strategy, counter)
    timed("unequal", _unequal_shares_case, tfdp, strategy, counter)
    timed("validation", _validation_case, tfdp, strategy)
    timed("zero", _fit_case, tfdp, strategy, counter, "zero", make_optimizer=adamw_optimizer,
          accum_steps=ACCUM_STEPS, shard_optimizer_state=True)
    results["scratch_created"] = len(scratch)
    results["scratch_left"] = np.array([p for p in scratch if os.path.exists(p)], dtype=str)
    timed("zero_keras", _keras_save_case, "zero", os.path.join(out_dir, f"zero-rank{rank}.keras"))
    # After the scratch count above: these Trainers save more.
    timed("resume", _resume_cases, tfdp, strategy, out_dir)
    timed("jit", _jit_case, tfdp, strategy, counter)
    timed("local_nan", _local_nan_case, tfdp, strategy, rank)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **results)
    sys.stdout.flush()
    sys.stderr.flush()
    # TensorFlow 2.21 can abort in its exit handlers after this many
    # multi-worker cases in one process ("double free or corruption");
    # everything is written by now.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
