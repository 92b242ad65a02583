"""ZeRO-1: each replica keeps the optimizer state of its own share of every weight.

Data parallelism keeps a full copy of the optimizer's slots (momentum, Adam's
two moments: 1 to 2 times the model's size) on every replica. With
`shard_optimizer_state=True` (Rajbhandari et al. 2020, "ZeRO", stage 1)
each of the N replicas keeps them for 1/N of the parameters only:

- **layout**: every trainable variable is flattened, padded with zeros to a
  multiple of N, and cut into N equal chunks of ``S = ceil(size / N)``
  elements; replica r owns chunk r of every variable. Each variable is split
  on its own (not one flat buffer over all of them), so a replica's share is
  within one element per variable of the even 1/N, every slot of the
  unsharded optimizer has exactly one sharded counterpart, and the chunks of
  a variable keep its name (weight-decay exclusions by name still apply).
- **a step**: each replica's gradients are reduce-scattered: laid out as
  ``[N, S]`` per variable, sent row j to replica j by one all-to-all per
  bucket of variables, and summed over the rows received, so each replica
  gets only its chunk of the summed gradients
  (`reduce_scatter_gradients`); each replica copies its chunk of every
  weight into a *shard variable* of shape ``[S]``, lets the wrapped Keras
  optimizer update the shard variables with its own update rule and its
  sharded slots, and the replicas then all-gather the updated chunks (float32,
  exact) so that every replica holds the full weights again.
- **what it costs**: per step each replica sends and receives
  ``(N - 1) / N * 4 * P`` bytes for the reduce-scatter and as many for the
  all-gather of P float32 parameters: the bytes of the ring all-reduce that
  unsharded training makes (a ring all-reduce is a reduce-scatter followed by
  an all-gather). TensorFlow's own reduce-scatter
  (`CollectiveReduceScatterV2`) has no CPU implementation, so the exchange is
  its all-to-all, through the strategy's collective launchers
  (`tfdp._upstream.collective_exchange`); on GPUs NCCL's reduce-scatter is
  used (not run here: no GPU). One more all-reduce of one float
  per step gives every replica the same non-finite verdict on the chunks.
  Where the gradients are compressed (`gradient_compression`,
  `all_reduce_dtype`), or the strategy has no collective launchers, the
  gradients are all-reduced as without sharding and each replica takes its
  slice: then the all-gather adds half again to the all-reduce's bytes.
  Memory per replica: the slots of P/N parameters plus the P/N shard
  variables, instead of the slots of P.

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
This module owns the layout, the shard variables and the gather;
`tfdp.training.nonfinite`'s wrappers call it around the inner optimizer's
`apply`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdp._upstream import collective_exchange
from tfdp.distribute import reduction
from tfdp.distribute import strategy_info as strategy_info_lib

#: Keras optimizers whose update needs a whole variable or more.
_WHOLE_VARIABLE = tuple(
    getattr(keras.optimizers, name)
    for name in ("Lamb", "Adafactor", "Muon")
    if hasattr(keras.optimizers, name)
)


#: Bytes of gathered weights one all-gather carries at most (a larger
#: variable takes one of its own): bounds the step's temporary buffers.
GATHER_BUCKET_BYTES = 32 * 2**20


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


class OptimizerSharding:
    """The chunks of every trainable variable that the replicas' optimizer states cover.

    Build it inside the strategy's scope (the wrapper's `build` does). With a
    single replica nothing is sharded: the inner optimizer is built on the
    variables themselves (`active` is False).
    """

    def __init__(self):
        self._strategy = None
        self.num_shards = None
        self.active = False
        self.shards: list = []
        self._variables: list = []
        self._index: dict = {}
        self._shard_index: dict = {}
        #: `[variables, 2]` float32, with `norm_terms` summed over replicas
        #: (for optimizers that take them; else None).
        self.terms = None
        self._scatters = None

    def __repr__(self) -> str:
        return f"OptimizerSharding(num_shards={self.num_shards})"

    def build(self, inner_optimizer: keras.optimizers.Optimizer, variables: Sequence) -> None:
        """Creates one shard variable per variable and builds `inner_optimizer` on them."""
        check_optimizer(inner_optimizer)
        self._variables = list(variables)
        self._strategy = tf.distribute.get_strategy()
        self.num_shards = self._strategy.num_replicas_in_sync
        self.active = self.num_shards > 1
        if not self.active:
            inner_optimizer.build(self._variables)
            return
        self._index = {id(v): i for i, v in enumerate(self._variables)}
        self.shards = [self._shard_variable(v) for v in self._variables]
        self._shard_index = {id(s): i for i, s in enumerate(self.shards)}
        inner_optimizer.build(self.shards)
        # `model.save()` saves the inner optimizer as an object of its own
        # (Keras' saving_lib walks every attribute), with Keras' methods,
        # which would write replica 0's chunks. Its own methods lay the state
        # out as without sharding, so a .keras file loads on any replica count.
        inner_optimizer.save_own_variables = self._save_inner_variables
        inner_optimizer.load_own_variables = self._load_inner_variables
        self._inner = inner_optimizer
        if takes_norm_terms(inner_optimizer):
            # Equal on every replica (set from one all-reduce); read by the
            # inner optimizer's update. Not an attribute it tracks: `self`
            # is a plain object, so no checkpoint holds it.
            self.terms = keras.Variable(tf.zeros([len(self.shards), 2]), trainable=False,
                                        name="summed_norm_terms", aggregation="none")
            inner_optimizer.summed_norm_terms = self

    def _shard_variable(self, variable):
        size = shard_size(_num_elements(variable), self.num_shards)
        *scopes, name = (getattr(variable, "path", None) or variable.name).split("/")
        # Not trainable, not tracked by any layer: a scratch copy of this
        # replica's chunk of `variable` (its value is taken from the weights at
        # every step), with the variable's path, so that exclusions by name
        # or path hold. aggregation="none": each replica's component holds its
        # own chunk.
        with contextlib.ExitStack() as stack:
            for scope in scopes:
                stack.enter_context(keras.name_scope(scope))
            return keras.Variable(tf.zeros([size], variable.dtype), trainable=False, name=name,
                                  aggregation="none")

    @property
    def variables(self) -> list:
        """The trainable variables whose optimizer state is sharded, in build order."""
        return list(self._variables)

    @property
    def shard_elements(self) -> int:
        """Elements of the chunks one replica covers (per slot kind), summed over variables."""
        return sum(int(s.shape[0]) for s in self.shards)

    def unsharded_state(self, optimizer) -> dict:
        """`{id(variable): value}` for `optimizer`'s variables, laid out as without sharding.

        A slot's chunks of every replica are put end to end and shaped like
        its weight; other variables (iterations, learning rate) are replica
        0's. What `model.save()` writes (`save_own_variables`), so a `.keras`
        file is the same with and without sharding and loads on any number
        of replicas.

        Raises:
            ValueError: the replicas are on several workers, whose chunks this
                worker does not hold.
        """
        self._check_one_worker("saved into a .keras file")
        owners = slot_variables(optimizer, len(self._variables))
        state = {}
        for variable, owner in zip(optimizer.variables, owners):
            copies = [np.asarray(keras.ops.convert_to_numpy(c)) for c in
                      self._strategy.experimental_local_results(_distributed(variable))]
            if owner is None or not self.active:
                state[id(variable)] = copies[0]
            else:
                weight = self._variables[owner]
                state[id(variable)] = repartition(copies, _num_elements(weight), 1)[0].reshape(
                    weight.shape)
        return state

    def load_unsharded_state(self, optimizer, state: dict) -> None:
        """Assigns `{id(variable): value}` laid out as without sharding: each replica takes its chunks."""
        self._check_one_worker("loaded from a .keras file")
        owners = slot_variables(optimizer, len(self._variables))
        for variable, owner in zip(optimizer.variables, owners):
            value = np.asarray(state[id(variable)])
            copies = self._strategy.experimental_local_results(_distributed(variable))
            if owner is None or not self.active:
                chunks = [value] * len(copies)
            else:
                weight = self._variables[owner]
                if value.size != _num_elements(weight):
                    raise ValueError(
                        f"The saved optimizer variable for {weight.path} has {value.size} "
                        f"elements; the weight has {_num_elements(weight)}. Load a file saved "
                        "from this model.")
                chunks = repartition([value], _num_elements(weight), self.num_shards)
            for copy, chunk in zip(copies, chunks):
                copy.assign(np.reshape(chunk, copy.shape))

    def _save_inner_variables(self, store) -> None:
        state = self.unsharded_state(self._inner)
        for i, variable in enumerate(self._inner.variables):
            store[str(i)] = state[id(variable)]

    def _load_inner_variables(self, store) -> None:
        variables = self._inner.variables
        if len(store.keys()) != len(variables):
            raise ValueError(
                f"The saved {type(self._inner).__name__} has {len(store.keys())} variables; "
                f"this one has {len(variables)}. Load a file saved with the same optimizer.")
        self.load_unsharded_state(self._inner, {id(v): store[str(i)]
                                                for i, v in enumerate(variables)})

    def _check_one_worker(self, what: str) -> None:
        workers = strategy_info_lib.strategy_info(self._strategy).num_workers
        if self.active and workers > 1:
            raise ValueError(
                f"An optimizer state sharded over {self.num_shards} replicas on {workers} "
                f"workers cannot be {what}: each worker holds its own replicas' chunks only. "
                "Keep it in tfdp's checkpoints instead (tfdp.Trainer(model_dir=...), "
                "tfdp.callbacks.BackupAndRestore, tfdp-train --model_dir), where every worker "
                "writes its chunks, or save the weights alone (model.save_weights).")

    def _chunk(self, context, tensor, variable):
        """This replica's `[S]` chunk of `tensor` (shaped like `variable`), zero-padded.

        Slices before padding, so only S elements are copied, never the
        whole tensor.
        """
        size = int(self.shards[self._index[id(variable)]].shape[0])
        flat = tf.reshape(tensor, [-1])
        start = tf.cast(context.replica_id_in_sync_group, tf.int32) * size
        chunk = flat[start:start + size]  # clamped at the end: shorter, or empty
        chunk = tf.pad(chunk, [[0, size - tf.shape(chunk)[0]]])
        return tf.ensure_shape(chunk, [size])

    def load_weights(self, context: tf.distribute.ReplicaContext) -> None:
        """Copies this replica's chunk of every weight into its shard variable (replica context)."""
        for variable, shard in zip(self._variables, self.shards):
            shard.assign(self._chunk(context, tf.identity(variable), variable))

    def shard_gradients(self, context, gradients, variables):
        """`(this replica's chunks of gradients, their shard variables)`, in the same order."""
        chunks, shards = [], []
        for gradient, variable in zip(gradients, variables):
            if isinstance(gradient, tf.IndexedSlices):
                gradient = tf.convert_to_tensor(gradient)
            chunks.append(self._chunk(context, gradient, variable))
            shards.append(self.shards[self._index[id(variable)]])
        return chunks, shards

    @property
    def scatters(self) -> bool:
        """Whether the gradients reach the replicas' chunks by reduce-scatter (else all-reduce and slice).

        True under a strategy with collective launchers for every replica
        (MultiWorkerMirroredStrategy, MirroredStrategy's collective ops):
        `reduce_scatter_gradients` then exchanges the chunks with an
        all-to-all (`tfdp._upstream.collective_exchange`).
        """
        if self._scatters is None:
            self._scatters = bool(self.active and collective_exchange.available(self._strategy))
        return self._scatters

    def reduce_scatter_gradients(self, context, gradients, variables):
        """`(this replica's chunks of the gradients summed over the replicas, their shard variables)`.

        The reduce-scatter of ZeRO: per bucket of variables (`_buckets`),
        each replica lays its gradients out as ``[N, sum S]`` (row j: its
        chunks for replica j, zero-padded as the layout pads), one all-to-all
        sends row j to replica j, and each replica sums the N rows it
        receives (on GPUs, NCCL's reduce-scatter does both:
        `tfdp._upstream.collective_exchange.reduce_scatter_sum`). Every
        replica sends and receives (N - 1) / N of its gradients' bytes, the
        bytes of the reduce-scatter half of a ring all-reduce; the whole
        summed gradient never exists on any replica.

        Args:
            context: the replica context.
            gradients: this replica's (unreduced) gradients, one per variable
                of `variables`.
            variables: trainable variables with a shard (any subset, any order).

        Returns:
            Lists in the order of `variables`.
        """
        given = {id(v): k for k, v in enumerate(variables)}
        chunks = [None] * len(variables)
        for bucket in self._buckets():
            members = [(i, given[id(self._variables[i])]) for i in bucket
                       if id(self._variables[i]) in given]
            if not members:
                continue
            rows = []
            for i, k in members:
                gradient = gradients[k]
                if isinstance(gradient, tf.IndexedSlices):
                    gradient = tf.convert_to_tensor(gradient)
                size = int(self.shards[i].shape[0])
                flat = tf.reshape(gradient, [-1])
                padding = self.num_shards * size - _num_elements(self._variables[i])
                padded = tf.pad(flat, [[0, padding]])
                rows.append(tf.reshape(padded, [self.num_shards, size]))
            summed = collective_exchange.reduce_scatter_sum(context, tf.concat(rows, axis=1))
            sizes = [int(self.shards[i].shape[0]) for i, _ in members]
            for (_, k), chunk in zip(members, tf.split(summed, sizes)):
                chunks[k] = chunk
        return chunks, [self.shards[self._index[id(v)]] for v in variables]

    def sum_norm_terms(self, context, optimizer, gradients, shards) -> None:
        """Sums the inner optimizer's `norm_terms` of every chunk over the replicas (one all-reduce).

        Args:
            context: the replica context.
            optimizer: the inner optimizer (`takes_norm_terms`).
            gradients: this replica's chunks of the gradients, as the inner
                optimizer will receive them (unscaled).
            shards: their shard variables.
        """
        indices = [[self._shard_index[id(s)]] for s in shards]
        local = tf.scatter_nd(indices, tf.stack([optimizer.norm_terms(g, s)
                                                 for g, s in zip(gradients, shards)]),
                              [len(self.shards), 2])
        (summed,) = reduction.all_reduce_sum(context, [local])
        self.terms.assign(summed)

    def _buckets(self) -> list[list[int]]:
        """Shard indices grouped for the all-gathers: one dtype, at most `GATHER_BUCKET_BYTES` each.

        Consecutive variables share a bucket (one collective) until it would
        hold more than the bound; a larger variable gets its own. Bounded so
        that the gathered buffer (N times the bucket) and the copies cut from
        it stay small beside the weights.
        """
        buckets, current, current_bytes, dtype = [], [], 0, None
        for index, shard in enumerate(self.shards):
            size = int(shard.shape[0]) * tf.as_dtype(shard.dtype).size * self.num_shards
            if current and (shard.dtype != dtype
                            or current_bytes + size > GATHER_BUCKET_BYTES):
                buckets.append(current)
                current, current_bytes = [], 0
            current.append(index)
            current_bytes += size
            dtype = shard.dtype
        if current:
            buckets.append(current)
        return buckets

    def gather_weights(self, context: tf.distribute.ReplicaContext) -> None:
        """All-gathers the updated chunks; every replica assigns the full weights (replica context).

        One all-gather per bucket (`_buckets`): the bucket's chunks are
        concatenated, gathered into ``[N, sum S]`` and cut back per variable.
        """
        for indices in self._buckets():
            # tf.identity: under MultiWorkerMirroredStrategy a converted
            # variable has no device, which collectives refuse.
            local = tf.concat([tf.identity(self.shards[i]) for i in indices], axis=0)
            gathered = tf.reshape(context.all_gather(local, axis=0), [self.num_shards, -1])
            sizes = [int(self.shards[i].shape[0]) for i in indices]
            for i, columns in zip(indices, tf.split(gathered, sizes, axis=1)):
                variable = self._variables[i]
                full = tf.reshape(columns, [-1])[: _num_elements(variable)]
                variable.assign(tf.reshape(full, variable.shape))


def _distributed(variable):
    # A Keras variable's tf.Variable (its `value`); a tf.Variable is itself.
    return variable.value if isinstance(variable, keras.Variable) else variable


def _num_elements(variable) -> int:
    return int(math.prod(variable.shape))
