"""Synthetic simulation run records with hand-computed figures, for the report's tests
(``test_simulate_report``, ``test_simulate_server_only``): requests of two devices, a run of
them, a report of runs, a sweep of device counts with and without batching."""

from edgespec_cli.simulate.records import RequestRecord, RunRecord
from edgespec_cli.simulate.report import build_report

REAL = ["verifier", "draft cache (embedded Redis)", "drafters (MaG)", "gRPC"]
EMULATED = {"pi5": {"rtt_ms": 20, "compute_slowdown": 4.0, "how": "TCP delaying proxy"}}


def req(device, profile, sent, times, drafted=0, accepted=0, mal=0.0, error=None):
    return RequestRecord(device_id=device, profile=profile, category="qa", prompt_ids=[1, 2],
                         sent_at=sent, token_times=list(times), tokens=list(range(len(times))),
                         drafted=drafted, accepted=accepted, mean_acceptance_length=mal,
                         board_drafted=drafted, board_accepted=accepted,  # no verifier drafts
                         error=error)


def fleet_requests():
    """Device a: 9 tokens, busy 4 s; device b: 2 tokens, busy 4 s, and one failed request."""
    return [
        req("dev-a", "pi5", 0.0, [1.0, 1.5, 1.5, 2.5], drafted=10, accepted=6, mal=2.0),
        req("dev-a", "pi5", 3.0, [3.5, 4.5, 4.5, 4.5, 4.5], drafted=10, accepted=8, mal=3.0),
        req("dev-b", "orin", 1.0, [3.0, 5.0], drafted=5, accepted=1, mal=1.0),
        req("dev-b", "orin", 2.0, [], drafted=3, accepted=3, mal=9.0, error="timeout"),
    ]


def run(batching="on", devices=2, ended=10.0, requests=None, batch_sizes=None):
    return RunRecord(batching=batching, devices=devices, started=0.0, ended=ended,
                     requests=fleet_requests() if requests is None else requests,
                     batch_sizes={1: 4, 2: 3, 4: 1} if batch_sizes is None else batch_sizes,
                     max_sessions=8)


def report_for(runs, lossless=None):
    return build_report(runs, lossless=lossless, emulated=EMULATED, real=REAL,
                        config={"model": "tiny", "prompts": 4})


def sweep():
    return [run("on", 1, ended=5.0), run("off", 1, ended=15.0),
            run("on", 2, ended=10.0), run("off", 2, ended=20.0),
            run("on", 4, ended=10.0)]
