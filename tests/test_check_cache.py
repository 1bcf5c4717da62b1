"""The start check's cache (edgespec.runner.check_cache): a key's outcome is reused in the
process and across a restart (on disk), a failure is raised again, any changed part of the key
checks again, a bad file is a miss and the model fingerprint sees what it samples."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from edgespec.config import ConfigError
from edgespec.runner.check_cache import (ENV_VAR, CheckKey, CheckOutcome, StartCheckCache,
                                         default_cache, model_fingerprint, run_checked)

KEY = CheckKey(model="m" * 64, device="Test CPU [avx2]", dtype="bfloat16",
               torch_version="2.13.0", triton_version="none", threads=4, max_rows=64,
               kernels="eager")


class Check:
    """A start check that counts its calls and raises ``error`` if given."""

    def __init__(self, error: Exception | None = None):
        self.calls, self.error = 0, error

    def __call__(self) -> None:
        self.calls += 1
        if self.error is not None:
            raise self.error


@pytest.fixture
def cache(tmp_path) -> StartCheckCache:
    return StartCheckCache(tmp_path / "checks")


def test_second_run_with_same_key_does_not_check(cache):
    check = Check()
    first = run_checked(KEY, check, cache)
    second = run_checked(dataclasses.replace(KEY), check, cache)  # an equal, distinct key
    assert check.calls == 1
    assert first.passed and first.failure is None and first.seconds >= 0
    assert second == first


@pytest.mark.parametrize("change", [{"dtype": "float32"}, {"device": "NVIDIA H100 80GB HBM3"},
                                    {"torch_version": "2.14.0"}, {"max_rows": 128},
                                    {"triton_version": "3.5.0"}, {"threads": 8},
                                    {"kernels": "triton"}, {"model": "n" * 64}])
def test_a_changed_key_checks_again(cache, change):
    check = Check()
    run_checked(KEY, check, cache)
    other = dataclasses.replace(KEY, **change)
    assert other.digest() != KEY.digest()
    run_checked(other, check, cache)
    assert check.calls == 2
    run_checked(other, check, cache)
    run_checked(KEY, check, cache)
    assert check.calls == 2


def test_a_failure_is_cached_and_raised_again(cache, tmp_path):
    message = "linear layer down (1536 -> 576) is not batch-invariant here"
    check = Check(ConfigError(message))
    with pytest.raises(ConfigError) as first:
        run_checked(KEY, check, cache)
    assert str(first.value) == message
    with pytest.raises(ConfigError) as second:
        run_checked(KEY, check, cache)
    assert str(second.value) == message and check.calls == 1
    with pytest.raises(ConfigError, match="not batch-invariant"):  # after a restart too
        run_checked(KEY, check, StartCheckCache(tmp_path / "checks"))
    assert check.calls == 1
    outcome = cache.lookup(KEY)
    assert outcome is not None and not outcome.passed and outcome.failure == message


def test_other_errors_propagate_and_are_not_cached(cache):
    check = Check(RuntimeError("CUDA out of memory"))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="out of memory"):
            run_checked(KEY, check, cache)
    assert check.calls == 2 and cache.lookup(KEY) is None


def test_disk_cache_survives_a_restart(tmp_path):
    folder = tmp_path / "checks"
    run_checked(KEY, Check(), StartCheckCache(folder))
    assert [p.name for p in folder.iterdir()] == [f"{KEY.digest()}.json"]  # no temp file left
    restarted, check = StartCheckCache(folder), Check()
    outcome = run_checked(KEY, check, restarted)
    assert check.calls == 0 and outcome.passed


def test_env_var_names_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "elsewhere"))
    run_checked(KEY, Check(), StartCheckCache())
    assert (tmp_path / "elsewhere" / f"{KEY.digest()}.json").is_file()
    check = Check()
    run_checked(KEY, check, StartCheckCache())
    assert check.calls == 0


BROKEN_OUTCOME = json.dumps({"key": dataclasses.asdict(KEY), "outcome": {"passed": True}}).encode()


@pytest.mark.parametrize("text", [b"{not json", b"", b"[]", b"\xff\xfe{", BROKEN_OUTCOME])
def test_a_corrupt_file_is_a_miss(cache, tmp_path, text):
    run_checked(KEY, Check(), cache)
    path = tmp_path / "checks" / f"{KEY.digest()}.json"
    path.write_bytes(text)
    fresh, check = StartCheckCache(tmp_path / "checks"), Check()
    assert fresh.lookup(KEY) is None
    run_checked(KEY, check, fresh)
    assert check.calls == 1
    assert json.loads(path.read_text())["outcome"]["passed"] is True  # rewritten whole


def test_a_file_of_another_key_is_a_miss(cache, tmp_path):
    other = dataclasses.replace(KEY, dtype="float32")
    run_checked(other, Check(), cache)
    folder = tmp_path / "checks"
    (folder / f"{other.digest()}.json").rename(folder / f"{KEY.digest()}.json")
    assert StartCheckCache(folder).lookup(KEY) is None


def test_off_keeps_the_cache_in_the_process(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv(ENV_VAR, "off")
    check, cache = Check(), StartCheckCache()
    run_checked(KEY, check, cache)
    run_checked(KEY, check, cache)
    assert check.calls == 1  # still cached in the process
    run_checked(KEY, check, StartCheckCache())
    assert check.calls == 2  # but not across a restart
    assert list(home.iterdir()) == []  # nothing under ~/.cache


def test_unwritable_folder_never_raises_and_warns_once(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cache, check = StartCheckCache(blocker / "checks"), Check()
    with caplog.at_level(logging.DEBUG, logger="edgespec.start_check"):
        run_checked(KEY, check, cache)
        run_checked(dataclasses.replace(KEY, dtype="float32"), check, cache)
        run_checked(KEY, check, cache)
    assert check.calls == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot write" in warnings[0].getMessage()


def test_cached_pass_is_logged(cache, caplog):
    run_checked(KEY, Check(), cache)
    with caplog.at_level(logging.INFO, logger="edgespec.start_check"):
        run_checked(KEY, Check(), cache)
    assert (f"start check: cached pass for {KEY.device} {KEY.dtype} ({KEY.digest()})"
            in caplog.messages)


def test_store_and_lookup_round_trip(cache, tmp_path):
    outcome = CheckOutcome(passed=False, failure="the SiLU is not batch-invariant here",
                           checked_at="2025-01-01T00:00:00+00:00", seconds=1.5)
    cache.store(KEY, outcome)
    assert cache.lookup(KEY) == outcome
    assert StartCheckCache(tmp_path / "checks").lookup(KEY) == outcome


def test_key_here_on_cpu():
    key = CheckKey.here("f" * 64, "cpu", torch.bfloat16, 64, "eager")
    assert key.dtype == "bfloat16" and key.threads == torch.get_num_threads()
    assert key.torch_version == torch.__version__ and key.triton_version
    assert key.device and key.max_rows == 64 and key.kernels == "eager"
    assert key == CheckKey.here("f" * 64, "cpu", "bfloat16", 64, "eager")
    assert len(key.digest()) == 16 and int(key.digest(), 16) >= 0
    assert key.digest() == CheckKey.here("f" * 64, "cpu", "bfloat16", 64, "eager").digest()


def test_default_cache_is_shared():
    assert default_cache() is default_cache()


def _weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(300, 40, generator=g), torch.randn(8, generator=g).to(torch.bfloat16),
            torch.randn(10, 3, generator=g)]


CONFIG = {"hidden_size": 40, "num_hidden_layers": 2, "rope_theta": 10000.0}


def test_fingerprint_is_stable():
    a = model_fingerprint(CONFIG, _weights())
    assert a == model_fingerprint(dict(reversed(list(CONFIG.items()))), _weights())
    assert len(a) == 64 and int(a, 16) >= 0


@pytest.mark.parametrize("index", [0, 2047, -1, -2048])
def test_fingerprint_sees_a_sampled_element(index):
    weights = _weights()
    base = model_fingerprint(CONFIG, weights)
    weights[0].view(-1)[index] += 1.0
    assert model_fingerprint(CONFIG, weights) != base


def test_fingerprint_sees_small_tensors_whole_and_dtype_and_shape():
    base = model_fingerprint(CONFIG, _weights())
    w = _weights()
    w[2][5, 1] += 1.0
    assert model_fingerprint(CONFIG, w) != base
    w = _weights()
    w[1] = w[1].float()
    assert model_fingerprint(CONFIG, w) != base
    w = _weights()
    w[2] = w[2].reshape(3, 10)
    assert model_fingerprint(CONFIG, w) != base


def test_fingerprint_samples_only_the_ends():
    weights = _weights()  # 12000 elements: 2048 from each end are hashed
    base = model_fingerprint(CONFIG, weights)
    weights[0].view(-1)[6000] += 1.0
    assert model_fingerprint(CONFIG, weights) == base


def test_fingerprint_sees_the_config():
    base = model_fingerprint(CONFIG, _weights())
    assert model_fingerprint({**CONFIG, "num_hidden_layers": 3}, _weights()) != base
    assert model_fingerprint({**CONFIG, "extra": None}, _weights()) != base


def test_fingerprint_of_a_strided_tensor_matches_its_contiguous_copy():
    w = _weights()[0]
    t = w.t()
    assert not t.is_contiguous()
    assert model_fingerprint(CONFIG, [t]) == model_fingerprint(CONFIG, [t.contiguous()])
    assert model_fingerprint(CONFIG, [t]) != model_fingerprint(CONFIG, [w])


def test_fingerprint_of_an_empty_tensor():
    assert model_fingerprint(CONFIG, [torch.empty(0, 4)]) != model_fingerprint(CONFIG, [])


def test_none_remembers_nothing(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "none")
    cache = StartCheckCache()
    calls = []
    key = KEY
    for _ in range(2):
        run_checked(key, lambda: calls.append(1), cache)
    assert len(calls) == 2
