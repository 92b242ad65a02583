"""`tfdp.compile`: `model.compile` whose `fit` and `evaluate` equal one device, under any strategy.

It installs tfdp's train and test steps (`tfdp.training.train_step`) on the
model: the loss of the global batch as one device computes it
(`tfdp.training.loss_normalization`), gradient accumulation with one
all-reduce per global batch (`tfdp.training.accumulation`), non-finite steps
skipped on every replica alike (`tfdp.training.nonfinite`), and with
`steps_per_execution > 1` logs reduced once per execution
(`tfdp._upstream.keras_train_function`). Its `fit` keeps full garbage
collections from stalling the workers (`tfdp.training.gc_freeze`), and
refuses or warns about Keras' own savers where they cannot keep per-replica
state (`tfdp.training.keras_savers`).
"""

from __future__ import annotations

import functools

import keras
import tensorflow as tf

from tfdp import _checks
from tfdp._upstream import keras_loss_terms
from tfdp._upstream import keras_spare_iterator
from tfdp._upstream import keras_train_function
from tfdp.distribute import compression
from tfdp.distribute import devices
from tfdp.distribute import local_sync as local_sync_lib
from tfdp.distribute import shard_layout
from tfdp.distribute import strategy_info as strategy_info_lib
from tfdp.training import balanced_batches
from tfdp.training import gc_freeze
from tfdp.training import keras_savers
from tfdp.training import loss_normalization as norm_lib
from tfdp.training import metric_reads
from tfdp.training import nonfinite as nonfinite_lib
from tfdp.training import option_rules
from tfdp.training import replicated_input
from tfdp.training import step_monitor
from tfdp.training import sync_points
from tfdp.training import train_step as train_step_lib
from tfdp.training.exchanges import bucketed


def _evaluate_keeping_validation_iterator(model, evaluate, *args, **kwargs):
    """`evaluate`, first keeping fit's validation iterator (`keras_spare_iterator`)."""
    if kwargs.get("_use_cached_eval_dataset"):
        keras_spare_iterator.keep_validation_iterator(model)
    return evaluate(*args, **kwargs)


def _overrides(model: keras.Model, name: str) -> bool:
    return getattr(type(model), name) is not getattr(keras.Model, name)


def _check_model(model: keras.Model, loss_normalization: str, accum_steps: int,
                 local: bool = False) -> bool:
    """Whether tfdp's steps can replace the model's; raises where the result would differ silently."""
    custom = [name for name in ("train_step", "compute_loss") if _overrides(model, name)]
    if not custom:
        return True
    if local:
        raise ValueError(
            f"{type(model).__name__} overrides "
            + " and ".join(f"`{name}`" for name in custom)
            + ", so tfdp cannot take local steps (sync_every > 1 or an outer_optimizer) "
            "through it: its loss is scaled for an all-reduce that local steps do not "
            "make. Give the loss to tfdp.compile(loss=...) and drop the override."
        )
    if loss_normalization == norm_lib.PER_REPLICA and accum_steps == 1:
        return False  # the model's own steps, with Keras' per-replica loss
    what = " and ".join(f"`{name}`" for name in custom)
    raise ValueError(
        f"{type(model).__name__} overrides {what}, so tfdp cannot "
        + ("accumulate gradients through it" if accum_steps > 1 else
           "compute its loss over the global batch")
        + ": its loss would be each replica's mean, averaged (wrong under masks, "
        "uneven sample weights or a loss that returns one scalar). Give the loss to "
        "tfdp.compile(loss=...) and drop the override, or pass "
        "loss_normalization='per_replica'"
        + (" and accum_steps=1" if accum_steps > 1 else "")
        + " to keep Keras' per-replica loss."
    )


def _fit_track(model: keras.Model, normalizer: norm_lib.Normalizer):
    tracker = keras_loss_terms.loss_tracker(model)

    def track(share, loss, denominators, term_losses, x, y, y_pred, sample_weight):
        normalizer.report(tracker, share, loss, denominators, term_losses)
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    return track


def fit_train_step(model: keras.Model, normalizer: norm_lib.Normalizer, accum_steps: int, data,
                   balance=None):
    """`model.train_step` under `tfdp.compile`: one replica, one global batch (whole, with `balance`)."""
    train_step_lib.replica_train_step(
        model=model, optimizer=model.optimizer, loss_source=norm_lib.ModelLoss(model),
        normalizer=normalizer, accum_steps=accum_steps, data=data,
        track=_fit_track(model, normalizer), balance=balance,
    )
    return model.get_metrics_result()


