"""Operating-system helpers for the launcher: process groups, state, reaping.

This module owns the few POSIX/Linux calls the launcher needs and nothing
else: reading a process's state from `/proc`, signalling a process group,
tying a worker's life to the launcher's (`PR_SET_PDEATHSIG`) and adopting
orphaned grandchildren so they can be reaped (`PR_SET_CHILD_SUBREAPER`).
Everything degrades to a no-op where `/proc` or `prctl` is missing (macOS), so
the launcher still runs there, with weaker clean-up guarantees.

Why this matters here: PID 1 on our CI machines does not reap orphans, so a
grandchild whose parent dies first stays a zombie forever unless an ancestor
has declared itself a subreaper and `wait()`s for it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import time
from typing import Callable

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _load_prctl():
    if not os.path.exists("/proc/self/stat"):  # not Linux
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                      ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


# Resolved once, in the parent: the pre-exec hook below must not import or
# look up symbols between fork and exec.
_PRCTL = _load_prctl()


def process_state(pid: int) -> str | None:
    """Returns the state letter of process `pid` from `/proc/<pid>/stat`.

    Args:
        pid: a process id.

    Returns:
        `"R"`, `"S"`, `"D"`, `"Z"` (zombie: exited, not yet reaped), `"T"`, ...,
        or `None` if no such process exists (it exited and was reaped).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) is in parentheses and may contain spaces.
    return stat[stat.rindex(b")") + 2 :].split()[0].decode()


def is_alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (reads `/proc`, not `kill -0`)."""
    state = process_state(pid)
    return state is not None and state not in ("Z", "X")


def children_of(pid: int) -> list[int]:
    """Returns the pids whose parent is `pid` (zombies included)."""
    children = []
    try:
        entries = os.listdir("/proc")
    except FileNotFoundError:
        return children
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat[stat.rindex(b")") + 2 :].split()[1]) == pid:
            children.append(int(entry))
    return children


def signal_group(pgid: int, signum: int) -> bool:
    """Sends `signum` to process group `pgid`; returns False if it is empty."""
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        return False
    return True


def parent_death_signal_hook(signum: int = signal.SIGKILL) -> Callable[[], None] | None:
    """Returns a `preexec_fn` that makes the child receive `signum` if we die.

    With it, a worker cannot outlive a launcher that was SIGKILLed (and so could
    not stop it). Linux-only (`PR_SET_PDEATHSIG`); `None` elsewhere. The signal
    fires when the *thread* that started the child exits, so start workers from
    a thread that lives as long as they should (the launcher's main thread).

    Args:
        signum: the signal the child gets. Defaults to `SIGKILL`.

    Returns:
        A zero-argument callable for `subprocess.Popen(preexec_fn=...)`, or
        `None` when unsupported.
    """
    prctl = _PRCTL
    if prctl is None:
        return None
    parent = os.getpid()

    # Runs in the child between fork and exec. It only calls a C function
    # resolved in the parent and os.getppid(): no import, no allocation-heavy
    # Python, no lock another thread could hold, so it is safe even when the
    # parent has threads (`subprocess` runs PyOS_AfterFork_Child first).
    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(128 + signum)

    return hook


def set_child_subreaper(enabled: bool = True) -> bool:
    """Makes this process adopt its orphaned descendants (Linux only).

    Call it only in a process that owns all of its children (the launcher's
    `__main__`), and pair it with `reap_children`: adopted orphans must be
    `wait()`ed for by this process.

    Args:
        enabled: True to become a child subreaper, False to stop being one.
            Defaults to True.

    Returns:
        True if the setting was applied, False where unsupported.
    """
    if _PRCTL is None:
        return False
    return _PRCTL(_PR_SET_CHILD_SUBREAPER, int(enabled), 0, 0, 0) == 0


def reap_children(timeout: float = 2.0) -> list[int]:
    """Reaps every child of this process that has exited, for up to `timeout`.

    Meant for the end of the launcher's `__main__`, after every worker has been
    waited for: what is left are orphaned grandchildren this subreaper adopted.

    Args:
        timeout: seconds to wait for children that are still exiting.

    Returns:
        Pids of children still alive after `timeout` (empty when all reaped).
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return []
        if pid:
            continue
        alive = [p for p in children_of(os.getpid()) if is_alive(p)]
        if time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)
