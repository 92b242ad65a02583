"""Tests for `tfdp-launch`: argument errors, and end-to-end runs.

Argument errors are checked in-process through `tfdp.launch.__main__.main(argv)`
(exit status 2 and the message), plus once through a real `tfdp-launch`.
The end-to-end tests run the launcher as users do, through
`tests/multiworker.py`, with plain-Python workers.
"""

import json
import shutil
import signal
import subprocess
import sys

import pytest

from tfdp.launch import __main__ as launch_main
from tfdp.launch import local
from launch_snippets import PRELUDE
from multiworker import (
    LaunchFailed,
    assert_processes_gone,
    python_command,
    run_launch,
    run_worker_script,
    start_launch,
    wait_for_files,
    write_worker_script,
)
from tfdp.distribute.cluster import parse_tf_config
from tfdp.distribute.local_cluster import free_ports


@pytest.mark.parametrize(
    "argv,fragment",
    [
        ([], "the following arguments are required: --nproc_per_node"),
        (["--nproc_per_node", "2"], "missing COMMAND after `--`"),
        (["--nproc_per_node", "2", "--"], "missing COMMAND after `--`"),
        (["--nproc_per_node", "2", "python", "train.py"],
         "unrecognized arguments before `--`: python train.py"),
        (["--nproc_per_node", "two", "--", "python"], "invalid int value: 'two'"),
        (["--nproc_per_node", "0", "--", "python"],
         "`nproc_per_node` must be a positive integer (the number of worker processes to start). "
         "Received: nproc_per_node=0"),
        (["--nproc_per_node", "2", "--port", "65535", "--", "python"],
         "`port` must be in [1, 65534]"),
        (["--nproc_per_node", "1", "--port", "-5", "--", "python"], "Received: port=-5"),
        (["--nproc_per_node", "1", "--grace_period", "-1", "--", "python"],
         "`grace_period` must be a finite number of seconds >= 0"),
        (["--nproc_per_node", "1", "--", "no-such-program-tfdp", "x"],
         "'no-such-program-tfdp' was not found on PATH"),
        (["--nproc_per_node", "1", "--max_restarts", "-1", "--", "python"],
         "`max_restarts` must be an integer >= 0"),
        (["--nproc_per_node", "1", "--nnodes", "2", "--", "python"],
         "--hosts is required with --nnodes 2"),
        (["--nproc_per_node", "1", "--hosts", "127.0.0.1:5000", "--port", "5000", "--",
          "python"], "--port cannot be combined with --hosts"),
        (["--nproc_per_node", "1", "--node_rank", "1", "--", "python"],
         "--node_rank 1 needs --nnodes > 1 and --hosts"),
        (["--nproc_per_node", "1", "--bind_all", "--", "python"],
         "--bind_all only applies with --hosts"),
        (["--nproc_per_node", "1", "--nnodes", "2", "--node_rank", "2", "--hosts",
          "127.0.0.1:5000,127.0.0.1:5010", "--", "python"], "`node_rank` must be in [0, 1]"),
        (["--nproc_per_node", "1", "--nnodes", "3", "--hosts", "127.0.0.1:5000,127.0.0.1:5010",
          "--", "python"], "nnodes=3, but it has 2"),
        (["--nproc_per_node", "1", "--nnodes", "2", "--hosts", "127.0.0.1:5000,127.0.0.1",
          "--", "python"], "`hosts` entry 1 must be host:port"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv, fragment, capsys):
    with pytest.raises(SystemExit) as info:
        launch_main.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err
    assert "usage: tfdp-launch --nproc_per_node N" in err


def test_help_documents_env_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as info:
        launch_main.main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for fragment in ("TFDP_RANK", "TFDP_LOCAL_RANK", "TFDP_WORLD_SIZE", "TF_CONFIG",
                     "SIGTERM: 143", "2 for invalid arguments", "--grace_period",
                     "TFDP_NODE_RANK", "TFDP_RESTART_COUNT", "--max_restarts", "--hosts",
                     "--bind_all", "host_r:port_r+i", "r*N+i", "listens on all interfaces",
                     "tfdp-launch slurm --help", "tfdp-launch k8s --help"):
        assert fragment in text


@pytest.mark.parametrize("command", [["tfdp-launch"], [sys.executable, "-m", "tfdp.launch"]],
                         ids=["console_script", "python_m"])
def test_the_installed_launcher_answers_help(command):
    # The console script `tfdp-launch` and `python -m tfdp.launch` are one program.
    executable = shutil.which(command[0])
    assert executable, f"{command[0]} is not on PATH: pip install -e . installs it"
    result = subprocess.run([executable, *command[1:], "--help"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: tfdp-launch --nproc_per_node N")


@pytest.mark.slow
def test_cli_rejects_bad_arguments_before_starting_anything():
    result = run_launch(["python", "-c", "print('started')"], nproc=0, timeout=60)
    assert result.returncode == 2, result.describe()
    assert "`nproc_per_node` must be a positive integer" in result.stderr
    assert "started" not in result.stdout and "[launch] starting" not in result.stderr


REPORT_WORKER = """
import json
print(json.dumps({"pid": os.getpid(), "TF_CONFIG": os.environ["TF_CONFIG"],
                  "rank": os.environ["TFDP_RANK"],
                  "world": os.environ["TFDP_WORLD_SIZE"]}))
print(f"to stderr from {RANK}", file=sys.stderr)
"""


@pytest.mark.slow
def test_cli_prefixes_output_and_sets_each_worker_environment(tmp_path, pid_dir):
    result = run_worker_script(tmp_path, PRELUDE + REPORT_WORKER, nproc=2, timeout=120,
                               env={"PID_DIR": str(pid_dir)}, check=True)
    print(f"2 workers, end to end: {result.elapsed:.2f} s")
    reports = [json.loads(result.worker_stdout(rank)[0]) for rank in (0, 1)]
    configs = [parse_tf_config(r["TF_CONFIG"]) for r in reports]
    assert [c.task_index for c in configs] == [0, 1]
    assert [r["rank"] for r in reports] == ["0", "1"]
    assert {r["world"] for r in reports} == {"2"}
    assert configs[0].cluster == configs[1].cluster
    assert len(set(configs[0].cluster["worker"])) == 2
    for rank in (0, 1):
        assert result.worker_stderr(rank) == [f"to stderr from {rank}"]
    assert all(line.startswith(("[0] ", "[1] ")) for line in result.stdout.splitlines())
    assert len(result.launcher_messages()) == 1  # just the start-up line
    assert result.launcher_messages()[0].startswith("starting 2 worker(s) on 127.0.0.1 ports")


GRANDCHILD_WORKER = """
if RANK == 0:
    child = subprocess.Popen(["sleep", "60"])  # in worker 0's process group
    write_pid("grandchild", child.pid)
    time.sleep(60)
else:
    wait_for_pid("grandchild")
    print("rank 1 failing", flush=True)
    sys.exit(3)
"""


@pytest.mark.slow
def test_cli_fail_fast_leaves_no_process_and_no_zombie(tmp_path, pid_dir):
    with pytest.raises(LaunchFailed) as info:
        run_worker_script(tmp_path, PRELUDE + GRANDCHILD_WORKER, nproc=2, timeout=120,
                          env={"PID_DIR": str(pid_dir)}, launch_args=["--grace_period", "2"],
                          check=True)
    result = info.value.result
    print(f"fail-fast end to end: exit {result.returncode} after {result.elapsed:.2f} s "
          "(including the launcher's start-up)")
    assert result.returncode == 3, result.describe()
    assert result.elapsed < 60, result.describe()
    assert result.worker_stdout(1) == ["rank 1 failing"]
    messages = result.launcher_messages()
    assert any("worker 1" in m and "exited with code 3" in m for m in messages), messages
    assert messages[-1] == "exiting with code 3 (worker 1 failed)"
    pids = [int(p) for p in wait_for_files(
        [pid_dir / "worker0.pid", pid_dir / "worker1.pid", pid_dir / "grandchild.pid"],
        timeout=1)]
    # Workers reaped by the launcher; the grandchild killed with worker 0's
    # process group and reaped by the launcher (a child subreaper).
    assert_processes_gone(pids)


IGNORE_SIGTERM_WORKER = """
if RANK == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_cli_forwards_sigterm_and_sigkills_after_the_grace_period(tmp_path, pid_dir):
    script = write_worker_script(tmp_path, PRELUDE + IGNORE_SIGTERM_WORKER)
    with start_launch(python_command(script), nproc=2, env={"PID_DIR": str(pid_dir)},
                      launch_args=["--grace_period", "1"]) as job:
        pids = [int(p) for p in wait_for_files(
            [pid_dir / "worker0.pid", pid_dir / "worker1.pid"], timeout=60, job=job)]
        job.send_signal(signal.SIGTERM)
        result = job.wait(timeout=60)
    assert result.returncode == 143, result.describe()
    messages = result.launcher_messages()
    assert any(m.startswith("received SIGTERM; forwarding it to 2") for m in messages)
    assert any(m.startswith("worker 0 (pid") and "still running 1 s after SIGTERM" in m
               for m in messages), messages
    assert not any(m.startswith("worker 1 (pid") for m in messages), messages
    assert messages[-1] == "exiting with code 143 (stopped the workers after a signal)"
    assert_processes_gone(pids)


MULTI_NODE_REPORT = """
import json
print(json.dumps({name: os.environ[name] for name in (
    "TF_CONFIG", "TFDP_RANK", "TFDP_LOCAL_RANK", "TFDP_NODE_RANK", "TFDP_WORLD_SIZE")}))
"""


def _free_first_ports(count, width):
    """`count` first ports of free, disjoint ranges of `width` ports."""
    firsts = []
    for _ in range(200):
        first = free_ports(1)[0]
        if (first + width <= 65535
                and not any(local.port_in_use(p) for p in range(first, first + width))
                and all(first + width <= f or f + width <= first for f in firsts)):
            firsts.append(first)
        if len(firsts) == count:
            return firsts
    pytest.skip("no free port ranges found")


def _start_nodes(command, *, hosts, nproc, env, extra=()):
    return [start_launch(command, nproc=nproc, env=env, launch_args=[
        "--nnodes", str(len(hosts.split(","))), "--node_rank", str(rank), "--hosts", hosts,
        "--grace_period", "2", *extra]) for rank in range(len(hosts.split(",")))]


@pytest.mark.slow
def test_cli_two_nodes_on_one_machine_form_one_job(tmp_path, pid_dir):
    script = write_worker_script(tmp_path, PRELUDE + MULTI_NODE_REPORT)
    first = _free_first_ports(2, 2)
    hosts = ",".join(f"127.0.0.1:{port}" for port in first)
    jobs = _start_nodes(python_command(script), hosts=hosts, nproc=2,
                        env={"PID_DIR": str(pid_dir)})
    try:
        results = [job.wait(timeout=120) for job in jobs]
    finally:
        for job in jobs:
            job.kill()
    reports = {}
    for node, result in enumerate(results):
        assert result.returncode == 0, result.describe()
        assert result.launcher_messages()[0].startswith(
            f"starting 2 worker(s) on 127.0.0.1 ports {first[node]},{first[node] + 1} "
            f"(node {node} of 2: ranks {2 * node}..{2 * node + 1} of 4)")
        for rank in (2 * node, 2 * node + 1):
            reports[rank] = json.loads(result.worker_stdout(rank)[0])
    assert sorted(reports) == [0, 1, 2, 3]
    clusters = {parse_tf_config(r["TF_CONFIG"]).cluster["worker"] for r in reports.values()}
    assert clusters == {(f"127.0.0.1:{first[0]}", f"127.0.0.1:{first[0] + 1}",
                         f"127.0.0.1:{first[1]}", f"127.0.0.1:{first[1] + 1}")}
    for rank, report in reports.items():
        assert parse_tf_config(report["TF_CONFIG"]).task_index == rank
        assert (report["TFDP_RANK"], report["TFDP_LOCAL_RANK"], report["TFDP_NODE_RANK"],
                report["TFDP_WORLD_SIZE"]) == (str(rank), str(rank % 2), str(rank // 2), "4")


ALL_REDUCE_WORKER = """
import tensorflow as tf
import tfdp

strategy = tfdp.make_strategy("multi_worker")
total = strategy.reduce(tf.distribute.ReduceOp.SUM,
                        strategy.run(lambda: tf.constant(1.0)), axis=None)
info = tfdp.strategy_info(strategy)
print(f"all-reduce {float(total)} worker {info.worker_index} of {info.num_workers}", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_two_nodes_of_one_tensorflow_worker_all_reduce(tmp_path):
    """Two launcher invocations (node ranks 0 and 1), one TensorFlow worker each."""
    script = write_worker_script(tmp_path, ALL_REDUCE_WORKER)
    hosts = ",".join(f"127.0.0.1:{port}" for port in _free_first_ports(2, 1))
    jobs = _start_nodes(python_command(script), hosts=hosts, nproc=1, env={})
    try:
        results = [job.wait(timeout=240) for job in jobs]
    finally:
        for job in jobs:
            job.kill()
    print(f"2 nodes x 1 TensorFlow worker: {max(r.elapsed for r in results):.1f} s")
    for node, result in enumerate(results):
        assert result.returncode == 0, result.describe()
        assert f"all-reduce 2.0 worker {node} of 2" in result.worker_stdout(node), \
            result.describe()


RESTARTING_WORKER = """
import os, sys
import tensorflow as tf
import tfdp

attempt, rank = int(os.environ["TFDP_RESTART_COUNT"]), int(os.environ["TFDP_RANK"])
strategy = tfdp.make_strategy("multi_worker")

def all_reduce():
    return float(strategy.reduce(tf.distribute.ReduceOp.SUM,
                                 strategy.run(lambda: tf.constant(1.0)), axis=None))

print(f"attempt {attempt} first all-reduce {all_reduce()}", flush=True)
if rank == 1 and attempt == 0:
    sys.exit(3)  # node 1's worker dies; node 0's worker waits in the next collective
print(f"attempt {attempt} second all-reduce {all_reduce()}", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_cli_two_nodes_restart_together_after_one_worker_fails(tmp_path):
    script = write_worker_script(tmp_path, RESTARTING_WORKER)
    hosts = ",".join(f"127.0.0.1:{port}" for port in _free_first_ports(2, 1))
    jobs = _start_nodes(python_command(script), hosts=hosts, nproc=1, env={},
                        extra=["--max_restarts", "1"])
    try:
        results = [job.wait(timeout=300) for job in jobs]
    finally:
        for job in jobs:
            job.kill()
    print(f"2 nodes, one restart: {max(r.elapsed for r in results):.1f} s")
    for node, result in enumerate(results):
        assert result.returncode == 0, result.describe()
        assert f"attempt 1 second all-reduce 2.0" in result.worker_stdout(node), result.describe()
        assert any(m.startswith(f"worker {node} exited with code")
                   and m.endswith("restarting the group (attempt 2 of 2)")
                   for m in result.launcher_messages()), result.describe()
