"""Rank-prefixed output: copy each worker's pipes to ours, line by line.

This module owns how worker output reaches the user: every line a worker
writes to stdout (stderr) is written to the launcher's stdout (stderr) with a
prefix such as `[1] `, whole lines at a time, so lines of different workers
never interleave mid-line. It works on bytes, so output that is not valid UTF-8
passes through unchanged. It can also keep the last lines of a worker (its
"log tail", shown again when the launch gives up on a failure). It does not
start or stop processes.
"""

from __future__ import annotations

import collections
import threading
from typing import BinaryIO


class LineSink:
    """A binary stream shared by several threads, written one line at a time.

    Args:
        stream: a binary, writable stream (e.g. `sys.stdout.buffer`).

    If the stream breaks (e.g. the reader of a pipe went away), later writes
    are dropped instead of raising, so workers are never blocked on a full pipe.
    """

    def __init__(self, stream: BinaryIO):
        self._stream = stream
        self._lock = threading.Lock()
        self._broken = False

    def write_line(self, prefix: bytes, line: bytes) -> None:
        """Writes `prefix + line`, adding a final newline if `line` lacks one."""
        if not line.endswith(b"\n"):
            line += b"\n"
        with self._lock:
            if self._broken:
                return
            try:
                self._stream.write(prefix + line)
                self._stream.flush()
            except (BrokenPipeError, ValueError, OSError):
                self._broken = True


class PrefixPump(threading.Thread):
    """A daemon thread copying one pipe to a `LineSink`, prefixing every line.

    The thread ends when the pipe reaches end-of-file, i.e. when every process
    holding its write end (the worker and any children it left behind) exited.

    Args:
        pipe: the read end of a worker's stdout or stderr pipe (binary).
        sink: where prefixed lines go.
        prefix: bytes put in front of every line, e.g. `b"[0] "`.
        tail: if given, every line (without prefix) is also appended to it;
            pass a `collections.deque(maxlen=n)` to keep the last `n` lines.
            Several pumps may share one (appends are thread-safe). Defaults
            to None.
    """

    def __init__(self, pipe: BinaryIO, sink: LineSink, prefix: bytes,
                 tail: collections.deque | None = None):
        super().__init__(name=f"launch-pump-{prefix.decode(errors='replace').strip()}",
                         daemon=True)
        self._pipe = pipe
        self._sink = sink
        self._prefix = prefix
        self._tail = tail

    def run(self) -> None:
        for line in iter(self._pipe.readline, b""):
            self._sink.write_line(self._prefix, line)
            if self._tail is not None:
                self._tail.append(line)
