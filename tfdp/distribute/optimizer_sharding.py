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
- **a step**: each replica's gradients are reduce-scattered, so it gets only
  its chunk of every summed gradient (`reduce_scatter_gradients`); it
  copies its chunk of every weight into a *shard variable* of shape ``[S]``,
  the wrapped Keras optimizer updates the shard variables with its own rule
  and its sharded slots, and the replicas all-gather the updated chunks
  (float32, exact) so that every replica holds the full weights again.
- **what it costs**: per step each replica sends and receives
  ``(N - 1) / N * 4 * P`` bytes for the reduce-scatter and as many for the
  all-gather of P float32 parameters: the bytes of a ring all-reduce
  (a reduce-scatter followed by an all-gather), plus one all-reduce of one
  float for the non-finite verdict. The reduce-scatter goes through the
  strategy's collective launchers (`tfdp._upstream.collective_exchange`):
  NCCL's reduce-scatter when every replica is on a GPU (not run here: no
  GPU), an all-to-all elsewhere (TensorFlow's reduce-scatter has no CPU
  implementation). A strategy without them is refused
  (`shard_layout.check_strategy`). Where the gradients are compressed
  (`gradient_compression`, `all_reduce_dtype`), they are all-reduced as
  without sharding and each replica takes its slice: the all-gather then
  adds half again to the all-reduce's bytes. Memory per replica: the slots
  of P/N parameters plus the P/N shard variables, instead of the slots of P.

Which optimizers qualify (an element-wise update, or LARS/LAMB's norms
summed over chunks), how the chunks are cut again for another number of
replicas and how a `.keras` file holds them: `tfdp.distribute.shard_layout`.
This module owns the shard variables and the step's collectives (the
reduce-scatter, the norm terms, the gather); the sharded exchange
(`tfdp.training.exchanges.sharded`) calls it around the inner optimizer's
`apply`.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Sequence

import keras
import tensorflow as tf

from tfdp._upstream import collective_exchange
from tfdp.distribute import reduction
from tfdp.distribute import shard_layout
from tfdp.distribute.shard_layout import check_optimizer, shard_size, takes_norm_terms

#: Bytes of gathered weights one all-gather carries at most (a larger
#: variable takes one of its own): bounds the step's temporary buffers.
GATHER_BUCKET_BYTES = 32 * 2**20


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
        inner_optimizer.save_own_variables = functools.partial(
            shard_layout.save_inner_variables, self, inner_optimizer)
        inner_optimizer.load_own_variables = functools.partial(
            shard_layout.load_inner_variables, self, inner_optimizer)
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
    def strategy(self) -> tf.distribute.Strategy:
        """The strategy it was built under."""
        return self._strategy

    @property
    def variables(self) -> list:
        """The trainable variables whose optimizer state is sharded, in build order."""
        return list(self._variables)

    @property
    def shard_elements(self) -> int:
        """Elements of the chunks one replica covers (per slot kind), summed over variables."""
        return sum(int(s.shape[0]) for s in self.shards)

    def unsharded_state(self, optimizer) -> dict:
        """`optimizer`'s state laid out as without sharding (`shard_layout.unsharded_state`)."""
        return shard_layout.unsharded_state(self, optimizer)

    def load_unsharded_state(self, optimizer, state: dict) -> None:
        """Assigns state laid out as without sharding (`shard_layout.load_unsharded_state`)."""
        shard_layout.load_unsharded_state(self, optimizer, state)

    def _chunk(self, context, tensor, variable):
        """This replica's `[S]` chunk of `tensor` (shaped like `variable`), zero-padded (S elements copied)."""
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
        """Whether the strategy's collective launchers can reduce-scatter (`shard_layout.check_strategy`)."""
        return bool(self.active and collective_exchange.available(self._strategy))

    def reduce_scatter_gradients(self, context, gradients, variables, divisor=None):
        """This replica's chunks of the gradients summed over the replicas (the reduce-scatter of ZeRO).

        Per bucket of variables (`_buckets`), each replica lays its gradients
        out as ``[N, sum S]`` (row j: its chunks for replica j, zero-padded)
        and receives the replicas' rows `replica_id_in_sync_group` summed
        (`tfdp._upstream.collective_exchange.reduce_scatter_sum`): (N - 1) / N
        of its gradients' bytes each way; no replica holds a whole sum.

        Args:
            context: the replica context.
            gradients: this replica's (unreduced) gradients, one per variable
                of `variables`.
            variables: trainable variables with a shard (any subset, any order).
            divisor: None, or a float32 `[1]` tensor to sum over the replicas
                too: it rides as one more column of every row of the first
                float32 bucket (its own all-reduce only when none is float32).

        Returns:
            `(chunks, shard variables, summed divisor or None)`, the lists in
            the order of `variables`.
        """
        given = {id(v): k for k, v in enumerate(variables)}
        chunks, summed_divisor = [None] * len(variables), None
        for bucket in self._buckets():
            members = [(i, given[id(self._variables[i])]) for i in bucket
                       if id(self._variables[i]) in given]
            if not members:
                continue
            rows = [self._rows(gradients[k], i) for i, k in members]
            sizes = [int(self.shards[i].shape[0]) for i, _ in members]
            if divisor is not None and summed_divisor is None and rows[0].dtype == tf.float32:
                rows.append(tf.tile(tf.reshape(divisor, [1, 1]), [self.num_shards, 1]))
                sizes.append(1)
            parts = tf.split(collective_exchange.reduce_scatter_sum(
                context, tf.concat(rows, axis=1)), sizes)
            if len(parts) > len(members):
                summed_divisor = parts.pop()
            for (_, k), chunk in zip(members, parts):
                chunks[k] = chunk
        if divisor is not None and summed_divisor is None:
            (summed_divisor,) = reduction.all_reduce_sum(context, [divisor])
        return chunks, [self.shards[self._index[id(v)]] for v in variables], summed_divisor

    def _rows(self, gradient, index: int):
        """`gradient` of variable `index`, flattened, zero-padded and laid out as ``[N, S]``."""
        if isinstance(gradient, tf.IndexedSlices):
            gradient = tf.convert_to_tensor(gradient)
        size = int(self.shards[index].shape[0])
        padding = self.num_shards * size - _num_elements(self._variables[index])
        return tf.reshape(tf.pad(tf.reshape(gradient, [-1]), [[0, padding]]),
                          [self.num_shards, size])

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


def _num_elements(variable) -> int:
    return int(math.prod(variable.shape))
