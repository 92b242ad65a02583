"""A shaped network link for the benchmarks: a network namespace whose loopback carries a fixed rate.

Real multi-node jobs all-reduce over 1-25 Gbit/s Ethernet; loopback here
carries about 29 Gbit/s. `shaped_link("1gbit")` creates a network namespace,
brings its loopback up and shapes it with a token-bucket filter (`tc qdisc
add dev lo root tbf rate 1gbit burst 256kb latency 20ms`; netem is not
available on these machines, tbf is). Worker processes started inside it
with `ip netns exec NAME ...` still talk over 127.0.0.1 and nothing else,
now at that rate. The namespace is deleted when the block ends, whatever
happened in it.

It needs root and iproute2's `ip` and `tc`; without them `LinkUnavailable`
says which is missing, in one line. Which runs go through the link is
`tfdp.bench.procs`'s (`through_link`): every multi-worker run.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from typing import Iterator, Sequence

#: tc's rate syntax as the suite accepts it: a number and a unit.
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
#: tc's units, in bits per second (decimal, as tc reads them: 1mbit is 10**6 bit/s).
_BITS_PER_UNIT = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
#: Token-bucket parameters: a burst a few packets deep, 20 ms of queue.
_TBF = ("burst", "256kb", "latency", "20ms")


class LinkUnavailable(RuntimeError):
    """This machine cannot shape a link (not root, or no `ip`/`tc`, or the kernel refused)."""


def check_rate(rate: str) -> str:
    """Returns `rate` if tc understands it as the suite accepts it (`100mbit`, `1gbit`, ...).

    Raises:
        ValueError: `rate` is not a positive number followed by kbit, mbit or gbit.
    """
    match = _RATE.match(rate) if isinstance(rate, str) else None
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(
            f"`link` must be a rate such as '10mbit', '100mbit' or '1gbit' (a positive number "
            f"and kbit, mbit or gbit). Received: link={rate!r}"
        )
    return rate


def bits_per_second(rate: str) -> float:
    """`rate` (`"100mbit"`, `"1gbit"`, ...) in bits per second.

    Raises:
        ValueError: `rate` is malformed (as `check_rate`).
    """
    match = _RATE.match(check_rate(rate))
    return float(match.group(1)) * _BITS_PER_UNIT[match.group(2)]


def why_unavailable() -> str | None:
    """Why this process cannot shape a link, or `None` when it can try."""
    if os.geteuid() != 0:
        return "shaping a link needs root (network namespaces and tc); run the suite as root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return (f"shaping a link needs iproute2's {' and '.join(missing)}, not found on PATH "
                f"(Debian: apt-get install iproute2)")
    return None


def _run(command: Sequence[str]) -> None:
    result = subprocess.run(list(command), capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise LinkUnavailable(
            f"`{' '.join(command)}` failed with status {result.returncode}: "
            f"{result.stderr.strip() or result.stdout.strip()}")


def tc_command(namespace: str, rate: str) -> list[str]:
    """The `tc` command that shapes `namespace`'s loopback to `rate`."""
    return ["tc", "-n", namespace, "qdisc", "add", "dev", "lo", "root", "tbf",
            "rate", check_rate(rate), *_TBF]


@contextlib.contextmanager
def shaped_link(rate: str, *, namespace: str | None = None) -> Iterator[list[str]]:
    """A network namespace whose loopback carries `rate`, for the duration of the block.

    Args:
        rate: e.g. `"100mbit"` or `"1gbit"` (tc's units: bits per second).
        namespace: its name. Defaults to `tfdp-bench-<pid>`.

    Yields:
        The command prefix that runs a program inside it:
        `["ip", "netns", "exec", namespace]`.

    Raises:
        ValueError: `rate` is malformed.
        LinkUnavailable: not root, no `ip`/`tc`, or a command failed (what was
            created is deleted first).
    """
    check_rate(rate)
    reason = why_unavailable()
    if reason is not None:
        raise LinkUnavailable(reason)
    namespace = namespace or f"tfdp-bench-{os.getpid()}"
    _run(["ip", "netns", "add", namespace])
    try:
        _run(["ip", "-n", namespace, "link", "set", "lo", "up"])
        _run(tc_command(namespace, rate))
        yield ["ip", "netns", "exec", namespace]
    finally:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
