"""Token trees through the engine: the draft's tree built chain-first, and whole generations
with tree drafts identical to target-only decoding, greedy and seeded sampling, alone and
batched with chain sessions. (How the stores keep, take and commit branches:
tests/test_store_contract_branches.py.)"""

import time

import pytest
from conftest import hf_greedy, hf_keyed_sampled
from tree_oracle import OracleTreeDrafter

from edgespec.config import ConfigError, EngineConfig, SamplingParams
from edgespec.drafters.base import Draft
from edgespec.protocol.contract import Branch
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.runner.target_runner import TargetRunner
from edgespec.verify.trees import tree_of_draft


def test_tree_of_draft_puts_the_chain_first_and_shares_prefixes():
    tree = tree_of_draft([10, 11, 12], [Branch(2, (20, 21)), Branch(2, (20, 22)),
                                        Branch(0, (10, 30)),  # shares the chain's 10
                                        Branch(3, (40,)),  # extends the chain's end
                                        Branch(4, (42,)),  # past the chain: ignored
                                        Branch(-1, (41,))])
    # at 2 hangs from chain node 1 (token 11); at 0 from the root; at 3 from the last node
    assert tree.tokens == (10, 11, 12, 20, 21, 22, 30, 40)
    assert tree.parents == (-1, 0, 1, 1, 3, 3, 0, 2)


def test_tree_settings_are_checked():
    with pytest.raises(ConfigError, match="tree_width"):
        EngineConfig(tree_width=0)
    with pytest.raises(ConfigError, match="tree_nodes"):
        EngineConfig(tree_nodes=65)


# -- whole generations ------------------------------------------------------------------------
PROMPTS = [[1, 10, 11, 12, 13, 10, 11, 12, 13, 10], [1, 50, 51, 52, 53, 54, 55, 56],
           [1, 30, 31, 30, 31, 30]]
CFG = dict(adaptive=False, draft_wait_ms=5000, tree_width=3)


def generate_with_oracle(hf, refs, n, seed, cfg=None, params=None, stop_ids=(2,),
                         batched=True):
    """Every prompt generated with the oracle tree drafter: in one batch, or one at a time."""
    runner = TargetRunner(hf, n_slots=4, max_len=128)
    drafter = OracleTreeDrafter(refs, runner.vocab_size, seed=seed)
    reqs = [Request(p, n, params or SamplingParams()) for p in PROMPTS]
    with SpecEngine(runner, drafter, cfg or EngineConfig(**CFG), stop_ids=set(stop_ids)) as engine:
        return engine.generate_many(reqs) if batched else [engine.generate(r) for r in reqs]


@pytest.mark.parametrize("model", ["tiny", "looping"])
def test_greedy_with_tree_drafts_equals_transformers_greedy(request, model):
    hf = request.getfixturevalue(model).model
    refs = {tuple(p): hf_greedy(hf, p, 40) for p in PROMPTS}
    results = generate_with_oracle(hf, refs, 40, seed=3, batched=False)
    for p, r in zip(PROMPTS, results):
        assert r.token_ids == refs[tuple(p)]
    assert sum(r.stats.branch_tokens for r in results) > 10  # branches really were accepted


def test_batched_tree_and_chain_sessions_equal_target_only(tiny):
    """Several sessions in one forward: some drafting trees, one verified as a chain (a budget
    of no branch tokens would make every row a chain; here rows mix)."""
    hf = tiny.model
    refs = {tuple(p): hf_greedy(hf, p, 30) for p in PROMPTS}
    results = generate_with_oracle(hf, refs, 30, seed=5)
    for p, r in zip(PROMPTS, results):
        assert r.token_ids == refs[tuple(p)]
    assert sum(r.stats.branch_tokens for r in results) > 5


def test_no_branch_budget_means_chains_only(tiny):
    hf = tiny.model
    refs = {tuple(p): hf_greedy(hf, p, 20) for p in PROMPTS}
    results = generate_with_oracle(hf, refs, 20, seed=5, cfg=EngineConfig(**CFG, tree_nodes=0))
    for p, r in zip(PROMPTS, results):
        assert r.token_ids == refs[tuple(p)]
        assert r.stats.branch_tokens == 0


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, seed=5),
                                    SamplingParams(temperature=0.7, top_k=10, top_p=0.9,
                                                   seed=2 ** 62 + 3)], ids=["plain", "filtered"])
def test_seeded_sampling_with_tree_drafts_equals_target_only(tiny, params):
    hf = tiny.model
    refs = {tuple(p): hf_keyed_sampled(hf, p, 24, params) for p in PROMPTS}
    assert len({t for r in refs.values() for t in r}) > 10  # really sampled
    results = generate_with_oracle(hf, refs, 24, seed=9, params=params, stop_ids=())
    for p, r in zip(PROMPTS, results):
        assert r.token_ids == refs[tuple(p)]
    assert sum(r.stats.branch_tokens for r in results) > 5


def test_a_loose_session_verifies_the_chain_only(looping):
    hf = looping.model
    refs = {tuple(p): hf_greedy(hf, p, 20) for p in PROMPTS}
    results = generate_with_oracle(hf, refs, 20, seed=1, cfg=EngineConfig(**CFG, verify="loose"),
                                   batched=False)
    assert all(r.stats.branch_tokens == 0 and r.stats.lossy for r in results)


