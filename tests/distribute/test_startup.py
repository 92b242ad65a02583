"""Tests for tfdp.distribute.startup: workers that cannot start together, found early and named.

Fast tests check the messages and the timeout's sources in this process. The
slow ones start real workers: a peer that never starts and a port already
taken; each asserts the exit status, the time to fail and what the message
names.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import tensorflow as tf

from multiworker import REPO_ROOT
from tfdp.distribute import cluster as cluster_lib
from tfdp.distribute import local_cluster
from tfdp.distribute import startup


def _config(index=0, ports=(2222, 2223), job="worker"):
    return cluster_lib.ClusterConfig(
        cluster={job: [f"127.0.0.1:{p}" for p in ports]}, task_type=job, task_index=index)


# --- the start-up timeout ------------------------------------------------------

@pytest.mark.parametrize(
    "argument, environ, expected",
    [
        (None, {}, startup.DEFAULT_STARTUP_TIMEOUT),
        (None, {"TFDP_STARTUP_TIMEOUT": " "}, startup.DEFAULT_STARTUP_TIMEOUT),
        (None, {"TFDP_STARTUP_TIMEOUT": "7.5"}, 7.5),
        (3, {"TFDP_STARTUP_TIMEOUT": "7.5"}, 3.0),  # the argument wins
    ],
)
def test_startup_timeout_comes_from_the_argument_then_the_environment(argument, environ,
                                                                      expected):
    assert startup.resolve_startup_timeout(argument, environ=environ) == expected


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf", "nan"])
def test_a_bad_startup_timeout_variable_is_named(value):
    with pytest.raises(ValueError, match=f"TFDP_STARTUP_TIMEOUT must be a positive.*"
                                         f"Received: TFDP_STARTUP_TIMEOUT='{value}'"):
        startup.resolve_startup_timeout(environ={"TFDP_STARTUP_TIMEOUT": value})


@pytest.mark.parametrize("value", [0, -2, float("inf"), True, "5"])
def test_a_bad_startup_timeout_argument_is_named(value):
    with pytest.raises(ValueError, match="`startup_timeout` must be a positive"):
        startup.resolve_startup_timeout(value, environ={})


# --- this worker's port ---------------------------------------------------------

def test_own_port_in_use_is_refused_naming_the_port_and_the_fix():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))  # taken on loopback only: TF binds all interfaces
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(startup.PortInUseError) as error:
            startup.check_own_port(_config(1, ports=(1234, port)))
    assert error.value.exit_code == startup.PORT_IN_USE_EXIT_CODE == 44
    message = str(error.value)
    assert f"port {port}" in message and f"worker 1 (127.0.0.1:{port})" in message
    assert "in use" in message and "--port" in message


def test_a_free_own_port_passes():
    port = local_cluster.free_ports(1)[0]
    startup.check_own_port(_config(0, ports=(port, 1234)))


def test_this_host_named_twice_under_two_names_fails_on_the_second_worker():
    # tfdp.distribute.cluster refuses a repeated address but resolves no names: the
    # worker that starts second finds its port taken and says so.
    with socket.socket() as first_worker:
        first_worker.bind(("0.0.0.0", 0))
        first_worker.listen()
        port = first_worker.getsockname()[1]
        config = cluster_lib.parse_tf_config(json.dumps({
            "cluster": {"worker": [f"localhost:{port}", f"127.0.0.1:{port}"]},
            "task": {"type": "worker", "index": 1}}))
        with pytest.raises(startup.StartupError, match=f"worker 1 \\(127.0.0.1:{port}\\)"):
            startup.check_own_port(config)


def test_tensorflows_grpc_server_error_becomes_the_port_message():
    config = _config(0, ports=(24680, 24681))
    with pytest.raises(startup.PortInUseError, match="cannot listen on port 24680.*--port"):
        with startup.explain_startup_failure(config, 5.0):
            raise tf.errors.UnknownError(None, None, "Could not start gRPC server")


def test_other_errors_pass_through_the_startup_translation():
    with pytest.raises(tf.errors.UnknownError, match="something else"):
        with startup.explain_startup_failure(_config(), 5.0):
            raise tf.errors.UnknownError(None, None, "something else")
    with pytest.raises(tf.errors.DeadlineExceededError):  # no cluster: nothing to name
        with startup.explain_startup_failure(None, 5.0):
            raise tf.errors.DeadlineExceededError(None, None, "late")


# --- peers that do not answer ---------------------------------------------------

# What TensorFlow 2.21 says on the leader when worker 2 never registered (3 workers).
_LEADER_TIMEOUT = (
    "Barrier timed out. Id: [Init]Wait_for_all_tasks_to_register::0. This usually happens "
    "because a task triggered the barrier too early or too slowly.\n# of tasks that reached "
    "the barrier: 2/3.\nThe first task at the barrier: /job:worker/replica:0/task:1. Some "
    "timed out task names:\n/job:worker/replica:0/task:2\n\nAdditional GRPC error "
    "information from remote target /job:worker/replica:0/task:0 while calling "
    "/tensorflow.CoordinationService/RegisterTask")
# ... and on a worker whose leader (worker 0) never answered.
_NO_LEADER = (
    "Deadline Exceeded\nAdditional GRPC error information from remote target "
    "/job:worker/replica:0/task:0 while calling /tensorflow.CoordinationService/"
    "RegisterTask:\n:UNKNOWN:Error received from peer {grpc_status:4}")


def _listening_socket():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_the_leaders_timeout_names_the_missing_worker_and_not_the_first_at_the_barrier():
    with _listening_socket() as peer:
        ports = (local_cluster.free_ports(1)[0], peer.getsockname()[1], local_cluster.free_ports(1)[0])
        message = startup.unanswered_message(_config(0, ports), 5.0, _LEADER_TIMEOUT)
    assert "on worker 0 (127.0.0.1:" in message
    assert "1 other worker did not answer within startup_timeout=5 s" in message
    assert f"worker 2 (127.0.0.1:{ports[2]}): nothing listens there" in message
    assert f"127.0.0.1:{ports[1]}" not in message  # it answered
    assert "TFDP_STARTUP_TIMEOUT" in message and "Start every worker" in message
    assert "(TensorFlow: Barrier timed out." in message


def test_peers_tensorflow_does_not_name_are_found_by_probing_their_ports():
    # The coordination service names at most two stragglers; a port nobody
    # listens on adds the others.
    ports = tuple(local_cluster.free_ports(3))
    message = startup.unanswered_message(_config(0, ports), 5.0, _LEADER_TIMEOUT)
    assert (f"2 other workers did not answer within startup_timeout=5 s: worker 2 (127.0.0.1:"
            f"{ports[2]}): nothing listens there; worker 1 (127.0.0.1:{ports[1]}): nothing "
            f"listens there.") in message


def test_a_worker_whose_leader_never_answered_names_the_leader():
    ports = tuple(local_cluster.free_ports(2))
    message = startup.unanswered_message(_config(1, ports), 5.0, _NO_LEADER)
    assert f"worker 0 (127.0.0.1:{ports[0]}): nothing listens there" in message
    assert "could not start on worker 1" in message


def test_a_peer_that_listens_but_never_joined_is_told_apart():
    with _listening_socket() as peer:
        ports = (local_cluster.free_ports(1)[0], peer.getsockname()[1])
        text = _LEADER_TIMEOUT.replace("task:2\n", "task:1\n")
        message = startup.unanswered_message(_config(0, ports), 5.0, text)
    assert f"worker 1 (127.0.0.1:{ports[1]}): its port answers, but it never joined" in message


def test_a_deadline_while_starting_becomes_a_startup_error():
    ports = tuple(local_cluster.free_ports(2))
    with pytest.raises(startup.StartupError, match=f"127.0.0.1:{ports[0]}") as error:
        with startup.explain_startup_failure(_config(1, ports), 5.0):
            raise tf.errors.DeadlineExceededError(None, None, _NO_LEADER)
    assert isinstance(error.value.__cause__, tf.errors.DeadlineExceededError)


# --- slow: real workers ---------------------------------------------------------

def _run_python(code, env, timeout):
    """Runs `code` in a fresh Python with `env`; returns (CompletedProcess, seconds)."""
    environ = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TF_CPP_MIN_LOG_LEVEL": "2",
               **env}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environ,
                            capture_output=True, text=True, timeout=timeout)
    return result, time.monotonic() - started


_MAKE_STRATEGY = """
    import time, tfdp
    {prelude}
    started = time.monotonic()
    try:
        tfdp.make_strategy("multi_worker", {arguments})
    finally:
        print(f"make_strategy took {{time.monotonic() - started:.1f}} s", flush=True)
