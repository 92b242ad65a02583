"""Which GPUs a process may use, as `CUDA_VISIBLE_DEVICES` names them (no TensorFlow).

This module owns reading that variable the way CUDA does, for the two places
that need it: the launcher, which splits a node's GPUs among its workers
(`tfdp.launch.gpus`), and `tfdp.strategy_info`, which shows a worker's GPUs in
the start-up line. It does not choose GPUs or touch devices.
"""

from __future__ import annotations

import os
import re
from typing import Mapping

#: Environment variable CUDA reads: the GPUs a process may use, comma-separated.
VISIBLE_DEVICES_VAR = "CUDA_VISIBLE_DEVICES"

# A device entry CUDA accepts: an index, or a (prefix of a) GPU or MIG UUID.
_ENTRY = re.compile(r"^(\d+|GPU-[0-9A-Fa-f-]+|MIG-[0-9A-Za-z/-]+)$")


def parse_visible_devices(value: str) -> tuple[str, ...]:
    """The devices a `CUDA_VISIBLE_DEVICES` value names, in order.

    Follows CUDA: entries are comma-separated (spaces around them ignored),
    each a device index or a GPU/MIG UUID, and the list ends at the first
    entry that is neither, so `""` and `"-1"` name no device and `"0,-1,1"`
    names device 0 only.
    """
    devices = []
    for entry in value.split(","):
        entry = entry.strip()
        if not _ENTRY.match(entry):
            break
        devices.append(entry)
    return tuple(devices)


def visible_gpus(environ: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """The GPUs `CUDA_VISIBLE_DEVICES` names in `environ` (default: `os.environ`).

    Returns:
        The entries (the process's `GPU:0` is the first), or None when the
        variable is unset: every GPU of the host is visible.
    """
    environ = os.environ if environ is None else environ
    value = environ.get(VISIBLE_DEVICES_VAR)
    return None if value is None else parse_visible_devices(value)
