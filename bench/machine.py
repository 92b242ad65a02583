"""What the benchmarks ran on: CPU, cores, memory, load, library versions.

Read without importing TensorFlow or PyTorch (package metadata only), so
describing the machine costs nothing and cannot initialise a runtime.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


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
