"""The dtype the runner is given: the probes' results kept per thread count, bfloat16's
attention products in float32 where it is emulated, and ``--dtype auto`` choosing the faster
exact dtype by measuring it once a setting and serving that choice on every run (the cost
measure mocked: the choice's rules, not this moment's load)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from edgespec.config import ConfigError
from edgespec.runner.dtype_probe import exact_here


def test_the_probes_run_at_the_thread_count_in_force(monkeypatch):
    """A kernel that is invariant at 2 threads and not at 8 is refused at 8: the probes' results
    are kept per thread count (the start check once ran at one count and served another)."""
    import edgespec.runner.attention_probe as attention_probe
    from edgespec.runner import dtype_choice, dtype_probe

    real = attention_probe.probe_invariance
    monkeypatch.setattr(attention_probe, "probe_invariance",
                        lambda *a, **k: torch.get_num_threads() != 8 and real(*a, **k))
    dtype_probe._attention_kernel.cache_clear()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert exact_here("float32")
        torch.set_num_threads(8)
        assert not exact_here("float32")
        with pytest.raises(ConfigError, match="not batch-invariant on this cpu at 8 threads"):
            dtype_choice.resolve_dtype("float32")
        monkeypatch.setattr(dtype_choice, "exact_here", lambda name, device="cpu": False)
        with pytest.raises(ConfigError, match="on this cpu at 8 threads .* fewer --threads"):
            dtype_choice.choose_auto()  # no dtype exact: the thread count named, fewer suggested
    finally:
        torch.set_num_threads(before)
        dtype_probe._attention_kernel.cache_clear()


def test_emulated_bfloat16_gets_float32_attention_products(monkeypatch):
    """Where bfloat16 is emulated (no AVX-512 BF16 nor AMX, or oneDNN capped below them) the
    attention kernel runs its products in float32; natively it keeps bfloat16's."""
    from edgespec.runner import dtype_probe
    from edgespec.runner.cpu_kind import cpu_kind

    kind = cpu_kind()
    for flags, cap, native in ((("avx512f", "avx512_vnni"), "", False),
                               (("avx512f", "avx512_bf16"), "", True),
                               (("avx512f", "avx512_bf16", "amx_bf16"), "AVX512_CORE_VNNI", False),
                               (("avx512f", "amx_bf16"), "AVX512_CORE_AMX", True)):
        fake = dataclasses.replace(kind, flags=flags, onednn_cap=cap)
        assert fake.bf16_native is native
        assert ("bfloat16 native" if native else "bfloat16 emulated") in fake.describe()
        monkeypatch.setattr(dtype_probe, "cpu_kind", lambda fake=fake: fake)
        dtype_probe._attention_kernel.cache_clear()
        kernel = dtype_probe.attention_kernel(torch.bfloat16, "cpu", 3, 3, 64)
        if kernel is not None and not native:  # None: this oneDNN has no bfloat16 at all
            assert kernel.products == torch.float32
        elif kernel is not None:  # native: its own products first, float32 if they fail
            assert kernel.products in (None, torch.float32)
    dtype_probe._attention_kernel.cache_clear()


def test_auto_takes_the_measured_faster_exact_dtype(monkeypatch, caplog):
    """``auto`` serves bfloat16 only where it is exact and measured faster than float32 (by the
    margin), says what it measured, and float32 where bfloat16 is refused."""
    import logging

    from edgespec.runner import dtype_choice

    if not exact_here("bfloat16"):
        assert dtype_choice.resolve_dtype("auto") == "float32"
        return
    for bf16_ms, chosen in ((0.05, "bfloat16"), (0.2, "float32"), (0.099, "float32")):
        dtype_choice.memo_path().unlink(missing_ok=True)  # measured again (see below)
        monkeypatch.setattr(dtype_choice, "linear_costs_ms",
                            lambda dts, device="cpu", b=bf16_ms:
                            [b if dt == torch.bfloat16 else 0.1 for dt in dts])
        with caplog.at_level(logging.INFO, logger="edgespec.dtype"):
            caplog.clear()
            assert dtype_choice.resolve_dtype("auto") == chosen
        assert f"dtype auto: {chosen}" in caplog.text
        assert f"bfloat16 {bf16_ms:.3f} ms" in caplog.text
        assert "this CPU: " in caplog.text
    monkeypatch.setattr(dtype_choice, "exact_here", lambda name, device="cpu": name == "float32")
    assert dtype_choice.resolve_dtype("auto") == "float32"
    assert dtype_choice.choose_auto().refused == ("bfloat16",)