def fit_test_step(model: keras.Model, normalizer: norm_lib.Normalizer, data):
    """`model.test_step` under `tfdp.compile`: the loss and metrics of one global batch."""
    train_step_lib.replica_eval_step(
        model=model, loss_source=norm_lib.ModelLoss(model), normalizer=normalizer, data=data,
        track=_fit_track(model, normalizer),
    )
    return model.get_metrics_result()


def compile(  # pylint: disable=redefined-builtin
    model: keras.Model,
    *,
    optimizer,
    loss,
    metrics=None,
    accum_steps: int = 1,
    steps_per_execution: int = 1,
    jit_compile: bool = False,
    nonfinite: str | None = "skip",
    max_consecutive_nonfinite: int = nonfinite_lib.DEFAULT_MAX_CONSECUTIVE,
    all_reduce_dtype: str | None = None,
    loss_normalization: str = "global",
    gradient_compression=None,
    sync_every: int = 1,
    outer_optimizer=None,
    overlap_sync: bool = False,
    shard_optimizer_state: bool = False,
    balance_batches: bool | balanced_batches.BalanceOptions = False,
    bucket_cap_mb: float | None = None,
    **compile_kwargs,
) -> keras.Model:
    """`model.compile` whose `fit` and `evaluate` give one device's result, under any strategy.

    After it, plain `model.fit` trains with one optimizer step (and one
    gradient all-reduce) per global batch; each replica's share of the global
    batch is processed in `accum_steps` micro-batches. Call it inside
    `strategy.scope()` as you would `model.compile`.

    **Loss normalisation.** With `loss_normalization="global"` (the default)
    the loss, its gradient and the logged `loss` (and `<output>_loss`) are
    those of one device on the whole global batch, whatever the replicas and
    micro-batches hold: every reduction, sample and class weights, masks
    (`Masking`, `Embedding(mask_zero=True)`), several outputs with
    `loss_weights`, `add_loss` and regularizers. With a static batch and no
    mask it costs nothing; with an unknown batch size one float32 in the
    gradients' all-reduce (its own small all-reduce under bfloat16 or a
    compressor); under masks and weight sums one all-reduce of a few
    float32 scalars per step (`tfdp.training.loss_normalization`). A loss
    function that returns one scalar is weighted by its examples, with a
    warning. `"per_replica"` averages each replica's own mean, as stock
    Keras does for `Loss` objects. A model class that overrides `test_step`
    keeps it: `evaluate` runs it as written.

    **Balanced batches.** With `balance_batches=True` (or a
    `tfdp.training.balanced_batches.BalanceOptions`) each replica computes a
    share of every global batch that follows its measured speed: `fit`
    feeds every replica the whole global batch (`fit`'s `x` must be a
    `tf.data.Dataset` of global batches, the same on every worker, with its
    labels in it), and in the step replica r computes its contiguous slice
    by a plan variable. The shares partition each global batch, and the
    loss, gradients and logs stay one device's on it (global loss
    normalisation). Each replica times its forward and backward pass
    (`tf.timestamp`); the seconds ride in the gradients' all-reduce (no
    collective of their own), and every `replan_every` steps (default 20,
    at the end of an execution; the first execution's timings dropped as
    warm-up) the shares are re-planned from the seconds per example, a
    moving average over those windows, when that predicts a step at least
    `min_gain` (5%) shorter (`tfdp.training.balanced_batches`). Every
    worker plans from the same sums, so the plan changes at the same step
    everywhere. On one replica it does nothing (so one script runs on one
    device and on many); it needs `accum_steps=1`, `sync_every=1`, no
    `outer_optimizer`, no compression or `all_reduce_dtype`, no
    `shard_optimizer_state`, `nonfinite` set and `jit_compile=False`
    (`tfdp.training.option_rules` refuses the others by name). The plan is
    not checkpointed: a resumed run starts equal and re-plans.

    **Non-finite steps.** With `nonfinite="skip"` (the default) the optimizer
    is wrapped (`tfdp.training.nonfinite.NonFiniteGuard`, or
    `NonFiniteLossScaleOptimizer` under `mixed_float16`): a step whose
    gradients (with `accum_steps > 1`, also loss) hold a NaN or Inf on any
    replica is skipped by every replica and worker alike, leaving weights,
    slots and `model.optimizer.iterations` unchanged, and counted in
    `model.optimizer.skipped_steps` (checkpointed with the optimizer). After
    `max_consecutive_nonfinite` in a row, `fit` raises
    `tfdp.training.nonfinite.NonFiniteError` (with local steps, where each
    replica skips on its own, on every worker after the synchronisation that
    carried the stop). `"raise"` raises at the first (never
    applying it); `None` keeps Keras' behaviour (under `mixed_float16`:
    overflowing steps skipped as Keras' loss scaling does, with no limit, and
    counted in `skipped_steps`). Keras still logs the loss of
    a skipped step (NaN) in the epoch's mean, what the forward pass updates
    (BatchNormalization moving statistics) is not undone, and
    `BackupAndRestore` counts it as a step (its position is in batches).

    Args:
        model: the Keras model.
        optimizer: a Keras optimizer instance or name. Must not set Keras'
            own `gradient_accumulation_steps` (use `accum_steps`).
        loss: the loss, as for `model.compile`.
        metrics: metrics, as for `model.compile`. Defaults to `None`.
        accum_steps: micro-batches per optimizer step; a replica's batch
            must be a multiple of it. Defaults to 1 (plain Keras train step).
        steps_per_execution: optimizer steps per `tf.function` call. Defaults
            to 1.
        jit_compile: compile the train step with XLA. Defaults to `False`.
        nonfinite: `"skip"`, `"raise"` or `None` (see above). Defaults to
            `"skip"`.
        max_consecutive_nonfinite: with `"skip"`, stop after this many
            skipped steps in a row. Defaults to 10.
        all_reduce_dtype: `None` (default) sums gradients over replicas in
            their own dtype; `"bfloat16"` all-reduces half the bytes, each
            sum rounded to about 3 significant digits (`tfdp.distribute.reduction`).
            Not with `nonfinite=None`.
        loss_normalization: `"global"` (default) or `"per_replica"` (see
            above).
        gradient_compression: `None` (default): gradients are all-reduced
            as they are; `"bfloat16"`: summed in bfloat16 (the same as
            `all_reduce_dtype="bfloat16"`); `tfdp.compression.PowerSGD(...)`
            or `tfdp.compression.TopK(...)`: compressed with per-replica
            error feedback (see the README's communication section),
            sending in `all_reduce_dtype`. A compressor acts only with more
            than one replica and needs `nonfinite` set.
        sync_every: with more than 1, local SGD: each replica applies its
            own gradients (of its own share of the batch, its loss
            normalised by its own counts) with no gradient all-reduce, and
            the replicas' weights are averaged every `sync_every` optimizer
            steps and at the end of every epoch (one all-reduce of the
            weights; `tfdp.distribute.local_sync`). Evaluation and
            checkpoints at epoch ends see the synchronised weights;
            `tfdp.callbacks.BackupAndRestore(save_freq=<steps>)` saves every
            replica's weights mid-window without synchronising them (the
            trajectory is that of a run without saves), and Keras'
            `ModelCheckpoint` / `BackupAndRestore` with `save_freq=<steps>`
            are refused (`tfdp.training.keras_savers`).
            Defaults to 1: synchronous training.
        outer_optimizer: `None` (default), or a Keras optimizer for
            DiLoCo's outer step at each synchronisation (e.g.
            `keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)`, the
            paper's). Not with
            `gradient_compression`.
        overlap_sync: with True (and local steps: `sync_every > 1` or an
            `outer_optimizer`), each window's all-reduce runs in a
            background thread while the next window computes, and is
            applied one window late, each replica keeping its progress since
            (`tfdp.distribute.overlapped_sync`). Needs `steps_per_execution` dividing
            `sync_every`. Defaults to False.
        shard_optimizer_state: with True, ZeRO-1: each replica keeps the
            optimizer's slots (momentum, Adam's moments) for its 1/N share of
            every weight only, updates that share after the gradient all-reduce
            and all-gathers the updated weights
            (`tfdp.distribute.optimizer_sharding`). Needs an element-wise
            optimizer (not LARS, LAMB, clipnorm, use_ema) and `nonfinite` set;
            not with `sync_every > 1`. Defaults to False.
        balance_batches: `False` (default), `True` (default
            `BalanceOptions`), or a
            `tfdp.training.balanced_batches.BalanceOptions` (its
            `replan_every`, a fixed or first plan `shares`, `smoothing`,
            `min_gain`). See "Balanced batches" above.
        bucket_cap_mb: `None` (default): the gradients are all-reduced once
            the backward pass has made them all. A number: PyTorch DDP's
            gradient buckets, last layers first, of at most this many MiB
            (the first at most 1 MiB); each bucket is all-reduced as soon as
            its gradients exist, while the backward pass goes on
            (`tfdp.training.exchanges.bucketed`; DDP's default is 25). The
            same sums, so the same result. Not with `gradient_compression`,
            local steps or `shard_optimizer_state`; needs `nonfinite` set.
        **compile_kwargs: passed on to `model.compile` (e.g. `loss_weights`).

    Returns:
        `model`, compiled.

    Raises:
        ValueError: `accum_steps` or `steps_per_execution` is not a positive
            integer, `nonfinite` or `max_consecutive_nonfinite` is invalid,
            two options cannot be combined (`tfdp.training.option_rules`
            names both and what to use instead),
            the optimizer sets `gradient_accumulation_steps`, or
            `jit_compile=True` under a strategy where XLA cannot run (see
            `tfdp.distribute.devices.check_jit_compile_supported`), a
            `Loss` has `reduction=None`, or the model overrides `train_step`
            or `compute_loss` where tfdp's steps must replace them (the
            message says what to write instead).
    """
    strategy_info_lib.check_synchronous(model.distribute_strategy, "tfdp.compile")
    _checks.check_int("accum_steps", accum_steps, hint=" (1 means no accumulation)")
    steps_per_execution = _checks.check_int("steps_per_execution", steps_per_execution)
    all_reduce_dtype, compressor = compression.resolve(gradient_compression, all_reduce_dtype)
    local_sync_lib.check_sync_every(sync_every)
    local_sync_lib.check_overlap(overlap_sync)
    nonfinite_lib.check_values(nonfinite, max_consecutive_nonfinite, all_reduce_dtype,
                               compressor, shard_optimizer_state)
    bucketed.check_bucket_cap_mb(bucket_cap_mb)
    loss_scaling = model.dtype_policy.name == "mixed_float16" and compile_kwargs.get(
        "auto_scale_loss", True
    )
    balance = balanced_batches.options_of(balance_batches)
    # On one replica there is nothing to balance: it does nothing.
    balancing = balance is not None and model.distribute_strategy.num_replicas_in_sync > 1
    # Every pair of options, before anything is built (tfdp.training.option_rules).
    option_rules.check(option_rules.TrainingOptions(
        nonfinite=nonfinite, all_reduce_dtype=all_reduce_dtype, compressor=compressor,
        sync_every=sync_every, outer_optimizer=outer_optimizer, overlap_sync=overlap_sync,
        shard_optimizer_state=shard_optimizer_state, accum_steps=accum_steps,
        steps_per_execution=steps_per_execution, loss_scaling=loss_scaling,
        jit_compile=jit_compile, optimizer=optimizer, balance_batches=balancing,
        bucket_cap_mb=bucket_cap_mb))
    local_sync = local_sync_lib.from_arguments(sync_every, outer_optimizer, overlap_sync)
    norm_lib.check_mode(loss_normalization)
    norm_lib.check_loss(loss)
    tfdp_steps = _check_model(model, loss_normalization, accum_steps, local_sync is not None)
    if balancing:
        balanced_batches.check_loss_normalization(loss_normalization)
    keras_loss_terms.warn_if_unsupported()
    if jit_compile:
        devices.check_jit_compile_supported(model.distribute_strategy)
    shard_layout.check_sharded_exchange(
        model.distribute_strategy, shard_optimizer_state=shard_optimizer_state,
        compressor=compressor, all_reduce_dtype=all_reduce_dtype)
    keras_accumulation = getattr(optimizer, "gradient_accumulation_steps", None)
    if keras_accumulation:
        raise ValueError(
            "The optimizer sets Keras' own `gradient_accumulation_steps="
            f"{keras_accumulation}`, which fails under tf.distribute strategies "
            "(keras-team/keras#20582). Remove it from the optimizer and pass "
            f"accum_steps={keras_accumulation} to tfdp.compile instead."
        )
    if loss_scaling or nonfinite is not None:
        # Under mixed_float16, what Keras' compile would do, with replicas
        # that agree on skipping an overflowing step: the decision is taken
        # from the all-reduced scaled gradients (tfdp.training.nonfinite).
        optimizer = nonfinite_lib.wrap_optimizer(
            optimizer, nonfinite=nonfinite, max_consecutive_nonfinite=max_consecutive_nonfinite,
            loss_scaling=loss_scaling, all_reduce_dtype=all_reduce_dtype,
            compressor=compressor, local_sync=local_sync,
            shard_optimizer_state=shard_optimizer_state, bucket_cap_mb=bucket_cap_mb,
        )
    model.compile(
        optimizer=optimizer,
        loss=loss,
        metrics=metrics,
        steps_per_execution=steps_per_execution,
        jit_compile=jit_compile,
        **compile_kwargs,
    )
    for name in (("train_step", "test_step") + sync_points.METHODS + metric_reads.METHODS
                 + gc_freeze.METHODS):
        if name in vars(model):
            delattr(model, name)  # an earlier tfdp.compile's
    # The plan, the timings and the planner (per-replica shares of each global batch).
    model.tfdp_balanced_batches = (
        balanced_batches.BalancedBatches(model.distribute_strategy, balance)
        if balancing else None)
    if tfdp_steps:
        # Instance attributes shadow Model.train_step / test_step; Keras looks
        # them up on the instance each time it builds its functions.
        num_replicas = model.distribute_strategy.num_replicas_in_sync
        model.train_step = functools.partial(
            fit_train_step, model,
            train_step_lib.train_normalizer(loss_normalization, num_replicas, accum_steps,
                                           local_sync is not None),
            accum_steps, balance=model.tfdp_balanced_batches,
        )
        if not _overrides(model, "test_step"):  # a class's own test_step runs as written
            model.test_step = functools.partial(
                fit_test_step, model, norm_lib.Normalizer(loss_normalization, num_replicas, 1)
            )
    # steps_per_execution > 1: fit and evaluate reduce the logs once per execution, not per step.
    keras_train_function.install(model, tfdp_step=tfdp_steps)
    if model.distribute_strategy.num_replicas_in_sync > 1:
        # No distributed iterator built after each pass only to be thrown away.
        keras_spare_iterator.install()
    monitor = None
    if nonfinite_lib.guard_of(model.optimizer) is not None:
        # After every execution: log skips, stop at the limit.
        monitor = step_monitor.install_fit_check(
            model, log=strategy_info_lib.strategy_info(model.distribute_strategy).is_chief
        )
    if local_sync is not None:
        sync_points.install_fit_sync(model, monitor)
    if isinstance(model.distribute_strategy, tf.distribute.MultiWorkerMirroredStrategy):
        # fit's validation passes share one distributed iterator where exact.
        model.evaluate = functools.partial(_evaluate_keeping_validation_iterator, model,
                                           model.evaluate)
    if keras_savers.has_state_they_lose(model.optimizer, model.distribute_strategy):
        # Keras' savers beside per-replica state: refused or warned about, by name.
        model.fit = functools.partial(_fit_checking_savers, model, model.fit)
    if balancing:
        # Every replica reads each global batch whole; the plan is re-planned between executions.
        model.fit = functools.partial(
            replicated_input.fit_balanced, model.tfdp_balanced_batches,
            strategy_info_lib.strategy_info(model.distribute_strategy).is_chief, model.fit)
    # Full garbage collections would stall every worker in turn (see gc_freeze).
    model.fit = functools.partial(gc_freeze.fit_with_frozen_heap, model.fit)
    for name in gc_freeze.CALL_METHODS:
        setattr(model, name, functools.partial(gc_freeze.call_with_frozen_heap,
                                               getattr(model, name)))
    # help(model.fit), inspect.signature and IDEs show Keras' own method, not a partial.
    for name in gc_freeze.METHODS:
        functools.update_wrapper(getattr(model, name), getattr(type(model), name).__get__(model),
                                 updated=())
    # One collective per metrics read in fit/evaluate, not one per variable.
    metric_reads.install(model)
    model.tfdp_accum_steps = accum_steps
    model.tfdp_loss_normalization = loss_normalization
    return model


def _fit_checking_savers(model, fit, *args, callbacks=None, **kwargs):
    """`fit`, after `keras_savers.check_fit_callbacks` looked at its callbacks."""
    keras_savers.check_fit_callbacks(
        model.optimizer, callbacks, num_replicas=model.distribute_strategy.num_replicas_in_sync)
    return fit(*args, callbacks=callbacks, **kwargs)
