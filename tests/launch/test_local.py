"""Tests for `tfdp.launch.local`: worker environments, output, fail-fast, signals.

These run the launcher library in the test process (`run_local` with in-memory
output streams) on plain-Python workers, so each test costs well under a
second plus its grace periods. The command line, zombie reaping of
grandchildren and the test helper are covered in `test_launch_main.py` and
`test_multiworker_helper.py`.
"""

import dataclasses
import io
import json
import os
import signal
import socket
import sys
import threading
import time

import pytest

from tfdp.launch import _proc, local
from launch_snippets import PRELUDE
from multiworker import assert_processes_gone, free_port_pair, wait_for_files, write_worker_script
from tfdp.distribute.cluster import parse_tf_config


def _run(tmp_path, pid_dir, source, *, nproc=2, grace_period=1.0, **kwargs):
    """Runs `PRELUDE + source` on `nproc` workers in-process.

    Returns (exit code, stdout text, stderr text, elapsed seconds).
    """
    script = write_worker_script(tmp_path, PRELUDE + source)
    out, err = io.BytesIO(), io.BytesIO()
    environ = dict(os.environ, PID_DIR=str(pid_dir))
    start = time.monotonic()
    code = local.run_local([sys.executable, "-u", str(script)], nproc_per_node=nproc,
                           grace_period=grace_period, environ=environ, stdout=out,
                           stderr=err, **kwargs)
    elapsed = time.monotonic() - start
    return (code, out.getvalue().decode(errors="replace"),
            err.getvalue().decode(errors="replace"), elapsed)


def _worker_pids(pid_dir, nproc):
    return [int(p) for p in wait_for_files(
        [pid_dir / f"worker{r}.pid" for r in range(nproc)], timeout=1)]


# -- plan_local: validation and environments, nothing started ----------------

def test_plan_gives_each_worker_its_rank_and_tf_config():
    environ = {"PATH": os.environ["PATH"], "TF_CONFIG": '{"stale": 1}', "KEEP_ME": "yes"}
    plan = local.plan_local(["python", "train.py", "--flag"], nproc_per_node=3,
                            environ=environ)
    assert plan.command == ("python", "train.py", "--flag")
    assert len(plan.ports) == len(set(plan.ports)) == 3
    configs = []
    for rank, spec in enumerate(plan.workers):
        assert spec.rank == rank
        assert spec.command == plan.command
        env = spec.env
        assert env["KEEP_ME"] == "yes" and env["PATH"] == environ["PATH"]
        assert (env["TFDP_RANK"], env["TFDP_LOCAL_RANK"]) == (str(rank), str(rank))
        assert (env["TFDP_WORLD_SIZE"], env["TFDP_LOCAL_WORLD_SIZE"]) == ("3", "3")
        assert env["PYTHONUNBUFFERED"] == "1"
        config = parse_tf_config(env["TF_CONFIG"])  # the stale TF_CONFIG is replaced
        assert (config.task_type, config.task_index, config.worker_index) == (
            "worker", rank, rank)
        configs.append(config)
    assert {tuple(c.cluster["worker"]) for c in configs} == {
        tuple(f"127.0.0.1:{p}" for p in plan.ports)}
    assert [c.is_chief for c in configs] == [True, False, False]


def test_plan_uses_consecutive_ports_from_port():
    port = free_port_pair()
    plan = local.plan_local(["python"], nproc_per_node=2, port=port)
    assert plan.ports == (port, port + 1)
    assert json.loads(plan.workers[1].env["TF_CONFIG"])["cluster"]["worker"] == [
        f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]


def test_plan_rejects_port_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=rf"port {port} is in use.*omit it"):
            local.plan_local(["python"], nproc_per_node=1, port=port)


