"""The in-process session state beyond the protocol's shared rules (tests/test_store_contract.py
runs those on both stores): the fix log a drafter reads, readiness, and the commit's own
argument checks."""

import pytest

from edgespec.protocol.contract import StaleChunkError, Verdict
from edgespec.protocol.local_store import SessionState


def _state():
    return SessionState("s", [1, 2, 3], has_drafter=True)


def test_fixes_are_logged_in_order_for_a_drafter_to_catch_up():
    st = _state()
    st.push_draft(0, 3, [4, 5, 6])
    first = st.commit(Verdict("s", 0, 3, 1, 9))
    assert st.committed == [4, 9] and st.draft == [] and st.epoch == 1
    assert (first.position, first.tokens) == (4, (9,))
    st.push_draft(1, 5, [7])
    second = st.commit(Verdict("s", 1, 5, 1, 8))  # a bonus token: a fix too
    assert second.id > first.id and (second.epoch, second.position) == (2, 6)
    assert st.fixes_after(0) == [first, second] and st.fixes_after(first.id) == [second]
    assert st.fixes_after(second.id) == []


def test_window_bounds_the_draft_and_idle_marks_readiness():
    st = _state()
    assert st.push_draft(0, 3, [4, 5, 6], window=2) == 2
    assert st.draft == [4, 5] and not st.draft_ready(4)
    st.push_draft(0, 5, [], idle=True)
    assert st.draft_ready(4)
    st.commit(Verdict("s", 0, 3, 0, 9))  # a fix: the drafter is busy again
    assert not st.draft_ready(4)


def test_a_commit_on_a_finished_session_with_a_stale_epoch_is_refused():
    st = _state()
    st.commit(Verdict("s", 0, 3, 0, 4, finish_reason="stop"))
    assert st.done
    with pytest.raises(StaleChunkError):
        st.push_draft(1, 4, [5])
    with pytest.raises(StaleChunkError):
        st.commit(Verdict("s", 0, 4, 0, 5))
