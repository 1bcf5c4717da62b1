"""The fleet on Ray: place the roles as actors and wait until they serve (the cluster, its nodes
and the placed actors' status and removal: ``cluster``).

Ray places, starts and restarts; gRPC + Redis stay the data path (see docs/architecture.md).
Placement follows what each node declares with ``ray start --resources``:

- the draft cache on the head node (``node:__internal_head__``);
- verifier replicas on nodes declaring ``verifier``, else on nodes with a GPU, round-robin;
- drafters on every node declaring ``edge``, ``drafters_per_board`` on each.

The actor classes (``cache_actor``, ``verifier_actor``, ``drafter_actor`` beside this module)
are passed in through ``RoleActors``, so that ``deploy`` and ``simulate`` choose theirs. Every
actor is restarted by Ray when it fails (``max_restarts=-1``);
``deploy`` makes them named and detached in the ``edgespec`` namespace so they outlive the
command, and ``simulate`` makes them owned by its process.
"""

from __future__ import annotations

import math
import os
import secrets
import time
from dataclasses import dataclass

from edgespec.config import ConfigError, EngineConfig, cache_dir

from .cluster import (NAMESPACE, PREFIX, FleetError, Node, PlacedActor, edge_nodes, head_node,
                      nodes, placed_names, remove_actors, status, verifier_nodes)


@dataclass(frozen=True)
class RoleActors:
    """The roles' actor classes (plain classes: ``place`` wraps them with ``ray.remote``)."""

    cache: type
    verifier: type
    drafter: type
    router: type


@dataclass
class DeploySpec:
    model: str = "default"
    drafter: str = "mag"
    drafters_per_board: int = 1
    tree_width: int = 1  # board drafters send token trees of this width (1: chains)
    verifiers: int = 1
    port: int = 50051  # the client endpoint (the verifier, or the router before replicas)
    cache_port: int = 50052
    http_port: int | None = None  # replica i serves HTTP on http_port + i
    max_sessions: int = 8
    threads: int | None = None
    dtype: str = "auto"  # the verifiers' (auto: bfloat16 where exact there, else float32)
    auth_token: str | None = None
    timeout_s: float = 900.0  # model downloads and loads included
    head: str = ""  # a draft head in the verifiers (a folder on their node, or a shipped one)
    cuda_graphs: bool | None = None  # GPU verifiers replay steps as CUDA graphs (None: on)
    fill_drafts: str = "auto"  # the verifiers' fill of boards' empty drafts (serve's option)

    def validate(self) -> None:
        if self.verifiers < 1 or self.drafters_per_board < 1:
            raise FleetError("--verifiers and --drafters-per-board must be >= 1")
        if not 1 <= self.tree_width <= 16:
            raise FleetError(f"--tree-width must be in [1, 16], got {self.tree_width}")
        if self.max_sessions < 1:
            raise FleetError(f"--max-sessions must be >= 1, got {self.max_sessions}")
        if self.threads is not None and self.threads < 1:
            raise FleetError(f"--threads must be >= 1, got {self.threads}")
        try:  # the verifiers' engine's own rules for it (mag not with a head), checked here
            EngineConfig(fill_drafts=self.fill_drafts, head=self.head)
        except ConfigError as exc:
            raise FleetError(f"--fill-drafts: {exc}") from None
        if not 0 < self.timeout_s < math.inf:  # NaN too
            raise FleetError(f"--timeout must be a finite number of seconds > 0, got "
                             f"{self.timeout_s}")
        ports = {"--port": self.port, "--cache-port": self.cache_port}
        if self.verifiers > 1:
            ports.update({f"replica {i}'s port": self.replica_port(i)
                          for i in range(self.verifiers)})
        if self.http_port is not None:
            ports.update({f"--http-port + {i}": self.http_port + i
                          for i in range(self.verifiers)})
        for what, port in ports.items():
            if not 0 < port < 65536:
                raise FleetError(f"{what} ({port}) must be in [1, 65535]")
        seen: dict[int, str] = {}
        for what, port in ports.items():
            if port in seen:
                raise FleetError(f"{what} and {seen[port]} are both port {port}")
            seen[port] = what

    def replica_port(self, i: int) -> int:
        """Replica ``i``'s port when a router holds ``port``: after both fixed ports."""
        return max(self.port, self.cache_port) + 1 + i


