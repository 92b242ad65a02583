"""Tests for `tfdp.launch.restarts` and `tfdp.launch.local.restart_plan`: `--max_restarts`.

Plain-Python workers (no TensorFlow): worker 1 fails on its first two
attempts (a counter file survives the restarts) and succeeds on the third;
worker 0 runs until it is stopped, except in the attempt that succeeds.
Each attempt's workers record their pid and environment in
`PID_DIR/attempt<A>-rank<R>.json` (worker 1 fails only once worker 0 has).
"""

import io
import json
import os
import signal
import socket
import sys
import threading
import time

import pytest

from tfdp.launch import local, restarts
from launch_snippets import PRELUDE
from multiworker import assert_processes_gone, free_port_pair, run_worker_script, \
    wait_for_files, write_worker_script
from tfdp.distribute.cluster import parse_tf_config

FAILS_TWICE_WORKER = """
import json
ATTEMPT = int(os.environ["TFDP_RESTART_COUNT"])
record = os.path.join(PID_DIR, f"attempt{ATTEMPT}-rank{RANK}.json")
with open(record + ".tmp", "w") as f:
    json.dump({"pid": os.getpid(), "TF_CONFIG": os.environ["TF_CONFIG"]}, f)
os.replace(record + ".tmp", record)
if RANK == 1:
    while not os.path.exists(os.path.join(PID_DIR, f"attempt{ATTEMPT}-rank0.json")):
        time.sleep(0.02)
    counter = os.path.join(PID_DIR, "failures")
    failures = int(open(counter).read()) if os.path.exists(counter) else 0
    if failures < 2:
        with open(counter, "w") as f:
            f.write(str(failures + 1))
        print(f"rank 1 failing on attempt {ATTEMPT}", flush=True)
        print("Traceback: the cause of the failure", file=sys.stderr, flush=True)
        sys.exit(5)
    print(f"rank 1 succeeded on attempt {ATTEMPT}")
elif ATTEMPT < 2:
    time.sleep(60)  # stopped by the launcher when rank 1 fails
"""


def _run(tmp_path, pid_dir, source, *, max_restarts, port=None, nproc=2):
    script = write_worker_script(tmp_path, PRELUDE + source)
    out, err = io.BytesIO(), io.BytesIO()
    start = time.monotonic()
    code = local.run_local([sys.executable, "-u", str(script)], nproc_per_node=nproc,
                           port=port, grace_period=1.0, max_restarts=max_restarts,
                           environ=dict(os.environ, PID_DIR=str(pid_dir)), stdout=out,
                           stderr=err)
    return (code, out.getvalue().decode(errors="replace"),
            err.getvalue().decode(errors="replace"), time.monotonic() - start)


def _attempts(pid_dir):
    """attempt -> rank -> the record that worker wrote."""
    records = {}
    for path in pid_dir.glob("attempt*-rank*.json"):
        attempt, rank = path.stem.removeprefix("attempt").split("-rank")
        records.setdefault(int(attempt), {})[int(rank)] = json.loads(path.read_text())
    return records


def test_group_restarts_until_the_worker_succeeds(tmp_path, pid_dir):
    code, out, err, elapsed = _run(tmp_path, pid_dir, FAILS_TWICE_WORKER, max_restarts=2)
    print(f"3 attempts, 2 restarts: exit {code} after {elapsed:.2f} s")
    assert code == 0, err
    attempts = _attempts(pid_dir)
    assert sorted(attempts) == [0, 1, 2] and all(sorted(a) == [0, 1] for a in attempts.values())
    for number, records in attempts.items():
        for rank, record in records.items():
            config = parse_tf_config(record["TF_CONFIG"])
            assert config.task_index == rank and config.num_workers == 2
    # Every attempt is a fresh group: new processes, all reaped.
    pids = [r["pid"] for records in attempts.values() for r in records.values()]
    assert len(set(pids)) == 6
    assert_processes_gone(pids)
    assert "[1] rank 1 succeeded on attempt 2" in out
    for attempt in (2, 3):
        assert (f"[launch] worker 1 exited with code 5; restarting the group "
                f"(attempt {attempt} of 3)") in err
    assert "(attempt 3 of 3): " in err  # the start-up line of the last attempt
    assert "exiting with code" not in err and "[launch] | " not in err
    assert elapsed < 30


