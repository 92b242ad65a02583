"""The bind shim (`tfdp.launch.bind`): workers listen on their own address, not on all interfaces."""

import ipaddress
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from tfdp.launch import bind as bind_lib
from tfdp.launch import local
from multiworker import free_port_pair, run_worker_script

BIND_PROBE = textwrap.dedent("""
    import socket
    v4 = socket.socket(socket.AF_INET)
    v4.bind(("0.0.0.0", 0))
    v6 = socket.socket(socket.AF_INET6)
    v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    v6.bind(("::", 0))
    v6.listen()
    mine = socket.socket(socket.AF_INET)
    mine.bind(("127.0.0.1", 0))  # a specific address passes through
    with socket.create_connection(("127.0.0.1", v6.getsockname()[1]), timeout=5):
        pass  # the dual-stack socket still accepts IPv4 connections
    print(v4.getsockname()[0], v6.getsockname()[0], mine.getsockname()[0])
""")


def _probe(env):
    done = subprocess.run([sys.executable, "-c", BIND_PROBE], env=env, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.timeout(60)
def test_shim_rewrites_wildcard_binds_only_with_the_variable():
    shim = bind_lib.shim_path()
    if shim is None:
        pytest.skip("no C compiler")
    assert os.path.isfile(shim) and bind_lib.shim_path() == shim  # cached
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TFDP_BIND_ADDRESS")}
    env = dict(base, **bind_lib.worker_environment("127.0.0.1", ld_preload=""))
    assert env["LD_PRELOAD"] == shim and env["TFDP_BIND_ADDRESS"] == "127.0.0.1"
    assert _probe(env) == ["127.0.0.1", "::ffff:127.0.0.1", "127.0.0.1"]
    assert _probe(base) == ["0.0.0.0", "::", "127.0.0.1"]
    assert _probe(dict(base, LD_PRELOAD=shim)) == ["0.0.0.0", "::", "127.0.0.1"]


def test_worker_environment_keeps_an_existing_preload():
    if bind_lib.shim_path() is None:
        pytest.skip("no C compiler")
    env = bind_lib.worker_environment("127.0.0.1", ld_preload="/lib/a.so:/lib/b.so")
    assert env["LD_PRELOAD"] == f"{bind_lib.shim_path()}:/lib/a.so:/lib/b.so"
    with pytest.raises(ValueError):
        bind_lib.worker_environment("::1")


def test_plans_give_workers_the_shim_unless_bind_all(monkeypatch):
    if bind_lib.shim_path() is None:
        pytest.skip("no C compiler")
    environ = {"PATH": os.environ["PATH"], "LD_PRELOAD": "/lib/x.so"}
    plan = local.plan_local(["python"], nproc_per_node=2, environ=environ)
    assert not plan.bind_warning
    for spec in plan.workers:
        assert spec.env["TFDP_BIND_ADDRESS"] == "127.0.0.1"
        assert spec.env["LD_PRELOAD"] == f"{bind_lib.shim_path()}:/lib/x.so"
    restarted = local.restart_plan(plan, restart_count=1)
    assert all(s.env["TFDP_BIND_ADDRESS"] == "127.0.0.1" for s in restarted.workers)
    port = plan.ports[0]
    nodes = local.plan_nodes(["python"], nnodes=1, node_rank=0, hosts=f"127.0.0.1:{port}",
                             nproc_per_node=1, environ=environ)
    assert nodes.workers[0].env["TFDP_BIND_ADDRESS"] == "127.0.0.1"
    exposed = local.plan_nodes(["python"], nnodes=1, node_rank=0, hosts=f"127.0.0.1:{port}",
                               nproc_per_node=1, environ=environ, bind_all=True)
    assert "TFDP_BIND_ADDRESS" not in exposed.workers[0].env
    assert exposed.workers[0].env["LD_PRELOAD"] == "/lib/x.so"
    # No compiler: no shim, and a warning that the workers listen on all interfaces.
    monkeypatch.setattr(bind_lib, "build_shim",
                        lambda: bind_lib.ShimBuild(None, "no C compiler was found"))
    plan = local.plan_local(["python"], nproc_per_node=1, environ=environ)
    assert "TFDP_BIND_ADDRESS" not in plan.workers[0].env
    assert plan.bind_warning == (
        "warning: workers will listen on all interfaces: the bind shim (launch/bindshim.c) "
        "could not be built: no C compiler was found.")


# -- building the shim: the reason when it fails, one library per platform ------

def _fresh_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(bind_lib, "_cached", {})


def test_a_failing_compiler_is_quoted_in_the_warning(monkeypatch, tmp_path):
    _fresh_cache(monkeypatch, tmp_path)
    cc = tmp_path / "broken-cc"
    cc.write_text("#!/bin/sh\necho 'bindshim.c:15:10: fatal error: dlfcn.h: No such file or "
                  "directory' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    build = bind_lib.build_shim()
    assert build.path is None
    assert "failed with exit code 1: bindshim.c:15:10: fatal error: dlfcn.h: No such file" in (
        build.error)
    plan = local.plan_local(["python"], nproc_per_node=1,
                            environ={"PATH": os.environ["PATH"]})
    assert "could not be built: `" in plan.bind_warning
    assert "fatal error: dlfcn.h" in plan.bind_warning
    assert not list((tmp_path / "cache" / "tfdp").glob("*.so"))  # no half-written library


def test_the_cache_is_keyed_on_architecture_and_libc(monkeypatch, tmp_path):
    _fresh_cache(monkeypatch, tmp_path)
    if bind_lib.build_shim().path is None:
        pytest.skip("no C compiler")
    here = bind_lib.build_shim().path
    assert here.endswith(f"-{bind_lib.platform_tag()}.so")
    assert bind_lib.platform_tag().split("-")[0] == os.uname().machine
    # A home directory shared with another kind of machine: that machine's library is
    # another file, never this one.
    monkeypatch.setattr(bind_lib, "platform_tag", lambda: "aarch64-musl1.2")
    other = bind_lib.build_shim().path
    assert other != here and other.endswith("-aarch64-musl1.2.so")
    assert sorted(p.name for p in (tmp_path / "cache" / "tfdp").glob("*.so")) == sorted(
        [os.path.basename(here), os.path.basename(other)])


# -- what the shim does with the addresses it meets ---------------------------

V6ONLY_PROBE = textwrap.dedent("""
    import socket
    s = socket.socket(socket.AF_INET6)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    try:
        s.bind(("::", 0))
        print("bound", s.getsockname()[0])
    except OSError as e:
        print("refused", e.errno)
""")


@pytest.mark.parametrize("address,expected", [
    ("127.0.0.1", "bound ::1"),
    ("127.0.1.1", "bound ::1"),
    ("10.1.2.3", "refused 99"),  # EADDRNOTAVAIL: never every IPv6 interface
])
def test_ipv6_only_wildcard_binds_stay_on_loopback_or_fail(address, expected):
    if bind_lib.shim_path() is None:
        pytest.skip("no C compiler")
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    env = dict(os.environ, **bind_lib.worker_environment(address, ld_preload=""))
    done = subprocess.run([sys.executable, "-c", V6ONLY_PROBE], env=env, capture_output=True,
                          text=True, timeout=30)
    assert done.stdout.strip() == expected, done.stderr


def test_debians_127_0_1_1_is_bound_and_reachable_on_this_machine():
    # Debian's /etc/hosts maps the machine's own name to 127.0.1.1.
    if bind_lib.shim_path() is None:
        pytest.skip("no C compiler")
    probe = textwrap.dedent("""
        import socket
        s = socket.socket(socket.AF_INET)
        s.bind(("0.0.0.0", 0))
        s.listen()
        with socket.create_connection(("127.0.1.1", s.getsockname()[1]), timeout=5):
            pass
        try:
            socket.create_connection(("127.0.0.1", s.getsockname()[1]), timeout=5)
            print(s.getsockname()[0], "also-127.0.0.1")
        except ConnectionRefusedError:
            print(s.getsockname()[0], "only")
    """)
    env = dict(os.environ, **bind_lib.worker_environment("127.0.1.1", ld_preload=""))
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, timeout=30)
    assert done.stdout.split() == ["127.0.1.1", "only"], done.stderr


# -- end to end: two TensorFlow workers through the launcher --------------------

LISTEN_WORKER = """
import ipaddress, json, os
import tensorflow as tf
import tfdp

def decode(hex_ip):
    raw = bytes.fromhex(hex_ip)
    # /proc/net/tcp* print each 32-bit word in host (little-endian) order.
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(raw)
    mapped = getattr(address, "ipv4_mapped", None)
    return f"::ffff:{mapped}" if mapped else str(address)

def listening(port):
    found = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                hex_ip, hex_port = fields[1].split(":")
                if fields[3] == "0A" and int(hex_port, 16) == port:
                    found.append(decode(hex_ip))
    return sorted(found)

strategy = tfdp.make_strategy("multi_worker")
config = json.loads(os.environ["TF_CONFIG"])
port = int(config["cluster"]["worker"][config["task"]["index"]].rsplit(":", 1)[1])
rank = os.environ["TFDP_RANK"]
with open(f"listen{rank}.json", "w") as f:
    json.dump(listening(port), f)
total = strategy.reduce(tf.distribute.ReduceOp.SUM,
                        strategy.run(lambda: tf.constant(1.0)), axis=None)
print(float(total), flush=True)
"""


def _listening(tmp_path, launch_args=()):
    result = run_worker_script(tmp_path, LISTEN_WORKER, nproc=2, timeout=180, check=True,
                               launch_args=launch_args)
    found = []
    for rank in (0, 1):
        assert result.worker_stdout(rank)[-1] == "2.0"
        addresses = json.loads((tmp_path / f"listen{rank}.json").read_text())
        assert addresses, f"worker {rank} listens on nothing"
        found.extend(addresses)
    return result, found


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tensorflow_workers_listen_on_loopback_only(tmp_path):
    if bind_lib.shim_path() is None:
        pytest.skip("no C compiler")
    _, addresses = _listening(tmp_path)
    for address in addresses:
        assert address in ("127.0.0.1", "::ffff:127.0.0.1"), addresses
        assert not ipaddress.ip_address(address).is_unspecified


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bind_all_workers_listen_on_all_interfaces(tmp_path):
    # The control: without the shim, the same probe sees TensorFlow's wildcard bind.
    port = free_port_pair()
    result, addresses = _listening(tmp_path, launch_args=(
        "--nnodes", "1", "--hosts", f"127.0.0.1:{port}", "--bind_all"))
    assert addresses and all(ipaddress.ip_address(a).is_unspecified for a in addresses), (
        addresses)
    assert any("--bind_all" in line for line in result.launcher_messages())
