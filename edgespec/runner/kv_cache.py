"""A static, slotted KV cache: one slot per session, rollback by moving a length pointer.

Memory is allocated once: per layer, keys of shape [slots, kv_heads, max_len, head_dim] and values
of shape [slots, kv_heads, max_len, head_dim + 1], whose last column is all ones (so that the
attention's values product also sums its probabilities: ``edgespec.runner.attention``; the fused
kernels' values have none).
Writing a step's keys scatters them into the rows' slots in place; reading returns the first
``max(length)`` positions of the step's slots: on a GPU a view when the slots are a contiguous
ascending run (the common case: one session, or a full batch), else a gather; on the CPU always
a compact copy (its attention runs faster over one than over the strided view).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..config import CacheFullError, ConfigError
from .host_transfers import longs_to_device

GIB = 1 << 30


def available_memory(device: torch.device) -> int | None:
    """Bytes a new allocation can certainly not exceed on ``device`` now (None where it cannot
    be read): on CUDA the free memory plus what torch's caching allocator holds unused (a
    runner's fused weights leave the originals' blocks there); on Linux MemAvailable plus free
    swap, capped by the cgroup's memory.max (a container's limit, which MemAvailable does not
    show). Generous on purpose: only a cache that cannot fit is refused."""
    if device.type == "cuda":
        free = int(torch.cuda.mem_get_info(device)[0])
        return free + int(torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    info = _meminfo()
    if info is None:
        return None
    have = info.get("MemAvailable", 0) + info.get("SwapFree", 0)
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            have = min(have, int(limit))
    except OSError:
        pass
    return have


def _meminfo() -> dict[str, int] | None:
    """/proc/meminfo's figures in bytes (None where it cannot be read)."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        name, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            out[name] = int(parts[0]) * 1024
    return out or None


