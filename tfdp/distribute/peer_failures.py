"""Stuck and dead peers while training: a `PeerFailureError` that names the workers.

This module owns what a collective failure caused by another worker means: a
collective that times out (a stuck peer; it needs a collective timeout,
`make_strategy(timeout_seconds=...)`) or a peer that is gone (killed or
crashed: TensorFlow's heartbeat times out or the connection is reset; or it
was restarted and reconnected with a new incarnation) becomes a
`PeerFailureError` naming the workers and the fix (`explain_peer_failures`),
and which exit status a program should end with for it (`exit_code`):

- a lost peer (`PeerLostError`): `PEER_LOST_EXIT_CODE` (43). Running the
  whole job again can help (the peer was killed, preempted, OOM-killed), so
  schedulers retry it: `tfdp-launch tfjob-worker` reports it to the Kubeflow
  Training Operator as its retryable 138, and `tfdp-launch --max_restarts`
  restarts the group as after any failure.
- a stuck peer: 1. The peer is still there; restarting this worker does not
  unstick it, so it is not retried under `restartPolicy: ExitCode`.

A peer that fails with an error of its own exits with that error's status
(2 for a configuration error, 1 for a traceback): that worker's status is what
decides whether the job is retried. Failures while the workers start are
`tfdp.distribute.startup`'s.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping

import tensorflow as tf

from tfdp.distribute import cluster as cluster_lib
from tfdp.distribute import failure_text


#: Exit status of tfdp's programs when a collective failed because another
#: worker was lost (killed, crashed, restarted): retrying the job can help.
PEER_LOST_EXIT_CODE = 43
#: Exit status when another worker is stuck (a collective timed out).
PEER_STUCK_EXIT_CODE = 1

# TensorFlow's coordination service, when a task it knows reconnects as a new
# process: "... unexpectedly tried to connect with a different incarnation.
# It has likely restarted." (an AbortedError in the other workers' collectives).
_RESTARTED_PEER = "different incarnation"


class PeerFailureError(RuntimeError):
    """A collective failed because another worker is stuck, stopped or gone.

    Attributes:
        exit_code: the exit status a program should end with for it:
            `PEER_STUCK_EXIT_CODE` here, `PEER_LOST_EXIT_CODE` for a
            `PeerLostError`.
    """

    exit_code = PEER_STUCK_EXIT_CODE


class PeerLostError(PeerFailureError):
    """A collective failed because another worker is gone (killed, crashed or restarted)."""

    exit_code = PEER_LOST_EXIT_CODE


def peer_failure_message(
    error: BaseException, config: cluster_lib.ClusterConfig | None,
    collective_timeout: float | None = None,
) -> str | None:
    """What a collective's `DeadlineExceededError` / `UnavailableError` means, or None.

    An `AbortedError` that says a peer reconnected with a new incarnation (it
    was restarted) is explained too; other errors give None.

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
    if isinstance(error, tf.errors.AbortedError) and _RESTARTED_PEER in text:
        return (
            f"{who[0].upper() + who[1:]} was restarted while {here} trained (it reconnected "
            f"as a new process): it had crashed or been killed. This worker must start "
            f"again too; a run with a model_dir resumes from its last checkpoint "
            f"(`tfdp-launch --max_restarts N` and a TFJob's restartPolicy ExitCode do it for "
            f"you). (TensorFlow: {failure_text.summary(error)})"
        )
    return None


def is_lost_peer(error: BaseException) -> bool:
    """Whether a collective's error says a peer is gone (not merely stuck)."""
    return isinstance(error, tf.errors.UnavailableError) or (
        isinstance(error, tf.errors.AbortedError) and _RESTARTED_PEER in str(error))


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
        PeerLostError: from `UnavailableError` (a peer died or stopped: the
            heartbeat timed out, the connection was reset) or an
            `AbortedError` saying a peer reconnected as a new process.
        PeerFailureError: from `DeadlineExceededError` (a collective timed
            out: a stuck peer).
    """
    try:
        yield
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
            tf.errors.AbortedError) as error:
        message = peer_failure_message(error, job_cluster(environ), collective_timeout)
        if message is None:
            raise
        if is_lost_peer(error):
            raise PeerLostError(message) from error
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
