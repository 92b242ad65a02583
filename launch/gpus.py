"""One set of GPUs per local worker: which GPUs this node has, and how they are split.

This module owns the GPU assignment of one node's workers. Each local worker
gets its own `CUDA_VISIBLE_DEVICES`, the standard mechanism (what Slurm's
`--gpus-per-task` sets): with G GPUs and N workers, worker i gets GPUs
`[i*G/N, (i+1)*G/N)`, so each worker's `tfdp.make_strategy()` mirrors over its
own GPUs only, and TensorFlow in each process allocates memory on those only.

Where the G GPUs come from, without importing TensorFlow:

- the launcher's own `CUDA_VISIBLE_DEVICES` when it is set: its entries, in
  order, are kept as written (indices such as `3`, or UUIDs such as
  `GPU-5d3...` / `MIG-...`). CUDA's rule applies: the list ends at the first
  entry that is not a device (so `-1` or an empty value means no GPU);
- else `nvidia-smi -L` (one `GPU I: NAME (UUID: ...)` line per GPU): GPUs
  `0..G-1`. Those are nvidia-smi's indices, which are in PCI bus order; CUDA
  numbers GPUs fastest first unless `CUDA_DEVICE_ORDER=PCI_BUS_ID`, so the
  workers also get `CUDA_DEVICE_ORDER=PCI_BUS_ID` unless it is set (the
  indices in the log are then the ones `nvidia-smi` shows);
- no `nvidia-smi` on PATH, or it lists no GPU: no GPU, nothing is set and
  nothing is logged.

`--gpus_per_proc K` gives each worker K GPUs instead (`K*N <= G`; the rest stay
unused, and K = 0 hides every GPU from the workers). Starting, restarting and
supervising workers is not this module's job (`tfdp.launch.local`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from typing import Any, Mapping

from tfdp.distribute import visible_gpus
from tfdp.launch import _checks

#: Environment variable CUDA reads: the GPUs a process may use, comma-separated.
VISIBLE_DEVICES_VAR = visible_gpus.VISIBLE_DEVICES_VAR
#: Reads a `CUDA_VISIBLE_DEVICES` value as CUDA does (see `tfdp.distribute.visible_gpus`).
parse_visible_devices = visible_gpus.parse_visible_devices
#: Seconds `nvidia-smi -L` may take before it is given up on.
NVIDIA_SMI_TIMEOUT = 30.0

_SMI_GPU_LINE = re.compile(r"^GPU (\d+): ")


@dataclasses.dataclass(frozen=True)
class NodeGpus:
    """The GPUs this node's workers share, and where that list came from.

    Attributes:
        devices: device entries as `CUDA_VISIBLE_DEVICES` takes them, in order.
        source: `"CUDA_VISIBLE_DEVICES"`, `"nvidia-smi"`, or `"none"`.
        warning: why the GPUs could not be read (nvidia-smi failed), else "".
    """

    devices: tuple[str, ...]
    source: str
    warning: str = ""


@dataclasses.dataclass(frozen=True)
class GpuAssignment:
    """Each local worker's GPUs.

    Attributes:
        per_worker: by local rank, the `CUDA_VISIBLE_DEVICES` entries.
        node: the node's GPUs they were taken from.
    """

    per_worker: tuple[tuple[str, ...], ...]
    node: NodeGpus

    def environment(self, local_rank: int, environ: Mapping[str, str]) -> dict[str, str]:
        """The variables worker `local_rank` gets on top of `environ`."""
        env = {VISIBLE_DEVICES_VAR: ",".join(self.per_worker[local_rank])}
        if self.node.source == "nvidia-smi" and "CUDA_DEVICE_ORDER" not in environ:
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA's numbering = nvidia-smi's
        return env

    def describe(self) -> str:
        """The launcher's log line, e.g. `GPUs per worker (of CUDA_VISIBLE_DEVICES=3,5,6,7): ...`."""
        parts = [f"[{rank}] {','.join(gpus) or 'none'}"
                 for rank, gpus in enumerate(self.per_worker)]
        used = {gpu for gpus in self.per_worker for gpu in gpus}
        unused = [gpu for gpu in self.node.devices if gpu not in used]
        where = (f"CUDA_VISIBLE_DEVICES={','.join(self.node.devices)}"
                 if self.node.source == VISIBLE_DEVICES_VAR
                 else f"{len(self.node.devices)} GPU(s) listed by nvidia-smi -L")
        text = f"GPUs per worker (CUDA_VISIBLE_DEVICES; of {where}): {' '.join(parts)}"
        if unused:
            text += f"; unused: {','.join(unused)}"
        return text


