"""A one-node Slurm cluster in a temporary directory, for tests and by hand.

This module owns the cluster's life: it writes a `slurm.conf` and a fresh
munge key into one directory, starts `munged` (its own socket, key, pid and
log files there), `slurmctld` and `slurmd` as child processes of this
process, waits until the node is idle, and stops every one of them again,
`wait()`ing for each, with every job and job-step process that carries this
cluster's `SLURM_CONF`. It needs Debian's `slurm-wlm` and `munge` packages
(Slurm 22.05; run as root: the daemons and the jobs run as the current user).
What the jobs do is the tests' business (`tests/slurm/test_slurm_jobs.py`).

The cluster: `ProctrackType=proctrack/linuxproc`, `TaskPlugin=task/none`
(no cgroups), `SelectType=select/cons_tres` over CPUs, one node named after
this host (the workers find each other through the node names `srun` gives
them) with the CPUs and memory `slurmd -C` reports, one default partition
`debug`, no accounting. The daemons listen on free ports on 127.0.0.1, so
several clusters (one per test session) can run side by side.

The daemons run under their own process, `python tests/slurm/slurm_cluster.py`:
`slurmd` forks a `slurmstepd` per job step that outlives its parent, and that
process makes itself their child subreaper and reaps them, so nothing is left
as a zombie of PID 1 (which does not reap on every machine). The pytest
fixture (`tests/slurm/conftest.py`) starts it with `ClusterProcess.start()`
and talks to the cluster through a `SlurmClient`.

From a shell (as root):

    python tests/slurm/slurm_cluster.py      # prints `export SLURM_CONF=...`
    # in another shell: export SLURM_CONF=...; srun -n 2 hostname
    # Ctrl-C (or SIGTERM) stops the daemons and removes the directory

From Python (in-process; the caller reaps the step daemons):

    with SlurmCluster.start() as cluster:
        cluster.run(["srun", "-n", "2", "hostname"])
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

from tfdp.launch import _proc

#: Programs the cluster needs, by Debian package.
REQUIRED_BINARIES = {"munge": ("munged", "mungekey"),
                     "slurm-wlm": ("slurmctld", "slurmd", "sbatch", "srun", "scontrol",
                                   "scancel", "sinfo")}
#: Job states after which a job no longer runs (`scontrol show job`'s JobState).
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                          "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"})
#: Seconds a daemon gets to exit after SIGTERM before SIGKILL.
_STOP_GRACE = 10.0
_CONF = """\
# Written by tests/slurm/slurm_cluster.py: a one-node test cluster.
ClusterName=tfdptest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
SchedulerType=sched/builtin
ReturnToService=2
KillWait=10
MinJobAge=600
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class ClusterError(RuntimeError):
    """The cluster did not start (the message quotes the daemons' logs)."""


def missing_binaries() -> list[str]:
    """Returns the programs the cluster needs that are not on PATH (empty: none)."""
    return [name for names in REQUIRED_BINARIES.values() for name in names
            if shutil.which(name) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_hardware() -> dict[str, str]:
    """`slurmd -C`'s view of this machine: NodeName, CPUs, RealMemory, ..."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30,
                         check=True).stdout
    return dict(re.findall(r"(\w+)=(\S+)", out))


def _processes_with(variable: str) -> list[int]:
    """Pids of processes whose environment holds `variable` (a `NAME=value`)."""
    needle = variable.encode() + b"\0"
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read() + b"\0"
        except OSError:
            continue
        if b"\0" + needle in b"\0" + environ:
            pids.append(int(entry))
    return pids


class SlurmClient:
    """Slurm commands against one cluster, named by its `slurm.conf`.

    Args:
        conf: the cluster's `slurm.conf`.

    Attributes:
        conf: that file.
        root: its directory (state, logs, key).
        env: an environment for Slurm commands and jobs (this process's, plus
            `SLURM_CONF`).
    """

    def __init__(self, conf: str | os.PathLike):
        self.conf = Path(conf)
        self.root = self.conf.parent
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for name in [name for name in self.env if name.startswith("SLURM_") and
                     name != "SLURM_CONF"]:
            del self.env[name]  # not a job of some outer cluster

    def query(self, argv: Sequence[str]) -> str | None:
        """Output of a quick Slurm command, or None if it failed."""
        try:
            result = subprocess.run(list(argv), env=self.env, capture_output=True, text=True,
                                    timeout=15)
        except subprocess.TimeoutExpired:
            return None
        return result.stdout if result.returncode == 0 else None

    def run(self, argv: Sequence[str], *, timeout: float = 60.0, check: bool = True,
            cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
        """Runs a command (a Slurm client, a job submission) against this cluster."""
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=check, cwd=cwd)

    def logs(self, tail: int = 30) -> str:
        """The last `tail` lines of every daemon's log, for error messages."""
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"--- {path.name} ---\n" + "\n".join(lines))
        return "\n".join(parts)

    def job(self, job_id: int | str) -> dict[str, str]:
        """`scontrol show job`'s fields of a job (JobState, ExitCode, Restarts, ...)."""
        out = self.run(["scontrol", "show", "job", "-o", str(job_id)], timeout=15).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: int | str, *, timeout: float,
                 until=lambda job: job.get("JobState") in FINAL_STATES) -> dict[str, str]:
        """Polls a job until `until(fields)` holds; returns its fields.

        Raises:
            TimeoutError: after `timeout` seconds (the job is left to the caller).
        """
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if until(job):
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"Slurm job {job_id} still {job.get('JobState')} "
                                   f"(reason {job.get('Reason')}) after {timeout:g} s")
            time.sleep(0.25)

    def cancel_all(self, *, timeout: float = 30.0) -> None:
        """Cancels every job and waits until none is left running (best effort)."""
        if self.query(["scancel", "--full", "--user", str(os.getuid())]) is None:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not (self.query(["squeue", "-h", "-o", "%i"]) or "").strip():
                return  # squeue lists the jobs that have not ended
            time.sleep(0.25)

    def kill_leftovers(self) -> list[int]:
        """SIGKILLs every process carrying this cluster's `SLURM_CONF`; returns their pids.

        Jobs inherit the submitting environment, so this finds job steps and
        tasks; call it after the daemons are stopped.
        """
        pids = _processes_with(f"SLURM_CONF={self.conf}")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids


class SlurmCluster(SlurmClient):
    """A running one-node cluster whose daemons are this process's children.

    Use `SlurmCluster.start()`; `stop()` (or leaving `with`) ends it.

    Attributes:
        node: the node's name.
        cpus: the node's CPUs.
        start_seconds: how long `start()` took, until the node was idle.
    """

    def __init__(self, root: Path, *, remove_root: bool):
        super().__init__(Path(root) / "slurm.conf")
        self.node = ""
        self.cpus = 0
        self.start_seconds = 0.0
        self._remove_root = remove_root
        self._daemons: list[tuple[str, subprocess.Popen]] = []

    @classmethod
    def start(cls, root: str | os.PathLike | None = None, *,
              timeout: float = 60.0) -> "SlurmCluster":
        """Starts munged, slurmctld and slurmd and waits until the node is idle.

        Args:
            root: an empty directory for the cluster. Defaults to a new
                temporary directory, removed again by `stop()`.
            timeout: seconds until the node must be idle.

        Returns:
            The running cluster.

        Raises:
            ClusterError: if a program is missing, a daemon exits, or the node
                is not idle in time (everything started is stopped first).
        """
        missing = missing_binaries()
        if missing:
            raise ClusterError(
                f"Slurm test cluster: {', '.join(missing)} not on PATH; install them with "
                f"`apt-get install -y slurm-wlm munge` (as root).")
        began = time.monotonic()
        if root is None:
            # Short: munged's socket path must fit in a sockaddr_un (108 bytes).
            cluster = cls(Path(tempfile.mkdtemp(prefix="tfdp-slurm-")), remove_root=True)
        else:
            cluster = cls(Path(root), remove_root=False)
        try:
            cluster._start(timeout)
        except BaseException:
            cluster.stop()
            raise
        cluster.start_seconds = time.monotonic() - began
        return cluster

    def _start(self, timeout: float) -> None:
        root = self.root
        os.chmod(root, 0o711)  # munged wants its socket's directories searchable
        for sub in ("munge", "state", "spool", "log"):
            (root / sub).mkdir(mode=0o711 if sub == "munge" else 0o700, exist_ok=True)
        hardware = _node_hardware()
        self.node = hardware.get("NodeName") or socket.gethostname().split(".")[0]
        self.cpus = int(hardware.get("CPUs", os.cpu_count() or 1))
        user = subprocess.run(["id", "-un"], capture_output=True, text=True,
                              check=True).stdout.strip()
        self.conf.write_text(_CONF.format(
            node=self.node, cpus=self.cpus, memory=hardware.get("RealMemory", "1"),
            ctld_port=_free_port(), slurmd_port=_free_port(), user=user, root=root))
        key = root / "munge" / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True,
                       capture_output=True, timeout=30)
        socket_path = root / "munge" / "munge.socket"
        self._spawn("munged", ["munged", "--foreground", "--force", f"--socket={socket_path}",
                               f"--key-file={key}", f"--pid-file={root}/munge/munged.pid",
                               f"--log-file={root}/log/munged.log",
                               f"--seed-file={root}/munge/munged.seed"])
        self._wait_for(socket_path.exists, timeout, "munged's socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
        self._wait_for(lambda: self.query(["sinfo", "-h"]) is not None, timeout,
                       "slurmctld to answer")
        self._spawn("slurmd", ["slurmd", "-D", "-N", self.node])
        self._wait_for(lambda: (self.query(["sinfo", "-h", "-N", "-o", "%T"]) or "")
                       .strip() == "idle", timeout, "the node to be idle")

    def _spawn(self, name: str, argv: Sequence[str]) -> None:
        with open(self.root / "log" / f"{name}.out", "wb") as log:
            process = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        self._daemons.append((name, process))

    def _wait_for(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, process in self._daemons:
                if process.poll() is not None:
                    raise ClusterError(f"Slurm test cluster: {name} exited with status "
                                       f"{process.returncode} while waiting for {what}.\n"
                                       f"{self.logs()}")
            if time.monotonic() > deadline:
                raise ClusterError(f"Slurm test cluster: no {what} after {timeout:g} s.\n"
                                   f"{self.logs()}")
            time.sleep(0.2)

    def daemon_pids(self) -> set[int]:
        """Pids of the daemons still running."""
        return {process.pid for _, process in self._daemons if process.poll() is None}

    def stop(self) -> list[int]:
        """Cancels the jobs, stops the daemons (SIGTERM, then SIGKILL), waits for them.

        Any process still carrying this cluster's `SLURM_CONF` afterwards (a
        job step, a task) is killed and listed. Removes the directory if
        `start()` made it. Safe to call twice.

        Returns:
            The pids of leftover processes it had to kill (empty: none).
        """
        if self.daemon_pids():
            self.cancel_all()
        for _, process in reversed(self._daemons):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(_STOP_GRACE)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
        self._daemons.clear()
        leftovers = self.kill_leftovers()
        if self._remove_root and self.root.exists():
            shutil.rmtree(self.root, ignore_errors=True)
        return leftovers

    def __enter__(self) -> "SlurmCluster":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def _reap_orphans(keep: set[int]) -> None:
    """Reaps this subreaper's exited children other than `keep` (the daemons)."""
    for pid in _proc.children_of(os.getpid()):
        if pid not in keep and _proc.process_state(pid) == "Z":
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


class ClusterProcess(SlurmClient):
    """The cluster run by `python slurm_cluster.py` in its own process (for pytest).

    Use `ClusterProcess.start()`; `stop()` ends the process, which stops the
    daemons, kills what is left of the jobs and removes the directory.
    """

    def __init__(self, conf: str, process: subprocess.Popen, lines: list[str],
                 reader: threading.Thread):
        super().__init__(conf)
        self.process = process
        self.lines = lines  # its output so far
        self._reader = reader

    @classmethod
    def start(cls, *, timeout: float = 90.0) -> "ClusterProcess":
        """Starts `python slurm_cluster.py` and waits for its `SLURM_CONF`.

        Raises:
            ClusterError: if it exits or says nothing in `timeout` seconds (it
                is stopped first), with its output.
        """
        # SIGTERM (a clean stop) if this process dies without stopping it.
        process = subprocess.Popen([sys.executable, "-u", __file__], stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, start_new_session=True,
                                   preexec_fn=_proc.parent_death_signal_hook(signal.SIGTERM))
        lines: list[str] = []
        # Its output is read by a thread until it exits, so it never blocks on a full pipe.
        reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
        reader.start()
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and process.poll() is None:
                conf = next((line.strip().split("=", 1)[1] for line in list(lines)
                             if line.startswith("export SLURM_CONF=")), None)
                if conf and any(line.startswith("Ctrl-C") for line in list(lines)):
                    return cls(conf, process, lines, reader)
                time.sleep(0.1)
        except BaseException:
            cls._end(process)
            raise
        cls._end(process)
        reader.join(10)
        raise ClusterError("Slurm test cluster did not start:\n" + "".join(lines))

    @staticmethod
    def _end(process: subprocess.Popen, timeout: float = 60.0) -> None:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def stop(self) -> str:
        """Stops the cluster process; returns what it printed while stopping."""
        self._end(self.process)
        self.kill_leftovers()  # only if the process had to be SIGKILLed
        self._reader.join(10)
        return "".join(self.lines)


def main() -> int:
    """`python tests/slurm/slurm_cluster.py`: runs a cluster until Ctrl-C or SIGTERM."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    _proc.set_child_subreaper()  # adopt the job steps' slurmstepd, to reap them
    try:
        cluster = SlurmCluster.start()
    except (ClusterError, KeyboardInterrupt) as error:
        print(error, file=sys.stderr)
        return 1
    try:
        print(f"Slurm test cluster up in {cluster.start_seconds:.1f} s: node {cluster.node} "
              f"with {cluster.cpus} CPUs, files in {cluster.root}.\n"
              f"export SLURM_CONF={cluster.conf}\n"
              "Ctrl-C stops it.", flush=True)
        while True:
            time.sleep(0.5)
            _reap_orphans(cluster.daemon_pids())
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # let stop() finish
        leftovers = cluster.stop()
        _proc.reap_children()
        print(f"Slurm test cluster stopped (leftover processes killed: {leftovers or 'none'}).",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