def test_after_the_last_restart_exit_code_and_log_tail(tmp_path, pid_dir):
    code, _, err, elapsed = _run(tmp_path, pid_dir, FAILS_TWICE_WORKER, max_restarts=1)
    assert code == 5, err
    assert sorted(_attempts(pid_dir)) == [0, 1]
    messages = [line.removeprefix("[launch] ") for line in err.splitlines()
                if line.startswith("[launch] ")]
    assert "worker 1 exited with code 5; restarting the group (attempt 2 of 2)" in messages
    assert "worker 1 exited with code 5 in the last attempt (2 of 2); not restarting" in messages
    # The failing worker's last lines of stdout, of stderr, then the exit line.
    assert messages[-5:] == [
        "last 1 line(s) of worker 1's stdout:",
        "| rank 1 failing on attempt 1",
        "last 1 line(s) of worker 1's stderr:",
        "| Traceback: the cause of the failure",
        "exiting with code 5 (worker 1 failed)",
    ]
    assert_processes_gone([r["pid"] for records in _attempts(pid_dir).values()
                           for r in records.values()])
    assert elapsed < 30


ALWAYS_FAILS_WORKER = FAILS_TWICE_WORKER.replace("if failures < 2:", "if True:")


def test_a_worker_failing_every_attempt_gives_up_after_max_restarts_plus_one(
    tmp_path, pid_dir
):
    code, _, err, _ = _run(tmp_path, pid_dir, ALWAYS_FAILS_WORKER, max_restarts=2)
    assert code == 5, err
    assert sorted(_attempts(pid_dir)) == [0, 1, 2]  # the third failure is the last
    assert "worker 1 exited with code 5 in the last attempt (3 of 3); not restarting" in err
    assert "| Traceback: the cause of the failure" in err
    assert_processes_gone([r["pid"] for records in _attempts(pid_dir).values()
                           for r in records.values()])


def test_without_restarts_the_failure_still_shows_the_log_tail(tmp_path, pid_dir):
    code, _, err, _ = _run(tmp_path, pid_dir, FAILS_TWICE_WORKER, max_restarts=0)
    assert code == 5
    assert "restarting" not in err and "in the last attempt" not in err
    assert "[launch] | rank 1 failing on attempt 0" in err
    assert err.splitlines()[-1] == "[launch] exiting with code 5 (worker 1 failed)"


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed_port", "free_ports"])
def test_restart_reuses_fixed_ports_and_picks_fresh_free_ones(tmp_path, pid_dir, fixed,
                                                              monkeypatch):
    port = free_port_pair() if fixed else None
    if not fixed:
        # Make "fresh" observable: the restart must ask for new free ports.
        picks = iter([[41001, 41002], [41011, 41012], [41021, 41022]])
        monkeypatch.setattr(local.local_cluster, "free_ports", lambda n, host: next(picks))
    code, _, err, _ = _run(tmp_path, pid_dir, FAILS_TWICE_WORKER, max_restarts=2, port=port)
    assert code == 0, err
    clusters = [parse_tf_config(records[0]["TF_CONFIG"]).cluster["worker"]
                for _, records in sorted(_attempts(pid_dir).items())]
    if fixed:
        expected = (f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}")
        assert clusters == [expected] * 3
    else:
        assert clusters == [("127.0.0.1:41001", "127.0.0.1:41002"),
                            ("127.0.0.1:41011", "127.0.0.1:41012"),
                            ("127.0.0.1:41021", "127.0.0.1:41022")]


