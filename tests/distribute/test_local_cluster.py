"""Tests for `tfdp.distribute.local_cluster`: free ports and TF_CONFIG for local workers."""

import json
import socket

import pytest

from tfdp.distribute import local_cluster
from tfdp.distribute.cluster import parse_tf_config
from tfdp.distribute.local_cluster import free_ports, local_tf_config


def test_port_in_use_sees_a_port_held_on_any_one_address():
    # TensorFlow binds all interfaces: a port held on loopback only is in use too.
    for address in ("127.0.0.1", "0.0.0.0"):
        with socket.socket() as holder:
            holder.bind((address, 0))
            holder.listen()
            assert "in use" in local_cluster.port_in_use(holder.getsockname()[1])


def test_port_in_use_passes_a_free_port():
    assert local_cluster.port_in_use(free_ports(1)[0]) is None


@pytest.mark.parametrize("num_workers", [1, 2, 4])
def test_local_tf_config_round_trips(num_workers):
    ports = free_ports(num_workers)
    configs = [parse_tf_config(json.dumps(local_tf_config(num_workers, i, ports=ports)))
               for i in range(num_workers)]
    expected_cluster = {"worker": tuple(f"127.0.0.1:{p}" for p in ports)}
    for i, config in enumerate(configs):
        assert dict(config.cluster) == expected_cluster
        assert (config.task_type, config.task_index) == ("worker", i)
        assert config.worker_index == i
        assert config.num_workers == num_workers
        assert config.is_chief == (i == 0)


def test_local_tf_config_picks_free_ports_and_custom_host():
    tf_config = local_tf_config(3, 2, host="localhost")
    addresses = tf_config["cluster"]["worker"]
    assert len(set(addresses)) == 3
    assert all(a.startswith("localhost:") for a in addresses)
    assert tf_config["task"] == {"type": "worker", "index": 2}
    assert local_tf_config(1, 0, ports=[2222], host="::1")["cluster"] == {
        "worker": ["[::1]:2222"]}


@pytest.mark.parametrize(
    "args,kwargs,error,fragment",
    [
        ((0, 0), {}, ValueError, "`num_workers` must be a positive integer. Received: num_workers=0"),
        ((2.0, 0), {}, TypeError, "`num_workers` must be a positive integer"),
        ((2, 2), {}, ValueError, "`worker_index` must be in [0, 1]"),
        ((2, -1), {}, ValueError, "Received: worker_index=-1"),
        ((2, "0"), {}, TypeError, "`worker_index` must be an int"),
        ((2, 0), {"ports": [2222]}, ValueError, "one port per worker (2)"),
        ((2, 0), {"ports": [2222, 2222]}, ValueError, "`ports` must be distinct"),
        ((2, 0), {"ports": [2222, 70000]}, ValueError, "`ports` must be in [1, 65535]"),
        ((2, 0), {"ports": [2222, "2223"]}, TypeError, "`ports` must contain ints"),
        ((1, 0), {"ports": [2222], "host": "bad host"}, ValueError, "host part"),
    ],
)
def test_local_tf_config_rejects_bad_arguments(args, kwargs, error, fragment):
    with pytest.raises(error) as info:
        local_tf_config(*args, **kwargs)
    assert fragment in str(info.value)


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(8)
    assert len(ports) == 8 and len(set(ports)) == 8
    for port in ports:
        assert 1 <= port <= 65535
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


@pytest.mark.parametrize("n,error", [(0, ValueError), (-2, ValueError), (1.5, TypeError),
                                     (True, TypeError)])
def test_free_ports_rejects_bad_count(n, error):
    with pytest.raises(error, match="`n` must be"):
        free_ports(n)


def _ephemeral_range_file(tmp_path, monkeypatch, text):
    path = tmp_path / "ip_local_port_range"
    path.write_text(text)
    monkeypatch.setattr(local_cluster, "_EPHEMERAL_RANGE_FILE", str(path))


def test_free_ports_are_picked_below_the_ephemeral_range(tmp_path, monkeypatch):
    # Outgoing connections and bind(0) get ports from the ephemeral range: a port
    # picked below it is not handed to another process by the kernel.
    _ephemeral_range_file(tmp_path, monkeypatch, "18000\t60999\n")
    assert local_cluster.ephemeral_port_range() == (18000, 60999)
    ports = free_ports(6)
    assert len(set(ports)) == 6
    assert all(local_cluster.LOWEST_PICKED_PORT <= p < 18000 for p in ports), ports
    assert all(local_cluster.port_in_use(p) is None for p in ports)


def test_free_ports_ignore_a_seeded_random_module():
    # Concurrent launches (pytest-xdist workers, a user's seeded script) must not pick
    # the same ports because something seeded the shared generator.
    import random

    random.seed(0)
    first = free_ports(4)
    random.seed(0)
    assert free_ports(4) != first


def test_free_ports_leave_picking_to_the_kernel_when_little_is_below_the_range(
        tmp_path, monkeypatch):
    _ephemeral_range_file(tmp_path, monkeypatch, "15500 60999\n")
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(p >= 15500 for p in ports)
    _ephemeral_range_file(tmp_path, monkeypatch, "not a range\n")
    assert local_cluster.ephemeral_port_range() == (32768, 60999)
