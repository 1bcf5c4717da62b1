"""The Ray cluster a fleet runs on: connecting to it, its nodes and the resources they declare
(which of them take verifiers, which edge drafters, which is the head), and the role actors
placed on it (``status``, ``down``). ``placement`` places the actors on these nodes.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from edgespec.config import ConfigError


NAMESPACE = "edgespec"


PREFIX = "edgespec-"


HEAD_RESOURCE = "node:__internal_head__"


START_A_CLUSTER = ("start one with `ray up deploy/ray-onprem.yaml`, or "
                   "`ray start --head --resources '{\"verifier\": 1}'` on the server")


class FleetError(ConfigError):
    """A fleet that cannot be placed or does not come up; the message says what to do."""


@dataclass(frozen=True)
class Node:
    node_id: str
    ip: str
    resources: dict

    @property
    def is_head(self) -> bool:
        return HEAD_RESOURCE in self.resources


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
    from ..terminated import keeping_sigterm

    try:
        with keeping_sigterm():  # ray.init's handler would exit 15, no cleanup line
            ray.init(address=address or "auto", namespace=namespace, log_to_driver=False,
                     logging_level=logging.WARNING, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        target = address or "this machine (auto)"
        raise FleetError(f"no Ray cluster at {target}: {str(e).splitlines()[0][:200]}\n"
                         f"{START_A_CLUSTER}") from None


def use_token_auth_if_present() -> None:
    """Ray 2.60's `ray start` turns token authentication on when this machine has a token
    (~/.ray/auth_token, written by any local `ray.init()`), while a driver joining by address
    stays in 'disabled' mode unless told, and is refused. A driver in 'token' mode joins
    clusters with or without authentication, so choose it when a token exists. Call before
    ray is imported."""
    token_file = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    if "RAY_AUTH_MODE" not in os.environ and (os.path.exists(token_file)
                                              or os.environ.get("RAY_AUTH_TOKEN")):
        os.environ["RAY_AUTH_MODE"] = "token"


def _check_reachable(address: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise FleetError(f"--address takes HOST:PORT (the Ray head's GCS port), got "
                         f"{address[:60]!r}")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise FleetError(f"no Ray cluster at {address} ({e}): {START_A_CLUSTER}") from None


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


def placed_names() -> list[str]:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == NAMESPACE and a["name"].startswith(PREFIX))


def status(timeout_s: float = 5.0) -> list[PlacedActor]:
    """Every placed actor and whether it answers (a restarting actor does not)."""
    import ray

    out = []
    for name in placed_names():
        # Any: ray types an ActorHandle's methods as Never (its __getattr__ is dynamic)
        handle: Any = ray.get_actor(name, namespace=NAMESPACE)
        role = name[len(PREFIX):].split("-", 1)[0]
        try:
            info: dict = ray.get(handle.info.remote(), timeout=timeout_s)
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
    remove_actors([ray.get_actor(n, namespace=NAMESPACE) for n in names], timeout_s)
    deadline = time.monotonic() + timeout_s
    while placed_names() and time.monotonic() < deadline:
        time.sleep(0.2)
    return len(names)


def remove_actors(handles: list, timeout_s: float) -> None:
    """Ask the actors to stop cleanly, then kill them for good (no restart)."""
    import ray

    stops = [h.stop.remote() for h in handles]
    if stops:
        ray.wait(stops, num_returns=len(stops), timeout=timeout_s)
    for h in handles:
        try:
            ray.kill(h, no_restart=True)
        except Exception:
            pass  # already gone


def format_table(actors: list[PlacedActor]) -> str:
    rows = [("NODE", "ROLE", "ADDRESS", "STATE")]
    rows += [(a.node_ip, a.role, a.address, a.state) for a in actors]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
