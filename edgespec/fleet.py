"""The fleet on Ray: place the roles as actors, report them, remove them.

Ray places, starts and restarts; gRPC + Redis stay the data path (see docs/architecture.md).
Placement follows what each node declares with ``ray start --resources``:

- the draft cache on the head node (``node:__internal_head__``);
- verifier replicas on nodes declaring ``verifier``, else on nodes with a GPU, round-robin;
- drafters on every node declaring ``edge``, ``drafters_per_board`` on each.

The actor classes come from the roles' packages (``cache_service.actor``,
``verifier_node.actor``, ``drafter_node.actor``) through ``RoleActors``: this shared library
never imports the roles. Every actor is restarted by Ray when it fails (``max_restarts=-1``);
``deploy`` makes them named and detached in the ``edgespec`` namespace so they outlive the
command, and ``simulate`` makes them owned by its process.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass, field

from .config import ConfigError, cache_dir

NAMESPACE = "edgespec"
PREFIX = "edgespec-"
HEAD_RESOURCE = "node:__internal_head__"


class FleetError(ConfigError):
    """A fleet that cannot be placed or does not come up; the message says what to do."""


@dataclass(frozen=True)
class RoleActors:
    """The roles' actor classes (plain classes: ``place`` wraps them with ``ray.remote``)."""

    cache: type
    verifier: type
    drafter: type
    router: type


@dataclass(frozen=True)
class Node:
    node_id: str
    ip: str
    resources: dict

    @property
    def is_head(self) -> bool:
        return HEAD_RESOURCE in self.resources


@dataclass
class DeploySpec:
    model: str = "default"
    drafter: str = "mag"
    drafters_per_board: int = 1
    verifiers: int = 1
    port: int = 50051  # the client endpoint (the verifier, or the router before replicas)
    cache_port: int = 50052
    http_port: int | None = None  # replica i serves HTTP on http_port + i
    max_sessions: int = 8
    threads: int | None = None
    auth_token: str | None = None
    timeout_s: float = 900.0  # model downloads and loads included

    def replica_port(self, i: int) -> int:
        """Replica ``i``'s port when a router holds ``port``: after both fixed ports."""
        return max(self.port, self.cache_port) + 1 + i


@dataclass
class PlacedActor:
    name: str
    role: str
    node_ip: str
    address: str
    state: str  # "ready", "not answering", or the error it reports
    info: dict = field(default_factory=dict)

    @property
    def node_id(self) -> str:
        return self.info.get("node_id", "")


@dataclass
class Deployment:
    endpoint: str
    actors: list[PlacedActor]


