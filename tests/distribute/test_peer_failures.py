"""Tests for tfdp.distribute.peer_failures: a stuck or dead peer while training, named.

Fast tests check the messages in this process; the slow one stops a real
worker (SIGSTOP, or a sleep) under a collective timeout and asserts the time
to fail and what the message names.
"""

import os

import pytest
import tensorflow as tf

from multiworker import run_worker_script
from tfdp.distribute import cluster as cluster_lib
from tfdp.distribute import peer_failures


def _config(index=0, ports=(2222, 2223), job="worker"):
    return cluster_lib.ClusterConfig(
        cluster={job: [f"127.0.0.1:{p}" for p in ports]}, task_type=job, task_index=index)


# --- peers that fail while training --------------------------------------------

_HEARTBEAT = (
    "Graph execution error:\n\nDetected at node CollectiveReduceV2 defined at:\n  File "
    "\"x.py\", line 3\n\nCollective ops is aborted by: Error reported from "
    "/job:worker/task:1: The following tasks are unhealthy (stopped sending heartbeats):\n"
    "/job:worker/replica:0/task:1\nThe tasks have crashed.\n\t [[{{node CollectiveReduceV2}}]]")
_TIMED_OUT = ("Graph execution error:\n\nDetected at node CollectiveReduceV2 defined at:\n"
              "Collective has timed out during execution.\n\t [[{{node CollectiveReduceV2}}]]")


def test_a_collective_timeout_says_a_peer_is_stuck_and_how_to_wait_longer():
    message = peer_failures.peer_failure_message(
        tf.errors.DeadlineExceededError(None, None, _TIMED_OUT), _config(0), 5)
    assert "did not finish within 5 s on worker 0 (127.0.0.1:2222)" in message
    assert "stuck" in message and "--collective_timeout" in message
    assert message.endswith("(TensorFlow: Collective has timed out during execution.)")


def test_a_dead_peer_is_named_with_its_address():
    message = peer_failures.peer_failure_message(
        tf.errors.UnavailableError(None, None, _HEARTBEAT), _config(0), None)
    assert message.startswith("Worker 1 (127.0.0.1:2223) stopped answering while worker 0")
    assert "--max_restarts" in message
    assert "(TensorFlow: Collective ops is aborted by:" in message


# Recorded from a survivor (TensorFlow 2.21) when worker 1 was SIGKILLed and
# started again before the heartbeat timed out, and when the chief was SIGKILLed.
_RESTARTED = (
    "Graph execution error:\n\nDetected at node CollectiveReduceV2 defined at (most recent call "
    "last):\nCollective ops is aborted by: Error reported from /job:worker/task:1: "
    "/job:worker/replica:0/task:1 unexpectedly tried to connect with a different incarnation. "
    "It has likely restarted.\nThe error could be from a previous operation. Restart your "
    "program to reset.\n\t [[{{node CollectiveReduceV2}}]]")
_RESET = ("Collective ops is aborted by: recvmsg:Connection reset by peer\nAdditional GRPC error "
          "information from remote target /job:worker/replica:0/task:0 while calling "
          "/tensorflow.WorkerService/CompleteInstance:")


def test_a_restarted_peer_is_named_and_says_this_worker_must_start_again():
    message = peer_failures.peer_failure_message(
        tf.errors.AbortedError(None, None, _RESTARTED), _config(0), None)
    assert message.startswith("Worker 1 (127.0.0.1:2223) was restarted while worker 0")
    assert "This worker must start again too" in message


@pytest.mark.parametrize("error,lost", [
    (tf.errors.UnavailableError(None, None, _HEARTBEAT.replace("task:1", "task:0")), True),
    (tf.errors.UnavailableError(None, None, _RESET), True),
    (tf.errors.AbortedError(None, None, _RESTARTED.replace("task:1", "task:0")), True),
    (tf.errors.DeadlineExceededError(None, None, _TIMED_OUT), False),
])
def test_a_lost_peer_exits_43_and_a_stuck_one_1(error, lost):
    environ = {"TF_CONFIG": _config(1).to_json()}
    with pytest.raises(peer_failures.PeerFailureError) as info:
        with peer_failures.explain_peer_failures(collective_timeout=5, environ=environ):
            raise error
    assert isinstance(info.value, peer_failures.PeerLostError) is lost
    assert info.value.exit_code == (43 if lost else 1)
    assert info.value.__cause__ is error