class FixBreakingDrafter(OracleTreeDrafter):
    """Its sessions fail on the first fix they are given (a broken device)."""

    closed = 0

    def open(self, tokens, params):
        session = super().open(tokens, params)

        def append(_tokens):
            raise RuntimeError("broken")

        def close():
            self.closed += 1

        session.append, session.close = append, close
        return session


@pytest.mark.slow
def test_a_drafter_failing_on_a_fix_costs_its_sessions_speed_not_output(tiny):
    hf = tiny.model
    refs = {tuple(p): hf_greedy(hf, p, 20) for p in PROMPTS}
    runner = TargetRunner(hf, n_slots=4, max_len=128)
    drafter = FixBreakingDrafter(refs, runner.vocab_size, seed=2)
    with SpecEngine(runner, drafter, EngineConfig(**CFG), stop_ids={2}) as engine:
        results = engine.generate_many([Request(p, 20) for p in PROMPTS])
        assert engine.worker.is_alive()
        deadline = time.monotonic() + 30  # the drafter thread closes them when it next plans
        while drafter.closed < len(PROMPTS) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert drafter.closed == len(PROMPTS)  # every session gave back what it held
        again = engine.generate(Request(PROMPTS[0], 20))  # the drafter thread still serves
    for p, r in zip(PROMPTS, results):
        assert r.token_ids == refs[tuple(p)]
    assert again.token_ids == refs[tuple(PROMPTS[0])]


class WideTreeDrafter(OracleTreeDrafter):
    """Always the widest trees it may send: the right chain padded to k tokens, and a k-token
    branch of other tokens at each of its first width - 1 positions."""

    def open(self, tokens, params):
        session = super().open(tokens, params)
        drafter = self

        def propose_tree(k, width):
            ref = drafter.refs[tuple(session.tokens[:session.n_prompt])]
            pos = len(session.tokens) - session.n_prompt
            if session.tokens[session.n_prompt:] != ref[:pos]:
                return Draft()
            chain = (ref[pos:pos + k] + [3] * k)[:k]
            session.tokens.extend(chain)
            return Draft(chain, branches=[
                Branch(at, tuple((chain[at] + 1 + i) % drafter.vocab for i in range(k)))
                for at in range(min(k, width - 1))])

        session.propose_tree = propose_tree
        return session


def test_a_tree_session_at_the_context_limit_finishes(tiny):
    """The branch budget leaves room in the fullest KV slot: a request admitted right at the
    context limit is verified with trees to its last token."""
    hf = tiny.model
    prompt, max_len = PROMPTS[1], 64
    n = max_len - len(prompt) - 8 - 1  # max_draft 8: the largest request admitted
    refs = {tuple(prompt): hf_greedy(hf, prompt, n, eos=(max_len + 1000,))}
    runner = TargetRunner(hf, n_slots=2, max_len=max_len)
    drafter = WideTreeDrafter(refs, runner.vocab_size)
    cfg = EngineConfig(**{**CFG, "tree_width": 8}, tree_nodes=16)
    with SpecEngine(runner, drafter, cfg, stop_ids=set()) as engine:
        result = engine.generate(Request(prompt, n))
    assert result.token_ids == refs[tuple(prompt)] and result.finish_reason == "length"
    assert result.stats.draft_tokens > result.stats.steps * 8  # trees were verified


def test_trees_fit_the_tree_size_limit():
    with pytest.raises(ConfigError, match="64 nodes"):
        EngineConfig(max_draft=60, tree_nodes=8)
    EngineConfig(max_draft=60, tree_nodes=0)  # chains only: no tree forward, no limit
    EngineConfig(max_draft=56, tree_nodes=8)


def test_tree_to_wire_leaves_out_what_is_no_alternative():
    from edgespec.wire.trees import tree_from_wire, tree_to_wire

    nodes, parents = tree_to_wire([5, 6], [Branch(2, (7,)), Branch(0, ()), Branch(1, (6, 9)),
                                           Branch(1, (8, 9))])
    assert (nodes, parents) == ([5, 6, 8, 9], [-1, 0, 0, 2])
    assert tree_from_wire(nodes, parents) == ([5, 6], [Branch(1, (8, 9))])
    assert tree_to_wire([], [Branch(0, (5, 6))]) == ([], [])


def test_with_the_planner_trees_stay_lossless_and_branches_are_measured(tiny):
    """The adaptive engine (the default): the planner decides chain and branch tokens from
    measured acceptance and forward cost; every session's branch yield (beta) is measured."""
    hf = tiny.model
    refs = {tuple(p): hf_greedy(hf, p, 30) for p in PROMPTS}
    runner = TargetRunner(hf, n_slots=4, max_len=128)
    drafter = OracleTreeDrafter(refs, runner.vocab_size, seed=8)
    cfg = EngineConfig(draft_wait_ms=5000, tree_width=3)
    with SpecEngine(runner, drafter, cfg, stop_ids={2}) as engine:
        acts = [engine.add(Request(p, 30)) for p in PROMPTS]
        while engine.active:
            engine.step()
    for p, act in zip(PROMPTS, acts):
        assert act.output == refs[tuple(p)]
    assert any(a.draft_len.beta != pytest.approx(0.1) for a in acts)
    assert sum(a.stats.branch_tokens for a in acts) > 0
