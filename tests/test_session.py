"""The session protocol: epochs, positions, fixes."""

import pytest

from edgespec.session import SessionState, StaleChunkError


def _state():
    return SessionState("s", [1, 2, 3], has_drafter=True)


def test_full_accept_with_bonus_publishes_fix_at_the_draft_end():
    st = _state()
    st.push_draft(0, 3, [4, 5])
    taken = st.take_draft(8)
    assert (taken.epoch, taken.start, taken.tokens) == (0, 3, [4, 5])
    fix = st.commit(0, 2, 6)
    assert st.committed == [4, 5, 6] and st.draft == []
    assert (fix.epoch, fix.position, fix.token) == (1, 5, 6) and st.epoch == 1


def test_token_the_draft_already_held_needs_no_fix():
    st = _state()
    st.push_draft(0, 3, [4, 5, 6, 7])
    st.take_draft(2)  # the verifier only looked at [4, 5]; its bonus 6 is the next draft token
    assert st.commit(0, 2, 6) is None
    assert st.committed == [4, 5, 6] and st.draft == [7] and st.epoch == 0
    st.push_draft(0, 7, [8])  # the drafter continues at the same epoch
    assert st.draft == [7, 8]


def test_rejection_drops_the_draft_and_bumps_the_epoch():
    st = _state()
    st.push_draft(0, 3, [4, 5, 6])
    fix = st.commit(0, 1, 9)
    assert st.committed == [4, 9] and st.draft == [] and st.epoch == 1
    assert (fix.position, fix.token) == (4, 9)
    assert st.fixes_after(0) == [fix] and st.fixes_after(fix.id) == []


def test_stale_epoch_chunk_is_refused_and_changes_nothing():
    st = _state()
    st.push_draft(0, 3, [4])
    st.commit(0, 0, 7)  # rejected: epoch 1 now
    with pytest.raises(StaleChunkError, match="epoch"):
        st.push_draft(0, 4, [5, 6])
    assert st.draft == [] and st.committed == [7]


def test_chunk_at_the_wrong_position_is_refused():
    st = _state()
    st.push_draft(0, 3, [4])
    with pytest.raises(StaleChunkError, match="starts at"):
        st.push_draft(0, 3, [4])  # overlap
    with pytest.raises(StaleChunkError, match="starts at"):
        st.push_draft(0, 6, [4])  # gap
    assert st.draft == [4]


def test_window_bounds_the_draft_and_idle_marks_readiness():
    st = _state()
    assert st.push_draft(0, 3, [4, 5, 6], window=2) == 2
    assert st.draft == [4, 5] and not st.draft_ready(4)
    st.push_draft(0, 5, [], idle=True)
    assert st.draft_ready(4)


def test_finished_session_refuses_chunks_and_stale_verdicts():
    st = _state()
    st.commit(0, 0, 4, done=True)
    with pytest.raises(StaleChunkError):
        st.push_draft(1, 4, [5])
    with pytest.raises(StaleChunkError):
        st.commit(0, 0, 5)
