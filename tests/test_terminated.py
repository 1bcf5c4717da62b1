"""SIGTERM as ``Terminated`` (``edgespec_cli/terminated.py``): installed by ``main`` only over
Python's default, put back for a caller that goes on, and kept through ``ray.init`` (which sets
a handler of its own that exits with status 15, no cleanup line, and lets a second signal cut
the cleanup short). No signal is sent to the test's process: handlers are read and called."""

from __future__ import annotations

import signal

import pytest

from edgespec_cli import terminated
from edgespec_cli.terminated import Terminated, catch_sigterm, keeping_sigterm, raise_terminated


@pytest.fixture()
def default_sigterm():
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, before)


def test_the_handler_raises_once_and_ignores_a_second_signal(default_sigterm):
    assert catch_sigterm() is signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) is raise_terminated
    with pytest.raises(Terminated):
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # the cleanup runs on


def test_a_handler_the_caller_set_is_kept(default_sigterm):
    def mine(*_):
        pass

    signal.signal(signal.SIGTERM, mine)
    assert catch_sigterm() is None and signal.getsignal(signal.SIGTERM) is mine


def test_a_block_that_sets_a_handler_leaves_the_one_before(default_sigterm):
    signal.signal(signal.SIGTERM, raise_terminated)
    with keeping_sigterm():
        signal.signal(signal.SIGTERM, lambda *_: None)
    assert signal.getsignal(signal.SIGTERM) is raise_terminated


def _ray_init_that_sets_a_handler(calls):
    def init(*args, **kwargs):  # what ray.init does in a driver's main thread
        calls.append(kwargs)
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
    return init


def test_simulate_and_deploy_keep_sigterm_through_ray_init(default_sigterm, monkeypatch):
    ray = pytest.importorskip("ray")
    from edgespec_cli.deployment import cluster
    from edgespec_cli.simulate.cli import start_ray

    calls: list[dict] = []
    monkeypatch.setattr(ray, "init", _ray_init_that_sets_a_handler(calls))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    signal.signal(signal.SIGTERM, raise_terminated)
    start_ray(None)  # a local cluster, as simulate starts one
    assert signal.getsignal(signal.SIGTERM) is raise_terminated
    cluster.connect("auto")  # a cluster's driver, as deploy joins one
    assert signal.getsignal(signal.SIGTERM) is raise_terminated
    assert len(calls) == 2 and calls[1]["address"] == "auto"


def test_main_puts_the_handler_back_only_for_a_caller_that_goes_on(default_sigterm, monkeypatch):
    """``main`` called in process gives SIGTERM's default back; ``run`` (the process's own
    call) leaves the handler, so that a signal during the interpreter's exit finds it
    ignored once one came."""
    from edgespec_cli import main as main_mod

    seen = []

    def command(args) -> int:
        seen.append(signal.getsignal(signal.SIGTERM))
        return 0

    parser = main_mod.build_parser()
    monkeypatch.setattr(main_mod, "build_parser", lambda: parser)
    monkeypatch.setattr(main_mod, "check_output_files", lambda args: None)
    args = parser.parse_args(["status"])
    monkeypatch.setattr(parser, "parse_args", lambda argv: args)
    args.func = command
    assert main_mod.main(["status"]) == 0
    assert seen == [raise_terminated] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert main_mod.main(["status"], restore_sigterm=False) == 0
    assert signal.getsignal(signal.SIGTERM) is raise_terminated
    assert terminated.STATUS == 143
