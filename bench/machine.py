"""What the benchmarks ran on: CPU, cores, memory, load, library versions.

Read without importing TensorFlow or PyTorch (package metadata only), so
describing the machine costs nothing and cannot initialise a runtime.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform


def _vector_isa(flags: set[str]) -> str:
    """The widest vector and matrix instructions in `flags` (`/proc/cpuinfo`), e.g. "AVX-512, AMX"."""
    if "avx512f" in flags:
        found = ["AVX-512" + (" with BF16" if "avx512_bf16" in flags else "")]
    elif "avx2" in flags:
        found = ["AVX2"]
    else:
        found = []
    if "amx_tile" in flags:
        found.append("AMX")
    return ", ".join(found)


def _cpu_model() -> str:
    """The CPU's model name, with its family, model and vector ISA.

    Cloud VMs often report only "AMD EPYC" or "Intel Xeon Processor": the
    family (AMD 23 is Zen 1-2, 25 Zen 3-4, 26 Zen 5) and the vector
    instructions tell machines apart whose timings differ several-fold.
    """
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown"
    details = [f"family {fields['cpu family']} model {fields['model']}"
               if "cpu family" in fields and "model" in fields else "",
               _vector_isa(set(fields.get("flags", "").split()))]
    details = "; ".join(d for d in details if d)
    return f"{name} ({details})" if details else name


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def load_average() -> tuple[float, float, float] | None:
    """The 1-, 5- and 15-minute load averages, or None where unavailable."""
    try:
        return tuple(round(v, 2) for v in os.getloadavg())
    except OSError:
        return None


def describe() -> dict:
    """The machine and software, as the report prints them."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(_memory_gib() or 0.0, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "tensorflow": _version("tensorflow"),
        "keras": _version("keras"),
        "torch": _version("torch"),
        "load_average_at_start": load_average(),
    }
