"""Copies between the host and the device that never make the host wait, but one a step.

A step's integers (and flags, and sampling settings) go to the device in pinned, non-blocking
copies (``to_device``): the stream orders them before the kernels that read them, so the host
goes on planning while the device works. Its verdict comes back through pinned memory
(``to_host``): the one place a step waits for the device. Every other copy in a step's path goes
one of these two ways; a pageable copy (``torch.tensor(..., device=cuda)``, ``.tolist()`` of a
device tensor) makes the host wait for everything queued before it, and so serializes the host's
work with the device's. ``implicit_syncs_refused`` turns such waits into errors (torch's sync
debug mode), which the CUDA tests run whole engine steps under (an imitation head, which drafts
token by token on the host's reading of each, waits more). A prefill's device time is read from
events after the step's wait (``DeviceSpan``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch

ALIGN_BYTES = 16  # what Triton specialises a pointer on: every part starts at such a boundary

_NUMPY_OF = {torch.long: np.int64, torch.bool: np.bool_, torch.float32: np.float32}


def aligned_length(n: int, itemsize: int = 8) -> int:
    """n elements of ``itemsize`` bytes rounded up to whole ``ALIGN_BYTES``: the room a part
    takes in a flat buffer whose parts all start aligned."""
    per = max(1, ALIGN_BYTES // itemsize)
    return n + -n % per


def to_device(parts: Sequence[np.ndarray], device, dtype) -> list[torch.Tensor]:
    """``parts`` (host arrays) moved to ``device`` in one copy, as views of one
    buffer, shapes kept, each at a 16-byte boundary (so a fused kernel reading one meets the
    same alignment, hence runs the same binary, in every step; on CUDA from pinned memory,
    without waiting: the stream orders the copy before the forward). The buffer is put
    together in NumPy: one host array, one tensor. On the CPU there is no copy to make: each
    part becomes a tensor of its own (a copy of the host array, so that the step's tensors and
    its host arrays never share memory), each at such a boundary as the allocator gives it
    (checked: where one is not, the parts are laid out in one aligned buffer instead)."""
    np_dtype = _NUMPY_OF[dtype]
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if kind == "cpu":
        # a tensor over each part's own array: a third of the aligned buffer's calls (a step
        # makes two or three of these), which this host then cuts into views
        own = [torch.from_numpy(np.array(a, dtype=np_dtype, order="C")) for a in parts]
        if all(t.data_ptr() % ALIGN_BYTES == 0 for t in own):
            return own
    arrays = list(parts)
    itemsize = np.dtype(np_dtype).itemsize
    offsets, at = [], 0
    for a in arrays:
        offsets.append(at)
        at += aligned_length(a.size, itemsize)
    host: np.ndarray = np.zeros(at, dtype=np_dtype)
    for a, o in zip(arrays, offsets):
        host[o:o + a.size] = a.reshape(-1)
    if kind == "cpu":  # the host buffer is the tensors' (views cut in NumPy: a tensor's slice
        # and view cost several times more, per part and step)
        return [torch.from_numpy(host[o:o + a.size].reshape(a.shape))
                for o, a in zip(offsets, arrays)]
    flat = torch.from_numpy(host)
    if kind == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    return [flat[o:o + a.size].view(a.shape) for o, a in zip(offsets, arrays)]


def longs_to_device(rows: Sequence[Sequence[int]], device) -> list[torch.Tensor]:
    """Lists of ints (each a 1-d part) on ``device`` as int64, in one ``to_device`` copy."""
    return to_device([np.asarray(r, dtype=np.int64).reshape(-1) for r in rows], device,
                     torch.long)


def to_host(t: torch.Tensor) -> np.ndarray:
    """A device tensor's values on the host, as a NumPy array (integer and float32 dtypes: a
    verdict's): on CUDA copied into pinned memory and waited for by an event on the tensor's
    own device's stream (the step's one wait: everything queued before it is done when it
    returns); on the CPU the tensor's own memory."""
    return HostCopy(t).wait()


class HostCopy:
    """``to_host`` in two halves: the copy queued (``HostCopy(t)``), then waited for
    (``wait``). Work queued between the two runs after the copy on the device's stream, and
    the wait does not wait for it: a decode step launched ahead (``engine.decode_ahead``) is
    queued there, so the device runs it while the host reads this step's verdicts."""

    def __init__(self, t: torch.Tensor):
        self._host: torch.Tensor | None = None
        self._done = None
        if t.device.type == "cpu":
            self._array = t.detach().numpy()
            return
        if t.device.type != "cuda":
            self._array = t.detach().cpu().numpy()
            return
        self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._host.copy_(t, non_blocking=True)  # on the current stream of t's device
        self._done = torch.cuda.Event()
        self._done.record(torch.cuda.current_stream(t.device))

    def wait(self) -> np.ndarray:
        if self._done is not None:
            assert self._host is not None
            self._done.synchronize()
            self._array, self._done = self._host.numpy(), None
        return self._array


class DeviceSpan:
    """The device's seconds for the work queued between its start and ``stop``, read once a
    later wait has passed (CUDA events on the device's stream: reading them then waits for
    nothing; ``seconds`` before that waits for the work). On a CPU the host's clock: the
    work ran as it was queued."""

    def __init__(self, device: torch.device):
        self.on_cuda = device.type == "cuda"
        if self.on_cuda:
            self._stream = torch.cuda.current_stream(device)
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record(self._stream)
        else:
            self._t0 = time.perf_counter()
        self._seconds: float | None = None

    def stop(self) -> "DeviceSpan":
        if self.on_cuda:
            self._end.record(self._stream)
        else:
            self._seconds = time.perf_counter() - self._t0
        return self

    def seconds(self) -> float:
        if self._seconds is None:
            self._end.synchronize()  # done already after the step's wait
            self._seconds = self._start.elapsed_time(self._end) / 1e3
        return self._seconds


@contextlib.contextmanager
def implicit_syncs_refused(device: torch.device) -> Iterator[None]:
    """While inside, a copy between pageable host memory and CUDA memory, or a stream
    synchronize torch makes on its own (``.item()``, ``.tolist()``, ``nonzero``, a blocking
    copy), raises RuntimeError naming it (torch's sync debug mode, set for the whole process,
    every thread). What it does not see: an explicit ``torch.cuda.synchronize()``, an event's
    wait (``to_host``'s, the one a step makes), an allocation. Does nothing off CUDA."""
    if device.type != "cuda":
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)