def test_auto_measures_again_a_choice_another_measure_made(monkeypatch):
    """A choice remembered from another measure (the one linear read from the cache every call,
    which chose float32 where bfloat16's forward was faster) is not reused: the setting's key
    names what was measured, and the new measure's choice is kept beside the old entry."""
    import json

    from edgespec.runner import dtype_choice
    from edgespec.runner.cpu_kind import cpu_kind
    from edgespec.runner.dtype_memo import setting_key

    if not exact_here("bfloat16"):
        pytest.skip("bfloat16 is not exact here: auto has one candidate and measures nothing")
    old = setting_key("cpu", cpu_kind().describe(), ["bfloat16", "float32"])
    dtype_choice.memo_path().parent.mkdir(parents=True, exist_ok=True)
    dtype_choice.memo_path().write_text(json.dumps(
        {old: {"dtype": "float32", "cost_ms": {"bfloat16": 0.66, "float32": 0.62}}}))
    monkeypatch.setattr(dtype_choice, "linear_costs_ms",
                        lambda dts, device="cpu": [5.5 if dt == torch.bfloat16 else 9.0
                                                   for dt in dts])
    choice = dtype_choice.choose_auto()
    assert choice.dtype == "bfloat16" and not choice.remembered
    assert dtype_choice.COST_PROBE in choice.reason()
    table = json.loads(dtype_choice.memo_path().read_text())
    assert table[old]["dtype"] == "float32"
    [new_key] = [k for k in table if k != old]
    assert new_key.endswith(dtype_choice.COST_PROBE) and table[new_key]["dtype"] == "bfloat16"


def test_auto_measures_once_a_setting_and_every_run_serves_that_choice(monkeypatch, caplog):
    """Two runs of one command could choose differently where the two dtypes are close (both
    exact: a seeded request answered with other tokens): the first measurement of a setting is
    kept in the cache folder and reused, said in the log; deleting the file measures again, and
    a file that cannot be read is measured past."""
    import logging

    from edgespec.runner import dtype_choice

    if not exact_here("bfloat16"):
        pytest.skip("bfloat16 is not exact here: auto has one candidate and measures nothing")
    calls = []

    def costs(bf16_ms):
        def cost(dts, device="cpu"):
            calls.extend(dts)
            return [bf16_ms if dt == torch.bfloat16 else 0.1 for dt in dts]
        monkeypatch.setattr(dtype_choice, "linear_costs_ms", cost)

    costs(0.05)
    assert dtype_choice.choose_auto().dtype == "bfloat16" and len(calls) == 2
    assert dtype_choice.memo_path().exists()
    costs(0.5)  # the moment's load would now choose float32
    with caplog.at_level(logging.INFO, logger="edgespec.dtype"):
        assert dtype_choice.resolve_dtype("auto") == "bfloat16"
    assert len(calls) == 2 and "remembered from" in caplog.text and "measured" in caplog.text
    dtype_choice.memo_path().write_text("{not json")
    assert dtype_choice.choose_auto().dtype == "float32" and len(calls) == 4
    dtype_choice.memo_path().unlink()
    costs(0.05)
    assert dtype_choice.choose_auto().dtype == "bfloat16" and len(calls) == 6
