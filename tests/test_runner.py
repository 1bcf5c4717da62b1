"""The target runner against transformers' own forward, and its batching and rollback."""

import pytest
import torch

from edgespec.config import ConfigError
from edgespec.runner.kv_cache import CacheFullError
from edgespec.runner.target_runner import TargetRunner


@pytest.fixture()
def runner(tiny):
    return TargetRunner(tiny.model, n_slots=4, max_len=128)


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_logits_match_transformers_forward(tiny, runner):
    ids = torch.randint(0, 90, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = _hf_logits(tiny.model, ids)
    slot = runner.new_slot()
    runner.prefill(slot, ids[:20])
    out = runner.forward([slot], [ids[20:]])[0]
    assert torch.allclose(out, ref[20:], atol=1e-3, rtol=1e-3)
    assert torch.equal(out.argmax(-1), ref[20:].argmax(-1))


def test_batched_ragged_forward_equals_one_by_one(tiny, runner):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 90, (n,), generator=g).tolist() for n in (5, 17, 9)]
    drafts = [torch.randint(0, 90, (n,), generator=g).tolist() for n in (3, 1, 6)]
    alone = []
    for p, d in zip(prompts, drafts):
        s = runner.new_slot()
        runner.prefill(s, p)
        alone.append(runner.forward([s], [d])[0])
        runner.free_slot(s)
    # non-contiguous slots exercise the gathering read path
    slots = [runner.new_slot() for _ in range(4)][:1] + [3, 2]
    for s, p in zip(slots, prompts):
        runner.prefill(s, p)
    batch = runner.forward(slots, drafts)
    for b, d in enumerate(drafts):
        assert torch.allclose(batch[b, : len(d)], alone[b], atol=1e-4)
        assert torch.equal(batch[b, : len(d)].argmax(-1), alone[b].argmax(-1))


def test_rollback_by_pointer_forgets_rejected_positions(tiny, runner):
    ids = list(range(10, 30))
    s = runner.new_slot()
    runner.prefill(s, ids[:10])
    fresh = runner.forward([s], [ids[10:15]])[0]
    # write junk (a rejected draft) past the pointer, then roll back and redo
    runner.forward([s], [[1, 2, 3, 4, 5, 6]])
    runner.commit(s, 16)
    runner.rollback(s, 10)
    again = runner.forward([s], [ids[10:15]])[0]
    assert torch.equal(fresh, again)


def test_slot_limits_give_clear_errors(tiny):
    r = TargetRunner(tiny.model, n_slots=1, max_len=16)
    s = r.new_slot()
    with pytest.raises(CacheFullError):
        r.new_slot()
    with pytest.raises(CacheFullError, match="positions"):
        r.prefill(s, list(range(20)))
    with pytest.raises(ValueError):
        r.rollback(s, 5)


def test_a_cache_larger_than_the_memory_available_is_refused_before_it_is_allocated(
        tiny, monkeypatch):
    """The KV cache and rotary tables a context asks for are weighed against the memory the
    device has (Linux's MemAvailable here) before any is allocated; the error names the options
    and how many tokens would fit. The weight covers what the runner then allocates."""
    from edgespec.runner import kv_cache

    with pytest.raises(ConfigError, match=r"GiB available: serve a shorter context "
                                          r"\(--max-context; about \d+ tokens fit") as caught:
        TargetRunner(tiny.model, n_slots=2, max_len=10**12)
    assert "--max-sessions" in str(caught.value)

    r = TargetRunner(tiny.model, n_slots=3, max_len=64, exact=False)
    dims = (r.n_layers, 3, r.cache.capacity, r.kv_heads, r.head_dim, r.dtype)
    held = sum(t.nbytes for t in [*r.cache.k, *r.cache.v, r.cos, r.sin])
    assert held <= kv_cache.cache_bytes(*dims) <= held * 2
    cpu = torch.device("cpu")
    monkeypatch.setattr(kv_cache, "available_memory", lambda device: kv_cache.cache_bytes(*dims))
    kv_cache.check_cache_fits(*dims, cpu)  # exactly what it needs: taken
    monkeypatch.setattr(kv_cache, "available_memory",
                        lambda device: kv_cache.cache_bytes(*dims) - 1)
    with pytest.raises(ConfigError, match=f"about {r.cache.capacity - 1} tokens fit"):
        kv_cache.check_cache_fits(*dims, cpu)


