"""The check of a worker command, shared by the launcher's plans: local, multi-node, Slurm, Kubernetes.

Counts, choices and how a message echoes a value are tfdp's shared checks
(`tfdp._checks`, no TensorFlow), re-exported here for the launcher's modules.
"""

from __future__ import annotations

from typing import Any, Sequence

from tfdp._checks import check_choice, check_int, echo

__all__ = ["check_choice", "check_command", "check_int", "echo"]


def check_command(command: Any, *, example: str) -> tuple[str, ...]:
    """Checks that `command` is a non-empty list of strings; returns it as a tuple.

    Args:
        command: the program and arguments every worker runs (no shell).
        example: a launcher command line showing where COMMAND goes, quoted
            in the message when `command` is empty.

    Raises:
        TypeError: `command` is not a list of strings.
        ValueError: `command` is empty.
    """
    if isinstance(command, (str, bytes)) or not isinstance(command, Sequence):
        raise TypeError(
            "`command` must be a list of strings (program, then arguments), e.g. "
            f"['python', 'train.py']. Received: command={echo(command)}"
        )
    if not command:
        raise ValueError(
            f"`command` must not be empty: give the program every worker runs after `--`, "
            f"e.g. `{example}`. Received: command={echo(command)}"
        )
    if not all(isinstance(part, str) for part in command):
        raise TypeError(f"`command` must contain only strings. Received: command={echo(command)}")
    return tuple(command)
