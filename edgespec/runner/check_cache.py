"""The outcome of a GPU runner's start check (``start_check.check_invariance``: is every kernel
batch-invariant here), remembered so that a process building several runners, or a restart, does
not probe again (a CPU's check costs under a second and runs every time): in the process, and on
disk as one JSON file per key under ``~/.cache/edgespec/start-checks/``
(``EDGESPEC_START_CHECK_CACHE`` names another folder; ``off`` keeps it in the process only,
``none`` remembers nothing: the tests' setting, where a check is made to fail on purpose). A key
holds what the outcome depends on: the model (``model_fingerprint``: its config and a fixed
sample of each weight), the device (GPU name, or CPU model, ISA caps and thread count), dtype,
torch and Triton versions, max rows and kernel path. A failure is remembered and raised again;
I/O errors never raise (a bad file is a miss).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch

from ..config import ConfigError
from .cpu_kind import cpu_kind

log = logging.getLogger("edgespec.start_check")

ENV_VAR = "EDGESPEC_START_CHECK_CACHE"
DEFAULT_DIR = Path("~/.cache/edgespec/start-checks")
SAMPLE = 2048  # elements hashed from each end of a tensor's flattened view


@lru_cache(maxsize=1)
def triton_version() -> str:
    """Triton's installed version, read without importing it (a CPU runner never does)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triton")
    except PackageNotFoundError:
        return "none"