def where() -> dict:
    """Inside an actor: the node it runs on, as Ray knows it."""
    import ray

    return {"node_ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id()}


def connect(address: str | None, namespace: str = NAMESPACE) -> None:
    """Join the Ray cluster at ``address`` ("auto": the one this machine runs)."""
    import ray

    if ray.is_initialized():
        return
    if address and address != "auto" and "://" not in address:
        _check_reachable(address)  # ray.init would retry an absent cluster forever
    try:
        ray.init(address=address or "auto", namespace=namespace, log_to_driver=False,
                 logging_level=logging.WARNING, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = address or "this machine (auto)"
        raise FleetError(f"no Ray cluster at {where}: {str(e).splitlines()[0][:200]}\n"
                         "start one with `ray up deploy/ray-onprem.yaml`, or "
                         "`ray start --head --resources '{\"verifier\": 1}'` on the server") \
            from None


def _check_reachable(address: str) -> None:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
    except (OSError, ValueError) as e:
        raise FleetError(f"no Ray cluster at {address} ({e}): start one with `ray up "
                         "deploy/ray-onprem.yaml`, or `ray start --head --resources "
                         "'{\"verifier\": 1}'` on the server") from None


def nodes() -> list[Node]:
    import ray

    return [Node(n["NodeID"], n["NodeManagerAddress"], dict(n["Resources"]))
            for n in ray.nodes() if n.get("Alive")]


def verifier_nodes(all_nodes: list[Node]) -> tuple[list[Node], str]:
    """Nodes for verifiers and the resource that put them there."""
    declared = [n for n in all_nodes if n.resources.get("verifier", 0) > 0]
    if declared:
        return declared, "verifier"
    gpus = [n for n in all_nodes if n.resources.get("GPU", 0) > 0]
    if gpus:
        return gpus, "GPU"
    raise FleetError("no node declares the 'verifier' resource and none has a GPU: start the "
                     "server's Ray with `ray start --head --resources '{\"verifier\": 1}'` "
                     "(or head_start_ray_commands in the cluster YAML)")


def edge_nodes(all_nodes: list[Node]) -> list[Node]:
    boards = [n for n in all_nodes if n.resources.get("edge", 0) > 0]
    if not boards:
        raise FleetError("no node declares the 'edge' resource: start each board with "
                         "`ray start --address HEAD:PORT --resources '{\"edge\": 1}'` (or "
                         "worker_start_ray_commands in the cluster YAML), or run "
                         "`edgespec drafter --cache HEAD:PORT` on boards without Ray")
    return boards


def head_node(all_nodes: list[Node]) -> Node:
    for n in all_nodes:
        if n.is_head:
            return n
    return all_nodes[0]


def place(cls: type, node: Node, *, name: str | None = None, detached: bool = False,
          resources: dict | None = None, num_gpus: float = 0):
    """``cls`` as an actor pinned to ``node``, restarted by Ray whenever it fails."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options = dict(num_cpus=0, num_gpus=num_gpus, resources=resources or {},
                   max_restarts=-1, max_concurrency=8,
                   scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False))
    if name:
        options.update(name=name, namespace=NAMESPACE)
    if detached:
        options["lifetime"] = "detached"
    return ray.remote(cls).options(**options)


def device_id_for(node: Node, index: int) -> str:
    """A board's ``index``-th drafter: named after the board's address and Ray node (two
    Ray nodes may share an address)."""
    return f"edge-{node.ip.replace('.', '-').replace(':', '-')}-{node.node_id[:6]}-{index}"


def share(node: Node, resource: str, count: int) -> dict:
    """An equal share of ``node``'s ``resource`` for each of ``count`` actors."""
    return {resource: node.resources[resource] / count}


def deploy(roles: RoleActors, spec: DeploySpec, progress=print) -> Deployment:
    """Place the cache, the verifier(s) (and a router before replicas) and the drafters as
    named detached actors; wait until the endpoint answers and a drafter is attached."""
    import ray

    if spec.verifiers < 1 or spec.drafters_per_board < 1:
        raise FleetError("--verifiers and --drafters-per-board must be >= 1")
    if placed_names():
        raise FleetError("edgespec is already deployed on this cluster (`edgespec deploy "
                         "--status` lists it; `edgespec deploy --down` removes it)")
    all_nodes = nodes()
    vnodes, vres = verifier_nodes(all_nodes)
    boards = edge_nodes(all_nodes)
    head = head_node(all_nodes)
    deadline = time.monotonic() + spec.timeout_s
    handles = {}

    # the cache's Redis persists here (a restarted cache actor reloads it); removed by down()
    data_dir = os.path.join(cache_dir(), "fleet-redis", secrets.token_hex(6))
    handles["cache"] = place(roles.cache, head, name=PREFIX + "cache", detached=True).remote(
        spec.cache_port, data_dir, secrets.token_urlsafe(24), auth_token=spec.auth_token)
    cache = _get(handles["cache"].info.remote(), deadline, "the draft cache")
    progress(f"cache ready on {cache['address']}")

    per_node: dict[str, int] = {}
    assigned = [vnodes[i % len(vnodes)] for i in range(spec.verifiers)]
    for n in assigned:
        per_node[n.node_id] = per_node.get(n.node_id, 0) + 1
    replicas = []
    for i, n in enumerate(assigned):
        port = spec.port if spec.verifiers == 1 else spec.replica_port(i)
        http = None if spec.http_port is None else spec.http_port + i
        opts = (dict(resources=share(n, vres, per_node[n.node_id])) if vres == "verifier"
                else dict(num_gpus=n.resources["GPU"] / per_node[n.node_id]))
        name = f"{PREFIX}verifier-{i}"
        handles[name] = place(roles.verifier, n, name=name, detached=True, **opts).remote(
            port, cache["redis_url"], model=spec.model, max_sessions=spec.max_sessions,
            threads=spec.threads, http_port=http, auth_token=spec.auth_token,
            device="cuda" if vres == "GPU" else "cpu")
    for n in boards:
        for j in range(spec.drafters_per_board):
            name = f"{PREFIX}drafter-{device_id_for(n, j)}"
            handles[name] = place(roles.drafter, n, name=name, detached=True,
                                  resources=share(n, "edge", spec.drafters_per_board)).remote(
                cache["address"], device_id_for(n, j), spec.drafter, threads=spec.threads,
                auth_token=spec.auth_token)
    progress(f"placed {spec.verifiers} verifier(s) ({vres}) and "
             f"{len(boards) * spec.drafters_per_board} drafter(s) on {len(boards)} board(s); "
             "waiting for the model to load")
    for i in range(spec.verifiers):
        info = _get(handles[f"{PREFIX}verifier-{i}"].info.remote(), deadline, f"verifier {i}")
        replicas.append(info["address"])
        progress(f"verifier {i} ready on {info['address']}")
    endpoint = replicas[0]
    if spec.verifiers > 1:
        handles[PREFIX + "router"] = place(roles.router, head, name=PREFIX + "router",
                                           detached=True).remote(spec.port, replicas,
                                                                 spec.auth_token)
        endpoint = _get(handles[PREFIX + "router"].info.remote(), deadline, "the router")[
            "address"]
    drafter_names = [n for n in handles if n.startswith(PREFIX + "drafter-")]
    attached = _wait_drafters([handles[n] for n in drafter_names], deadline)
    if not attached:
        errors = [i.get("error") for i in ray.get([handles[n].info.remote()
                                                   for n in drafter_names])]
        why = next((e for e in errors if e), "none attached in time")
        raise FleetError(f"no drafter attached to the cache at {cache['address']}: {why}")
    return Deployment(endpoint, status())


def _wait_drafters(handles, deadline: float) -> int:
    import ray

    while True:
        left = max(1.0, min(10.0, deadline - time.monotonic()))
        attached = sum(ray.get([h.wait_attached.remote(left) for h in handles]))
        if attached or time.monotonic() >= deadline:
            return attached


def _get(ref, deadline: float, what: str):
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    try:
        return ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
    except GetTimeoutError:
        raise FleetError(f"{what} did not come up in time (a model download or load can take "
                         "minutes: raise --timeout)") from None
    except (RayActorError, RayTaskError) as e:
        raise FleetError(f"{what} failed to start: {str(e).strip().splitlines()[-1][:300]}") \
            from None


def placed_names() -> list[str]:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == NAMESPACE and a["name"].startswith(PREFIX))


def status(timeout_s: float = 5.0) -> list[PlacedActor]:
    """Every placed actor and whether it answers (a restarting actor does not)."""
    import ray

    out = []
    for name in placed_names():
        handle = ray.get_actor(name, namespace=NAMESPACE)
        role = name[len(PREFIX):].split("-", 1)[0]
        try:
            info = ray.get(handle.info.remote(), timeout=timeout_s)
        except Exception as e:
            out.append(PlacedActor(name, role, "?", "?", f"not answering ({type(e).__name__})"))
            continue
        address = info.get("address") or info.get("device_id", "")
        state = "ready"
        if info.get("error"):
            state = f"error: {info['error'][:80]}"
        elif role == "drafter" and not info.get("attached"):
            state = "attaching"
        elif info.get("healthy") is False:
            state = "unhealthy"
        out.append(PlacedActor(name, role, info.get("node_ip", "?"), address, state, info))
    return out


def down(timeout_s: float = 10.0) -> int:
    """Stop and remove every placed actor; returns how many were removed."""
    import ray

    names = placed_names()
    handles = [ray.get_actor(n, namespace=NAMESPACE) for n in names]
    stops = [h.stop.remote() for h in handles]
    try:
        ray.wait(stops, num_returns=len(stops), timeout=timeout_s)
    except Exception:
        pass  # an actor that cannot stop cleanly is killed all the same
    for h in handles:
        ray.kill(h, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while placed_names() and time.monotonic() < deadline:
        time.sleep(0.2)
    return len(names)


def format_table(actors: list[PlacedActor]) -> str:
    rows = [("NODE", "ROLE", "ADDRESS", "STATE")]
    rows += [(a.node_ip, a.role, a.address, a.state) for a in actors]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
