"""Tests for `tfdp.bench.link` and the suite's `--link` (no test needs a shaped link to exist)."""

import os
import subprocess
import sys

import pytest

from tfdp.bench import link
from tfdp.bench import procs
from tfdp.bench import suite


@pytest.mark.parametrize("rate", ["10mbit", "100mbit", "1gbit", "2.5gbit", "512kbit"])
def test_rates_tc_understands_are_accepted(rate):
    assert link.check_rate(rate) == rate
    assert link.tc_command("ns", rate) == [
        "tc", "-n", "ns", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
        "burst", "256kb", "latency", "20ms"]


@pytest.mark.parametrize("rate", ["100", "1 gbit", "fast", "0mbit", "1Gbit/s", None, 100])
def test_other_rates_are_refused_with_examples(rate):
    with pytest.raises(ValueError, match=r"`link` must be a rate such as '10mbit', '100mbit' "
                                         r"or '1gbit'.*Received: link="):
        link.check_rate(rate)
    if isinstance(rate, str):
        with pytest.raises(ValueError, match="`link` must be a rate"):
            suite.SuiteConfig.quick_config(link=rate)


def test_missing_tools_are_named(monkeypatch):
    monkeypatch.setattr(link.os, "geteuid", lambda: 0)
    monkeypatch.setattr(link.shutil, "which", lambda tool: None if tool == "tc" else "/x/ip")
    assert link.why_unavailable() == (
        "shaping a link needs iproute2's tc, not found on PATH (Debian: apt-get install iproute2)")
    with pytest.raises(link.LinkUnavailable, match="needs iproute2's tc"):
        with link.shaped_link("100mbit"):
            pass
    monkeypatch.setattr(link.os, "geteuid", lambda: 1000)
    assert "needs root" in link.why_unavailable()


def test_only_multi_worker_runs_go_through_the_link(monkeypatch):
    commands = []

    def record(command, **kwargs):
        commands.append(list(command))
        raise procs.JobFailed("recorded")

    monkeypatch.setattr(procs, "run_command", record)
    prefix = ["ip", "netns", "exec", "tfdp-bench-test"]
    with procs.through_link(prefix):
        for nproc in (None, 1, 2):
            with pytest.raises(procs.JobFailed):
                procs.run_job("throughput", {}, timeout=1, nproc=nproc)
    with pytest.raises(procs.JobFailed):
        procs.run_job("throughput", {}, timeout=1, nproc=2)  # after the block: no prefix
    assert [c[:4] == prefix for c in commands] == [False, False, True, False]
    assert commands[2][4:7] == [sys.executable, "-m", "tfdp.launch"]


def test_the_suite_says_in_one_line_when_it_cannot_shape(tmp_path):
    # No `ip` or `tc` on PATH: exit 2 with one line and no traceback, before any case
    # runs (and before TensorFlow is imported: 0.2 s, not 12-19 s on a busy 2-core machine).
    empty = tmp_path / "bin"
    empty.mkdir()
    environ = {**os.environ, "PATH": str(empty)}
    result = subprocess.run(
        [sys.executable, "-m", "tfdp.bench", "--quick", "--link", "100mbit",
         "--out_dir", str(tmp_path / "out")],
        env=environ, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [l for l in result.stderr.splitlines() if l.startswith("[tfdp.bench]")]
    assert len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("[tfdp.bench] --link=100mbit: cannot shape the link: ")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rate, bits", [("512kbit", 512e3), ("10mbit", 10e6), ("100mbit", 100e6),
                                        ("1gbit", 1e9), ("2.5gbit", 2.5e9)])
def test_rates_in_bits_per_second_as_tc_reads_them(rate, bits):
    assert link.bits_per_second(rate) == bits


def test_a_slower_link_stretches_every_deadline_in_proportion():
    # Over 100mbit the 2-worker CNN launch outlived its 600 s deadline: the
    # all-reducing paths slow by the link's rate, so the deadlines must too.
    assert suite.SuiteConfig().timeout(600) == 600
    assert suite.SuiteConfig(link="1gbit").timeout(600) == 600
    assert suite.SuiteConfig(link="10gbit").timeout(600) == 600  # never shorter
    assert suite.SuiteConfig(link="100mbit").timeout(600) == pytest.approx(6000)
    assert suite.SuiteConfig(link="10mbit", timeout_scale=2).timeout(300) == pytest.approx(60000)