@pytest.mark.parametrize(
    "command,kwargs,error,fragment",
    [
        (["python"], {"nproc_per_node": 0}, ValueError,
         "`nproc_per_node` must be a positive integer (the number of worker processes to start). "
         "Received: nproc_per_node=0"),
        (["python"], {"nproc_per_node": -3}, ValueError, "Received: nproc_per_node=-3"),
        (["python"], {"nproc_per_node": 2.0}, TypeError, "`nproc_per_node` must be a positive integer"),
        (["python"], {"nproc_per_node": True}, TypeError, "`nproc_per_node` must be a positive integer"),
        (["python"], {"nproc_per_node": 1, "port": 0}, ValueError,
         "`port` must be in [1, 65535]"),
        (["python"], {"nproc_per_node": 1, "port": 65536}, ValueError, "Received: port=65536"),
        (["python"], {"nproc_per_node": 2, "port": 65535}, ValueError,
         "`port` must be in [1, 65534] so that the 2 worker ports"),
        (["python"], {"nproc_per_node": 1, "port": "2222"}, TypeError,
         "`port` must be an int or None"),
        (["python"], {"nproc_per_node": 1, "grace_period": -1}, ValueError,
         "`grace_period` must be a finite number of seconds >= 0. Received: grace_period=-1"),
        (["python"], {"nproc_per_node": 1, "grace_period": float("nan")}, ValueError,
         "Received: grace_period=nan"),
        (["python"], {"nproc_per_node": 1, "grace_period": float("inf")}, ValueError,
         "Received: grace_period=inf"),
        (["python"], {"nproc_per_node": 1, "grace_period": "5"}, TypeError,
         "`grace_period` must be a number of seconds"),
        ([], {"nproc_per_node": 1}, ValueError, "`command` must not be empty"),
        ("python train.py", {"nproc_per_node": 1}, TypeError,
         "`command` must be a list of strings"),
        (["python", 3], {"nproc_per_node": 1}, TypeError, "`command` must contain only strings"),
        (["no-such-program-tfdp"], {"nproc_per_node": 1}, ValueError,
         "'no-such-program-tfdp' was not found on PATH"),
        (["/nonexistent/python"], {"nproc_per_node": 1}, ValueError,
         "'/nonexistent/python' is not an executable file"),
    ],
)
def test_plan_rejects_bad_arguments(command, kwargs, error, fragment):
    with pytest.raises(error) as info:
        local.plan_local(command, **kwargs)
    assert fragment in str(info.value)


# -- run_local: real worker processes ---------------------------------------

OUTPUT_WORKER = """
print(f"out line 1 from {RANK}")
print(f"err line from {RANK}", file=sys.stderr)
sys.stdout.buffer.write(b"\\xff\\xfe not utf-8\\n")
sys.stdout.write(f"last line without newline from {RANK}")
"""


def test_output_is_prefixed_per_stream(tmp_path, pid_dir):
    code, out, err, _ = _run(tmp_path, pid_dir, OUTPUT_WORKER, nproc=2)
    assert code == 0, err
    out_lines = out.splitlines()
    assert len(out_lines) == 6  # three lines per worker, nothing else on stdout
    for rank in (0, 1):
        # Whole lines, in the worker's order; the unterminated last line is completed.
        assert [line for line in out_lines if line.startswith(f"[{rank}] ")] == [
            f"[{rank}] out line 1 from {rank}",
            f"[{rank}] \ufffd\ufffd not utf-8",
            f"[{rank}] last line without newline from {rank}",
        ]
        assert f"[{rank}] err line from {rank}" in err.splitlines()
    assert "err line" not in out
    assert "out line" not in err


def test_output_bytes_pass_through(tmp_path, pid_dir):
    script = write_worker_script(tmp_path, PRELUDE + OUTPUT_WORKER)
    out, err = io.BytesIO(), io.BytesIO()
    code = local.run_local([sys.executable, "-u", str(script)], nproc_per_node=1,
                           environ=dict(os.environ, PID_DIR=str(pid_dir)), stdout=out,
                           stderr=err)
    assert code == 0
    assert out.getvalue() == (b"[0] out line 1 from 0\n[0] \xff\xfe not utf-8\n"
                              b"[0] last line without newline from 0\n")


ENV_WORKER = """
import json
names = ["TF_CONFIG", "TFDP_RANK", "TFDP_LOCAL_RANK", "TFDP_WORLD_SIZE",
         "TFDP_LOCAL_WORLD_SIZE", "PYTHONUNBUFFERED"]
print(json.dumps({name: os.environ.get(name) for name in names}))
"""