def host_device(device: str | torch.device) -> tuple[str, int]:
    """(the device's name, torch's threads): a GPU's name and 0, or the CPU's model, ISA flags and
    caps and torch's intra-op thread count now (they split a CPU's products)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev), 0
    k = cpu_kind()
    caps = ",".join(f"{n}={v}" for n, v in (("onednn", k.onednn_cap), ("aten", k.aten_cap),
                                            ("torch", k.torch_capability)) if v)
    return f"{k.model} [{' '.join(k.flags)}] {caps}".strip(), torch.get_num_threads()


def code_digest(*modules) -> str:
    """A digest of modules' source, for a key's ``kernels``: an edited kernel checks again."""
    return hashlib.sha256(b"".join(Path(m.__file__).read_bytes() for m in modules)).hexdigest()[:12]


@dataclass(frozen=True)
class CheckKey:
    model: str  # model_fingerprint(...)
    device: str  # the GPU's name, or the CPU's model and ISA caps
    dtype: str  # "bfloat16", "float32", ...
    torch_version: str
    triton_version: str  # "none" when triton is not importable
    threads: int  # torch's intra-op threads on CPU; 0 on CUDA
    max_rows: int
    kernels: str  # the runner's kernel path, e.g. "eager" or "triton"

    @classmethod
    def here(cls, model: str, device: str | torch.device, dtype: torch.dtype | str,
             max_rows: int, kernels: str) -> CheckKey:
        """The key for this machine and process now (set torch's thread count first)."""
        name, threads = host_device(device)
        return cls(model=model, device=name, dtype=str(dtype).removeprefix("torch."),
                   torch_version=torch.__version__,
                   triton_version=triton_version() if kernels.startswith("triton") else "-",
                   threads=threads, max_rows=int(max_rows), kernels=kernels)

    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class CheckOutcome:
    passed: bool
    failure: str | None  # the ConfigError's message when it failed
    checked_at: str  # ISO time, UTC
    seconds: float  # how long the check ran


def model_fingerprint(config_dict: dict, tensors: list[torch.Tensor]) -> str:
    """sha256 of the model's config and of each tensor's shape, dtype and first and last
    ``SAMPLE`` elements (a fixed sample, so an 8B model costs microseconds a tensor; a change
    only in the middle of a weight is not seen)."""
    h = hashlib.sha256(json.dumps(config_dict, sort_keys=True, default=str).encode())
    for t in tensors:
        t = t.detach()
        n = t.numel()
        h.update(f"|{tuple(t.shape)}|{t.dtype}|".encode())
        if n == 0:
            continue
        if t.is_contiguous():
            flat = t.reshape(-1)
            sample = flat if n <= 2 * SAMPLE else torch.cat([flat[:SAMPLE], flat[-SAMPLE:]])
        else:  # index the sample in place: flattening a strided weight would copy all of it
            idx = torch.arange(n) if n <= 2 * SAMPLE else torch.cat(
                [torch.arange(SAMPLE), torch.arange(n - SAMPLE, n)])
            sample = t[torch.unravel_index(idx.to(t.device), t.shape)]
        sample = sample.to("cpu").contiguous().reshape(-1)
        h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class StartCheckCache:
    """Outcomes by key: in the process, and (unless the folder is ``off``) on disk. ``folder``
    None reads ``EDGESPEC_START_CHECK_CACHE`` at each call, else the default folder."""

    def __init__(self, folder: str | os.PathLike | None = None):
        self.folder, self._warned = folder, False
        self._mem: dict[CheckKey, CheckOutcome] = {}

    def _dir(self) -> Path | None:
        where = self.folder if self.folder is not None else os.environ.get(ENV_VAR) or DEFAULT_DIR
        return None if str(where).strip().lower() in ("off", "none") else Path(where).expanduser()

    def _disabled(self) -> bool:
        where = self.folder if self.folder is not None else os.environ.get(ENV_VAR, "")
        return str(where).strip().lower() == "none"

    def lookup(self, key: CheckKey) -> CheckOutcome | None:
        if self._disabled():
            return None
        if key in self._mem:
            return self._mem[key]
        folder = self._dir()
        if folder is None:
            return None
        path = folder / f"{key.digest()}.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data["key"] != asdict(key):  # a truncated digest's collision: not this key
                return None
            o = data["outcome"]
            outcome = CheckOutcome(passed=bool(o["passed"]), failure=o["failure"],
                                   checked_at=str(o["checked_at"]), seconds=float(o["seconds"]))
        except Exception as exc:  # unreadable or corrupt (or another version's): a miss
            log.debug("start check cache: ignoring %s: %s", path, exc)
            return None
        self._mem[key] = outcome
        return outcome

    def store(self, key: CheckKey, outcome: CheckOutcome) -> None:
        if self._disabled():
            return
        self._mem[key] = outcome
        folder = self._dir()
        if folder is None:
            return
        tmp = None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            text = json.dumps({"key": asdict(key), "outcome": asdict(outcome)}, indent=1)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".", suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, folder / f"{key.digest()}.json")
        except OSError as exc:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            (log.debug if self._warned else log.warning)(
                "start check cache: cannot write under %s (%s); outcomes stay in this process",
                folder, exc)
            self._warned = True


@lru_cache(maxsize=1)
def default_cache() -> StartCheckCache:
    """The process's shared cache."""
    return StartCheckCache()


def run_checked(key: CheckKey, check: Callable[[], None],
                cache: StartCheckCache | None = None) -> CheckOutcome:
    """``check()`` (raises ConfigError to refuse) run once per key: a cached pass returns, a
    cached failure raises its ConfigError again. Other exceptions propagate, not cached."""
    cache = cache if cache is not None else default_cache()
    cached = cache.lookup(key)
    if cached is not None:
        if cached.passed:
            log.info("start check: cached pass for %s %s (%s)", key.device, key.dtype,
                     key.digest())
            return cached
        log.info("start check: cached failure for %s %s (%s)", key.device, key.dtype, key.digest())
        raise ConfigError(cached.failure or "the start check failed (cached)")
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    try:
        check()
    except ConfigError as exc:
        cache.store(key, CheckOutcome(False, str(exc), now, time.perf_counter() - t0))
        raise
    outcome = CheckOutcome(True, None, now, time.perf_counter() - t0)
    cache.store(key, outcome)
    return outcome
