"""Make workers listen on their own address only: an LD_PRELOAD `bind()` shim.

TensorFlow 2.21's gRPC server always listens on all interfaces (see
`tfdp.launch.nodes`). `bindshim.c`, preloaded into a worker with
`TFDP_BIND_ADDRESS=A.B.C.D`, rewrites that process's wildcard binds:
`0.0.0.0` becomes `A.B.C.D` and `[::]` becomes `::ffff:A.B.C.D` (so a
dual-stack socket still accepts IPv4 connections to that address); every other
bind is unchanged. The launcher uses it for every worker unless `--bind_all`.

`build_shim()` compiles the shim once per source version, machine
architecture and C library with the system C compiler into a per-user cache
directory (a home directory shared by machines of different kinds gets one
library per kind); when it cannot (no compiler, or compiling fails) it says
why, the workers listen on all interfaces and the launcher warns with that
reason.

What it does with the addresses it meets:

- a host name that resolves to `127.0.1.1` (Debian's `/etc/hosts` entry for
  the machine's own name) binds `127.0.1.1`, which this machine can connect to
  like any loopback address and no other machine can (`tfdp.launch.nodes`
  refuses such an entry for a node of a job that spans machines);
- an IPv6-only socket (`IPV6_V6ONLY`) bound to `[::]` cannot take an IPv4
  address: with a loopback `TFDP_BIND_ADDRESS` it binds `[::1]` (loopback
  only, as asked), otherwise the bind fails with EADDRNOTAVAIL rather than
  listen on every IPv6 interface. gRPC's own sockets are dual-stack, so
  TensorFlow's servers never take this path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

#: The shim's C source.
SOURCE = Path(__file__).with_name("bindshim.c")
#: Environment variable the shim reads: the IPv4 address wildcard binds get.
ADDRESS_VAR = "TFDP_BIND_ADDRESS"



@dataclasses.dataclass(frozen=True)
class ShimBuild:
    """The compiled shim, or why there is none.

    Attributes:
        path: the shared library, or None.
        error: why `path` is None (no compiler, the compiler's own message),
            else "".
    """

    path: str | None
    error: str = ""


_cached: dict[str, ShimBuild] = {}


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tfdp"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def platform_tag() -> str:
    """The machine architecture and C library the shim is built for, e.g. `x86_64-glibc2.36`."""
    machine = platform.machine() or "unknown-arch"
    libc, version = platform.libc_ver()
    return f"{machine}-{libc + version if libc else 'unknown-libc'}"


def _compile(compiler: str, target: Path) -> str:
    """Compiles the shim into `target`; returns "" or why it failed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".bindshim-", suffix=".so", dir=target.parent)
    os.close(fd)
    argv = [compiler, "-shared", "-fPIC", "-O2", "-o", tmp, str(SOURCE), "-ldl"]
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            said = (done.stderr.strip() or done.stdout.strip()).splitlines()
            return (f"`{' '.join(argv[:5])} ... {SOURCE.name}` failed with exit code "
                    f"{done.returncode}" + (f": {' | '.join(said[:3])}" if said else ""))
        os.replace(tmp, target)
        return ""
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_shim() -> ShimBuild:
    """The compiled shim (built on first use), or why it cannot be built.

    The library is `<cache>/tfdp/bindshim-<sha256 of the source, 12 hex>-
    <platform_tag()>.so` (`<cache>` is `$XDG_CACHE_HOME` or `~/.cache`),
    written atomically and reused by later calls and launches. The compiler
    is `$CC`, else `cc`, else `gcc`.
    """
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    target = _cache_dir() / f"bindshim-{digest}-{platform_tag()}.so"
    key = str(target)
    if key in _cached:
        return _cached[key]
    if target.is_file():
        result = ShimBuild(str(target))
    else:
        compiler = _compiler()
        if compiler is None:
            result = ShimBuild(None, "no C compiler was found ($CC, cc or gcc) to build it")
        else:
            try:
                error = _compile(compiler, target)
            except (OSError, subprocess.SubprocessError) as e:
                error = f"compiling it with {compiler} failed: {e}"
            result = ShimBuild(None if error else str(target), error)
    _cached[key] = result
    return result


def shim_path() -> str | None:
    """Path of the compiled shim (`build_shim().path`), or None if it cannot be built."""
    return build_shim().path


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
        OSError: if the shim cannot be built, saying why; see `build_shim`.
    """
    address = str(ipaddress.IPv4Address(address))
    build = build_shim()
    shim = build.path
    if shim is None:
        raise OSError(f"cannot build launch/bindshim.c: {build.error}")
    existing = os.environ.get("LD_PRELOAD", "") if ld_preload is None else ld_preload
    preload = ":".join([shim] + [p for p in existing.split(":") if p and p != shim])
    return {"LD_PRELOAD": preload, ADDRESS_VAR: address}
