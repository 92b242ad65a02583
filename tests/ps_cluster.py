"""A local `ParameterServerStrategy` cluster for tests: real processes, all cleaned up.

`LocalPsCluster` starts each worker and ps task as its own process
(`tfdp.distribute.parameter_server.serve`, with its TF_CONFIG from
`tfdp.distribute.local_cluster.parameter_server_tf_configs`) on 127.0.0.1,
runs the chief's script with a timeout, can SIGKILL a worker and start it
again on its own address, and on `close()` kills every process it started,
by pid, and checks that none is left (`multiworker.assert_processes_gone`).
Use it as a context manager:

    with LocalPsCluster(tmp_path, num_workers=2) as cluster:
        result = cluster.run_chief(["python", "job.py"], timeout=240)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import multiworker

from tfdp.distribute import local_cluster

_SERVE = "from tfdp.distribute import parameter_server; parameter_server.serve()"


class LocalPsCluster:
    """One chief, `num_workers` workers and `num_ps` ps tasks on this host.

    Args:
        tmp_path: where each task's output goes (`<task>-<index>.log`).
        num_workers: worker tasks. Defaults to 2.
        num_ps: ps tasks. Defaults to 1.
        env: extra environment for every task.
    """

    def __init__(self, tmp_path: Path, *, num_workers: int = 2, num_ps: int = 1,
                 env: dict | None = None):
        self.tmp_path = Path(tmp_path)
        self.configs = local_cluster.parameter_server_tf_configs(num_workers, num_ps)
        self._token = f"ps-{os.getpid()}-{id(self)}"
        self._env = multiworker._environment(env, self._token)
        self.servers: dict[tuple[str, int], subprocess.Popen] = {}
        self._all: list[subprocess.Popen] = []

    def __enter__(self) -> "LocalPsCluster":
        for config in self.configs[1:]:
            self.start(config["task"]["type"], config["task"]["index"])
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _config(self, job: str, index: int) -> dict:
        return next(c for c in self.configs
                    if c["task"] == {"type": job, "index": index})

    def start(self, job: str, index: int) -> subprocess.Popen:
        """Starts (or starts again) the server of task `job:index`."""
        env = dict(self._env, TF_CONFIG=json.dumps(self._config(job, index)))
        log = open(self.tmp_path / f"{job}-{index}.log", "ab")
        process = subprocess.Popen([sys.executable, "-c", _SERVE], env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
        log.close()
        self.servers[(job, index)] = process
        self._all.append(process)
        return process

    def kill(self, job: str, index: int) -> None:
        """SIGKILLs task `job:index` and reaps it."""
        process = self.servers[(job, index)]
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)

    def chief_environment(self) -> dict:
        return dict(self._env, TF_CONFIG=json.dumps(self.configs[0]))

    def start_chief(self, command: Sequence[str]) -> subprocess.Popen:
        """Starts the chief's program (its output captured); `close()` kills it if still running."""
        process = subprocess.Popen(list(command), env=self.chief_environment(),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._all.append(process)
        return process

    def run_chief(self, command: Sequence[str], *, timeout: float) -> subprocess.CompletedProcess:
        """Runs the chief's program to its end; raises with its output on timeout or failure."""
        process = self.start_chief(command)
        return self.finish_chief(process, timeout=timeout)

    def finish_chief(self, process: subprocess.Popen, *, timeout: float):
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
            raise AssertionError(
                f"the chief did not finish within {timeout:g} s\n--- stdout\n{stdout[-3000:]}"
                f"\n--- stderr\n{stderr[-6000:]}\n--- servers\n{self.server_logs()}") from None
        if process.returncode != 0:
            raise AssertionError(
                f"the chief exited {process.returncode}\n--- stdout\n{stdout[-3000:]}"
                f"\n--- stderr\n{stderr[-6000:]}\n--- servers\n{self.server_logs()}")
        return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)

    def server_logs(self, chars: int = 1500) -> str:
        parts = []
        for path in sorted(self.tmp_path.glob("*.log")):
            parts.append(f"[{path.name}] {path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    def close(self) -> None:
        """Kills every process this cluster started (by pid) and checks none is left."""
        for process in self._all:
            if process.poll() is None:
                process.kill()
        for process in self._all:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        multiworker.assert_processes_gone([p.pid for p in self._all], timeout=10)
        left = multiworker.marked_processes(self._token)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"processes of this cluster left running (now killed): {left}"


def result_of(stdout: str) -> dict:
    """The JSON the chief printed after `RESULT `."""
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, stdout[-3000:]
    return json.loads(lines[-1][len("RESULT "):])