def cache_bytes(n_layers: int, n_slots: int, capacity: int, kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> int:
    """Bytes a runner's KV cache (``KVCache``, values with their column of ones) and rotary
    tables (cos and sin, and their four float32 [capacity, head_dim] stagings) take."""
    return capacity * _position_bytes(n_layers, n_slots, kv_heads, head_dim, dtype)


def _position_bytes(n_layers: int, n_slots: int, kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return (n_layers * n_slots * kv_heads * (2 * head_dim + 1) * itemsize
            + 2 * head_dim * itemsize + 4 * head_dim * 4)


def check_cache_fits(n_layers: int, n_slots: int, capacity: int, kv_heads: int, head_dim: int,
                     dtype: torch.dtype, device: torch.device, advice: str | None = None
                     ) -> None:
    """Refuse (``ConfigError``) a KV cache and rotary tables that do not fit in the memory
    ``device`` has available, before any is allocated: a context asked too long would
    otherwise end in the allocator's error or, touched page by page, in the kernel's
    out-of-memory kill with no word said. ``advice``: what to change, said last (None: a
    server's options, with how many tokens a slot would fit)."""
    per_position = _position_bytes(n_layers, n_slots, kv_heads, head_dim, dtype)
    need = per_position * capacity
    have = available_memory(device)
    if have is None or need <= have:
        return
    if advice is None:
        advice = (f"serve a shorter context (--max-context; about {have // per_position} "
                  f"tokens fit a slot here) or fewer sessions (--max-sessions)")
    raise ConfigError(
        f"the KV cache of {n_slots} slots x {capacity} positions ({n_layers} layers, "
        f"{kv_heads} KV heads of {head_dim}, {str(dtype).removeprefix('torch.')}) needs "
        f"{need / GIB:.1f} GiB, and {device.type} has {have / GIB:.1f} GiB available: {advice}")


class KVCache:
    def __init__(self, n_layers: int, n_slots: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 capacity: int | None = None, value_ones: bool = True):
        """``value_ones``: values carry a last column of ones (the eager attention's softmax
        denominator); the fused attention keeps its own and reads rows of head_dim."""
        # capacity >= max_len: positions allocated (attention reads whole blocks past the end)
        self.capacity = max(max_len, capacity or max_len)
        shape = (n_slots, kv_heads, self.capacity, head_dim)
        # zeros, not empty: masked-out positions still enter p @ V with p == 0, and 0 * NaN from
        # uninitialised memory would poison the row
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        vshape = (n_slots, kv_heads, self.capacity, head_dim + int(value_ones))
        self.v = [torch.zeros(vshape, dtype=dtype, device=device) for _ in range(n_layers)]
        if value_ones:
            for v in self.v:
                v[..., head_dim] = 1
        self.head_dim = head_dim
        self.max_len = max_len
        self.lengths = [0] * n_slots  # valid positions per slot: the rollback pointer
        self._free = list(range(n_slots))
        self._reserved = 0  # slots taken for good (``reserve``)

    # -- slots ---------------------------------------------------------------------------------
    def allocate(self) -> int:
        """Take the lowest free slot (keeps active slots compact, so reads stay views)."""
        if not self._free:
            raise CacheFullError(f"all {len(self.lengths) - self._reserved} KV slots are in use")
        self._free.sort()
        slot = self._free.pop(0)
        self.lengths[slot] = 0
        return slot

    def reserve(self) -> int:
        """Take the highest free slot for good (a scratch slot no session is given)."""
        self._free.sort()
        self._reserved += 1
        return self._free.pop()

    def release(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"slot {slot} is not allocated")
        self.lengths[slot] = 0
        self._free.append(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    # -- positions -----------------------------------------------------------------------------
    def rollback(self, slot: int, length: int) -> None:
        """Forget every position at or beyond ``length`` (no data moves)."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot roll slot {slot} back to {length} (has {self.lengths[slot]})")
        self.lengths[slot] = length

    def commit(self, slot: int, length: int) -> None:
        """Declare positions below ``length`` valid (they were written by a forward pass)."""
        if not 0 <= length <= self.max_len:
            raise CacheFullError(f"length {length} exceeds the slot size {self.max_len}")
        self.lengths[slot] = length

    def check_room(self, slot: int, start: int, n_tokens: int) -> None:
        if start + n_tokens > self.max_len:
            raise CacheFullError(
                f"session needs {start + n_tokens} positions, a KV slot holds {self.max_len}"
            )

    # -- data ----------------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter a step's keys/values into place.

        slots: [B] long; positions: [B, T] long; k, v: [B, T, kv_heads, head_dim].
        """
        idx = (slots[:, None], slice(None), positions)
        self.k[layer][idx] = k
        self.v[layer][idx + (slice(0, self.head_dim),)] = v

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Slot ``dst`` holds slot ``src``'s first ``length`` positions (keys and values, in
        every layer: one copy a layer, queued on the device without a wait) and that length."""
        if not 0 <= length <= self.lengths[src]:
            raise ValueError(f"slot {src} holds {self.lengths[src]} positions, not {length}")
        if src == dst or dst in self._free:
            raise ValueError(f"cannot copy slot {src}'s positions into slot {dst}")
        for cache in self.k + self.v:
            cache[dst, :, :length] = cache[src, :, :length]
        self.lengths[dst] = length

    def move_many(self, slots: list[int], src: list[int], dst: list[int]) -> None:
        """Copy keys/values between positions of slots: entry i copies position ``src[i]`` of
        slot ``slots[i]`` to ``dst[i]``, in every layer, one indexed copy a layer (every source
        entry is read before any is overwritten; two entries never write one place)."""
        slot_t, src_t, dst_t = longs_to_device([slots, src, dst], self.k[0].device)  # no wait
        for cache in self.k + self.v:
            cache[slot_t, :, dst_t] = cache[slot_t, :, src_t]  # the gather copies first

    def place_paths(self, paths: Sequence[tuple[int, Sequence[int]]]
                    ) -> list[Exception | None]:
        """Keep verified trees' accepted paths: for each (slot, path) (node indices, root to
        leaf, of a tree whose root sits at the slot's length and whose node i was written at
        length + 1 + i), the keys/values of the path's nodes moved to the positions right after
        the root, in one indexed copy a layer, and the slot's length set to cover root + path,
        as if the chain root + path had been verified (a path along the chain moves nothing).
        Returns each entry's error (None: placed): a path that is not increasing node indices,
        that outgrows its slot, or whose slot an earlier entry holds, is refused alone
        (nothing of it moved); if the copy itself fails, every entry it moved anything for gets
        that error (its slot's length stays at the root)."""
        errors: list[Exception | None] = [None] * len(paths)
        ends: list[tuple[int, int, int]] = []  # (entry, slot, end)
        slots: list[int] = []
        src: list[int] = []
        dst: list[int] = []
        moved: list[int] = []
        seen: set[int] = set()
        for e, (slot, path) in enumerate(paths):
            try:
                if slot in seen:  # its root would be read before the first entry moved it
                    raise ValueError(f"slot {slot} is placed twice in one call")
                root = self.lengths[slot]
                nodes = [int(i) for i in path]
                if any(b <= a for a, b in zip(nodes, nodes[1:])) or (nodes and nodes[0] < 0):
                    raise ValueError(f"a path is increasing node indices >= 0, got {nodes}")
                self.check_room(slot, root + 1, (nodes[-1] + 1) if nodes else 0)
            except Exception as exc:  # this entry's alone: nothing of it moved
                errors[e] = exc
                continue
            seen.add(slot)
            off = [(i, j) for j, i in enumerate(nodes) if i != j]  # off the chain: to move
            if off:
                moved.append(e)
                slots += [slot] * len(off)
                src += [root + 1 + i for i, _ in off]
                dst += [root + 1 + j for _, j in off]
            ends.append((e, slot, root + 1 + len(nodes)))
        if src:
            try:
                self.move_many(slots, src, dst)
            except Exception as exc:  # the device's copy: every entry it concerned
                for e in moved:
                    errors[e] = exc
        for e, slot, end in ends:
            if errors[e] is None:
                self.commit(slot, end)
        return errors

    def read(self, layer: int, slots: torch.Tensor, contiguous_from: int | None,
             n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [B, kv_heads, n_pos, hd] and values [B, kv_heads, n_pos, hd + 1] of positions
        [0, n_pos) for the step's slots."""
        if contiguous_from is not None:
            end = contiguous_from + slots.numel()
            k = self.k[layer][contiguous_from:end, :, :n_pos]
            v = self.v[layer][contiguous_from:end, :, :n_pos]
            if k.device.type == "cpu":
                # the CPU's attention runs faster over a compact copy than over the view strided
                # by the slot's capacity (measured: a decode forward 1-10% less, more at more rows)
                return k.contiguous(), v.contiguous()
            return k, v
        # Narrow to n_pos first, then gather whole slots: advanced indexing over the first axis
        # with a slice after it takes a slower general path (measured: about half the time).
        return (self.k[layer][:, :, :n_pos].index_select(0, slots),
                self.v[layer][:, :, :n_pos].index_select(0, slots))


def contiguous_start(slots: list[int]) -> int | None:
    """The first slot if ``slots`` is an ascending run of consecutive ids, else None."""
    if all(b - a == 1 for a, b in zip(slots, slots[1:])):
        return slots[0]
    return None
