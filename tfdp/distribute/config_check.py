"""The same configuration on every worker, checked with one small all-gather.

This module owns `check_same_config`: workers started with different
configurations (model, batch, seed, ...) are refused, on every worker, by
comparing a digest of each worker's configuration (as a whole and per field)
gathered from every worker, instead of a hang or an obscure failure in the
first all-reduce, or silently wrong training with different seeds. What
the configuration holds is the caller's (`tfdp-train` passes its `RunConfig`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Mapping, Sequence

import numpy as np
import tensorflow as tf
from absl import logging

from tfdp.distribute import startup
from tfdp.distribute import strategy_info as strategy_info_lib

#: Configuration fields whose per-field digests are compared (to name the
#: fields that differ); a longer configuration is still compared as a whole.
MAX_NAMED_FIELDS = 64


class ConfigMismatchError(ValueError):
    """Workers of one job were started with different configurations."""


def _fields(config: Any, exclude: Sequence[str]) -> dict[str, str]:
    """Field name -> canonical JSON of its value, without `exclude`."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if not isinstance(config, Mapping):
        raise TypeError(
            "`config` must be a mapping (e.g. RunConfig.to_dict()) or a dataclass "
            f"instance. Received: config of type {type(config).__name__}"
        )
    unknown = [name for name in exclude if name not in config]
    if unknown:
        raise ValueError(
            f"`exclude` must name fields of `config`. Received unknown field(s) "
            f"{unknown}; fields are {sorted(config)}"
        )
    return {
        str(name): json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)
        for name, value in config.items()
        if name not in exclude
    }


def _pieces(text: str, count: int) -> list[int]:
    """The first `count` 32-bit pieces of sha256(`text`): exact in float64."""
    digest = hashlib.sha256(text.encode()).digest()
    return [int.from_bytes(digest[4 * i:4 * i + 4], "big") for i in range(count)]


# Layout of one worker's row: its index, the configuration's digest (128
# bits), the field count, a digest of the field names, then one 32-bit digest
# per field (sorted by name), padded with -1.
_DIGEST = slice(1, 5)
_NUM_FIELDS, _NAMES = 5, 6
_FIELDS_START = 7


def _row(worker_index: int, fields: Mapping[str, str]) -> np.ndarray:
    names = sorted(fields)
    canonical = json.dumps(fields, sort_keys=True)
    row = [float(worker_index), *_pieces(canonical, 4), float(len(names)),
           *_pieces("\n".join(names), 1)]
    row += [_pieces(f"{name}={fields[name]}", 1)[0] for name in names[:MAX_NAMED_FIELDS]]
    row += [-1.0] * (_FIELDS_START + MAX_NAMED_FIELDS - len(row))
    return np.asarray(row, dtype=np.float64)


def _all_gather_rows(strategy: tf.distribute.Strategy, row: np.ndarray,
                     timeout_seconds: float | None) -> np.ndarray:
    """Every replica's copy of its worker's `row`, gathered: [replicas, len(row)]."""
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout_seconds)

    @tf.function
    def gather():
        def replica_fn():
            value = tf.constant(row[np.newaxis, :], dtype=tf.float64)
            return tf.distribute.get_replica_context().all_gather(value, axis=0,
                                                                  options=options)
        return strategy.run(replica_fn)

    return strategy.experimental_local_results(gather())[0].numpy()


def config_digest(config: Any, *, exclude: Sequence[str] = ()) -> str:
    """The hex digest `check_same_config` compares (sha256 of the canonical JSON, 128 bits)."""
    pieces = _pieces(json.dumps(_fields(config, exclude), sort_keys=True), 4)
    return "".join(f"{p:08x}" for p in pieces)


