"""Tests for `tfdp.launch.nodes`: `--hosts` parsing, the layout rule, address checks."""

import pytest

from tfdp.launch import nodes
from tfdp.launch.nodes import HostPort
from tfdp.distribute.cluster import ClusterConfig


@pytest.mark.parametrize(
    "hosts,expected",
    [
        ("h0:2222", (HostPort("h0", 2222),)),
        ("10.0.0.1:2222, 10.0.0.2:3333", (HostPort("10.0.0.1", 2222),
                                           HostPort("10.0.0.2", 3333))),
        (["a:1", "b:2"], (HostPort("a", 1), HostPort("b", 2))),
        ("[fd00::2]:2222", (HostPort("fd00::2", 2222),)),
    ],
)
def test_parse_hosts(hosts, expected):
    assert nodes.parse_hosts(hosts) == expected


@pytest.mark.parametrize(
    "hosts,error,fragment",
    [
        ("", ValueError, "`hosts` must list every node as host:port"),
        ("h0", ValueError, "`hosts` entry 0 must be host:port"),
        ("h0:2222,h1", ValueError, "`hosts` entry 1 must be host:port"),
        ("h0:0", ValueError, "port in [1, 65535]"),
        ("h0:65536", ValueError, "Received: 'h0:65536'"),
        ("h0:22,,h2:22", ValueError, "`hosts` entry 1"),
        ("fd00::2:2222", ValueError, "IPv6 hosts in brackets"),
        (42, TypeError, "`hosts` must be a string"),
    ],
)
def test_parse_hosts_rejects_malformed(hosts, error, fragment):
    with pytest.raises(error) as info:
        nodes.parse_hosts(hosts)
    assert fragment in str(info.value)


def test_layout_rule_for_two_nodes_of_two_workers():
    layouts = [nodes.plan_layout("h0:2222,h1:3000", nnodes=2, node_rank=rank,
                                 nproc_per_node=2) for rank in (0, 1)]
    expected = ("h0:2222", "h0:2223", "h1:3000", "h1:3001")
    for rank, layout in enumerate(layouts):
        assert layout.addresses == expected  # every node builds the same cluster
        assert layout.world_size == 4 and layout.nnodes == 2
        assert [layout.global_rank(i) for i in (0, 1)] == [2 * rank, 2 * rank + 1]
    assert layouts[0].ports == (2222, 2223) and layouts[1].ports == (3000, 3001)
    assert layouts[1].this_node == HostPort("h1", 3000)
    # Worker 0 (node 0, local 0) is the chief.
    chief = ClusterConfig(cluster={"worker": expected}, task_type="worker", task_index=0)
    assert chief.is_chief


def test_ipv6_hosts_are_bracketed_in_addresses():
    layout = nodes.plan_layout("[::1]:5000", nnodes=1, node_rank=0, nproc_per_node=2)
    assert layout.addresses == ("[::1]:5000", "[::1]:5001")


@pytest.mark.parametrize(
    "hosts,kwargs,error,fragment",
    [
        ("h0:1,h1:1", {"nnodes": 3}, ValueError,
         "one host:port entry per node: nnodes=3, but it has 2"),
        ("h0:1,h1:1", {"node_rank": 2}, ValueError,
         "`node_rank` must be in [0, 1] for nnodes=2"),
        ("h0:1,h1:1", {"node_rank": -1}, ValueError, "`node_rank` must be an integer >= 0"),
        ("h0:1,h1:1", {"nproc_per_node": 0}, ValueError, "`nproc_per_node` must be a positive integer"),
        ("h0:1,h1:1", {"nnodes": "2"}, TypeError, "`nnodes` must be a positive integer"),
        ("h0:65535,h1:1", {"nproc_per_node": 2}, ValueError,
         "entry 0 (h0:65535) starts 2 workers at ports 65535..65536, past 65535"),
        ("h0:2222,h0:2222", {}, ValueError,
         "`hosts` entries 0 and 1 both give a worker h0:2222"),
        ("h0:2222,H0:2223", {"nproc_per_node": 2}, ValueError,
         "entries 0 and 1 both give a worker H0:2223"),
    ],
)
def test_plan_layout_rejects_bad_layouts(hosts, kwargs, error, fragment):
    arguments = {"nnodes": 2, "node_rank": 0, "nproc_per_node": 1, **kwargs}
    with pytest.raises(error) as info:
        nodes.plan_layout(hosts, **arguments)
    assert fragment in str(info.value)


