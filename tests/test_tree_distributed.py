"""Token trees over the distributed path: a drafter agent sends tree chunks over gRPC, the draft
cache stores chains and branches in Redis, the verifier takes and verifies trees and commits
branches, and the fixes that carry a branch's tokens reach the agent (the test drafter checks
that its belief never leaves the target-only output). Real Redis, real gRPC, real processes for
the command-line path."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from cache_harness import engine_over_cache
from conftest import hf_greedy, hf_keyed_sampled
from tree_oracle import OracleTreeDrafter

from drafter_node.agent import DrafterAgent
from edgespec.config import SamplingParams
from edgespec.engine.spec_engine import Request

PROMPTS = [[1, 10, 11, 12, 13, 10, 11, 12, 13, 10], [1, 50, 51, 52, 53, 54, 55, 56],
           [1, 30, 31, 30, 31, 30]]


@pytest.fixture()
def fleet(tiny):
    """An embedded Redis, the draft cache on loopback, and a verifier engine over the store."""
    with engine_over_cache(tiny.model, "tree:") as parts:
        yield parts


def _attach(address, drafter, tree_width=3):
    agent = DrafterAgent(address, "edge-tree", drafter, window=8, chunk=4, tree_width=tree_width)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not agent.connected.is_set():
        assert time.monotonic() < deadline, "the agent did not attach"
        time.sleep(0.05)
    return agent, thread


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-sampling"])
def test_tree_chunks_over_grpc_and_redis_give_target_only_output(fleet, tiny, sampled):
    params = SamplingParams(temperature=0.8, top_k=20, seed=11) if sampled else SamplingParams()
    n = 24
    refs = {tuple(p): (hf_keyed_sampled(tiny.model, p, n, params) if sampled
                       else hf_greedy(tiny.model, p, n)) for p in PROMPTS}
    drafter = OracleTreeDrafter(refs, fleet["runner"].vocab_size, seed=4)
    agent, thread = _attach(fleet["address"], drafter)
    try:
        engine = fleet["engine"]
        acts = [engine.add(Request(p, n, params), session_id=f"s{i}", device="edge-tree")
                for i, p in enumerate(PROMPTS)]
        while engine.active:
            engine.step()
    finally:
        agent.stop()
        thread.join(timeout=10)
    assert agent.refused == 0  # the drafter's belief followed every fix, branch fixes included
    for p, act in zip(PROMPTS, acts):
        ref = refs[tuple(p)]
        assert act.output == ref[:len(act.output)] and (len(act.output) == n or act.output[-1] == 2)
    assert sum(a.stats.branch_tokens for a in acts) > 3  # branches were verified and accepted


def test_an_agent_falls_back_to_chains_when_the_cache_refuses_trees():
    """A cache from before token trees refuses tree chunks: the agent then drafts chains."""
    from edgespec.drafters import MaGDrafter
    from edgespec.v1 import edgespec_pb2 as pb

    agent = DrafterAgent("127.0.0.1:1", "edge-old", MaGDrafter(), tree_width=4)
    agent._apply(pb.CacheMessage(ack=pb.ChunkAck(session_id="s", code=3, message="the window")))
    assert agent.tree_width == 4  # another refusal: trees stay on
    agent._apply(pb.CacheMessage(ack=pb.ChunkAck(
        session_id="s", code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
        message="tree drafts are not accepted by this cache yet")))
    assert agent.tree_width == 1
