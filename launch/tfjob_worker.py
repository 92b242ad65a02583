"""One TFJob worker container's entry point: `tfdp-launch tfjob-worker -- COMMAND`.

This module owns what a tfdp worker's exit status means to the Kubeflow
Training Operator. Under a TFJob's `restartPolicy: ExitCode` the operator
re-creates a failed worker pod only when its container's exit code is one of
the operator's retryable codes (`IsRetryableExitCode` in the operator's
`pkg/util/train/train_util.go`): 130, 137, 143 (SIGINT, SIGKILL, SIGTERM) and
138, which the operator reserves for "user-defined retryable"; every other
code fails the job for good. tfdp's codes map onto that as follows:

| worker exits | means                                   | container exits | operator   |
|--------------|-----------------------------------------|-----------------|------------|
| 0            | done                                    | 0               | succeeded  |
| 2            | configuration error (`tfdp-train` flags)| 2               | permanent  |
| 42           | preempted: SIGTERM, saved, exited       | 138             | retryable  |
| 43           | a peer was lost: another worker was     | 138             | retryable  |
|              | killed, crashed or restarted            |                 |            |
| 128+N        | killed by signal N (137 SIGKILL/OOM,    | 128+N           | 130/137/143|
|              | 143 SIGTERM)                            |                 | retryable  |
| other (1...) | an error (traceback; a stuck peer, i.e. | unchanged       | permanent  |
|              | a collective timeout)                   |                 |            |

So when one worker pod is killed (137) the others, whose collectives then
fail, exit 43 (`tfdp.distribute.peer_failures.PEER_LOST_EXIT_CODE`; within
about 10 s, TensorFlow's heartbeat) and are re-created too: the whole job
starts again and resumes from its `--model_dir`. A worker that fails with an
error of its own (1, 2) still fails the job: the operator marks the job
failed when any replica fails with a permanent code, whatever its peers
exit with. tfdp's own programs (`tfdp-train`, `tfdp-predict`) exit 43 for
a lost peer; a program of your own does so by running its training inside
`tfdp.distribute.peer_failures.explain_peer_failures()` and exiting with
the `PeerFailureError`'s `exit_code`.

`run` starts COMMAND as a child (the container's PID 1 stays this process),
forwards SIGTERM and SIGINT to it (the kubelet signals PID 1 only: without
this, a pod's deletion would never reach the worker's save-on-SIGTERM), waits
for it, and exits with the mapped code. What the TFJob looks like is
`tfdp.launch.k8s`'s; the preemption save itself is `tfdp.distribute.preemption`'s.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Sequence

from tfdp.launch import _checks
from tfdp.launch.signals import SignalCatcher

#: tfdp's exit status after a SIGTERM-triggered save (`tfdp.distribute.preemption`).
PREEMPTION_EXIT_CODE = 42
#: tfdp's exit status after losing a peer worker
#: (`tfdp.distribute.peer_failures.PEER_LOST_EXIT_CODE`; not imported: no TensorFlow here).
PEER_LOST_EXIT_CODE = 43
#: tfdp's exit status for invalid flags or configuration: retrying cannot help.
CONFIG_ERROR_EXIT_CODE = 2
#: tfdp's exit codes reported to the operator as `OPERATOR_USER_RETRYABLE`.
TFDP_RETRYABLE = frozenset({PREEMPTION_EXIT_CODE, PEER_LOST_EXIT_CODE})
#: The Training Operator's exit code for "user-defined retryable" (128 + SIGUSR1).
OPERATOR_USER_RETRYABLE = 138
#: Exit codes the operator retries under `restartPolicy: ExitCode`.
OPERATOR_RETRYABLE = frozenset({130, 137, 138, 143})
#: The TFJob replica restart policies, and whether each restarts a worker at all.
RESTART_POLICIES = ("ExitCode", "OnFailure", "Never", "Always")


def container_exit_code(returncode: int) -> int:
    """The container's exit code for a worker's `Popen.returncode`.

    42 (preempted and saved) and 43 (a peer worker was lost) become
    `OPERATOR_USER_RETRYABLE`; death by signal N (a negative returncode)
    becomes 128 + N, as a shell reports it; every other code is kept.
    """
    if returncode < 0:
        return 128 - returncode
    if returncode in TFDP_RETRYABLE:
        return OPERATOR_USER_RETRYABLE
    return returncode


def operator_restarts(restart_policy: str, exit_code: int) -> bool:
    """Whether the Training Operator restarts a worker container that exited `exit_code`.

    Mirrors the operator (kubeflow/training-operator v1): `Always` restarts
    every exit, `OnFailure` every non-zero exit (the kubelet restarts the
    container in place, counted against `runPolicy.backoffLimit`), `Never`
    none, and `ExitCode` only `OPERATOR_RETRYABLE` codes (the pod is
    re-created; not counted against `backoffLimit`).
    """
    _checks.check_choice("restart_policy", restart_policy, RESTART_POLICIES)
    if restart_policy == "Always":
        return True
    if restart_policy == "Never" or exit_code == 0:
        return False
    if restart_policy == "OnFailure":
        return True
    return exit_code in OPERATOR_RETRYABLE


def run(command: Sequence[str]) -> int:
    """Runs `command` as this container's worker; returns the container's exit code.

    SIGTERM and SIGINT received while it runs are forwarded to it (every
    one of them: a second SIGTERM reaches the worker too). 127 or 126 when
    the program cannot be started, with a message on stderr.
    """
    command = _checks.check_command(
        command, example="tfdp-launch tfjob-worker -- tfdp-train --model_dir /workspace/run")
    with SignalCatcher() as signals:
        try:
            child = subprocess.Popen(list(command), stdin=subprocess.DEVNULL)
        except OSError as e:
            print(f"[tfjob-worker] cannot start {command[0]!r}: {e}", file=sys.stderr)
            return 127 if isinstance(e, FileNotFoundError) else 126
        forwarded = 0
        while True:
            try:
                returncode = child.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            while forwarded < signals.count:
                child.send_signal(signals.received[forwarded])
                forwarded += 1
    code = container_exit_code(returncode)
    if code != returncode:
        if returncode < 0:
            what = f"was killed by {_signal_name(-returncode)}"
        elif returncode == PREEMPTION_EXIT_CODE:
            what = f"was preempted and saved its state (exit {returncode})"
        else:
            what = f"lost a peer worker (exit {returncode})"
        verdict = ("re-creates the pod" if code in OPERATOR_RETRYABLE
                   else "fails the job (not a retryable code)")
        print(f"[tfjob-worker] the worker {what}; exiting {code}: a TFJob with "
              f"restartPolicy ExitCode {verdict}", file=sys.stderr)
    return code


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
