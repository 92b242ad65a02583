"""Make workers listen on their own address only: an LD_PRELOAD `bind()` shim.

TensorFlow 2.21's gRPC server always listens on all interfaces (see
`tfdp.launch.nodes`). `bindshim.c`, preloaded into a worker with
`TFDP_BIND_ADDRESS=A.B.C.D`, rewrites that process's wildcard binds:
`0.0.0.0` becomes `A.B.C.D` and `[::]` becomes `::ffff:A.B.C.D` (so a
dual-stack socket still accepts IPv4 connections to that address); every other
bind is unchanged. The launcher uses it for every worker unless `--bind_all`.

`shim_path()` compiles the shim once per source version with the system C
compiler into a per-user cache directory; without a compiler it returns None
and the workers listen on all interfaces (the launcher warns).
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

#: The shim's C source.
SOURCE = Path(__file__).with_name("bindshim.c")
#: Environment variable the shim reads: the IPv4 address wildcard binds get.
ADDRESS_VAR = "TFDP_BIND_ADDRESS"

_cached: dict[str, str | None] = {}


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tfdp"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def shim_path() -> str | None:
    """Path of the compiled shim (built on first use), or None if it cannot be built.

    The library is `<cache>/tfdp/bindshim-<sha256 of the source, 12 hex>.so`
    (`<cache>` is `$XDG_CACHE_HOME` or `~/.cache`), written atomically and
    reused by later calls and launches. None means no C compiler was found or
    compiling failed.
    """
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:12]
    if digest in _cached:
        return _cached[digest]
    target = _cache_dir() / f"bindshim-{digest}.so"
    result: str | None = str(target)
    if not target.is_file():
        compiler = _compiler()
        result = None
        if compiler is not None:
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=".bindshim-", suffix=".so",
                                           dir=target.parent)
                os.close(fd)
                try:
                    done = subprocess.run(
                        [compiler, "-shared", "-fPIC", "-O2", "-o", tmp, str(SOURCE), "-ldl"],
                        stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
                    if done.returncode == 0:
                        os.replace(tmp, target)
                        result = str(target)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
            except (OSError, subprocess.SubprocessError):
                result = None
    _cached[digest] = result
    return result


def shim_address(host: str) -> str | None:
    """The IPv4 literal the shim should bind for a worker reached at `host`, or None.

    `host` is an IPv4 literal (returned as is), or a name resolving to IPv4
    addresses (the first, sorted). IPv6-only hosts return None: the shim
    binds IPv4 addresses only.
    """
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    import socket
    try:
        infos = socket.getaddrinfo(host, None, family=socket.AF_INET, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return None
    addresses = sorted({info[4][0] for info in infos})
    return addresses[0] if addresses else None


def worker_environment(address: str, *, ld_preload: str | None = None) -> dict[str, str]:
    """The variables that make a worker's wildcard binds bind `address`.

    Args:
        address: an IPv4 literal, e.g. "127.0.0.1".
        ld_preload: the worker's existing `LD_PRELOAD`, kept after the shim.
            Defaults to this process's.

    Returns:
        `{"LD_PRELOAD": SHIM[:EXISTING], "TFDP_BIND_ADDRESS": address}`.

    Raises:
        ValueError: if `address` is not an IPv4 literal.
        OSError: if the shim cannot be built (no C compiler); see `shim_path`.
    """
    address = str(ipaddress.IPv4Address(address))
    shim = shim_path()
    if shim is None:
        raise OSError("cannot build launch/bindshim.c: no working C compiler (cc or gcc) "
                      "was found")
    existing = os.environ.get("LD_PRELOAD", "") if ld_preload is None else ld_preload
    preload = ":".join([shim] + [p for p in existing.split(":") if p and p != shim])
    return {"LD_PRELOAD": preload, ADDRESS_VAR: address}
