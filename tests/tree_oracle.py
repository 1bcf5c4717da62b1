"""A test drafter for token trees: it knows the target-only output and proposes trees whose
right continuation is often in a branch, not the chain, so verification must take branches."""

import random

from edgespec.drafters import Drafter, DraftSession
from edgespec.drafters.base import Branch, Draft


class OracleTreeSession(DraftSession):
    """Drafts from the known target-only output: usually a chain that goes wrong at some
    position with the right continuation offered as a branch there, sometimes a right chain,
    sometimes a wrong one with no right branch."""

    def __init__(self, drafter, tokens, params):
        super().__init__(tokens, params)
        self.drafter = drafter
        self.n_prompt = len(tokens)

    def append(self, tokens):
        """A fix (after a rollback): the session must be back on the target's output."""
        super().append(tokens)
        ref = self.drafter.refs[tuple(self.tokens[:self.n_prompt])]
        if self.tokens[self.n_prompt:] != ref[:len(self.tokens) - self.n_prompt]:
            raise AssertionError(f"a fix left the session off the reference: {tokens}")

    def propose(self, k):
        return self.propose_tree(k, 1)

    def propose_tree(self, k, width):
        d = self.drafter
        ref = d.refs[tuple(self.tokens[:self.n_prompt])]
        pos = len(self.tokens) - self.n_prompt
        if self.tokens[self.n_prompt:] != ref[:pos]:
            return Draft()  # its last chain went wrong: wait for the verifier's fix
        right = ref[pos:pos + k]
        if not right:
            return Draft()
        chain, branches = list(right), []
        roll = d.rng.random()
        if roll < 0.7:
            at = d.rng.randrange(len(chain))
            chain[at] = (chain[at] + 1 + d.rng.randrange(5)) % d.vocab
            if width > 1:
                branches.append(Branch(at, tuple(right[at:])))
                decoy = (right[at] + 7) % d.vocab
                if decoy not in (chain[at], right[at]) and width > 2:
                    branches.append(Branch(at, (decoy,)))
        elif roll < 0.85:
            chain = [(t + 3) % d.vocab for t in chain]
        self.tokens.extend(chain)
        return Draft(chain, branches=branches)


class OracleTreeDrafter(Drafter):
    name = "oracle-tree"

    def __init__(self, refs: dict, vocab: int, seed: int = 0):
        self.refs, self.vocab, self.rng = refs, vocab, random.Random(seed)

    def open(self, tokens, params):
        return OracleTreeSession(self, tokens, params)