def _layout(hosts, node_rank=0, nproc=1):
    return nodes.plan_layout(hosts, nnodes=len(hosts.split(",")), node_rank=node_rank,
                             nproc_per_node=nproc)


def test_check_hosts_accepts_loopback_without_bind_all():
    assert nodes.check_hosts(_layout("127.0.0.1:5000,localhost:5010", nproc=2),
                             bind_all=False) == []


def test_non_loopback_addresses_are_listed_for_the_warning():
    # Workers listen on their own --hosts address (the bind shim), so an
    # address other machines can reach needs no --bind_all, only the warning.
    layout = _layout("10.255.255.1:2222,127.0.0.1:2222", node_rank=1)
    assert nodes.check_hosts(layout, bind_all=False) == ["10.255.255.1:2222"]
    assert nodes.check_hosts(layout, bind_all=True) == ["10.255.255.1:2222"]


def test_this_node_must_be_an_address_of_this_machine():
    # node_rank 0 names 10.255.255.1, which this machine cannot bind: a wrong
    # --node_rank would make two processes claim the same rank and hang.
    layout = _layout("10.255.255.1:2222,127.0.0.1:2222", node_rank=0)
    with pytest.raises(ValueError) as info:
        nodes.check_hosts(layout, bind_all=True)
    assert "not an address of this machine" in str(info.value)
    assert "Received: node_rank=0" in str(info.value)


def test_unresolvable_host_is_named():
    layout = _layout("127.0.0.1:2222,no-such-host.invalid:2222")
    with pytest.raises(ValueError, match=r"entry 1 \(no-such-host.invalid:2222\): cannot "
                                         r"resolve host 'no-such-host.invalid'"):
        nodes.check_hosts(layout, bind_all=True)


def test_two_names_of_one_machine_must_not_overlap():
    layout = _layout("127.0.0.1:5000,localhost:5001", nproc=2)
    with pytest.raises(ValueError, match="are the same machine .* overlapping port ranges "
                                         "5000..5001 and 5001..5002"):
        nodes.check_hosts(layout, bind_all=False)


def _fake_names(monkeypatch, names):
    real = nodes.socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if host in names:
            return [(nodes.socket.AF_INET, nodes.socket.SOCK_STREAM, 6, "", (names[host], 0))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(nodes.socket, "getaddrinfo", getaddrinfo)


def test_a_name_resolving_to_debians_127_0_1_1_is_refused_in_a_job_over_machines(monkeypatch):
    # Debian's /etc/hosts: "127.0.1.1 node-a". node-b is another machine.
    _fake_names(monkeypatch, {"node-a": "127.0.1.1", "node-b": "10.255.255.2"})
    with pytest.raises(ValueError) as info:
        nodes.check_hosts(_layout("node-a:2222,node-b:2222", node_rank=0), bind_all=False)
    message = str(info.value)
    assert "`hosts` entry 0 (node-a:2222) names this machine, but the name resolves here to " \
           "127.0.1.1, a loopback address (Debian's /etc/hosts" in message
    assert "other machines (node-b:2222)" in message
    assert "Give this node's network address in `hosts`" in message


def test_names_resolving_to_loopback_are_fine_when_every_node_is_this_machine(monkeypatch):
    _fake_names(monkeypatch, {"node-a": "127.0.1.1", "node-b": "127.0.0.1"})
    assert nodes.check_hosts(_layout("node-a:2222,node-b:2232", node_rank=0),
                             bind_all=False) == []
