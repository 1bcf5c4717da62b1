"""``edgespec simulate`` end to end on a tiny model: a local Ray cluster, the real verifier,
cache and drafter actors, emulated links; the report's fields and losslessness. Plus the
capacity search and option checks, which need no fleet."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from edgespec.config import ConfigError
from edgespec_cli.simulate.cli import find_capacity
from edgespec_cli.simulate.options import parse_devices
from edgespec_cli.simulate.records import RequestRecord, RunRecord
from edgespec_cli.simulate.run import deal

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier

pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[fleet]', or the "
                           "test extra)")


def test_small_fleet_reports_every_figure_and_is_lossless(looping_dir, tmp_path):
    out = tmp_path / "report.json"
    r = subprocess.run(
        [sys.executable, "-m", "edgespec_cli", "simulate", "--model", str(looping_dir),
         "--devices", "2", "--profile", "local,phone-lte", "--requests", "4",
         "--max-new-tokens", "24", "--batching", "both", "--baseline", "server-only",
         "--tree-width", "3",
         "--json", str(out), "--plot", str(tmp_path / "plots"), "--timeout", "300",
         "--link-faults", "reset@0.3:all"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "link fault on device" not in r.stderr, r.stderr[-3000:]  # every fault applied
    report = json.loads(out.read_text())
    # lossless with the verifier's own fill for empty board drafts (its default: auto)
    assert report["config"]["fill_drafts"] == "auto"
    assert report["lossless"]["ok"] and report["lossless"]["checked"] >= 6  # 2 devices x 3 modes
    assert report["throughput_ratio"] > 0
    runs = {run["batching"]: run for run in report["runs"]}
    assert set(runs) == {"on", "off", "server-only"}
    # the server and the boards on cores of their own (this machine's halves), each side's use
    split = len(os.sched_getaffinity(0)) >= 2
    for run in runs.values():
        if split:
            assert run["cpu"]["server"]["cpus"] >= 1 and run["cpu"]["boards"]["cpus"] >= 1
        assert run["cpu"]["server"]["cpu_s"] > 0 and run["server_cpu_s_per_token"] > 0
        # the server's cores by who used them: the verifier and the cache (with its Redis),
        # whose CPU is read in 10 ms ticks: the server alone may leave its cache under one, the
        # boards' drafts through it do not
        server = run["cpu"]["server"]
        assert server["verifier_cpu_s"] > 0 and server["cache_cpu_s"] >= 0
        if run["batching"] != "server-only":
            assert server["cache_cpu_s"] > 0
        assert server["verifier_cpu_s"] + server["cache_cpu_s"] == \
            pytest.approx(server["cpu_s"], abs=1e-6)
        assert run["tokens_per_forward"] > 0
    assert runs["server-only"]["draft_tokens_sent"] is None  # no board at all
    assert runs["server-only"]["acceptance"]["drafted"] == 0
    assert runs["on"]["draft_tokens_sent"] is not None
    assert runs["on"]["draft_tokens_wasted"] <= runs["on"]["draft_tokens_sent"]
    vs = report["vs_server_only"]["2"]
    assert vs["throughput"] > 0 and vs["server_cpu_s_per_token"] > 0
    # the fleet's one-token steps priced at the server alone's for the same rows: a figure
    # exactly where both ran such steps at some batch size
    common = set((runs["on"]["step_ms"].get("plain") or {}).get("forward_ms_by_rows", {})) & \
        set(runs["server-only"]["step_ms"]["plain"]["forward_ms_by_rows"])
    assert (vs["plain_step"] is not None) == bool(common)
    assert vs["plain_step"] is None or vs["plain_step"] > 0
    assert "throughput_by_round" not in vs  # one round
    assert "edge drafting / server-only, 2 dev" in r.stdout and "server cost" in r.stdout
    assert "cache and its Redis" in r.stdout
    for mode, run in runs.items():
        assert run["devices"] == 2 and run["requests"] == 4 and run["errors"] == 0, \
            (mode, run["error_samples"])
        if run["wall_s"] > 1.0:  # the reset of every link landed within the run, and cost none
            assert [f["fault"] for f in run["link_faults"]] == ["reset"]
            # the server alone has its clients' links and no board's to break
            assert run["link_faults"][0]["links"] == ("clients" if mode == "server-only"
                                                      else "all")
        assert run["tokens"] > 0 and run["system_tokens_per_s"] > 0
        for key in ("ttft_s", "itl_s"):
            assert run[key]["p50"] is not None and run[key]["p99"] >= run[key]["p50"]
        assert sorted(d["device_id"] for d in run["per_device"]) == [
            "dev00-local", "dev01-phone-lte"]
        for d in run["per_device"]:
            assert d["tokens"] > 0 and d["decode_tokens_per_s"] > 0
            assert d["acceptance_rate"] is None or 0 <= d["acceptance_rate"] <= 1
        assert run["step_ms"]["steps"] == sum(run["batch_sizes"]["histogram"].values())
        assert run["step_ms"]["forward"] > 0
        # steps whose boards rested (drafting measured slower): none where no board drafts
        assert 0 <= run["step_ms"]["rested"] <= run["step_ms"]["steps"]
        if mode == "server-only":  # the server alone: every step one token a row
            assert run["step_ms"]["rested"] == 0
            assert run["step_ms"]["plain"]["steps"] == run["step_ms"]["steps"]
        assert run["round"] == run["rounds"] == 1
        sizes = {int(k) for k in run["batch_sizes"]["histogram"]}
        assert sizes and (sizes == {1} if mode == "off" else max(sizes) <= 2)
    assert "phone-lte" in report["emulated"] and report["real"]
    assert "throughput on/off" in r.stdout and "dev01-phone-lte" in r.stdout
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == ["acceptance_per_device.png", "batching_on_vs_off.png",
                    "itl_p99_vs_devices.png", "throughput_vs_devices.png"]


def _run(n: int, rate: float) -> RunRecord:
    reqs = [RequestRecord(f"d{i}", "local", "qa", [1], 0.0, [1.0] * 10, list(range(10)))
            for i in range(n)]
    for r in reqs:  # 10 tokens in 10 / rate seconds
        r.token_times = [10 / rate] * 10
    return RunRecord("on", n, 0.0, 10 / rate, reqs, {n: 1})


def test_simulate_starts_a_cluster_of_its_own_beside_one_running_here(tmp_path):
    """A Ray cluster already running on the machine (recorded in /tmp/ray by `ray start`, or by
    another test's) is not joined: simulate starts its own (``start_ray``, as ``cmd_simulate``
    calls it), and the other's stop cannot cancel its actors (a CI run failed so: "The actor
    never ran - it was cancelled ...")."""
    from ray.cluster_utils import Cluster
    from ray_nodes import add_node

    nodes = Cluster(initialize_head=False)
    add_node(nodes, num_cpus=1, include_dashboard=False, node_ip_address="127.0.0.1")
    try:
        r = subprocess.run(
            [sys.executable, "-c", "import ray; from edgespec_cli.simulate.cli import start_ray; "
             "start_ray(None); print('joined', ray.get_runtime_context().gcs_address)"],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "HOME": str(tmp_path), "RAY_USAGE_STATS_ENABLED": "0"})
        assert r.returncode == 0, r.stderr[-3000:]
        joined = r.stdout.split("joined ")[-1].strip()
        assert joined and joined != nodes.address, (joined, nodes.address)
        assert "starting a local Ray cluster" in r.stderr
    finally:
        nodes.shutdown()