@pytest.mark.parametrize("nproc", [1, 3])
def test_each_worker_sees_a_consistent_cluster(tmp_path, pid_dir, nproc):
    code, out, err, _ = _run(tmp_path, pid_dir, ENV_WORKER, nproc=nproc)
    assert code == 0, err
    reports = {}
    for line in out.splitlines():
        prefix, _, payload = line.partition(" ")
        reports[int(prefix.strip("[]"))] = json.loads(payload)
    assert sorted(reports) == list(range(nproc))
    clusters = set()
    for rank, env in reports.items():
        config = parse_tf_config(env["TF_CONFIG"])
        assert config.task_index == config.worker_index == int(env["TFDP_RANK"]) == rank
        assert int(env["TFDP_LOCAL_RANK"]) == rank
        assert int(env["TFDP_WORLD_SIZE"]) == int(env["TFDP_LOCAL_WORLD_SIZE"]) == nproc
        assert config.num_workers == nproc
        assert env["PYTHONUNBUFFERED"] == "1"
        clusters.add(tuple(config.cluster["worker"]))
    assert len(clusters) == 1
    assert len(set(next(iter(clusters)))) == nproc  # one distinct address per worker


FAIL_FAST_WORKER = """
if RANK == 1:
    wait_for_pid("worker0")
    print("rank 1 failing", flush=True)
    sys.exit(3)
time.sleep(60)
"""


def test_fail_fast_returns_failing_code_and_stops_the_others(tmp_path, pid_dir):
    code, out, err, elapsed = _run(tmp_path, pid_dir, FAIL_FAST_WORKER, nproc=2,
                                   grace_period=1.0)
    print(f"fail-fast: exit code {code} after {elapsed:.2f} s")
    assert code == 3, err
    assert elapsed < 30, f"launch took {elapsed:.1f} s to notice a failed worker"
    assert "[1] rank 1 failing" in out
    assert "[launch] worker 1 " in err and "exited with code 3" in err
    assert "exiting with code 3 (worker 1 failed)" in err
    assert_processes_gone(_worker_pids(pid_dir, 2))


