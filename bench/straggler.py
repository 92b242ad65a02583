"""A real straggler for the benchmarks and tests: one worker's processes held to a fraction of a CPU.

Shared hosts, thermal throttling and noisy neighbours make one worker of a
job slower than the others, and a synchronous job then runs at its pace. To
reproduce that without touching tfdp's code (no sleep in a train step),
`cpu_limited(0.5)` creates a CPU cgroup whose CFS quota is half of each
period (`cpu.cfs_quota_us` = 50,000 of `cpu.cfs_period_us` = 100,000 on
cgroup v1; `cpu.max` = "50000 100000" on v2): every thread of every process
in it, together, gets at most half a CPU of wall time, whatever the machine's
load. The group is removed when the block ends, whatever happened in it;
processes still in it are moved back to the parent group first.

From the command line, as a wrapper under `tfdp-launch` (only the worker
whose `TFDP_RANK` is `--rank` is slowed; the others run the command as is):

    tfdp-launch --nproc_per_node 2 -- python -m tfdp.bench.straggler \\
        --rank 1 --cpu_fraction 0.5 -- tfdp-train --dataset=digits --model=cnn

The wrapper runs the command as its child inside the group, passes SIGTERM
and SIGINT on to it, removes the group when it exits and exits with its
code (128 + N for a signal N, as a shell does).

Needs root and a CPU controller (v1 at `/sys/fs/cgroup/cpu`, or v2 with
`cpu` in `/sys/fs/cgroup/cgroup.controllers`); without them
`StragglerUnavailable` says which is missing, in one line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import os
import signal
import subprocess
import sys
from typing import Iterator, Sequence

#: Where cgroup v1 mounts the CPU controller, and the v2 hierarchy.
V1_CPU_ROOT = "/sys/fs/cgroup/cpu"
V2_ROOT = "/sys/fs/cgroup"
#: The name of every group made here starts so, then the creating process's pid.
PREFIX = "tfdp-straggler-"
#: The CFS period (µs): 100 ms, the kernel's default.
PERIOD_US = 100_000
#: Groups this process made, numbered so that two in one process differ.
_COUNTER = itertools.count()


class StragglerUnavailable(RuntimeError):
    """This machine cannot hold a process to a CPU fraction (not root, or no CPU controller)."""


def why_unavailable() -> str | None:
    """None if `cpu_limited` can work here; else what is missing, in one sentence."""
    if os.geteuid() != 0:
        return "Slowing a worker with a CPU cgroup needs root; run the benchmark as root."
    if _hierarchy() is None:
        return (f"No CPU cgroup controller: neither {V1_CPU_ROOT}/cpu.cfs_quota_us (cgroup v1) "
                f"nor 'cpu' in {V2_ROOT}/cgroup.controllers (cgroup v2). Mount one, or run "
                "the benchmark without a straggler.")
    return None


def check_fraction(cpu_fraction: float) -> float:
    """Returns `cpu_fraction` if it is a CPU share a group can be held to: 0.01 to 64 CPUs."""
    if isinstance(cpu_fraction, bool) or not isinstance(cpu_fraction, (int, float)) or not (
            0.01 <= cpu_fraction <= 64):
        raise ValueError(
            "`cpu_fraction` must be the CPUs' worth of time the straggler gets, from 0.01 "
            f"to 64 (0.5: half of one CPU). Received: cpu_fraction={cpu_fraction!r}")
    return float(cpu_fraction)


@dataclasses.dataclass(frozen=True)
class CpuGroup:
    """A CPU cgroup made by `cpu_limited`.

    Attributes:
        path: its directory.
        version: 1 or 2, the cgroup hierarchy it lives in.
        cpu_fraction: CPUs' worth of time per period its processes share.
    """

    path: str
    version: int
    cpu_fraction: float

    def add(self, pid: int) -> None:
        """Moves process `pid` (all its threads; its future children follow) into the group."""
        _write(os.path.join(self.path, "cgroup.procs"), str(pid))

    def pids(self) -> list[int]:
        """The processes in the group now."""
        with open(os.path.join(self.path, "cgroup.procs")) as f:
            return [int(line) for line in f if line.strip()]

    def throttled_periods(self) -> int:
        """CFS periods in which the group used up its quota and was stopped (`nr_throttled`)."""
        with open(os.path.join(self.path, "cpu.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "nr_throttled":
                    return int(value)
        raise StragglerUnavailable(f"{self.path}/cpu.stat has no nr_throttled line")


def _hierarchy() -> tuple[str, int] | None:
    if os.path.exists(os.path.join(V1_CPU_ROOT, "cpu.cfs_quota_us")):
        return V1_CPU_ROOT, 1
    try:
        with open(os.path.join(V2_ROOT, "cgroup.controllers")) as f:
            if "cpu" in f.read().split():
                return V2_ROOT, 2
    except OSError:
        pass
    return None


def current_group() -> CpuGroup | None:
    """The straggler group this process runs in (one `cpu_limited` made), or None.

    Read from `/proc/self/cgroup`, so a process started under `run_wrapped`
    (e.g. one worker of a benchmark) can report the quota it ran under and
    its throttled periods.
    """
    hierarchy = _hierarchy()
    if hierarchy is None:
        return None
    root, version = hierarchy
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, relative = line.split(":", 2)
        wanted = controllers == "" if version == 2 else "cpu" in controllers.split(",")
        if not wanted or not os.path.basename(relative).startswith(PREFIX):
            continue
        path = os.path.join(root, relative.lstrip("/"))
        try:
            if version == 1:
                with open(os.path.join(path, "cpu.cfs_quota_us")) as f:
                    quota, period = int(f.read()), PERIOD_US
                with open(os.path.join(path, "cpu.cfs_period_us")) as f:
                    period = int(f.read())
            else:
                with open(os.path.join(path, "cpu.max")) as f:
                    quota_text, period_text = f.read().split()
                quota, period = int(quota_text), int(period_text)
        except (OSError, ValueError):
            return None
        return CpuGroup(path, version, quota / period)
    return None


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


@contextlib.contextmanager
def cpu_limited(cpu_fraction: float, *, name: str | None = None) -> Iterator[CpuGroup]:
    """A CPU cgroup whose processes share `cpu_fraction` CPUs' worth of time.

    Args:
        cpu_fraction: CPUs of time per `PERIOD_US` (0.5: half of one CPU).
        name: the group's directory name. Defaults to
            `tfdp-straggler-<pid>-<n>`. Empty groups of processes that are
            gone are removed first (`remove_orphans`).

    Yields:
        The `CpuGroup`; put processes in with `add(pid)`.

    Raises:
        ValueError: `cpu_fraction` out of range.
        StragglerUnavailable: not root, no CPU controller, or the kernel
            refused the group (nothing is left behind).
    """
    check_fraction(cpu_fraction)
    reason = why_unavailable()
    if reason is not None:
        raise StragglerUnavailable(reason)
    root, version = _hierarchy()
    remove_orphans(root)
    path = os.path.join(root, name or f"{PREFIX}{os.getpid()}-{next(_COUNTER)}")
    quota = max(1000, round(cpu_fraction * PERIOD_US))
    try:
        os.mkdir(path)
    except OSError as error:
        raise StragglerUnavailable(f"Could not create the cgroup {path}: {error}") from error
    try:
        try:
            if version == 1:
                _write(os.path.join(path, "cpu.cfs_period_us"), str(PERIOD_US))
                _write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))
            else:
                _write(os.path.join(path, "cpu.max"), f"{quota} {PERIOD_US}")
        except OSError as error:
            raise StragglerUnavailable(
                f"The kernel refused a CPU quota of {quota} µs per {PERIOD_US} µs in {path}: "
                f"{error}") from error
        yield CpuGroup(path, version, float(cpu_fraction))
    finally:
        _remove(path, parent=root)


def remove_orphans(root: str) -> list[str]:
    """Removes the empty groups whose creating process is gone; returns their paths.

    A wrapper killed with SIGKILL (as `tfdp-launch` ends a worker that
    outlives its grace period) cannot remove its group; the next
    `cpu_limited` on the machine does. Groups that still hold processes are
    left alone.
    """
    removed = []
    for entry in os.listdir(root):
        owner = entry[len(PREFIX):].split("-", 1)[0]
        if not entry.startswith(PREFIX) or not owner.isdigit() or os.path.exists(
                f"/proc/{owner}"):
            continue
        with contextlib.suppress(OSError):  # not empty, or removed meanwhile
            os.rmdir(os.path.join(root, entry))
            removed.append(os.path.join(root, entry))
    return removed


def _remove(path: str, *, parent: str) -> None:
    """Moves what is left in the group to `parent`, then deletes it (an empty cgroup only)."""
    for _ in range(50):
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                left = [line.strip() for line in f if line.strip()]
        except FileNotFoundError:
            return
        for pid in left:
            with contextlib.suppress(OSError):  # it may have exited meanwhile
                _write(os.path.join(parent, "cgroup.procs"), pid)
        try:
            os.rmdir(path)
            return
        except OSError:
            continue  # a process was still leaving (or forked): move again
    os.rmdir(path)  # raises, naming the group that could not be removed


def run_wrapped(command: Sequence[str], *, cpu_fraction: float, rank: int | None) -> int:
    """Runs `command`, inside a `cpu_limited(cpu_fraction)` group if this is worker `rank`.

    This worker's rank is `TFDP_RANK` (set by `tfdp-launch`); `rank=None`
    slows whatever runs the wrapper. Returns the command's exit status
    (128 + N if a signal N ended it).
    """
    this_rank = os.environ.get("TFDP_RANK")
    slowed = rank is None or (this_rank is not None and int(this_rank) == rank)
    with contextlib.ExitStack() as stack:
        group = stack.enter_context(cpu_limited(cpu_fraction)) if slowed else None
        forwarded_signals = {signal.SIGTERM, signal.SIGINT}

        def in_child():
            # Inside the group before the command starts (threads it starts
            # later follow), with the signals this wrapper holds back open.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded_signals)
            if group is not None:
                group.add(os.getpid())

        # A SIGTERM between starting the child and forwarding must not end
        # this wrapper alone (the group would be left behind): held back
        # until the handler that forwards it is in place.
        signal.pthread_sigmask(signal.SIG_BLOCK, forwarded_signals)
        try:
            child = subprocess.Popen(list(command), preexec_fn=in_child)
            previous = {s: signal.signal(s, lambda signum, _: child.send_signal(signum))
                        for s in forwarded_signals}
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded_signals)
        try:
            status = child.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    return 128 - status if status < 0 else status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tfdp.bench.straggler",
        description="Run a command held to a fraction of a CPU (a CPU cgroup), e.g. one "
                    "worker of a tfdp-launch job. Needs root.")
    parser.add_argument("--cpu_fraction", type=float, default=0.5,
                        help="CPUs' worth of time the command's processes share (default 0.5).")
    parser.add_argument("--rank", type=int, default=None,
                        help="Slow only the worker whose TFDP_RANK is this (default: always).")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- then the command to run.")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --, e.g. -- tfdp-train --dataset=digits")
    try:
        check_fraction(args.cpu_fraction)
    except ValueError as error:
        parser.error(str(error))
    try:
        return run_wrapped(command, cpu_fraction=args.cpu_fraction, rank=args.rank)
    except StragglerUnavailable as error:
        print(f"tfdp.bench.straggler: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