def test_a_signal_never_restarts(tmp_path, pid_dir):
    source = "print('ready', flush=True)\ntime.sleep(60)\n"

    def send_sigterm():
        wait_for_files([pid_dir / "worker0.pid", pid_dir / "worker1.pid"], timeout=30)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=send_sigterm, daemon=True)
    thread.start()
    code, _, err, _ = _run(tmp_path, pid_dir, source, max_restarts=3)
    thread.join()
    assert code == 143, err
    assert "restarting" not in err
    assert err.count("[launch] starting 2 worker(s)") == 1
    assert err.splitlines()[-1] == ("[launch] exiting with code 143 (stopped the workers "
                                    "after a signal)")


def test_a_restart_that_cannot_be_planned_ends_the_launch(tmp_path, pid_dir):
    script = write_worker_script(tmp_path, PRELUDE + FAILS_TWICE_WORKER)
    plan = local.plan_local([sys.executable, "-u", str(script)], nproc_per_node=2,
                            grace_period=1.0, max_restarts=5,
                            environ=dict(os.environ, PID_DIR=str(pid_dir)))

    def replan(plan, restart_count, cancelled):
        raise OSError("port 5000 is still in use")

    err = io.BytesIO()
    code = restarts.run_with_restarts(plan, describe=lambda p, a: p.describe(a), replan=replan,
                                      stdout=io.BytesIO(), stderr=err)
    text = err.getvalue().decode()
    assert code == 5
    assert "[launch] cannot restart the group: port 5000 is still in use" in text
    assert text.splitlines()[-1] == "[launch] exiting with code 5 (worker 1 failed)"
    assert sorted(_attempts(pid_dir)) == [0]


def test_restart_plan_waits_for_fixed_ports_then_gives_up():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        plan = local.LocalLaunchPlan(command=("true",), nproc_per_node=1, ports=(port,),
                                     grace_period=1.0, workers=(), fixed_ports=True)
        start = time.monotonic()
        with pytest.raises(OSError, match=f"port {port} is still in use .* after the "
                                          "workers were stopped"):
            local.restart_plan(plan, restart_count=1, port_timeout=0.3)
        assert 0.3 <= time.monotonic() - start < 5
        with pytest.raises(OSError):  # a signal cancels the wait at once
            local.restart_plan(plan, restart_count=1, port_timeout=60,
                               cancelled=lambda: True)


def test_restart_plan_renews_each_worker_environment():
    plan = local.plan_local(["python"], nproc_per_node=2, max_restarts=1,
                            environ={"PATH": os.environ["PATH"], "KEEP": "1"})
    again = local.restart_plan(plan, restart_count=1)
    for old, new in zip(plan.workers, again.workers):
        assert old.env["TFDP_RESTART_COUNT"] == "0" and new.env["TFDP_RESTART_COUNT"] == "1"
        assert new.rank == old.rank and new.env["KEEP"] == "1"
        assert new.env["TFDP_RANK"] == old.env["TFDP_RANK"]
        assert parse_tf_config(new.env["TF_CONFIG"]).cluster["worker"] == tuple(
            f"127.0.0.1:{p}" for p in again.ports)


@pytest.mark.slow
def test_cli_max_restarts_end_to_end(tmp_path, pid_dir):
    result = run_worker_script(tmp_path, PRELUDE + FAILS_TWICE_WORKER, nproc=2, timeout=120,
                               env={"PID_DIR": str(pid_dir)},
                               launch_args=["--max_restarts", "2", "--grace_period", "1"])
    assert result.returncode == 0, result.describe()
    assert result.worker_stdout(1)[-1] == "rank 1 succeeded on attempt 2"
    assert sum("restarting the group" in m for m in result.launcher_messages()) == 2
    assert_processes_gone([r["pid"] for records in _attempts(pid_dir).values()
                           for r in records.values()])