@dataclass
class Deployment:
    endpoint: str
    actors: list[PlacedActor]


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
    named detached actors; wait until the endpoint answers and a drafter is attached. Nothing
    is placed when a check fails; what this call placed is removed when it fails later."""
    spec.validate()
    if placed_names():
        raise FleetError("edgespec is already deployed on this cluster (`edgespec deploy "
                         "--status` lists it; `edgespec deploy --down` removes it)")
    all_nodes = nodes()
    vnodes, vres = verifier_nodes(all_nodes)
    boards = edge_nodes(all_nodes)
    handles: dict = {}
    try:
        return _place_all(roles, spec, head_node(all_nodes), vnodes, vres, boards, handles,
                          progress)
    except BaseException:
        progress("deploy failed; removing what it placed")
        remove_actors(list(handles.values()), timeout_s=10.0)
        raise


def _place_all(roles, spec, head, vnodes, vres, boards, handles, progress) -> Deployment:
    deadline = time.monotonic() + spec.timeout_s
    # the cache's Redis persists here (a restarted cache actor reloads it); removed by down()
    data_dir = os.path.join(cache_dir(), "fleet-redis", secrets.token_hex(6))
    handles[PREFIX + "cache"] = place(roles.cache, head, name=PREFIX + "cache",
                                      detached=True).remote(
        spec.cache_port, data_dir, secrets.token_urlsafe(24), auth_token=spec.auth_token)
    cache = _get(handles[PREFIX + "cache"].info.remote(), deadline, "the draft cache")
    progress(f"cache ready on {cache['address']}")

    assigned = [vnodes[i % len(vnodes)] for i in range(spec.verifiers)]
    per_node = {n.node_id: assigned.count(n) for n in assigned}
    replicas = []
    for i, n in enumerate(assigned):
        port = spec.port if spec.verifiers == 1 else spec.replica_port(i)
        http = None if spec.http_port is None else spec.http_port + i
        gpus = n.resources.get("GPU", 0)
        num_gpus = ((1 if gpus >= per_node[n.node_id] else gpus / per_node[n.node_id])
                    if gpus else 0)
        resources = share(n, vres, per_node[n.node_id]) if vres == "verifier" else None
        name = f"{PREFIX}verifier-{i}"
        handles[name] = place(roles.verifier, n, name=name, detached=True, resources=resources,
                              num_gpus=num_gpus).remote(
            port, cache["redis_url"], model=spec.model, max_sessions=spec.max_sessions,
            threads=spec.threads, http_port=http, auth_token=spec.auth_token,
            device="cuda" if gpus else "cpu", dtype=spec.dtype,
            engine={**({"head": spec.head} if spec.head else {}),
                    **({"fill_drafts": spec.fill_drafts} if spec.fill_drafts != "auto" else {}),
                    **({"cuda_graphs": spec.cuda_graphs}
                       if spec.cuda_graphs is not None and gpus else {})} or None)
    for n in boards:
        # the board's cores shared by its drafters (a model drafter uses them)
        threads = max(1, int(n.resources.get("CPU", 1) // spec.drafters_per_board))
        for j in range(spec.drafters_per_board):
            name = f"{PREFIX}drafter-{device_id_for(n, j)}"
            board_gpus = n.resources.get("GPU", 0)  # a board's GPU runs its model drafters
            handles[name] = place(roles.drafter, n, name=name, detached=True,
                                  resources=share(n, "edge", spec.drafters_per_board),
                                  num_gpus=board_gpus / spec.drafters_per_board).remote(
                cache["address"], device_id_for(n, j), spec.drafter, threads=threads,
                auth_token=spec.auth_token, tree_width=spec.tree_width,
                device="cuda" if board_gpus else "cpu")
    progress(f"placed {spec.verifiers} verifier(s) on {vres} node(s) and "
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
    _wait_serving(endpoint, spec.auth_token, deadline)
    progress(f"endpoint {endpoint} is serving; waiting for a drafter to attach")
    drafters = {n: h for n, h in handles.items() if n.startswith(PREFIX + "drafter-")}
    attached, problems = _wait_drafters(drafters, deadline)
    for name, why in problems.items():
        progress(f"warning: {name}: {why}")
    if not attached:
        why = next(iter(problems.values()), "none attached in time")
        raise FleetError(f"no drafter attached to the cache at {cache['address']}: {why}")
    return Deployment(endpoint, status())


def _wait_serving(endpoint: str, token: str | None, deadline: float) -> None:
    """Until the endpoint answers gRPC health checks with SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from edgespec.wire.convert import auth_metadata
    from edgespec.wire.channels import make_channel

    channel = make_channel(endpoint)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                res = stub.Check(health_pb2.HealthCheckRequest(), timeout=5,
                                 metadata=auth_metadata(token))
                if res.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() >= deadline:
                raise FleetError(f"the endpoint {endpoint} does not answer health checks "
                                 "with SERVING")
            time.sleep(0.5)
    finally:
        channel.close()


def _wait_drafters(handles: dict, deadline: float) -> tuple[int, dict[str, str]]:
    """Until one drafter is attached (each gets until the deadline to try); returns how many
    are attached and why the others are not. A drafter that fails costs speed, not the fleet."""
    import ray

    problems: dict[str, str] = {}
    failed: set[str] = set()
    while True:
        left = max(1.0, min(10.0, deadline - time.monotonic()))
        refs = {h.info.remote(): name for name, h in handles.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=left)
        attached = 0
        for ref, name in refs.items():
            if ref not in ready:
                problems[name] = "not answering (not placed yet, or restarting)"
                continue
            try:
                info = ray.get(ref)
            except Exception as e:
                problems[name] = f"failed: {str(e).strip().splitlines()[-1][:200]}"
                continue
            if info.get("attached"):
                attached += 1
                problems.pop(name, None)
            elif info.get("error"):
                problems[name] = info["error"]
                failed.add(name)  # refused for good or cannot start: waiting will not help
            else:
                problems[name] = "not attached yet"
        if attached or failed == set(handles) or time.monotonic() >= deadline:
            return attached, problems
        time.sleep(1.0)


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