def test_other_aborted_errors_pass_through():
    environ = {"TF_CONFIG": _config(1).to_json()}
    with pytest.raises(tf.errors.AbortedError):
        with peer_failures.explain_peer_failures(environ=environ):
            raise tf.errors.AbortedError(None, None, "Collective ops is aborted by: cancelled")


def test_the_launchers_exit_codes_are_the_librarys():
    # tfdp.launch keeps its own copies (it imports no TensorFlow).
    from tfdp.distribute import preemption
    from tfdp.launch import sbatch, tfjob_worker

    assert tfjob_worker.PEER_LOST_EXIT_CODE == peer_failures.PEER_LOST_EXIT_CODE == 43
    assert (tfjob_worker.PREEMPTION_EXIT_CODE == sbatch.PREEMPTION_EXIT_CODE
            == preemption.PREEMPTION_EXIT_CODE == 42)


def test_peer_failures_outside_a_multi_worker_job_pass_through(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(tf.errors.DeadlineExceededError):
        with peer_failures.explain_peer_failures(collective_timeout=5, environ={}):
            raise tf.errors.DeadlineExceededError(None, None, _TIMED_OUT)


def test_peer_failures_in_a_job_become_peer_failure_errors():
    environ = {"TF_CONFIG": _config(1).to_json()}
    with pytest.raises(peer_failures.PeerFailureError, match="stopped answering") as error:
        with peer_failures.explain_peer_failures(environ=environ):
            raise tf.errors.UnavailableError(None, None, _HEARTBEAT.replace("task:1", "task:0"))
    assert "Worker 0 (127.0.0.1:2222)" in str(error.value)


# --- slow: a real stuck worker ------------------------------------------------

_STUCK_PEER = """
    import os, signal, sys, time
    import tensorflow as tf
    import tfdp
    from tfdp.distribute import peer_failures

    strategy = tfdp.make_strategy("multi_worker", timeout_seconds=5, startup_timeout=60)

    @tf.function
    def all_reduce():
        return strategy.reduce("SUM", strategy.run(lambda: tf.ones([4])), axis=None)

    @tf.function
    def first_all_reduce():
        # The first collective also connects the workers: on a slow machine
        # that alone can take longer than the 5 s under test, so it gets its
        # own deadline; the second runs under the strategy's.
        options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=60)
        return strategy.extended.reduce_to(
            "SUM", strategy.run(lambda: tf.ones([4])), destinations="/cpu:0", options=options)

    print("first all-reduce", first_all_reduce().numpy().tolist(), flush=True)
    if os.environ["TFDP_RANK"] == "0":
        open("first.done", "w").close()
    else:
        # Worker 0 may still be pulling worker 1's last piece of the first
        # all-reduce (gRPC RecvBuf): worker 1 gets stuck only once it is done.
        deadline = time.monotonic() + 60
        while not os.path.exists("first.done") and time.monotonic() < deadline:
            time.sleep(0.05)
        with open("stuck.pid", "w") as f:
            f.write(str(os.getpid()))
        if sys.argv[1] == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(300)  # alive (heartbeats go on) but never joins the next all-reduce
    started = time.monotonic()
    try:
        with peer_failures.explain_peer_failures(collective_timeout=5):
            all_reduce().numpy()
    finally:
        print(f"second all-reduce ended after {time.monotonic() - started:.1f} s", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigstop", "sleep"])
def test_a_stuck_peer_fails_the_others_at_the_collective_timeout(tmp_path, how):
    result = run_worker_script(tmp_path, _STUCK_PEER, script_args=[how], timeout=150,
                               launch_args=["--grace_period", "2"])
    # run_worker_script has checked that no worker is left (stopped ones included).
    assert result.returncode != 0, result.describe()
    assert result.worker_stdout(1) == ["first all-reduce [2.0, 2.0, 2.0, 2.0]"]
    ended = [l for l in result.worker_stdout(0) if l.startswith("second all-reduce ended")]
    assert ended, result.describe()
    assert 4.5 <= float(ended[0].split()[-2]) <= 15, ended
    stderr = "\n".join(result.worker_stderr(0))
    assert "PeerFailureError: A collective across the workers did not finish within 5 s" in stderr
    assert "--collective_timeout" in stderr
    stuck = int((tmp_path / "stuck.pid").read_text())
    assert not os.path.exists(f"/proc/{stuck}")