"""


# Imported before the clock starts, so that the time measured is the wait for
# peers (importing Keras takes seconds on a busy 2-core machine).
_PRELOAD = "import tfdp._upstream.keras_multi_worker"


def _took(result):
    line = [l for l in result.stdout.splitlines() if l.startswith("make_strategy took")]
    assert line, result.stdout + result.stderr[-3000:]
    return float(line[0].split()[2])


@pytest.mark.slow
@pytest.mark.parametrize("started", [0, 1], ids=["only_the_leader", "only_worker_1"])
def test_a_peer_that_never_starts_fails_within_the_startup_timeout(started):
    ports = local_cluster.free_ports(2)
    tf_config = local_cluster.local_tf_config(2, started, ports=ports)
    result, seconds = _run_python(_MAKE_STRATEGY.format(prelude=_PRELOAD, arguments="startup_timeout=5"),
                                  {"TF_CONFIG": json.dumps(tf_config)}, timeout=90)
    missing = f"127.0.0.1:{ports[1 - started]}"
    assert result.returncode != 0
    assert "StartupError" in result.stderr, result.stderr[-3000:]
    assert f"worker {1 - started} ({missing}): nothing listens there" in result.stderr
    # The leader gives up at the deadline; another worker adds gRPC's back-off.
    assert _took(result) < 5 + (3 if started == 0 else 8), result.stdout
    assert seconds < 60


@pytest.mark.slow
def test_the_startup_timeout_comes_from_the_environment_in_a_worker():
    ports = local_cluster.free_ports(2)
    tf_config = local_cluster.local_tf_config(2, 0, ports=ports)
    result, _ = _run_python(_MAKE_STRATEGY.format(prelude=_PRELOAD, arguments=""),
                            {"TF_CONFIG": json.dumps(tf_config), "TFDP_STARTUP_TIMEOUT": "3"},
                            timeout=90)
    assert result.returncode != 0 and "within startup_timeout=3 s" in result.stderr
    assert _took(result) < 3 + 3


@pytest.mark.slow
def test_a_worker_whose_port_is_taken_fails_at_once_naming_it():
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        tf_config = local_cluster.local_tf_config(2, 1, ports=[local_cluster.free_ports(1)[0], port])
        result, _ = _run_python(_MAKE_STRATEGY.format(prelude="import tfdp.distribute.strategy", arguments="startup_timeout=30"),
                                {"TF_CONFIG": json.dumps(tf_config)}, timeout=90)
    assert result.returncode != 0
    assert f"cannot listen on port {port}: it is in use" in result.stderr
    assert "--port" in result.stderr and "Could not start gRPC server" not in result.stderr
    assert _took(result) < 2