def check_same_config(
    strategy: tf.distribute.Strategy,
    config: Any,
    *,
    exclude: Sequence[str] = (),
    timeout_seconds: float | None = None,
) -> str:
    """Raises on every worker when the workers' configurations differ.

    Every worker hashes a canonical JSON of `config` (per field, and as a
    whole), and one all-gather of a small float64 row per replica (about 70
    numbers) brings every worker's digests to every worker. Call it on every
    worker right after the strategy is built, before the first real
    collective: workers that build different models or batches otherwise
    hang or fail obscurely in the first all-reduce, and workers with
    different seeds train silently wrong. A single-worker strategy compares
    nothing (and runs no collective).

    Fields that may legitimately differ between workers go in `exclude`
    (`RunConfig` has none today; a per-node `data_dir` would be one).

    Args:
        strategy: the job's strategy; every worker must call this with it.
        config: a mapping of JSON-serialisable values (e.g.
            `RunConfig.to_dict()`) or a dataclass instance.
        exclude: field names left out of the comparison. Defaults to ().
        timeout_seconds: how long to wait for the other workers, in seconds.
            Defaults to `None`: the start-up timeout (`TFDP_STARTUP_TIMEOUT`,
            else 120 s).

    Returns:
        This worker's configuration digest (hex), equal on every worker.

    Raises:
        ConfigMismatchError: on every worker, naming the workers whose
            configuration differs from the chief's and the fields that
            differ (this worker's values of them).
        TypeError, ValueError: `config` is not a mapping or dataclass, or
            `exclude` names a field `config` does not have.
    """
    fields = _fields(config, exclude)
    digest = config_digest(config, exclude=exclude)
    info = strategy_info_lib.strategy_info(strategy)
    if info.num_workers < 2:
        return digest
    timeout = startup.resolve_startup_timeout(timeout_seconds)
    rows = _all_gather_rows(strategy, _row(info.worker_index, fields), timeout)
    by_worker = {int(row[0]): row for row in rows}
    chief = by_worker[0]
    differ = sorted(w for w, row in by_worker.items()
                    if not np.array_equal(row[_DIGEST], chief[_DIGEST]))
    if not differ:
        if info.is_chief:
            logging.info("tfdp: all %d workers run the same configuration (digest %s)",
                         info.num_workers, digest)
        return digest
    raise ConfigMismatchError(_mismatch_message(info, fields, by_worker, differ, digest))


def _differing_fields(fields: Mapping[str, str], a: np.ndarray, b: np.ndarray) -> list[str] | None:
    """Fields whose digests differ between rows `a` and `b`; None if the field names differ."""
    if a[_NUM_FIELDS] != b[_NUM_FIELDS] or a[_NAMES] != b[_NAMES]:
        return None
    names = sorted(fields)[:MAX_NAMED_FIELDS]
    return [name for i, name in enumerate(names)
            if a[_FIELDS_START + i] != b[_FIELDS_START + i]]


def _mismatch_message(info, fields, by_worker, differ, digest) -> str:
    me = info.worker_index
    chief = by_worker[0]
    parts = []
    for worker in differ:
        names = _differing_fields(fields, by_worker[worker], chief)
        if names is None:
            what = "its set of fields (are the workers running different tfdp versions?)"
        elif names:
            what = ", ".join(names)
        else:
            what = f"a field past the first {MAX_NAMED_FIELDS} compared by name"
        parts.append(f"worker {worker} differs from the chief (worker 0) in: {what}")
    reference = chief if me != 0 else by_worker[differ[0]]
    mine = _differing_fields(fields, by_worker[me], reference) or []
    values = ", ".join(f"{name}={fields[name]}" for name in mine)
    here = (f" This worker ({me}) has {values}." if values else "")
    fix = ("Start every worker with identical flags (the same command on each; only "
           "TF_CONFIG and the launcher's TFDP_* variables may differ), then run again."
           if info.is_chief else
           "Every worker must get the same flags as the chief (worker 0); see the chief's "
           "output.")
    return (
        f"The workers' configurations differ: {'; '.join(parts)}.{here} {fix} "
        f"(configuration digest here: {digest})"
    )