def test_capacity_search_finds_the_largest_fleet_meeting_the_slo():
    # each device gets 100 / n tokens/s: with an SLO of 20, 5 devices pass and 6 fail
    tried = []

    def run(n):
        tried.append(n)
        return _run(n, 100 / n)

    capacity, probes = find_capacity(run, slo=20, max_devices=32)
    assert capacity == 5
    assert tried[:4] == [1, 2, 4, 8] and 5 in tried and 6 in tried
    assert all((v >= 20) == (r.devices <= 5) for r, v in probes)
    assert find_capacity(lambda n: _run(n, 1.0), slo=20, max_devices=8)[0] == 0
    assert find_capacity(lambda n: _run(n, 1000.0), slo=20, max_devices=8)[0] == 8


def test_requests_are_dealt_to_devices_in_turn_and_devices_parse():
    assert deal(5, 2) == [[0, 2, 4], [1, 3]]
    assert parse_devices("4") == [4] and parse_devices("8,1,2") == [1, 2, 8]
    for bad in ("0", "x", ""):
        with pytest.raises(ConfigError):
            parse_devices(bad)


@pytest.mark.parametrize("args, message", [
    (["--find-capacity"], "--slo"), (["--slo", "5"], "--find-capacity"),
    (["--profile", "toaster"], "toaster"), (["--requests", "0"], "--requests"),
    (["--devices", "0"], "--devices"), (["--tree-width", "0"], "--tree-width must be in"),
    (["--shared-cpus", "--server-cpus", "0"], "--shared-cpus"),
    (["--board-cpus", "100000"], "--board-cpus"),
    (["--devices", "1,2", "--link-faults", "blackhole@1+2/5"], "names device 5"),
    (["--devices", "2", "--link-faults", "reset@1/2"], "at most 2 device(s)"),
    (["--repeat", "0"], "--repeat must be >= 1"),
    (["--repeat", "2", "--find-capacity", "--slo", "5"], "not --find-capacity"),
    (["--head", "eagle", "--fill-drafts", "mag"], "--fill-drafts fills a board's empty drafts")])
def test_bad_options_are_refused_before_anything_starts(args, message):
    from cli_inprocess import run_cli

    r = run_cli("simulate", *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_open_loop_sends_requests_at_the_rate_in_order_until_the_duration_ends():
    from concurrent.futures import ThreadPoolExecutor

    from edgespec_cli.deployment.device_profiles import PROFILES
    from edgespec_cli.simulate.run import FleetRun, SimSettings

    run = FleetRun(None, SimSettings(model="x", rate=1000.0), [PROFILES["local"]] * 2, "on",
                   prompts=[])
    sent = []
    run._request = lambda dev, k, due: sent.append((k, dev, due))
    try:
        with ThreadPoolExecutor(1) as pool:  # one thread: calls complete in submission order
            run._open_loop(pool, deal(10, 2), started=100.0, stop_at=100.0 + 0.0065)
    finally:
        run.close()
    assert [(k, dev) for k, dev, _ in sent] == [(k, k % 2) for k in range(7)]
    assert [due for *_, due in sent] == [100.0 + k / 1000.0 for k in range(7)]
