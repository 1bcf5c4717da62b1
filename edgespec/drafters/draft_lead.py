"""What a draft session holds ahead of the verifier, the drafting loop's and the inline
drafter's alike: a fix applied against everything it holds, rolled back only from the first
token that differs (``apply_fix``: the tokens beyond a fix that agreed stay a draft), and how far
ahead of the committed end to draft (``lead_cap``: about twice the verifier's last ask;
``output_room``: never to where the session's output ends; ``lead_room``: both).
"""

from __future__ import annotations

from typing import Sequence

from .base import DraftSession
from .draft_book import DraftTarget

LEAD_SLACK = 2  # drafted beyond twice what the verifier asks, so that its ask can grow


def apply_fix(draft: DraftSession, position: int, tokens: Sequence[int]) -> int:
    """Roll ``draft`` back to ``position`` and append ``tokens``, except where it already
    holds them: it is rolled back only from the first token that differs. Returns how many of
    its tokens beyond the fix it keeps (drafted under the same prefix: still a draft)."""
    return fix_draft(draft, position, tokens)[0]


def fix_draft(draft: DraftSession, position: int, tokens: Sequence[int]) -> tuple[int, int]:
    """``apply_fix``'s work: (tokens kept beyond the fix, the position the session was rolled
    back to or, when nothing was rolled back, the fix's end)."""
    agree = _agreement(draft.tokens, position, tokens)
    if agree == len(tokens):
        draft.confirm(position + len(tokens))  # verified as the session holds them
        return len(draft.tokens) - position - len(tokens), position + agree
    draft.rollback(position + agree)
    draft.append(list(tokens[agree:]))
    return 0, position + agree


def _agreement(have: Sequence[int], position: int, tokens: Sequence[int]) -> int:
    """How many of ``tokens`` ``have`` already holds from ``position`` on."""
    agree = 0
    while agree < len(tokens) and position + agree < len(have) and \
            have[position + agree] == tokens[agree]:
        agree += 1
    return agree


def lead_room(t: DraftTarget, window: int) -> int:
    """How far ahead of its committed end a session is drafted: its ``lead_cap``, and never to
    where its output ends (``output_room``)."""
    return min(lead_cap(t.wanted, window), output_room(t.output_end, t.committed_end))


def output_room(output_end: int | None, committed_end: int) -> int:
    """Tokens a session may be drafted ahead of ``committed_end`` before its output ends: a
    token drafted at ``output_end`` - 1 or beyond would be cut to the step's own token, or past
    the output, if a step took it (the verifier asks for none). Unbounded when not said."""
    return (1 << 30) if output_end is None else output_end - 1 - committed_end


def lead_cap(wanted: int | None, window: int) -> int:
    """How far ahead of the committed end to draft a session whose last step asked ``wanted``
    draft tokens of it: enough for the next step's ask after a commit that moved the end by up
    to wanted + 1, plus LEAD_SLACK (room for the next ask to grow); the whole window when the
    verifier did not say. Drafting further ahead only sends tokens no step will use, on the
    board's time. ``wanted`` 0: the verifier rests the session's drafts (its planner wants
    none and no probe is near; ``step_planning.told_wants``): nothing ahead."""
    if wanted is None:
        return window
    if wanted <= 0:
        return 0
    cap = 2 * wanted + LEAD_SLACK  # (compared here, not by min(): a call a session and step)
    return cap if cap < window else window