KILLED_WORKER = """
if RANK == 0:
    wait_for_pid("worker1")
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


def test_worker_killed_by_signal_maps_to_128_plus_signum(tmp_path, pid_dir):
    code, _, err, elapsed = _run(tmp_path, pid_dir, KILLED_WORKER, nproc=2)
    assert code == 128 + signal.SIGKILL == 137, err
    assert "worker 0" in err and "was killed by SIGKILL (exit code 137)" in err
    assert elapsed < 30
    assert_processes_gone(_worker_pids(pid_dir, 2))


def test_all_workers_succeeding_returns_zero(tmp_path, pid_dir):
    code, out, err, _ = _run(tmp_path, pid_dir, "print('done')\n", nproc=3)
    assert code == 0, err
    assert sorted(out.splitlines()) == ["[0] done", "[1] done", "[2] done"]
    assert "exiting with code" not in err


def _signal_self_when_ready(pid_dir, nproc, signum, *, repeat_after=None):
    """Sends `signum` to this process once every worker wrote its pid file."""
    sent = []

    def target():
        wait_for_files([pid_dir / f"worker{r}.pid" for r in range(nproc)], timeout=30)
        time.sleep(0.2)  # let the workers install their handlers
        sent.append(time.monotonic())
        os.kill(os.getpid(), signum)
        if repeat_after is not None:
            time.sleep(repeat_after)
            os.kill(os.getpid(), signum)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, sent


# Rank 0 ignores the forwarded signal, rank 1 dies of it.
IGNORING_WORKER = """
if RANK == 0:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(60)
"""


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_is_forwarded_then_escalated_to_sigkill(tmp_path, pid_dir, signum):
    grace = 1.0
    handler_before = signal.getsignal(signum)
    thread, sent = _signal_self_when_ready(pid_dir, 2, signum)
    code, _, err, _ = _run(tmp_path, pid_dir, IGNORING_WORKER, nproc=2, grace_period=grace)
    thread.join()
    after_signal = time.monotonic() - sent[0]
    print(f"{signum.name}: launch returned {code} {after_signal:.2f} s after the signal")
    assert code == 128 + signum
    assert f"received {signum.name}; forwarding it to 2 running worker(s)" in err
    # Only the worker that ignored the signal needed SIGKILL, after the grace period.
    assert "worker 0 (pid" in err and f"still running {grace:g} s after {signum.name}" in err
    assert "worker 1 (pid" not in err
    assert grace <= after_signal < 30
    assert_processes_gone(_worker_pids(pid_dir, 2))
    assert signal.getsignal(signum) == handler_before  # the launcher restored it


@pytest.mark.timeout(90)
def test_second_signal_kills_without_waiting_for_the_grace_period(tmp_path, pid_dir):
    source = """
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(60)
"""
    thread, sent = _signal_self_when_ready(pid_dir, 2, signal.SIGTERM, repeat_after=0.5)
    code, _, err, _ = _run(tmp_path, pid_dir, source, nproc=2, grace_period=60.0)
    thread.join()
    after_signal = time.monotonic() - sent[0]
    print(f"second SIGTERM: launch returned {code} {after_signal:.2f} s after the first")
    assert code == 143
    assert after_signal < 20, "the second signal should SIGKILL at once, not after 60 s"
    assert_processes_gone(_worker_pids(pid_dir, 2))


def test_a_worker_that_cannot_start_stops_the_started_ones(tmp_path, pid_dir):
    good = local.plan_local(["sleep", "60"], nproc_per_node=1).workers[0]
    bad = dataclasses.replace(good, rank=1, command=(str(tmp_path / "missing-program"),))
    plan = local.LocalLaunchPlan(command=good.command, nproc_per_node=2, ports=(1, 2),
                                 grace_period=1.0, workers=(good, bad))
    err = io.BytesIO()
    # Children this test process had before (under `-n auto` it may hold the
    # session's Slurm cluster process): not the launch's.
    earlier = set(_proc.children_of(os.getpid()))
    start = time.monotonic()
    code = local.run_plan(plan, stdout=io.BytesIO(), stderr=err)
    assert code == 127
    assert b"could not start the workers" in err.getvalue()
    assert time.monotonic() - start < 30
    # The `sleep` of rank 0 was started, then SIGKILLed and reaped.
    sleeps = [pid for pid in _proc.children_of(os.getpid())
              if pid not in earlier and _proc.process_state(pid) is not None]
    assert sleeps == []


# -- plan_nodes: this node's share of a multi-node job -------------------------

def _two_free_ranges(width):
    """Two first ports whose ranges of `width` ports are free and disjoint."""
    firsts = []
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("", 0))
            first = probe.getsockname()[1]
        ports = range(first, first + width)
        if first + width > 65535 or any(local.port_in_use(p) for p in ports):
            continue
        if firsts and abs(firsts[0] - first) < width:
            continue
        firsts.append(first)
        if len(firsts) == 2:
            return firsts
    pytest.skip("no free port ranges found")


def test_plan_nodes_every_node_builds_the_same_cluster_with_its_own_ranks():
    p, q = _two_free_ranges(2)
    hosts = f"127.0.0.1:{p},127.0.0.1:{q}"
    environ = {"PATH": os.environ["PATH"]}
    plans = [local.plan_nodes(["python", "train.py"], nnodes=2, node_rank=rank, hosts=hosts,
                              nproc_per_node=2, environ=environ) for rank in (0, 1)]
    expected = (f"127.0.0.1:{p}", f"127.0.0.1:{p + 1}", f"127.0.0.1:{q}", f"127.0.0.1:{q + 1}")
    assert plans[0].ports == (p, p + 1) and plans[1].ports == (q, q + 1)
    specs = [spec for plan in plans for spec in plan.workers]
    assert [spec.rank for spec in specs] == [0, 1, 2, 3]
    for spec in specs:
        env = spec.env
        config = parse_tf_config(env["TF_CONFIG"])
        assert config.cluster == {"worker": expected}
        assert config.task_index == config.worker_index == spec.rank == int(env["TFDP_RANK"])
        assert env["TFDP_LOCAL_RANK"] == str(spec.rank % 2)
        assert env["TFDP_NODE_RANK"] == str(spec.rank // 2)
        assert (env["TFDP_WORLD_SIZE"], env["TFDP_LOCAL_WORLD_SIZE"]) == ("4", "2")
        assert env["TFDP_RESTART_COUNT"] == "0"
        assert config.address == expected[spec.rank]  # each worker's own address
    assert plans[1].describe().startswith(
        f"starting 2 worker(s) on 127.0.0.1 ports {q},{q + 1} (node 1 of 2: ranks 2..3 of 4): ")
    assert all(plan.fixed_ports and not plan.bind_all for plan in plans)


def test_plan_nodes_rejects_a_busy_port_of_this_node():
    p, q = _two_free_ranges(1)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", q))
        busy.listen()
        hosts = f"127.0.0.1:{p},127.0.0.1:{q}"
        local.plan_nodes(["python"], nnodes=2, node_rank=0, hosts=hosts, nproc_per_node=1)
        with pytest.raises(ValueError, match=rf"`hosts` entry 1 \(127.0.0.1:{q}\): ports "
                                             rf"{q}..{q} must be free .* port {q} is in use"):
            local.plan_nodes(["python"], nnodes=2, node_rank=1, hosts=hosts, nproc_per_node=1)


@pytest.mark.parametrize(
    "kwargs,error,fragment",
    [
        ({"bind_all": "yes"}, TypeError, "`bind_all` must be a bool"),
        ({"max_restarts": -1}, ValueError, "`max_restarts` must be an integer >= 0"),
        ({"hosts": "127.0.0.1:5000"}, ValueError, "nnodes=2, but it has 1"),
        ({"nproc_per_node": 0}, ValueError, "`nproc_per_node` must be a positive integer"),
    ],
)
def test_plan_nodes_rejects_bad_arguments(kwargs, error, fragment):
    arguments = {"nnodes": 2, "node_rank": 0, "hosts": "127.0.0.1:5000,127.0.0.1:5010",
                 "nproc_per_node": 1, **kwargs}
    with pytest.raises(error) as info:
        local.plan_nodes(["python"], **arguments)
    assert fragment in str(info.value)


def test_reachable_hosts_without_bind_all_bind_this_nodes_address_and_warn(tmp_path):
    p, _ = _two_free_ranges(1)
    plan = local.plan_nodes(["true"], nnodes=2, node_rank=1,
                            hosts=f"10.255.255.1:2222,127.0.0.1:{p}", nproc_per_node=1)
    assert plan.exposed == ("10.255.255.1:2222",) and not plan.bind_all
    if not plan.bind_warning:  # the shim was built: this node's address only
        assert plan.workers[0].env["TFDP_BIND_ADDRESS"] == "127.0.0.1"
    err = io.BytesIO()
    assert local.run_plan(plan, stdout=io.BytesIO(), stderr=err) == 0
    first = err.getvalue().decode().splitlines()[0]
    assert first.startswith("[launch] warning: workers are reached at 10.255.255.1:2222, "
                            "which other machines can reach; this node's workers listen "
                            "on 127.0.0.1 only")


def test_bind_all_logs_the_unauthenticated_endpoint_warning(tmp_path):
    p, _ = _two_free_ranges(1)
    plan = local.plan_nodes(["true"], nnodes=2, node_rank=1, bind_all=True,
                            hosts=f"10.255.255.1:2222,127.0.0.1:{p}", nproc_per_node=1)
    assert plan.exposed == ("10.255.255.1:2222",)
    err = io.BytesIO()
    assert local.run_plan(plan, stdout=io.BytesIO(), stderr=err) == 0
    first = err.getvalue().decode().splitlines()[0]
    assert first.startswith("[launch] warning: --bind_all: workers are reached at "
                            "10.255.255.1:2222. TensorFlow's gRPC endpoints have no "
                            "authentication")


# -- a free port taken between the launcher's choice and the worker's bind ------

_BIND_OWN_PORT = """
import json
config = json.loads(os.environ["TF_CONFIG"])
port = int(config["cluster"]["worker"][config["task"]["index"]].rsplit(":", 1)[1])
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    server.bind(("0.0.0.0", port))  # as TensorFlow's gRPC server does
except OSError as e:
    print(f"cannot listen on {port}: {e.strerror}", file=sys.stderr)
    sys.exit(1)
