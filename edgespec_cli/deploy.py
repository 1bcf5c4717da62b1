"""``edgespec deploy``: place the roles as Ray actors on a running cluster, list them, remove
them (see edgespec_cli/deployment/placement.py for the placement rules)."""

from __future__ import annotations

import argparse
import os
import sys


def add_deploy_command(sub) -> None:
    from edgespec.config import FILL_DRAFTS
    from edgespec_cli.cli_args import add_dtype_arg, add_threads_arg, add_tree_width_arg

    d = sub.add_parser("deploy", help="place the verifier, the cache and the drafters as Ray "
                                      "actors on a running cluster (ray up)")
    d.add_argument("--address", default=None, metavar="HEAD:PORT",
                   help="the Ray cluster's address: its head's IP and Ray port, as given to "
                        "ray start --head --port (e.g. 10.8.0.1:6380; default: $RAY_ADDRESS, "
                        "else the cluster this machine runs)")
    what = d.add_mutually_exclusive_group()
    what.add_argument("--status", action="store_true",
                      help="list the placed actors and their state, then exit")
    what.add_argument("--down", action="store_true", help="remove every placed actor")
    d.add_argument("--model", metavar="M", default="default",
                   help="the target model on the verifier node: 'default', a transformers "
                        "directory or a .gguf file (default: %(default)s)")
    d.add_argument("--drafter", metavar="SPEC", default="mag",
                   help="the board drafters: mag | cacheback | mag+cacheback | model:PATH | "
                        "llamacpp:FILE.gguf | cascade:SPEC,SPEC,... (default: %(default)s)")
    d.add_argument("--drafters-per-board", type=int, default=1,
                   help="drafter actors on each node declaring 'edge' (default: %(default)s)")
    add_tree_width_arg(d)
    d.add_argument("--verifiers", type=int, default=1,
                   help="verifier replicas sharing the cache, each with its own KV slots; "
                        "with more than one, a router on the head is the endpoint and spreads "
                        "sessions over them (default: %(default)s)")
    d.add_argument("--port", metavar="PORT", type=int, default=50051,
                   help="the client endpoint's port; with --verifiers > 1 the router holds it "
                        "and replica i listens on max(--port, --cache-port) + 1 + i "
                        "(default: %(default)s)")
    d.add_argument("--cache-port", metavar="PORT", type=int, default=50052,
                   help="the draft cache's port on the head, where drafters attach "
                        "(default: %(default)s)")
    d.add_argument("--http-port", metavar="PORT", type=int, default=None,
                   help="serve the OpenAI-compatible HTTP API on this port of the verifier "
                        "node (replica i: port + i) (default: none)")
    d.add_argument("--max-sessions", type=int, default=8,
                   help="KV slots per verifier replica (default: %(default)s)")
    d.add_argument("--auth-token", metavar="TOKEN", default=None,
                   help="token every role and client uses (default: $EDGESPEC_AUTH_TOKEN; "
                        "none: no authentication)")
    d.add_argument("--timeout", metavar="S", type=float, default=900.0,
                   help="seconds to wait for the fleet to come up, model load included "
                        "(default: %(default)s)")
    add_threads_arg(d)
    add_dtype_arg(d, "the verifiers' ")
    d.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="verifiers on a GPU node replay their steps as CUDA graphs (default: "
                        "on there; see serve --cuda-graphs)")
    d.add_argument("--head", default=None, metavar="DIR",
                   help="a trained draft head in the verifiers, drafting from their own "
                        "forward's features beside the boards' drafts: 'default' (shipped), a "
                        "kind (eagle, specformer, ctc) or a head folder on the verifier's node "
                        "(default: none)")
    d.add_argument("--fill-drafts", choices=FILL_DRAFTS, default="auto",
                   help="the verifiers' own cheap draft for a session whose board's draft is "
                        "empty when a step asks for one (serve --fill-drafts): auto (mag "
                        "unless --head), mag or none (default: %(default)s)")
    d.set_defaults(func=cmd_deploy)


def role_actors():
    """The roles' actor classes, for ``deployment.placement``."""
    from .deployment.cache_actor import CacheActor
    from .deployment.drafter_actor import DrafterActor
    from .deployment.placement import RoleActors
    from .deployment.verifier_actor import RouterActor, VerifierActor

    return RoleActors(CacheActor, VerifierActor, DrafterActor, RouterActor)


def cmd_deploy(args: argparse.Namespace) -> int:
    from edgespec.config import ConfigError
    from .deployment.cluster import use_token_auth_if_present

    use_token_auth_if_present()
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ConfigError("edgespec deploy needs Ray, the fleet extra: pip install -e "
                          "'.[fleet]' in the edgespec repository") from None
    from .deployment import cluster
    from .deployment import placement as fleet
    from edgespec.drafters import EDGE_KINDS, parse_drafter_spec

    roles = role_actors()
    spec = fleet.DeploySpec(model=args.model, drafter=args.drafter,
                            drafters_per_board=args.drafters_per_board,
                            tree_width=args.tree_width,
                            verifiers=args.verifiers, port=args.port, cache_port=args.cache_port,
                            http_port=args.http_port, max_sessions=args.max_sessions,
                            threads=args.threads, dtype=args.dtype,
                            auth_token=args.auth_token or os.environ.get("EDGESPEC_AUTH_TOKEN"),
                            timeout_s=args.timeout, head=args.head or "",
                            cuda_graphs=args.cuda_graphs, fill_drafts=args.fill_drafts)
    if not (args.status or args.down):  # before touching the cluster
        parse_drafter_spec(args.drafter, allowed=EDGE_KINDS)
        spec.validate()
    cluster.connect(args.address or os.environ.get("RAY_ADDRESS"))
    if args.status:
        actors = cluster.status()
        print(cluster.format_table(actors) if actors else "nothing is deployed")
        return 0
    if args.down:
        n = cluster.down()
        left = cluster.placed_names()
        print(f"removed {n} actor(s)" + (f"; still there: {', '.join(left)}" if left else ""))
        return 1 if left else 0
    deployment = fleet.deploy(roles, spec, progress=lambda m: print(
        f"edgespec: {m}", file=sys.stderr, flush=True))
    print(cluster.format_table(deployment.actors))
    print(deployment.endpoint)
    return 0
