"""Stuck and dead peers while training: a `PeerFailureError` that names the workers.

This module owns what a collective failure caused by another worker means: a
collective that times out (a stuck peer; it needs a collective timeout,
`make_strategy(timeout_seconds=...)`) or a peer that stops answering (killed
or stopped; TensorFlow's heartbeat) becomes a `PeerFailureError` naming the
workers and the fix (`explain_peer_failures`). Failures while the workers
start are `tfdp.distribute.startup`'s.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping

import tensorflow as tf

from tfdp.distribute import cluster as cluster_lib
from tfdp.distribute import failure_text


class PeerFailureError(RuntimeError):
    """A collective failed because another worker is stuck, stopped or gone."""


def peer_failure_message(
    error: BaseException, config: cluster_lib.ClusterConfig | None,
    collective_timeout: float | None = None,
) -> str | None:
    """What a collective's `DeadlineExceededError` / `UnavailableError` means, or None.

    Args:
        error: the TensorFlow error.
        config: this job's cluster; `None` (one process) returns None.
        collective_timeout: the strategy's collective timeout in seconds, for
            the message. Defaults to `None`.
    """
    if config is None or config.num_workers < 2:
        return None
    text = str(error)
    me = (config.task_type, config.task_index)
    named = [t for t in failure_text.tasks_in(text, config) if t != me]
    who = ", ".join(failure_text.worker_name(config, *t) for t in named) or "another worker"
    here = failure_text.worker_name(config, *me)
    if isinstance(error, tf.errors.DeadlineExceededError):
        limit = f" within {collective_timeout:g} s" if collective_timeout else " in time"
        return (
            f"A collective across the workers did not finish{limit} on {here}: "
            f"{who} is stuck, stopped or far slower (a hang, a SIGSTOP, a much slower "
            f"input pipeline). Look at the other "
            f"workers' output for the cause. If steps legitimately take longer, raise the "
            f"collective timeout (make_strategy(timeout_seconds=...), --collective_timeout). "
            f"(TensorFlow: {failure_text.summary(error)})"
        )
    if isinstance(error, tf.errors.UnavailableError):
        return (
            f"{who[0].upper() + who[1:]} stopped answering while {here} trained: it crashed, was killed or stopped (TensorFlow's heartbeat "
            f"timed out). Look at that worker's output for the cause, then start the job "
            f"again (`tfdp-launch --max_restarts N` does it for you; a run with a "
            f"model_dir resumes from its last checkpoint). (TensorFlow: {failure_text.summary(error)})"
        )
    return None


@contextlib.contextmanager
def explain_peer_failures(
    *, collective_timeout: float | None = None, environ: Mapping[str, str] | None = None
) -> Iterator[None]:
    """Turns collective failures caused by other workers into a `PeerFailureError`.

    Wrap a multi-worker training run in it (e.g. `tfdp-train`'s call of
    `train_and_evaluate`). Outside a multi-worker job, errors pass through.

    Args:
        collective_timeout: the collective timeout in seconds (for the message).
        environ: the environment holding TF_CONFIG or Slurm's variables.
            Defaults to `os.environ`.

    Raises:
        PeerFailureError: from `DeadlineExceededError` (a collective timed
            out: a stuck peer) or `UnavailableError` (a peer died or stopped).
    """
    try:
        yield
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError) as error:
        message = peer_failure_message(error, job_cluster(environ), collective_timeout)
        if message is None:
            raise
        raise PeerFailureError(message) from error


def job_cluster(environ: Mapping[str, str] | None = None) -> cluster_lib.ClusterConfig | None:
    """This job's cluster: TF_CONFIG, else a Slurm job step of several tasks, else None."""
    from tfdp.distribute import slurm_env

    environ = os.environ if environ is None else environ
    config = cluster_lib.parse_tf_config(environ=environ)
    if config is None:
        config = slurm_env.cluster_config(environ)
        if config is not None and config.num_workers < 2:
            config = None
    return config
