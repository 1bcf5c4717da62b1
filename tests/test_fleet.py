"""The fleet on a real multi-node Ray cluster on loopback (``ray.cluster_utils.Cluster``): a
head declaring ``verifier``, two boards declaring ``edge`` and a plain node. ``edgespec deploy``
places the roles; drafters land only on boards, verifiers on the head; two verifier replicas
behind the router serve sessions identically to target-only; a killed drafter actor is restarted
by Ray and attaches again; ``deploy --down`` leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import free_port_run, hf_greedy
from ray_nodes import add_node

pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[fleet]', or the "
                           "test extra)")

import edgespec  # noqa: E402
from edgespec_cli.deployment import cluster  # noqa: E402
from edgespec_cli.deployment import placement as fleet  # noqa: E402
from edgespec.config import ConfigError  # noqa: E402
from edgespec.wire.channels import free_port  # noqa: E402

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier

# set by conftest before ray is imported too (see there); the CLI's subprocesses get them here
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
PROMPTS = [[1, 10, 11, 12, 13, 10, 11, 12], [1, 50, 51, 52, 53, 54], [1, 30, 31, 30, 31]]


def edgespec_cli(*args, timeout=300, cache=None) -> subprocess.CompletedProcess:
    env = {**os.environ, **RAY_ENV, **({"EDGESPEC_CACHE_DIR": str(cache)} if cache else {})}
    return subprocess.run([sys.executable, "-m", "edgespec_cli", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def ray_cluster():
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=False)
    add_node(nodes, num_cpus=1, resources={"verifier": 1}, include_dashboard=False,
              node_ip_address="127.0.0.1")
    boards = [add_node(nodes, num_cpus=1, resources={"edge": 1}, node_ip_address="127.0.0.1")
              for _ in range(2)]
    plain = add_node(nodes, num_cpus=1, node_ip_address="127.0.0.1")
    nodes.wait_for_nodes()
    yield {"cluster": nodes, "address": nodes.address,
           "head": nodes.head_node.node_id, "boards": {b.node_id for b in boards},
           "plain": plain.node_id}
    import ray

    ray.shutdown()
    nodes.shutdown()


@pytest.fixture(scope="module")
def deployed(ray_cluster, looping_dir, tmp_path_factory):
    import ray

    cache = tmp_path_factory.mktemp("fleet-cache")  # the cache actor's Redis files go here
    # the router's port, the cache's, then the two replicas' (max(port, cache port) + 1 + i)
    port = free_port_run(4)
    cache_port = port + 1
    r = edgespec_cli("deploy", "--address", ray_cluster["address"], "--model", looping_dir,
                     "--verifiers", 2, "--port", port, "--cache-port", cache_port,
                     "--threads", 1, "--tree-width", 3, "--timeout", 240, "--dtype", "float32",
                     cache=cache)
    assert r.returncode == 0, r.stderr[-3000:]
    endpoint = r.stdout.strip().splitlines()[-1]
    assert endpoint == f"127.0.0.1:{port}"
    ray.init(address=ray_cluster["address"], namespace=cluster.NAMESPACE, log_to_driver=False)
    yield {"endpoint": endpoint, "table": r.stdout, "cache": cache, **ray_cluster}
    if cluster.placed_names():  # the down test did not run or failed
        cluster.down()


def all_ready(timeout: float = 120) -> list:
    """The placed actors once every one is ready (deploy returns when one drafter is)."""
    deadline = time.monotonic() + timeout
    while True:
        actors = cluster.status()
        if all(a.state == "ready" for a in actors) or time.monotonic() > deadline:
            return actors
        time.sleep(0.5)


def test_placement_follows_declared_resources(deployed):
    actors = all_ready()
    by_role: dict[str, list] = {}
    for a in actors:
        by_role.setdefault(a.role, []).append(a)
    assert sorted(by_role) == ["cache", "drafter", "router", "verifier"]
    assert len(by_role["verifier"]) == 2 and len(by_role["drafter"]) == 2
    assert {a.node_id for a in by_role["drafter"]} == deployed["boards"]
    for role in ("verifier", "cache", "router"):
        assert {a.node_id for a in by_role[role]} == {deployed["head"]}, role
    assert all(a.node_id != deployed["plain"] for a in actors)
    assert all(a.state == "ready" for a in actors), cluster.format_table(actors)
    for a in actors:  # the readiness table names every actor's node, role and address
        assert f"{a.role}" in deployed["table"] and a.address in deployed["table"]


def test_two_replicas_serve_sessions_identically_to_target_only(deployed, looping):
    from concurrent.futures import ThreadPoolExecutor

    refs = [hf_greedy(looping.model, p, 40) for p in PROMPTS]

    def run(ids):
        with edgespec.Client(deployed["endpoint"], timeout=120) as c:
            return c.generate(prompt_ids=ids, raw=True, max_new_tokens=40).token_ids

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(run, PROMPTS * 2))
    assert outs == refs * 2
    with edgespec.Client(deployed["endpoint"], timeout=30) as c:
        s = c.status()
    assert s["kv_slots"] == 16 and s["healthy"]  # two replicas of 8 slots each
    assert s["dtype"] == "float32"  # deploy --dtype reached the verifiers
    assert {d["device_id"] for d in s["drafters"] if d["attached"]} == {
        fleet.device_id_for(n, 0) for n in cluster.nodes() if n.node_id in deployed["boards"]}


def test_killed_drafter_actor_is_restarted_and_attaches_again(deployed, looping):
    import ray

    name = next(a.name for a in cluster.status() if a.role == "drafter")
    handle = ray.get_actor(name, namespace=cluster.NAMESPACE)
    before = ray.get(handle.info.remote(), timeout=30)
    ray.kill(handle, no_restart=False)  # a crash: Ray restarts it
    deadline = time.monotonic() + 120
    info = None
    while time.monotonic() < deadline:
        try:
            info = ray.get(handle.info.remote(), timeout=10)
            if info["pid"] != before["pid"] and info["attached"]:
                break
        except Exception:  # restarting: the call fails until __init__ ran again
            pass
        time.sleep(0.5)
    assert info is not None and info["pid"] != before["pid"] and info["attached"], info
    ids = PROMPTS[0]
    with edgespec.Client(deployed["endpoint"], timeout=120) as c:  # pinned to the new drafter
        out = c.generate(prompt_ids=ids, raw=True, max_new_tokens=30,
                         device_id=before["device_id"])
    assert out.token_ids == hf_greedy(looping.model, ids, 30)
    assert out.device_id == before["device_id"]


def test_a_killed_verifier_replica_costs_no_session(deployed, looping):
    """Replica 0 dies (Ray restarts it): sessions sent through the router meanwhile go to the
    other replica or to the restarted one, and come out identical to target-only."""
    import ray

    handle = ray.get_actor(f"{cluster.PREFIX}verifier-0", namespace=cluster.NAMESPACE)
    before = ray.get(handle.info.remote(), timeout=30)
    ray.kill(handle, no_restart=False)
    with edgespec.Client(deployed["endpoint"], timeout=120) as c:
        outs = [c.generate(prompt_ids=ids, raw=True, max_new_tokens=30).token_ids
                for ids in PROMPTS]
    assert outs == [hf_greedy(looping.model, ids, 30) for ids in PROMPTS]
    deadline, info = time.monotonic() + 120, before
    while time.monotonic() < deadline:  # and the replica comes back on its port
        try:
            info = ray.get(handle.info.remote(), timeout=10)
            if info["pid"] != before["pid"]:
                break
        except Exception:
            pass
        time.sleep(0.5)
    assert info["pid"] != before["pid"] and info["address"] == before["address"]


def test_placement_errors_say_which_resource_to_declare():
    plain = cluster.Node("n1", "127.0.0.1", {"CPU": 2.0})
    with pytest.raises(ConfigError, match="'verifier' resource"):
        cluster.verifier_nodes([plain])
    with pytest.raises(ConfigError, match="'edge' resource"):
        cluster.edge_nodes([plain])
    gpu = cluster.Node("n2", "127.0.0.1", {"GPU": 1.0})
    assert cluster.verifier_nodes([plain, gpu]) == ([gpu], "GPU")


def test_deploy_without_a_cluster_is_a_clear_error():
    r = edgespec_cli("deploy", "--address", f"127.0.0.1:{free_port()}", "--status", timeout=120)
    assert r.returncode == 2
    assert "no Ray cluster" in r.stderr


def test_a_second_deploy_is_refused_and_leaves_the_fleet_running(deployed):
    r = edgespec_cli("deploy", "--address", deployed["address"], "--model", "default",
                     "--port", free_port(), "--cache-port", free_port(), cache=deployed["cache"])
    assert r.returncode == 2 and "already deployed" in r.stderr
    assert len(cluster.placed_names()) == 6


def test_down_leaves_no_actor_behind(deployed):
    r = edgespec_cli("deploy", "--address", deployed["address"], "--down")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "removed 6 actor(s)" in r.stdout  # cache, router, 2 verifiers, 2 drafters
    assert cluster.placed_names() == []
    r = edgespec_cli("deploy", "--address", deployed["address"], "--status")
    assert r.returncode == 0 and "nothing is deployed" in r.stdout
    assert list((deployed["cache"] / "fleet-redis").iterdir()) == []  # the cache's files too


def test_router_picks_fewest_active_healthy_replica_and_resumes_where_a_session_ran():
    from verifier_node.router import VerifierRouter

    router = VerifierRouter("127.0.0.1:0", ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
    try:
        r0, r1, r2 = router._replicas
        r0.healthy = r1.healthy = True  # r2 is down
        assert router._acquire(set(), None) == 0  # tie: the first
        assert router._acquire(set(), None) == 1  # r0 has a stream now
        assert router._acquire(set(), None) == 0
        assert router._acquire({0, 1}, None) == 2  # the unhealthy one only when nothing else
        assert router._acquire({0, 1, 2}, None) is None
        assert router._acquire(set(), 1) == 1  # a resume prefers its replica when healthy
        assert router._acquire(set(), 2) != 2
        assert [r.active for r in router._replicas] == [3, 2, 1]
    finally:
        router.stop()


def test_deploy_refuses_clashing_ports_before_touching_a_cluster():
    r = edgespec_cli("deploy", "--port", 6000, "--cache-port", 6002, "--http-port", 6002)
    assert r.returncode == 2 and "both port 6002" in r.stderr
    r = edgespec_cli("deploy", "--port", 65534, "--cache-port", 6002, "--verifiers", 2)
    assert r.returncode == 2 and "must be in [1, 65535]" in r.stderr

    r = edgespec_cli("deploy", "--tree-width", 0)
    assert r.returncode == 2 and "--tree-width must be in [1, 16]" in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--threads", "0"], "--threads"), (["--timeout", "-1"], "--timeout"),
    (["--timeout", "nan"], "--timeout"), (["--max-sessions", "0"], "--max-sessions"),
    (["--head", "default", "--fill-drafts", "mag"], "--fill-drafts")])
def test_deploy_refuses_what_would_only_fail_on_the_cluster(args, needle):
    r = edgespec_cli("deploy", *args)
    assert r.returncode == 2 and needle in r.stderr, r.stderr


def test_deploy_takes_the_fill_values_serve_takes_and_refuses_others():
    """``deploy --fill-drafts``: serve's values (auto, the default, left to the verifiers'
    engine to resolve; mag; none), anything else refused before a cluster is touched (mag
    with --head: the parametrized refusal above)."""
    from edgespec_cli.deployment.cluster import FleetError
    from edgespec_cli.deployment.placement import DeploySpec

    for value in ("auto", "mag", "none"):
        DeploySpec(fill_drafts=value).validate()
    with pytest.raises(FleetError, match="--fill-drafts"):
        DeploySpec(fill_drafts="llamacpp").validate()