print(f"listening on {port}")
"""


def _hold(port):
    holder = socket.socket()
    holder.bind(("0.0.0.0", port))
    holder.listen()
    return holder


def test_a_free_port_taken_by_another_process_is_retried_with_new_ports(tmp_path, pid_dir):
    script = write_worker_script(tmp_path, PRELUDE + "import socket\n" + _BIND_OWN_PORT)
    environ = dict(os.environ, PID_DIR=str(pid_dir))
    plan = local.plan_local([sys.executable, "-u", str(script)], nproc_per_node=2,
                            grace_period=1.0, environ=environ)
    taken = plan.ports[1]
    out, err = io.BytesIO(), io.BytesIO()
    with _hold(taken):  # another process takes worker 1's port after the launcher chose it
        code = local.run_plan(plan, stdout=out, stderr=err)
    err = err.getvalue().decode()
    assert code == 0, err
    assert (f"port {taken} (worker 1's) is held by another process (Address already in use); "
            "it was taken after the launcher picked it: running the attempt again with new "
            "ports (port retry 1 of 3, not a restart)") in err
    listening = [line for line in out.getvalue().decode().splitlines() if "listening" in line]
    assert len(listening) >= 2 and f"listening on {taken}" not in " ".join(listening[-2:])


def test_fixed_ports_and_other_failures_are_not_retried(tmp_path, pid_dir):
    # A fixed --port is the user's choice: its collision fails the run as before.
    port = free_port_pair()
    script = write_worker_script(tmp_path, PRELUDE + "import socket\n" + _BIND_OWN_PORT)
    environ = dict(os.environ, PID_DIR=str(pid_dir))
    plan = local.plan_local([sys.executable, "-u", str(script)], nproc_per_node=2, port=port,
                            grace_period=1.0, environ=environ)
    out, err = io.BytesIO(), io.BytesIO()
    with _hold(port + 1):
        code = local.run_plan(plan, stdout=out, stderr=err)
    assert code == 1
    assert "port retry" not in err.getvalue().decode()
    # A worker failing with its ports free is a failure, not a collision.
    code, _, err, _ = _run(tmp_path, pid_dir, "sys.exit(3)\n")
    assert code == 3
    assert "port retry" not in err


_EXITS_44_ON_ITS_FIRST_PORTS = """
marker = pathlib.Path(os.environ["PID_DIR"]) / "collided"
if os.environ["TFDP_RANK"] == "1" and not marker.exists():
    marker.write_text(os.environ["TF_CONFIG"])
    # tfdp-train's exit when its port was taken by a process that is gone by now.
    sys.exit(44)
