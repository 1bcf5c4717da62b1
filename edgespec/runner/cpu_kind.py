"""What CPU this process computes on, as its kernels see it: the model name, the ISA flags that
decide bfloat16's path, and the caps a user put on them (``ONEDNN_MAX_CPU_ISA`` for oneDNN,
``ATEN_CPU_CAPABILITY`` for torch's own kernels), plus torch's thread count. Benchmarks and the
dtype choice print it, so a figure or a refusal always says which machine it came from.

Flags never decide what is served: the start probes do (``dtype_probe``). Flags only pick which
kernel a probe tries first. bfloat16 without AVX-512 BF16 or AMX is emulated by oneDNN's
``gemm:jit`` driver, which splits a small batched product among threads by the thread count;
seen on Cascade Lake and under ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI``: at 8 threads a
[9, 65, 64] x [9, 64, 256] product gave one column other bits than the same column in a
[6, ...] product, so the attention's products run in float32 there (``attention.py``).
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field

FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")
# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) that keep bfloat16 instructions in use; any lower one
# (AVX512_CORE_VNNI, AVX512_CORE, AVX2, ...) makes oneDNN emulate bfloat16
BF16_CAPS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX",
             "AVX10_1_512_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16", "ALL", "DEFAULT")


@dataclass(frozen=True)
class CpuKind:
    model: str  # e.g. "Intel(R) Xeon(R) Platinum 8480+"
    flags: tuple[str, ...]  # those of FLAGS_OF_INTEREST the CPU reports
    onednn_cap: str  # ONEDNN_MAX_CPU_ISA, "" when unset
    aten_cap: str  # ATEN_CPU_CAPABILITY, "" when unset
    torch_capability: str  # what torch's own kernels run (torch.backends.cpu), "" without torch
    threads: int  # torch's intra-op threads now
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)

    @property
    def bf16_native(self) -> bool:
        """Whether oneDNN runs bfloat16 products on bfloat16 instructions here (else it emulates
        them in float32 with a thread-count-dependent split)."""
        has = "avx512_bf16" in self.flags or "amx_bf16" in self.flags
        return has and (not self.onednn_cap or self.onednn_cap.upper() in BF16_CAPS)

    def describe(self) -> str:
        """One line for a log or a table's caption."""
        caps = ", ".join(f"{k}={v}" for k, v in (("ONEDNN_MAX_CPU_ISA", self.onednn_cap),
                                                 ("ATEN_CPU_CAPABILITY", self.aten_cap)) if v)
        bf16 = "native" if self.bf16_native else "emulated"
        return (f"{self.model} ({' '.join(self.flags) or 'no AVX2'}; bfloat16 {bf16}"
                f"{'; ' + caps if caps else ''}), {self.threads} threads on {self.cores} cores")

    def as_json(self) -> dict:
        return {**asdict(self), "flags": list(self.flags), "bf16_native": self.bf16_native}


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) from /proc/cpuinfo; (platform's name, no flags) elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read(200_000)
    except OSError:
        return platform.processor() or platform.machine(), set()
    model, flags = "", set[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model or platform.machine(), flags


def cpu_kind() -> CpuKind:
    model, flags = _cpuinfo()
    try:
        import torch
        capability, threads = torch.backends.cpu.get_cpu_capability(), torch.get_num_threads()
    except ImportError:  # a core install: no torch kernels to describe
        capability, threads = "", 1
    return CpuKind(model=model, flags=tuple(f for f in FLAGS_OF_INTEREST if f in flags),
                   onednn_cap=os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
                   aten_cap=os.environ.get("ATEN_CPU_CAPABILITY", ""),
                   torch_capability=capability, threads=threads)
