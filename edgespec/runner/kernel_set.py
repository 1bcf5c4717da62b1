"""The runner's kernel set: every choice that decides a step's bits, made first, as one record.

A session's output is exactly target-only decoding *on one kernel set*: the same model in
another dtype, on another GPU or CPU kind, at another thread count, with another attention kernel
or other products (or another version of torch, Triton or these kernels) may round one logit
differently and, from that token on, decode differently. So ``choose_kernel_set`` decides all
of it before the runner loads a weight: the kernel path (``eager`` torch ops or the fused
``triton`` ones), the linear products, the attention kernel (the one its start probe proves
batch-invariant here), the dtype, the device's name, the versions; the runner is built from the
record (``TargetRunner(kernel_set=...)``) and keeps it.

Its ``fingerprint`` is kept with each session (``edgespec.protocol.lineage``): a replica whose
fingerprint differs does not continue a session silently; the router prefers a replica with the
session's fingerprint, and a session that does move says from which output position its decoding
differs (the SDK's result, the metrics; ``docs/failure-model.md``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import logging
from dataclasses import asdict, dataclass, replace

import torch

from ..config import ConfigError
from .attention import COL_TILE, MAX_COLS
from .check_cache import code_digest, host_device, triton_version
from . import dtype_probe
from .linear import GEMMS

log = logging.getLogger(__name__)

KERNELS = ("eager", "triton")

# the modules whose arithmetic decides a step's bits, per kernel path (their source is digested;
# every runner module is either here or in NO_STEP_ARITHMETIC, which a test checks)
NUMERIC_CODE = {
    "eager": ("edgespec.runner.attention", "edgespec.runner.linear",
              "edgespec.runner.target_runner", "edgespec.runner.slot_prompts",
              "edgespec.runner.eager_forward", "edgespec.runner.model_weights"),
    "triton": ("edgespec.runner.attention", "edgespec.runner.linear",
               "edgespec.runner.target_runner", "edgespec.runner.slot_prompts",
               "edgespec.runner.model_weights",
               "edgespec.runner.fused_kernels", "edgespec.runner.fused_gemm",
               "edgespec.runner.fused_attention", "edgespec.runner.fused_forward",
               "edgespec.runner.gemm_plan"),
}
# runner modules that compute none of a step's values: they choose, check, store, index or
# time (a change to what they choose shows in the kernel set's other fields)
NO_STEP_ARITHMETIC = ("attention_probe", "check_cache", "cpu_kind", "cpu_time", "dtype_choice",
                      "dtype_memo", "dtype_probe", "fused_attention_probe", "host_transfers",
                      "kernel_caches", "kernel_set", "kv_cache", "model_support",
                      "process_heap", "start_check", "step_graphs", "step_rows",
                      "thread_step_down", "threads")


@dataclass(frozen=True)
class HeadLayout:
    """The model's attention heads, which the attention probes are run for."""

    n_heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of_config(cls, cfg) -> "HeadLayout":
        """A transformers config's heads (its key-value heads and head size where it gives
        them, else the attention heads' and the hidden size's share)."""
        n_heads = cfg.num_attention_heads
        return cls(n_heads, getattr(cfg, "num_key_value_heads", None) or n_heads,
                   getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)


