"""--auto's per-session choice of draft sources (edgespec.engine.stack_choice), with measured
inputs."""

from edgespec.engine.stack_choice import StackChooser, accepted_prefix


def test_a_proposal_counts_its_common_prefix_with_what_was_committed():
    assert accepted_prefix([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accepted_prefix([5, 6], [5, 6, 7]) == 2
    assert accepted_prefix([], [1]) == 0 and accepted_prefix([4], [5]) == 0


def _run(chooser, steps, head_hits, drafter_hits, fixed=1.0, per_token=0.05):
    """Steps where the head's 6-token proposal has its first head_hits tokens right and the
    drafter's 4-token proposal its first drafter_hits."""
    committed = list(range(100, 110))
    for _ in range(steps):
        stack = chooser.choose({"drafter": 4, "head": 6}, fixed, per_token)
        head = committed[:head_hits] + [0] * (6 - head_hits)
        drafter = committed[:drafter_hits] + [1] * (4 - drafter_hits)
        chooser.observe({"head": head, "drafter": drafter}, committed[:7])
    return stack


def test_the_source_that_lands_is_kept_and_the_one_that_never_does_is_dropped():
    assert _run(StackChooser(), 40, head_hits=4, drafter_hits=0) == ("head",)
    assert _run(StackChooser(), 40, head_hits=0, drafter_hits=3) == ("drafter",)


def test_nothing_is_verified_when_nothing_lands_and_width_is_dear():
    assert _run(StackChooser(), 40, head_hits=0, drafter_hits=0, per_token=0.5) == ()


def test_both_are_verified_when_they_land_on_different_steps():
    chooser = StackChooser()
    committed = list(range(100, 110))
    for i in range(60):
        chooser.choose({"drafter": 3, "head": 3}, 1.0, 0.02)
        good, bad = committed[:3], [0, 0, 0]
        chooser.observe({"head": good if i % 2 else bad, "drafter": bad if i % 2 else good},
                        committed[:4])
    assert chooser.choose({"drafter": 3, "head": 3}, 1.0, 0.02) == ("drafter", "head")
    assert sum(chooser.chosen.values()) == 61


def test_drafter_specs_name_heads_and_auto():
    import pytest

    from edgespec.config import ConfigError
    from edgespec.drafters import EDGE_KINDS, build_drafter, parse_drafter_spec

    assert parse_drafter_spec("mag+cacheback+head:/x/y").head == "/x/y"
    assert parse_drafter_spec("mag+cacheback+head:/x/y").kind == "mag+cacheback"
    assert parse_drafter_spec("head:eagle").kind == "head"
    assert build_drafter("head:eagle") is None  # the head drafts in the verifier
    assert build_drafter("auto").name == "mag+cacheback"
    for bad in ("head:", "mag+head:", "head:a+head:b", "cascade:mag,head:x", "auto:x"):
        with pytest.raises(ConfigError):
            parse_drafter_spec(bad)
    for board_refused in ("head:eagle", "mag+head:eagle", "auto"):  # no target on a board
        with pytest.raises(ConfigError):
            parse_drafter_spec(board_refused, EDGE_KINDS)


def test_a_source_not_asked_leaves_its_stacks_unmeasured_and_costs_count():
    chooser = StackChooser()
    committed = list(range(100, 110))
    for _ in range(30):  # the head lands 3 tokens, the drafter none
        chooser.choose({"drafter": 3, "head": 3}, 1.0, 0.02)
        chooser.observe({"head": committed[:3], "drafter": [0]}, committed[:5])
    before = chooser.gain[("head",)].value
    for _ in range(30):  # the head was not asked: its stacks keep their measurement
        chooser.observe({"head": None, "drafter": [0]}, committed[:5])
    assert chooser.gain[("head",)].value == before > 2.5
    assert chooser.choose({"drafter": 3, "head": 3}, 1.0, 0.02) == ("head",)
    # a head that costs more per step than the tokens it saves is left out
    assert "head" not in chooser.choose({"drafter": 3, "head": 3}, 1.0, 0.02, {"head": 10.0})


def test_head_and_auto_figures_cross_the_wire():
    from edgespec.protocol.request_stats import Stats
    from edgespec.wire.convert import stats_from_pb, stats_to_pb

    s = Stats(steps=5, head_tokens=12, head_accepted=4, stacks={"head": 3, "drafter+head": 2})
    back = stats_from_pb(stats_to_pb(s))
    assert (back["head_tokens"], back["head_accepted"]) == (12, 4)
    assert back["stacks"] == {"head": 3, "drafter+head": 2}
