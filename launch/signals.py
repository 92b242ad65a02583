"""Catch the launcher's own termination signals so they can be forwarded.

This module owns one thing: while a worker group runs, SIGINT and SIGTERM sent
to the launcher must not kill it on the spot (its workers run in their own
sessions and would be orphaned); instead they are recorded, and the supervisor
(`tfdp.launch.worker_group`) forwards them to the workers. Deciding what to do with
a signal is not this module's job.
"""

from __future__ import annotations

import signal
import threading
from typing import Sequence

#: Signals the launcher forwards to its workers.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class SignalCatcher:
    """Context manager recording signals instead of acting on them.

    Inside the `with` block the handlers for `signums` only record the signal;
    on exit the previous handlers are restored. Python runs signal handlers in
    the main thread only, so in any other thread this is a no-op that records
    nothing (the caller's own handlers stay in charge).

    Args:
        signums: signals to catch. Defaults to `FORWARDED_SIGNALS`
            (SIGINT, SIGTERM).

    Example:

    >>> with SignalCatcher() as signals:
    ...     run_workers_until(lambda: signals.first is not None)
    """

    def __init__(self, signums: Sequence[int] = FORWARDED_SIGNALS):
        self._signums = tuple(signums)
        self._received: list[int] = []
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        del frame
        self._received.append(signum)

    def __enter__(self) -> "SignalCatcher":
        if threading.current_thread() is threading.main_thread():
            for signum in self._signums:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    @property
    def first(self) -> int | None:
        """The first signal received, or `None`."""
        return self._received[0] if self._received else None

    @property
    def received(self) -> tuple[int, ...]:
        """Every signal received so far, in order."""
        return tuple(self._received)

    @property
    def count(self) -> int:
        """How many signals were received (a second one means "hurry up")."""
        return len(self._received)