@dataclass(frozen=True)
class KernelSet:
    """How one runner computes a step. ``products``: the linear layers' kernels (eager: ``packed``
    oneDNN weights, ``packed-spans128``/``96`` the same in calls of 40 up to 128 or 96 rows, or
    ``packed-tiles`` in padded calls of 32 rows, where its probe needs them (``linear.RowCalls``),
    or ``plain`` torch ones; fused: ``tiles``, cuBLAS in 128-row tiles, or ``triton``).
    ``attention``: eager: ``blocks`` (fixed-shape products over key blocks, query columns in tiles
    of ``col_tile``, the products in ``attention_products`` or the model's own dtype when "");
    fused: ``tiles``, ``rows``, ``split``, ``chunks`` or ``split-decode``. ``proven``: the
    start probes chose the attention (an exact runner); a drafter's runner takes the defaults
    unprobed. ``device``: the GPU's name, or the CPU's model, ISA flags and caps;
    ``threads``: torch's intra-op threads on a CPU (they split products there), 0 on a GPU;
    ``torch_version``: with the CUDA it was built for on a GPU. ``code``: a digest of the
    numeric modules' source (an edited kernel is another kernel set)."""

    kernels: str
    products: str
    attention: str
    col_tile: int
    attention_products: str
    proven: bool
    dtype: str
    device: str
    threads: int
    torch_version: str
    triton_version: str  # "-" on the eager path
    code: str
    # eager: the most query columns an attention product takes (256; ``col_tile`` where every
    # product is exactly that wide: ``dtype_probe``)
    attention_cols: int = MAX_COLS

    @functools.cached_property
    def fingerprint(self) -> str:
        """16 hex digits naming this record: equal records, equal fingerprints."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def as_json(self) -> dict:
        return {**asdict(self), "fingerprint": self.fingerprint}

    def describe(self) -> str:
        """One line for a log or a status line."""
        att = self.attention
        if self.kernels == "eager":
            att += f"/{self.col_tile}" + (f"x{self.attention_cols}"
                                          if self.attention_cols == self.col_tile else "") + \
                (f"@{self.attention_products}" if self.attention_products else "")
        return (f"{self.fingerprint}: {self.kernels} kernels, {self.products} products, {att} "
                f"attention, {self.dtype} on {self.device}"
                f"{f' x{self.threads} threads' if self.threads else ''}, torch {self.torch_version}"
                f"{', triton ' + self.triton_version if self.triton_version != '-' else ''}")

    @property
    def attention_dtype(self) -> torch.dtype | None:
        """The attention's products' dtype (None: the model's own)."""
        return getattr(torch, self.attention_products) if self.attention_products else None


def choose_kernel_set(device: torch.device | str, dtype: torch.dtype, heads: HeadLayout,
                      kernels: str | None = None, gemm: str = "tiles", pack: bool = True,
                      exact: bool = True, attention: str | None = None,
                      attention_kernel: str | None = None,
                      linear_shapes: tuple[tuple[int, int], ...] = ()) -> KernelSet:
    """The kernel set a runner of this head layout serves with here, torch's thread count now.
    ``kernels``/``gemm``/``pack``: as asked (``kernels`` None: the default for the device).
    ``exact``: a target's runner, whose attention the start probes choose (ConfigError where
    none is batch-invariant); a drafter's takes the defaults. ``attention``: the fused kernel of
    a runner whose weights this one shares (not probed again). ``attention_kernel``: the fused
    attention kernel asked for (``fused_attention.ATTENTION_KERNELS``), probed alone; None: the
    first of them whose probe passes. ``linear_shapes``: the model's linear layers' (out, in),
    which the CPU's products are probed at (``dtype_probe.packed_products``)."""
    device = torch.device(device)
    path = kernels_for(device, kernels, heads.head_dim)
    if gemm not in GEMMS:
        raise ConfigError(f"gemm must be one of {', '.join(GEMMS)}, not {gemm!r}")
    fused = path == "triton"
    col_tile, att_products, proven, att_cols = COL_TILE, "", exact, MAX_COLS
    if fused:
        if attention is None:
            attention = _fused_attention(device, dtype, heads, exact, attention_kernel)
        products = gemm
    else:
        attention, products = "blocks", "packed" if pack else "plain"
        if exact and pack and device.type == "cpu":  # one oneDNN call, spans or tiles of rows
            products = dtype_probe.packed_products(dtype, str(device), linear_shapes) or "packed"
        if exact:
            kernel = dtype_probe.attention_kernel(dtype, str(device), heads.kv_heads,
                                                  heads.n_heads // heads.kv_heads,
                                                  heads.head_dim)
            if kernel is None:
                raise ConfigError(
                    f"attention with {heads.kv_heads} kv heads x "
                    f"{heads.n_heads // heads.kv_heads} x {heads.head_dim} is not batch-invariant "
                    f"here (its probe failed), {refusal(dtype, device)}")
            col_tile, att_cols = kernel.col_tile, kernel.max_cols
            att_products = str(kernel.products).removeprefix("torch.") if kernel.products else ""
    name, threads = host_device(device)
    code = code_digest(*(importlib.import_module(m) for m in NUMERIC_CODE[path]))
    return KernelSet(kernels=path, products=products, attention=attention, col_tile=col_tile,
                     attention_products=att_products, proven=proven,
                     dtype=str(dtype).removeprefix("torch."), device=name, threads=threads,
                     torch_version=_torch_build(device),
                     triton_version=triton_version() if fused else "-",
                     code=code, attention_cols=att_cols)


def runner_kernel_set(given: KernelSet | None, device: torch.device, dtype: torch.dtype,
                      heads: HeadLayout, shared: KernelSet | None = None,
                      kernels: str | None = None, gemm: str = "tiles", pack: bool = True,
                      exact: bool = True, attention_kernel: str | None = None,
                      linear_shapes: tuple[tuple[int, int], ...] = ()) -> KernelSet:
    """The kernel set a runner is built from, before any loading: ``given`` (ConfigError where
    it is for another dtype or device), else ``choose_kernel_set``'s. A runner sharing the
    weights of one built from ``shared`` keeps its fused attention kernel (not probed again)
    and, on the eager path, its products (one call, spans or tiles as its probe chose)."""
    if given is not None:
        here = (str(dtype).removeprefix("torch."), host_device(device)[0])
        if (given.dtype, given.device) != here:
            raise ConfigError(f"the kernel set is for {given.dtype} on {given.device}, this "
                              f"runner is in {here[0]} on {here[1]}")
        return given
    shared_attention = shared.attention if shared is not None and \
        shared.kernels == "triton" else None
    chosen = choose_kernel_set(device, dtype, heads, kernels, gemm, pack, exact,
                               attention=shared_attention, attention_kernel=attention_kernel,
                               linear_shapes=linear_shapes)
    if shared is not None and chosen.kernels == "eager":
        chosen = replace(chosen, products=shared.products)
    return chosen


def _torch_build(device: torch.device) -> str:
    """torch's version, with the CUDA it was built for on a GPU (cuBLAS's kernels are CUDA's)."""
    cuda = torch.version.cuda if device.type == "cuda" else None
    return f"{torch.__version__} (CUDA {cuda})" if cuda else torch.__version__


def kernels_for(device: torch.device, asked: str | None, head_dim: int) -> str:
    """The kernels a runner on ``device`` uses: the fused Triton ones on CUDA (where Triton
    is, as in torch's CUDA builds) for heads of a power-of-two size (their block shape), torch's
    eager ops elsewhere, unless ``asked``."""
    fits = head_dim & (head_dim - 1) == 0
    if asked is not None:
        if asked not in KERNELS:
            raise ConfigError(f"kernels must be one of {', '.join(KERNELS)}, not {asked!r}")
        if asked == "triton" and not fits:
            raise ConfigError(f"the fused kernels need a power-of-two head size, not {head_dim}")
        return asked
    if device.type != "cuda" or not fits:
        return "eager"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "eager"
    return "triton"


# the fused attention probes' outcomes in this process, by (probe, dtype, device, heads, kernel)
_PROBED: dict[tuple, str | None] = {}


def _fused_attention(device: torch.device, dtype: torch.dtype, heads: HeadLayout,
                     exact: bool, asked: str | None) -> str:
    """The fused attention kernel: the first of ``PROBE_ORDER`` (or ``asked`` alone, any of
    ``ATTENTION_KERNELS``)
    whose probe gives every query the same bits alone, in a batch and as a tree node here, for
    this head layout and dtype (a probe that differs, or a kernel that fails to build or run,
    logged); ConfigError where none holds. Not exact: ``asked``, else "tiles" where the head
    size allows, unprobed."""
    from .fused_attention import ATTENTION_KERNELS, PROBE_ORDER, supports_tiles
    from .fused_attention_probe import probe_slot_attention

    if asked is not None and asked not in ATTENTION_KERNELS:
        raise ConfigError(f"the attention kernel must be one of {', '.join(ATTENTION_KERNELS)}, "
                          f"not {asked!r}")
    if not exact:
        return asked or ("tiles" if supports_tiles(heads.head_dim) else "rows")
    failures: list[str] = []
    for name in (asked,) if asked else PROBE_ORDER:
        if name != "rows" and not supports_tiles(heads.head_dim):
            failures.append(f"{name}: heads of {heads.head_dim} are under 16")
            continue
        key = (probe_slot_attention, dtype, str(device), heads, name)
        if key not in _PROBED:  # once a process (the probe is the same code on the same device)
            try:
                _PROBED[key] = probe_slot_attention(dtype, device, heads.n_heads,
                                                    heads.kv_heads, heads.head_dim, kernel=name)
            except Exception as exc:  # a kernel that does not build or run here
                _PROBED[key] = f"{type(exc).__name__}: {exc}"
        differs = _PROBED[key]
        if differs is None:
            if failures:
                log.warning("the %s attention kernel is not batch-invariant on %s (%s): "
                            "serving with the %s kernel", ATTENTION_KERNELS[0], device,
                            "; ".join(failures), name)
            return name
        failures.append(f"{name}: {differs}")
    raise ConfigError(f"the fused attention is not batch-invariant here ({'; '.join(failures)})"
                      f", {refusal(dtype, device)}")


def refusal(dtype: torch.dtype, device: torch.device | str) -> str:
    """The words a refusal to serve ``dtype`` on ``device`` ends with."""
    return (f"so speculative decoding in {str(dtype).removeprefix('torch.')} on {device} would "
            "not be lossless: use --dtype auto (or float32 where it is served)")