def test_the_cache_reads_scattered_slots_as_the_slots_one_by_one():
    """A read of slots that are not an ascending run (a gather) returns, slot by slot, exactly
    the first n_pos keys and values each slot holds, in the order asked; a contiguous run the
    same positions, on the CPU as a compact copy."""
    from edgespec.runner.kv_cache import KVCache

    g = torch.Generator().manual_seed(3)
    cache = KVCache(n_layers=2, n_slots=6, max_len=16, kv_heads=2, head_dim=4)
    for layer in range(2):
        cache.k[layer].copy_(torch.randn(cache.k[layer].shape, generator=g))
        cache.v[layer].copy_(torch.randn(cache.v[layer].shape, generator=g))
    order = [4, 0, 5, 2]
    k, v = cache.read(1, torch.tensor(order), None, 7)
    assert k.shape == (4, 2, 7, 4) and v.shape == (4, 2, 7, 5)
    for i, slot in enumerate(order):
        assert torch.equal(k[i], cache.k[1][slot, :, :7])
        assert torch.equal(v[i], cache.v[1][slot, :, :7])
    k, v = cache.read(0, torch.tensor([1, 2, 3]), 1, 9)
    assert torch.equal(k, cache.k[0][1:4, :, :9]) and torch.equal(v, cache.v[0][1:4, :, :9])
    assert k.is_contiguous() and v.is_contiguous()
    assert k.data_ptr() != cache.k[0][1].data_ptr()  # a copy: the cache's layout is strided


def test_layer_skip_runner_shares_weights_and_uses_fewer_layers(tiny, runner):
    skip = TargetRunner(tiny.model, n_slots=2, max_len=64, n_layers=2, share_weights=runner)
    assert skip.layers[0] is runner.layers[0] and len(skip.layers) == 2
    s = skip.new_slot()
    out = skip.forward([s], [[5, 6, 7]])
    assert out.shape == (1, 3, tiny.model.config.vocab_size)
    with pytest.raises(ConfigError):
        TargetRunner(tiny.model, n_layers=99)


def test_unpacked_runner_agrees_with_packed_and_is_refused_as_a_target(tiny, runner):
    """Unpacked float32 weights (MKL's sgemm) are not row-invariant: a target runner refuses
    them; a drafter's runner (exact=False) may use them."""
    with pytest.raises(ConfigError, match="not batch-invariant"):
        TargetRunner(tiny.model, n_slots=1, max_len=64, pack=False)
    plain = TargetRunner(tiny.model, n_slots=1, max_len=64, pack=False, exact=False)
    a, b = runner.new_slot(), plain.new_slot()
    ids = [[7, 8, 9, 10, 11]]
    assert torch.allclose(runner.forward([a], ids), plain.forward([b], ids), atol=1e-4)


@pytest.mark.parametrize("tree", [False, True])
def test_a_ragged_steps_products_run_on_its_tokens_alone_with_the_padded_bits(tiny, runner,
                                                                           monkeypatch, tree):
    """Rows of unequal drafts are packed: the layers' products see only the rows' own tokens
    (not B x T), and every token's logits and features are the bits of the padded forward."""
    from edgespec.runner.step_rows import DraftShape, StepRows

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 90, (n,), generator=g).tolist() for n in (7, 12, 4)]
    slots = [runner.new_slot() for _ in prompts]
    for s, p in zip(slots, prompts):
        runner.prefill(s, p)
    drafts = [([11, 12, 13], [-1, 0, 1]), ([], []), ([21, 22, 23, 24, 25, 26],
                                                       [-1, 0, 1, 2, 3, 4])]
    if tree:  # a branch beside the first row's chain, and one under the third's
        drafts = [([11, 12, 13, 14], [-1, 0, 1, 0]), ([], []),
                  ([21, 22, 23, 24, 25], [-1, 0, 1, 2, 1])]
    shape = DraftShape.of(drafts)
    rows = StepRows.build(slots, [runner.cache.lengths[s] for s in slots], [5, 6, 7], shape,
                          runner.device, tree=tree or None)
    seen = []
    qkv = runner.layers[0].qkv
    monkeypatch.setattr(runner.layers[0], "qkv", lambda x: seen.append(x.shape[0]) or qkv(x))
    packed = runner.score_rows(rows)
    monkeypatch.setattr(runner.layers[0], "qkv", qkv)
    widths = [1 + len(t) for t, _ in drafts]
    assert seen == [sum(widths)] and sum(widths) < len(slots) * rows.width
    with torch.inference_mode():  # as the runner's own calls run
        if tree:
            x, _ = runner.eager.trees(rows)
        else:
            x, _ = runner.eager.chains(rows.slots, rows.tokens, rows.start_index,
                                       max(rows.starts), slot_index=rows.slot_index)
        padded = runner._scored(x)
    for b, w in enumerate(widths):
        assert torch.equal(packed.logits[b, :w], padded.logits[b, :w])
        assert torch.equal(packed.features[b, :w], padded.features[b, :w])
        assert not packed.logits[b, w:].any()  # padding: zeros, never read
