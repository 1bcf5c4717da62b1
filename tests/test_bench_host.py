"""``edgespec bench-host``: the engine's host work with a runner that answers at once. The
instant runner's answers follow its rule, a MaG fleet drafts and gets drafts accepted through
the real engine and store, every stage is timed, and the command writes its table and JSON."""

from __future__ import annotations

import json
import time

import pytest
import torch
from cli_inprocess import run_cli

from edgespec_cli.bench.host_cost import PLAIN_RUNS, STAGES, drafter_options, measure
from edgespec_cli.bench.instant_runner import InstantRunner


def test_the_instant_runner_follows_its_cycle_as_often_as_asked():
    runner = InstantRunner(2, right=1.0)
    tokens = torch.arange(0, 48).reshape(2, 24)
    positions = torch.full_like(tokens, 5)
    nxt = runner.next_token(tokens, positions)
    assert torch.equal(nxt, runner.cycle_next[tokens])
    never = InstantRunner(2, right=0.0)
    off = never.next_token(tokens, positions)
    assert torch.equal(off, never.noise[5, tokens])
    seq = [3]  # a cycle of CYCLE tokens comes back to its start
    for pos in range(24):
        seq.append(int(runner.next_token(torch.tensor([seq[-1]]), torch.tensor([pos]))[0]))
    assert seq[-1] == seq[0] and len(set(seq[:-1])) == 24


@pytest.mark.parametrize("store, drafter", [("local", "none"), ("local", "mag"),
                                            ("local", "mag@tree3"), ("local", "mag@thread"),
                                            ("redis", "none")])
def test_every_stage_is_timed_and_mag_drafts_are_accepted(store, drafter):
    # every step waits for its drafts (k tokens or the drafter idle): what is drafted and
    # accepted does not depend on how the drafting thread and the steps interleave
    r = measure(store, drafter, 4, 24, right=1.0, wait_ms=30_000)
    assert r["tokens"] == 4 * 24 and r["steps"] > 0
    assert set(r["us_per_step"]) == {*STAGES, "runner"}
    assert all(v >= 0 for v in r["us_per_step"].values())
    assert r["us_per_step"]["runner"] > 0
    # each part counted once: the stages (the runner's answers apart) within the host's time
    assert sum(r["us_per_step"][k] for k in STAGES) <= r["staged_host_us_per_step"] + 1e-6
    assert r["staged_steps"] > 0
    # the verifier thread's CPU by stage: verify's host part (the runner's answers left out)
    assert set(r["cpu_us_per_step"]) == set(STAGES)
    assert all(v >= 0 for v in r["cpu_us_per_step"].values())
    assert r["cpu_us_per_step"]["verify"] > 0 and r["cpu_us_per_step"]["commit"] > 0
    assert r["host_us_per_session_step"] > 0 and r["verifier_cpu_us_per_session_step"] > 0
    drafting = r["drafter_cpu_us_per_session_step"]  # None without a drafting thread's clock
    if drafter.endswith("@thread") and hasattr(time, "pthread_getcpuclockid"):
        assert drafting > 0
    else:
        assert drafting is None
    if drafter == "none":
        assert r["acceptance_rate"] is None and r["steps"] == 24
    else:  # the target follows its cycle: MaG learns it and fewer steps are needed
        assert r["acceptance_rate"] > 0.5 and r["steps"] < 24


def test_bench_host_command_writes_its_table_and_json(tmp_path):
    out = tmp_path / "host.json"
    r = run_cli("bench-host", "--sessions", "2", "--drafters", "mag", "--stores", "local",
                "--new-tokens", "8", "--repeats", "3", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "host us/step" in r.stdout and "cpu: verifier" in r.stdout and "local  mag" in r.stdout
    assert "CPU microseconds a step, by stage" in r.stdout
    [row] = json.loads(out.read_text())["results"]
    assert (row["store"], row["drafter"], row["sessions"]) == ("local", "mag", 2)
    runs = row["tokens_per_s_runs"]  # the median run's figures, every run's beside them
    assert len(runs) == 3 and row["tokens_per_s"] == sorted(runs)[1]
    # the host figure is the median of its engine's plain runs, each repeat's beside them
    plains = row["host_us_per_session_step_runs"]
    assert len(plains) == PLAIN_RUNS and plains == sorted(plains)
    assert row["host_us_per_session_step"] == pytest.approx(plains[PLAIN_RUNS // 2])
    assert len(row["host_us_per_session_step_repeats"]) == 3
    assert row["host_us_per_session_step"] in row["host_us_per_session_step_repeats"]
    assert "host us/sess-step of each repeat" in r.stdout
    bad = run_cli("bench-host", "--stores", "disk")
    assert bad.returncode == 2 and "--stores" in bad.stderr
    assert run_cli("bench-host", "--repeats", "0").returncode == 2
    bad = run_cli("bench-host", "--drafters", "mag;mag@threads")  # read as a drafter's name
    assert bad.returncode == 2 and "mag@threads" in bad.stderr and "host us/step" not in bad.stdout
    # ',' separates them too where the list has no ';' (as bench's --drafters)
    from argparse import Namespace

    from edgespec_cli.bench.host_cost import _settings

    given = Namespace(sessions="1", stores="local", new_tokens=8, repeats=1, right=0.9)
    assert _settings(Namespace(**vars(given), drafters="none,mag@tree2")) == \
        _settings(Namespace(**vars(given), drafters="none;mag@tree2")) == \
        [("local", "none", 1), ("local", "mag@tree2", 1)]
    # a cascade alone is one drafter: its members' ',' separates nothing
    assert _settings(Namespace(**vars(given), drafters="cascade:mag,cacheback")) == \
        [("local", "cascade:mag,cacheback", 1)]
    assert drafter_options("mag@tree4@thread") == ("mag", 4, False)
    assert drafter_options("mag@thread@tree2") == ("mag", 2, False)
    assert drafter_options("mag+cacheback") == ("mag+cacheback", 1, True)
