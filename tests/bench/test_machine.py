"""Tests for `tfdp.bench.machine`: the CPU named with what makes its timings differ."""

import pytest

from tfdp.bench import machine

_EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16 avx512vl

processor\t: 1
model name\t: something else
"""


@pytest.mark.parametrize("flags, isa", [
    ({"sse2", "avx", "avx2"}, "AVX2"),
    ({"avx2", "avx512f"}, "AVX-512"),
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX-512 with BF16"),
    ({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, "AVX-512 with BF16, AMX"),
    ({"sse2"}, ""),
])
def test_the_widest_vector_instructions_are_named(flags, isa):
    assert machine._vector_isa(flags) == isa


def test_a_bare_vm_model_name_gets_its_family_and_isa(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(_EPYC)
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(
        cpuinfo if path == "/proc/cpuinfo" else path, *a, **k))
    assert machine._cpu_model() == "AMD EPYC (family 26 model 2; AVX-512 with BF16)"
    assert machine.describe()["cpu"] == "AMD EPYC (family 26 model 2; AVX-512 with BF16)"
