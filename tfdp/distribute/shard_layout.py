"""The layout of sharded optimizer state (ZeRO-1): which optimizers it fits, and how it is cut again.

`tfdp.distribute.optimizer_sharding` shards the inner optimizer's slots over
the replicas during a step; this module owns what holds outside a step:
which optimizers can be sharded, and the state's layout in checkpoints and
`.keras` files.

An optimizer qualifies when its update of one element depends only on that
element (SGD, momentum, Adam, AdamW, Adamax, Nadam, RMSprop, Adagrad,
Adadelta, Ftrl, Lion), or when, like `tfdp.optimizers.LARS` and `LAMB`, it
needs only sums over a whole variable (their trust ratios' norms) and can
take them from its chunks: each replica computes its chunks' sums of squares
before the update, and one all-reduce of 2 floats per variable adds them up
(`takes_norm_terms`), so the result stays exact. An update that needs a
whole variable otherwise (Keras' own `Lamb`, Adafactor's and Muon's
row/column work), or all of them (`global_clipnorm`, `clipnorm`), or Keras'
moving averages (`use_ema`), is refused with the reason and the way out.

The slots of each replica differ, so they are per-replica state
(`tfdp.training.replica_state`): every worker writes its replicas' chunks
beside each checkpoint, and a resume loads them back. On another number of
replicas the chunks of all the old replicas are put end to end, the padding
dropped, and the result cut again for the new count (`repartition`): the
resumed state is the one an uninterrupted run on the old count had, exactly.
A `.keras` file (`model.save()`) holds the slots laid out as without sharding
(`unsharded_state`, `save_inner_variables`), so it loads on any number of
replicas (`load_unsharded_state`), on one worker (each worker holds only its
own replicas' chunks).
"""

from __future__ import annotations

import math
from typing import Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdp.distribute import strategy_info as strategy_info_lib

#: Keras optimizers whose update needs a whole variable or more.
_WHOLE_VARIABLE = tuple(
    getattr(keras.optimizers, name)
    for name in ("Lamb", "Adafactor", "Muon")
    if hasattr(keras.optimizers, name)
)


def check_optimizer(optimizer) -> None:
    """Raises ValueError when `optimizer`'s update cannot be split element-wise across replicas."""
    name = type(optimizer).__name__
    if takes_norm_terms(optimizer):
        if getattr(optimizer, "clipvalue", None):
            raise ValueError(
                f"shard_optimizer_state=True cannot apply {name}'s clipvalue: its trust ratio "
                "is computed from the unclipped gradients before the update. Drop clipvalue "
                "or shard_optimizer_state."
            )
    elif (isinstance(optimizer, _WHOLE_VARIABLE)
            or getattr(optimizer, "updates_whole_variables", False)):
        raise ValueError(
            f"shard_optimizer_state=True cannot shard {name}: its update of a variable "
            "needs that whole variable (a norm or a factorisation), which no replica holds "
            "the slots of. Train without shard_optimizer_state, or with an element-wise "
            "optimizer (SGD, Adam, AdamW, ...)."
        )
    for option in ("clipnorm", "global_clipnorm"):
        if getattr(optimizer, option, None):
            raise ValueError(
                f"shard_optimizer_state=True cannot apply {name}'s {option}: the norm would be "
                "taken over each replica's share of the gradients only. Drop "
                f"{option}, use clipvalue (per element), or train without "
                "shard_optimizer_state."
            )
    if getattr(optimizer, "use_ema", False):
        raise ValueError(
            f"shard_optimizer_state=True cannot keep {name}'s moving averages (use_ema): "
            "Keras keeps them per whole variable and overwrites the weights with them. "
            "Drop use_ema or shard_optimizer_state."
        )
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError(
            "shard_optimizer_state=True cannot shard Keras' own gradient accumulation; "
            "accumulate with tfdp (accum_steps) instead."
        )


def check_sharded_exchange(strategy: tf.distribute.Strategy, *, shard_optimizer_state: bool,
                           compressor, all_reduce_dtype) -> None:
    """`check_strategy` where ZeRO-1 will reduce-scatter: sharded state behind the plain exchange.

    For `tfdp.compile` and `tfdp.Trainer`, before anything is built. With a
    compressor or a 16-bit all-reduce the sharded exchange sums whole
    gradients by design (no reduce-scatter), so there is nothing to check.
    """
    if shard_optimizer_state and compressor is None and all_reduce_dtype is None:
        check_strategy(strategy)


