"""``--dtype auto``'s choice, remembered per machine setting, so that every run on it serves the
same dtype.

``auto`` serves the faster of the dtypes that are exact here, measured (``dtype_probe``). Where
the two are close (bfloat16 on an AMX Xeon: its margin within the moment's load), two runs of one
command could choose differently and, both lossless, answer a seeded request with different
tokens: each target-only decoding of its own dtype. The first measurement of a setting (the
device and what it is, torch's thread count and version, the dtypes exact there) is kept in
``cache_dir()/dtype-auto.json`` and reused; delete the file (or a line of it) to measure again,
or give ``--dtype``. A file that cannot be read or written costs only the remembering."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch

from ..config import cache_dir

log = logging.getLogger("edgespec.runner")

MEMO_FILE = "dtype-auto.json"


def setting_key(device: str, what: str, exact: list[str], measure: str = "") -> str:
    """The setting a choice holds for: the device and what it is (a CPU's model, flags and ISA
    caps; a GPU's name), torch's threads and version, the dtypes exact there, and what was
    measured (a choice another measure made is measured again)."""
    return (f"{device} | {what} | {torch.get_num_threads()} threads | torch {torch.__version__} "
            f"| exact: {','.join(exact)}" + (f" | {measure}" if measure else ""))


def memo_path() -> Path:
    return cache_dir() / MEMO_FILE


def remembered(key: str) -> dict | None:
    """The choice kept for ``key``: {"dtype", "cost_ms", "measured"} (None: none, or the file
    cannot be read)."""
    try:
        entry = json.loads(memo_path().read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str) or \
            not isinstance(entry.get("cost_ms"), dict):
        return None
    return entry


def remember(key: str, dtype: str, cost_ms: dict[str, float]) -> None:
    """Keep a measured choice (written whole, by rename: a reader never sees half a file)."""
    path = memo_path()
    try:
        try:
            table = json.loads(path.read_text())
            if not isinstance(table, dict):
                table = {}
        except (OSError, ValueError):
            table = {}
        table[key] = {"dtype": dtype, "cost_ms": cost_ms,
                      "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".dtype-auto-")
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        log.debug("dtype auto: cannot remember the choice in %s: %s", path, e)