print("trained on", os.environ["TF_CONFIG"])
"""


@pytest.mark.parametrize("fixed", [False, True], ids=["free_ports", "fixed_port"])
def test_a_worker_exiting_44_is_a_port_collision_only_on_picked_ports(tmp_path, pid_dir, fixed):
    script = write_worker_script(tmp_path, PRELUDE + "import pathlib\n"
                                 + _EXITS_44_ON_ITS_FIRST_PORTS)
    plan = local.plan_local([sys.executable, "-u", str(script)], nproc_per_node=2,
                            port=free_port_pair() if fixed else None, grace_period=1.0,
                            environ=dict(os.environ, PID_DIR=str(pid_dir)))
    out, err = io.BytesIO(), io.BytesIO()
    code = local.run_plan(plan, stdout=out, stderr=err)
    err = err.getvalue().decode()
    if fixed:  # the user's --port: nothing to pick again
        assert code == 44 and "port retry" not in err, err
        return
    assert code == 0, err
    assert ("worker 1 exited with code 44; its own port was taken by another process after "
            "the launcher picked it: running the attempt again with new ports (port retry 1 "
            "of 3, not a restart)") in err
    first = json.loads((pid_dir / "collided").read_text())["cluster"]
    trained = [json.loads(line.split("trained on ", 1)[1])["cluster"]
               for line in out.getvalue().decode().splitlines() if "trained on" in line]
    # Worker 0 may have finished the first attempt too; the last two ran on new ports.
    assert trained[-2] == trained[-1] != first, (first, trained)