def check_strategy(strategy: tf.distribute.Strategy) -> None:
    """Raises ValueError when ZeRO-1 could not reduce-scatter among `strategy`'s replicas.

    The reduce-scatter runs through the strategy's collective launchers
    (`tfdp._upstream.collective_exchange`): NCCL's reduce-scatter when every
    replica is on a GPU, an all-to-all elsewhere. MirroredStrategy has them
    on GPUs whatever its all-reduce (`NcclAllReduce` included) and on CPUs;
    MultiWorkerMirroredStrategy always. Without them (devices of two kinds,
    TensorFlow outside the known range) ZeRO-1 would all-reduce the whole
    gradients and slice them, half again the bytes: refused, never silently.
    A compressed exchange (`gradient_compression`, `all_reduce_dtype`) sums
    whole gradients by design and needs no check.
    """
    from tfdp._upstream import collective_exchange  # pylint: disable=import-outside-toplevel

    replicas = strategy.num_replicas_in_sync
    if replicas < 2 or collective_exchange.exchange_kind(strategy) is not None:
        return
    devices = tuple(strategy.extended.worker_devices)
    low, high = collective_exchange.KNOWN_TF_RANGE
    reason = (f"TensorFlow {tf.__version__} is outside {low[0]}.{low[1]} to {high[0]}.{high[1]}, "
              "whose collective launchers tfdp knows" if not collective_exchange.is_supported()
              else "it has no collective launchers for every replica (devices of two kinds?)")
    raise ValueError(
        f"shard_optimizer_state=True cannot reduce-scatter the gradients among the {replicas} "
        f"replicas of this {type(strategy).__name__} on {', '.join(devices)}: {reason}. It "
        "would all-reduce the whole gradients and slice them instead, half again the bytes. "
        "Use tfdp.make_strategy() (collective ops: NCCL's reduce-scatter on GPUs) on devices "
        "of one kind, or drop shard_optimizer_state, or pass gradient_compression='bfloat16' "
        "to shard behind an all-reduce on purpose.")


def takes_norm_terms(optimizer) -> bool:
    """Whether `optimizer` needs whole-variable norms and can take them summed over chunks.

    `tfdp.optimizers.LARS` and `LAMB` can: they say so with
    `updates_whole_variables` and give each chunk's sums of squares through
    `norm_terms(gradient, variable)` (float32 `[2]`), and read the sums over
    all chunks from `summed_norm_terms.terms[index]` in their update.
    """
    return bool(getattr(optimizer, "updates_whole_variables", False)
                and callable(getattr(optimizer, "norm_terms", None)))


def shard_size(num_elements: int, num_shards: int) -> int:
    """Elements of one replica's chunk of a variable of `num_elements` elements."""
    return max(1, math.ceil(num_elements / num_shards))


def repartition(chunks: Sequence[np.ndarray], num_elements: int, num_shards: int) -> np.ndarray:
    """The chunks of one slot cut again for `num_shards` replicas.

    Args:
        chunks: every old replica's chunk of the slot, in replica order
            (`replica_id_in_sync_group`), each `[ceil(num_elements / old N)]`.
        num_elements: elements of the variable the slot belongs to.
        num_shards: the new number of replicas.

    Returns:
        `[num_shards, shard_size(num_elements, num_shards)]`: row r is
        replica r's chunk, zero-padded at the end as `OptimizerSharding`
        pads. With one shard, row 0 holds the whole slot, flattened.
    """
    whole = np.concatenate([np.reshape(c, [-1]) for c in chunks])
    if whole.size < num_elements:
        raise ValueError(f"{len(chunks)} chunk(s) of {whole.size} elements in all cannot hold "
                         f"a slot of {num_elements} elements.")
    size = shard_size(num_elements, num_shards)
    cut = np.zeros([num_shards * size], whole.dtype)
    cut[:num_elements] = whole[:num_elements]
    return cut.reshape(num_shards, size)


def slot_variables(optimizer: keras.optimizers.Optimizer, num_variables: int) -> list:
    """For each of `optimizer.variables`: the index of the variable it is a slot of, or None.

    Which of an optimizer's variables belongs to which trainable variable is
    known only to its `build`, so this builds a fresh optimizer of the same
    class and configuration on `num_variables` stand-in vectors of sizes 1, 2,
    ..., and reads each slot's size: a slot of stand-in i has i + 1 elements;
    variables of rank 0 (iterations, learning rate) are no slot. `optimizer`
    must have been built on `num_variables` variables (its shard variables,
    or the weights themselves on one replica).

    Raises:
        ValueError: the probe's variables do not line up with `optimizer`'s.
    """
    probe = type(optimizer).from_config(optimizer.get_config())
    probe.build([keras.Variable(tf.zeros([i + 1]), trainable=False, name=f"probe_{i}")
                 for i in range(num_variables)])
    if len(probe.variables) != len(optimizer.variables):
        raise ValueError(
            f"{type(optimizer).__name__} built on {num_variables} variables has "
            f"{len(optimizer.variables)} variables, but {len(probe.variables)} when built again "
            "from its config: its state cannot be matched to the weights to re-partition it.")
    found = []
    for probe_variable, variable in zip(probe.variables, optimizer.variables):
        if len(probe_variable.shape) == 0:
            found.append(None)
        elif len(probe_variable.shape) == 1 and len(variable.shape) >= 1:
            found.append(int(probe_variable.shape[0]) - 1)
        else:
            raise ValueError(
                f"{type(optimizer).__name__}'s variable {variable.path} (shape "
                f"{tuple(variable.shape)}) is neither a scalar nor a slot of one weight: its "
                "state cannot be re-partitioned.")
    return found