def _nvidia_smi(path: str | None) -> NodeGpus:
    program = shutil.which("nvidia-smi", path=path)
    if program is None:
        return NodeGpus((), "none")
    try:
        done = subprocess.run([program, "-L"], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=NVIDIA_SMI_TIMEOUT)
    except (OSError, subprocess.SubprocessError) as e:
        return NodeGpus((), "none", f"`{program} -L` could not run ({e}); GPUs are not "
                                    "assigned to workers. Set CUDA_VISIBLE_DEVICES to assign them.")
    indices = [int(m.group(1)) for line in done.stdout.splitlines()
               if (m := _SMI_GPU_LINE.match(line))]
    if done.returncode != 0 and not indices:
        if "no devices" in (done.stdout + done.stderr).lower():
            return NodeGpus((), "none")
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        return NodeGpus((), "none", (
            f"`{program} -L` failed with exit code {done.returncode}"
            f"{': ' + said[0] if said else ''}; GPUs are not assigned to workers. Set "
            "CUDA_VISIBLE_DEVICES to assign them."))
    return NodeGpus(tuple(str(i) for i in sorted(indices)), "nvidia-smi" if indices else "none")


def node_gpus(environ: Mapping[str, str] | None = None) -> NodeGpus:
    """This node's GPUs: `CUDA_VISIBLE_DEVICES` if set in `environ`, else `nvidia-smi -L`.

    Args:
        environ: the launcher's environment; its `PATH` is where `nvidia-smi`
            is looked for. Defaults to `os.environ`.
    """
    environ = os.environ if environ is None else environ
    if VISIBLE_DEVICES_VAR in environ:
        devices = parse_visible_devices(environ[VISIBLE_DEVICES_VAR])
        return NodeGpus(devices, VISIBLE_DEVICES_VAR if devices else "none")
    return _nvidia_smi(environ.get("PATH"))


def split_gpus(gpus: NodeGpus, *, nproc_per_node: int,
               gpus_per_proc: Any = None) -> GpuAssignment | None:
    """Splits `gpus` among `nproc_per_node` workers, or None when nothing is to be set.

    Args:
        gpus: the node's GPUs (`node_gpus`).
        nproc_per_node: workers on this node, >= 1.
        gpus_per_proc: GPUs per worker, >= 0, or None for `G / nproc_per_node`.
            0 hides every GPU from the workers (`CUDA_VISIBLE_DEVICES=`).

    Returns:
        A `GpuAssignment`; None when the node has no GPU and `gpus_per_proc`
        is None or 0 (nothing is set).

    Raises:
        TypeError: `gpus_per_proc` is not an int.
        ValueError: G is not divisible by `nproc_per_node`, or
            `gpus_per_proc * nproc_per_node` exceeds G.
    """
    _checks.check_int("gpus_per_proc", gpus_per_proc, minimum=0, allow_none=True)
    count = len(gpus.devices)
    listed = (f"CUDA_VISIBLE_DEVICES={','.join(gpus.devices)}"
              if gpus.source == VISIBLE_DEVICES_VAR else "nvidia-smi -L")
    if gpus_per_proc is None:
        if count == 0:
            return None
        if count % nproc_per_node:
            raise ValueError(
                f"{count} GPU(s) ({listed}) cannot be split evenly among "
                f"--nproc_per_node {nproc_per_node} workers. Use an --nproc_per_node that "
                f"divides {count}, give each worker K GPUs with --gpus_per_proc K "
                f"(K*{nproc_per_node} <= {count}), or set CUDA_VISIBLE_DEVICES to the GPUs "
                "to use.")
        gpus_per_proc = count // nproc_per_node
    elif gpus_per_proc == 0:
        if count == 0:
            return None
    elif gpus_per_proc * nproc_per_node > count:
        have = f"{count} GPU(s) ({listed})" if count else (
            "no GPU (nvidia-smi is not on PATH or lists none, and CUDA_VISIBLE_DEVICES "
            "is not set)")
        raise ValueError(
            f"--gpus_per_proc {gpus_per_proc} with --nproc_per_node {nproc_per_node} needs "
            f"{gpus_per_proc * nproc_per_node} GPUs, but this node has {have}. Lower "
            "--gpus_per_proc or --nproc_per_node, or omit --gpus_per_proc to split the "
            "GPUs evenly.")
    per_worker = tuple(gpus.devices[i * gpus_per_proc:(i + 1) * gpus_per_proc]
                       for i in range(nproc_per_node))
    return GpuAssignment(per_worker, gpus)


def assign(environ: Mapping[str, str], *, nproc_per_node: int,
           gpus_per_proc: Any = None) -> tuple[GpuAssignment | None, str]:
    """`split_gpus(node_gpus(environ), ...)`, and a warning when the GPUs could not be read."""
    gpus = node_gpus(environ)
    return (split_gpus(gpus, nproc_per_node=nproc_per_node, gpus_per_proc=gpus_per_proc),
            gpus.warning)