def unsharded_state(sharding, optimizer) -> dict:
    """`{id(variable): value}` for `optimizer`'s variables (built on `sharding`'s chunks), laid out as without sharding.

    A slot's chunks of every replica are put end to end and shaped like
    its weight; other variables (iterations, learning rate) are replica
    0's. What `model.save()` writes (`save_own_variables`), so a `.keras`
    file is the same with and without sharding and loads on any number
    of replicas.

    Raises:
        ValueError: the replicas are on several workers, whose chunks this
            worker does not hold.
    """
    _check_one_worker(sharding, "saved into a .keras file")
    owners = slot_variables(optimizer, len(sharding.variables))
    state = {}
    for variable, owner in zip(optimizer.variables, owners):
        copies = [np.asarray(keras.ops.convert_to_numpy(c)) for c in
                  sharding.strategy.experimental_local_results(_distributed(variable))]
        if owner is None or not sharding.active:
            state[id(variable)] = copies[0]
        else:
            weight = sharding.variables[owner]
            state[id(variable)] = repartition(copies, _num_elements(weight), 1)[0].reshape(
                weight.shape)
    return state


def load_unsharded_state(sharding, optimizer, state: dict) -> None:
    """Assigns `{id(variable): value}` laid out as without sharding: each replica takes its chunks."""
    _check_one_worker(sharding, "loaded from a .keras file")
    owners = slot_variables(optimizer, len(sharding.variables))
    for variable, owner in zip(optimizer.variables, owners):
        value = np.asarray(state[id(variable)])
        copies = sharding.strategy.experimental_local_results(_distributed(variable))
        if owner is None or not sharding.active:
            chunks = [value] * len(copies)
        else:
            weight = sharding.variables[owner]
            if value.size != _num_elements(weight):
                raise ValueError(
                    f"The saved optimizer variable for {weight.path} has {value.size} "
                    f"elements; the weight has {_num_elements(weight)}. Load a file saved "
                    "from this model.")
            chunks = repartition([value], _num_elements(weight), sharding.num_shards)
        for copy, chunk in zip(copies, chunks):
            copy.assign(np.reshape(chunk, copy.shape))


def save_inner_variables(sharding, optimizer, store) -> None:
    """`optimizer.save_own_variables` under sharding: its state laid out as unsharded."""
    state = unsharded_state(sharding, optimizer)
    for i, variable in enumerate(optimizer.variables):
        store[str(i)] = state[id(variable)]


def load_inner_variables(sharding, optimizer, store) -> None:
    """`optimizer.load_own_variables` under sharding: each replica takes its chunks."""
    variables = optimizer.variables
    if len(store.keys()) != len(variables):
        raise ValueError(
            f"The saved {type(optimizer).__name__} has {len(store.keys())} variables; "
            f"this one has {len(variables)}. Load a file saved with the same optimizer.")
    load_unsharded_state(sharding, optimizer, {id(v): store[str(i)]
                                            for i, v in enumerate(variables)})


def _check_one_worker(sharding, what: str) -> None:
    workers = strategy_info_lib.strategy_info(sharding.strategy).num_workers
    if sharding.active and workers > 1:
        raise ValueError(
            f"An optimizer state sharded over {sharding.num_shards} replicas on {workers} "
            f"workers cannot be {what}: each worker holds its own replicas' chunks only. "
            "Keep it in tfdp's checkpoints instead (tfdp.Trainer(model_dir=...), "
            "tfdp.callbacks.BackupAndRestore, tfdp-train --model_dir), where every worker "
            "writes its chunks, or save the weights alone (model.save_weights).")


def _distributed(variable):
    # A Keras variable's tf.Variable (its `value`); a tf.Variable is itself.
    return variable.value if isinstance(variable, keras.Variable) else variable


def _num_elements(variable) -> int:
    return int(math.prod(variable.shape))
