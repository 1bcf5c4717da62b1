"""The distributed system's commands: ``serve``, ``verifier``, ``cache``, ``drafter``."""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import threading

from edgespec_cli.cli_args import (add_threads_arg, add_tree_width_arg, check_at_least,
                                   check_port, check_within, configure_logging)
from edgespec.config import LLAMACPP_HEAD, LLAMACPP_WINDOW, ConfigError, EngineConfig

STOP_GRACE_S = 10.0  # a drafter told to stop that has not exited by then exits at once


def _exit_if_stuck(grace_s: float) -> None:
    """After SIGTERM: a board holds nothing that outlives it, so one whose clean stop hangs
    (a transport's close, a thread's join) prints its threads' stacks and exits 0 after
    ``grace_s`` rather than waiting for the SIGKILL of a service manager."""
    def exit_now():
        print(f"edgespec: the drafter did not stop within {grace_s:.0f} s of SIGTERM; its "
              "threads' stacks follow, then it exits", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        sys.stdout.flush()
        os._exit(0)

    timer = threading.Timer(grace_s, exit_now)
    timer.daemon = True
    timer.start()
    # past the interpreter's finalization no Python thread runs: faulthandler's own thread
    # then dumps the stacks and exits (status 1)
    faulthandler.dump_traceback_later(grace_s + 5, exit=True)


def _add_security(p: argparse.ArgumentParser, server: bool) -> None:
    if server:
        p.add_argument("--auth-token", metavar="TOKEN", default=None,
                       help="shared token callers must send (default: $EDGESPEC_AUTH_TOKEN; "
                            "none: no authentication)")
        p.add_argument("--device-tokens", metavar="FILE", default=None,
                       help="per-device drafter tokens, one 'device_id: token' a line ('#' "
                            "comments): drafters then authenticate with their own token, "
                            "which is good for the DraftCache service only and for that "
                            "device only")
        p.add_argument("--tls-cert", metavar="FILE",
                       help="PEM certificate: serve TLS (needs --tls-key)")
        p.add_argument("--tls-key", metavar="FILE", help="PEM private key for --tls-cert")
        p.add_argument("--tls-client-ca", metavar="FILE", default=None,
                       help="PEM CA certificate: require every client to present a "
                            "certificate it signed (mutual TLS; needs --tls-cert)")
    else:
        p.add_argument("--auth-token", metavar="TOKEN", default=None,
                       help="token to send: the shared one, or this device's own when the "
                            "cache has per-device tokens (default: $EDGESPEC_AUTH_TOKEN)")
        p.add_argument("--tls", action="store_true", help="connect with TLS (system roots)")
        p.add_argument("--tls-ca", metavar="FILE",
                       help="PEM CA certificate to trust (implies --tls)")
        p.add_argument("--tls-cert", metavar="FILE",
                       help="PEM client certificate for mutual TLS (implies --tls; needs "
                            "--tls-key)")
        p.add_argument("--tls-key", metavar="FILE", help="PEM private key for --tls-cert")


def _add_server(p: argparse.ArgumentParser, roles: tuple[str, ...]) -> None:
    from edgespec_cli.cli_args import (add_engine_args, add_model_args, add_threads_arg,
                                    add_verify_args)

    p.add_argument("--listen", default="127.0.0.1:50051", metavar="HOST:PORT",
                   help="the gRPC address this process serves (its roles and health) on: what "
                        "clients (edgespec.Client, status --address) and drafters (drafter "
                        "--cache) are given; e.g. 0.0.0.0:50051 for other machines "
                        "(default: %(default)s)")
    p.add_argument("--redis-url", metavar="URL", default=None,
                   help="external Redis (redis://host:port/db or unix:///socket); default: "
                        "$EDGESPEC_REDIS_URL, else an embedded redis-server"
                   if len(roles) > 1 else
                   "the Redis (redis://host:port/db or unix:///socket) this role shares with "
                   f"the edgespec {'cache' if roles == ('verifier',) else 'verifier'} (its "
                   "sessions live there); default: $EDGESPEC_REDIS_URL, required (an "
                   "embedded one would be this process's alone)")
    p.add_argument("--max-drafters", type=int, default=64,
                   help="drafters attached at once; more are refused with RESOURCE_EXHAUSTED "
                        "(0: none, the verifier decodes alone; default: %(default)s)")
    p.add_argument("--metrics-port", metavar="PORT", type=int, default=None,
                   help="serve Prometheus /metrics on this port (the verifier also serves them "
                        "on --http-port) (default: none)")
    p.add_argument("--metrics-host", metavar="HOST", default="127.0.0.1",
                   help="the interface --metrics-port listens on, e.g. 0.0.0.0 for every one "
                        "(default: %(default)s)")
    p.add_argument("--drain-timeout", metavar="S", type=float, default=30.0,
                   help="seconds SIGTERM waits for running sessions before stopping "
                        "(default: %(default)s)")
    p.add_argument("--fleet-table", type=int, default=1 << 17, metavar="LEADERS",
                   help="most leader n-grams in the fleet-wide Cacheback table that every closed "
                        "session's output teaches; 0 turns the table off (default: %(default)s)")
    p.add_argument("--session-ttl", metavar="S", type=int, default=600,
                   help="seconds after its last commit an abandoned session expires (the "
                        "expiry moves on every 16 committed tokens) (default: %(default)s)")
    p.add_argument("--log-level", metavar="LEVEL", default="INFO",
                   help="DEBUG, INFO, WARNING or ERROR (default: %(default)s)")
    _add_security(p, server=True)
    if "verifier" in roles:
        add_model_args(p)
        p.add_argument("--max-sessions", type=int, default=8,
                       help="KV slots: sessions verified at once (default: %(default)s)")
        p.add_argument("--max-batch-tokens", type=int, default=256,
                       help="the most tokens in one verification forward (default: %(default)s)")
        p.add_argument("--max-queue", type=int, default=64,
                       help="requests waiting for a slot before RESOURCE_EXHAUSTED "
                            "(default: %(default)s)")
        p.add_argument("--handover-after", metavar="S", type=float, default=30.0,
                       help="seconds a board may be gone (detached) before its running sessions "
                            "are handed to another attached board with room; sessions admitted "
                            "while no board had room go to a board as one attaches. 0: no "
                            "session is handed over, each stays with the board it was admitted "
                            "with, or with the server alone (default: %(default)s)")
        p.add_argument("--http-port", metavar="PORT", type=int, default=None,
                       help="serve the OpenAI-compatible HTTP API, /health and /metrics on this "
                            "port (default: none)")
        p.add_argument("--max-request-bytes", type=int, default=None, metavar="N",
                       help="the largest HTTP request body; a larger one is answered 413 before "
                            "it is read whole (default: 4 MiB + 384 bytes per --max-context "
                            "token, room for the longest prompt admitted)")
        p.add_argument("--request-body-timeout", type=float, default=60.0, metavar="S",
                       help="seconds an HTTP request's body has to arrive whole after its "
                            "headers; a client slower than that (or one that sends less than it "
                            "declared and stays) is answered 408 and its connection closed "
                            "(0: no limit) (default: %(default)s)")
        p.add_argument("--http-host", metavar="HOST", default="127.0.0.1",
                       help="the interface --http-port listens on, e.g. 0.0.0.0 for every "
                            "one (default: %(default)s)")
        add_threads_arg(p)
        add_engine_args(p, in_process=False)
        add_verify_args(p)
    else:  # the cache alone uses only the drafting shape it hands to drafters
        d = EngineConfig()
        p.add_argument("--window", metavar="W", type=int, default=d.window,
                       help="most tokens drafted beyond the committed position, W "
                            "(default: %(default)s)")
        p.add_argument("--chunk", metavar="C", type=int, default=d.chunk,
                       help="tokens per draft chunk, c (default: %(default)s)")
    p.set_defaults(func=cmd_server, roles=roles)


def cmd_server(args) -> int:
    from edgespec_cli.cli_args import check_model_arg, engine_config, set_threads, warn_if_lossy

    from .server import EdgespecServer, ServerOptions

    from cache_service.redis_conn import REDIS_URL_ENV

    configure_logging(args.log_level)
    if len(args.roles) == 1 and not (args.redis_url or os.environ.get(REDIS_URL_ENV)):
        # a role alone shares its sessions with the other through Redis: an embedded one
        # would be this process's own, which the other role never reads
        other = "cache" if args.roles == ("verifier",) else "verifier"
        raise ConfigError(f"edgespec {args.roles[0]} runs one role: give --redis-url (or "
                          f"${REDIS_URL_ENV}), the Redis its edgespec {other} uses too, or run "
                          f"both roles in one process with edgespec serve")
    if args.device_tokens and "cache" not in args.roles:  # it would be read by nobody
        raise ConfigError("--device-tokens authenticates drafters to the draft cache: give it "
                          "to edgespec cache (or serve), not to edgespec verifier")
    engine = engine_config(args, getattr(args, "max_sessions", None))
    if "verifier" in args.roles:
        check_model_arg(args.model)
        set_threads(args.threads)
        warn_if_lossy(engine)
    check_at_least(args, ("max_drafters", "drain_timeout", "fleet_table", "max_queue"), 0)
    check_at_least(args, ("session_ttl",), 1)  # 0: Redis would expire the keys as they are made
    check_port(getattr(args, "metrics_port", None), "--metrics-port")
    check_port(getattr(args, "http_port", None), "--http-port")
    check_at_least(args, ("max_request_bytes",), 1)
    check_within(args, ("request_body_timeout", "handover_after"), 0)
    from edgespec.wire.convert import resolve_token

    resolve_token(args.auth_token)  # one no client could send: refused before the model loads
    opts = ServerOptions(listen=args.listen, roles=args.roles,
                         model=getattr(args, "model", "default"),
                         device=getattr(args, "device", "cpu"),
                         dtype=getattr(args, "dtype", "auto"), redis_url=args.redis_url,
                         auth_token=args.auth_token, tls_cert=args.tls_cert,
                         tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
                         device_tokens=args.device_tokens, max_drafters=args.max_drafters,
                         max_queue=getattr(args, "max_queue", 64),
                         session_ttl_s=args.session_ttl, fleet_leaders=args.fleet_table,
                         drain_timeout_s=args.drain_timeout,
                         handover_after_s=getattr(args, "handover_after", 30.0),
                         http_port=getattr(args, "http_port", None),
                         http_host=getattr(args, "http_host", "127.0.0.1"),
                         http_max_request_bytes=getattr(args, "max_request_bytes", None),
                         http_body_timeout_s=getattr(args, "request_body_timeout", 60.0),
                         metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                         engine=engine)
    server = EdgespecServer(opts)
    server.catch_stop_signals()  # before health says SERVING
    server.start()
    host = args.listen.rsplit(":", 1)[0]
    http = (f", HTTP API on http://{opts.http_host}:{server.http_port}/v1"
            if server.http_port else "")
    print(f"edgespec: {' + '.join(args.roles)} ready, listening on {host}:{server.port}{http}",
          file=sys.stderr, flush=True)
    server.wait()
    return 0


def cmd_drafter(args) -> int:
    from drafter_node.edge_drafter import build_edge_drafter, runs_torch
    from drafter_node.agent import DrafterAgent

    from edgespec_cli.cli_args import check_drafter_arg, set_threads
    from edgespec.drafters import EDGE_KINDS
    from edgespec.protocol.ids import check_device_id
    from edgespec.wire.convert import resolve_token
    from edgespec.wire.reachability import check_address

    check_device_id(args.device_id)  # before loading a model
    check_address(args.cache, "--cache")
    token = resolve_token(args.auth_token)  # one gRPC cannot send: refused, not retried
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigError("a client certificate needs both --tls-cert and --tls-key")
    check_drafter_arg(args.drafter, allowed=EDGE_KINDS)
    check_port(args.metrics_port, "--metrics-port")
    check_at_least(args, ("window", "chunk", "max_sessions", "max_context"), 1)  # before loading
    check_at_least(args, ("context_window",), 0)  # a model
    set_threads(args.threads, torch_too=runs_torch(args.drafter))
    configure_logging(args.log_level)
    metrics = None
    if args.metrics_port is not None:  # before loading a model: a busy port fails at once
        from prometheus_client import CollectorRegistry, start_http_server

        from drafter_node.metrics import DrafterMetrics

        registry = CollectorRegistry()
        metrics = DrafterMetrics(registry)
        try:
            httpd, _ = start_http_server(args.metrics_port, addr=args.metrics_host,
                                         registry=registry)
        except OSError as e:
            raise ConfigError(f"cannot serve metrics on {args.metrics_host}:"
                              f"{args.metrics_port}: {e}") from None
        print(f"edgespec: drafter metrics on http://{args.metrics_host}:{httpd.server_port}"
              "/metrics", file=sys.stderr, flush=True)
    print(f"edgespec: drafter {args.device_id}: loading {args.drafter}", file=sys.stderr,
          flush=True)  # (a model drafter loads for seconds before it attaches)
    drafter, fingerprint = build_edge_drafter(args.drafter, args.max_sessions, args.max_context,
                                              args.device, args.dtype, args.context_window)
    agent = DrafterAgent(args.cache, args.device_id, drafter, fingerprint, args.window,
                         args.chunk, token,
                         args.tls_ca, args.tls, args.max_sessions, tls_cert=args.tls_cert,
                         tls_key=args.tls_key, metrics=metrics, tree_width=args.tree_width,
                         pace=not args.no_pace)
    print(f"edgespec: drafter {args.device_id} ({drafter.name}) attaching to {args.cache}",
          file=sys.stderr, flush=True)
    def on_sigterm(*_):  # stop cleanly: exit 0
        agent.stop()
        _exit_if_stuck(STOP_GRACE_S)

    signal.signal(signal.SIGTERM, on_sigterm)
    from edgespec.runner.process_heap import freeze_startup_heap

    freeze_startup_heap()  # the drafter's model and libraries: out of the collector's passes
    try:
        agent.run()
    except KeyboardInterrupt:
        agent.stop()
    print(f"edgespec: drafter {args.device_id} stopped", file=sys.stderr, flush=True)
    return 0


def add_cluster_commands(sub) -> None:
    s = sub.add_parser("serve", help="run the verifier and the draft cache on one address")
    _add_server(s, ("verifier", "cache"))
    v = sub.add_parser("verifier", help="run the verifier alone (shares Redis with a cache)")
    _add_server(v, ("verifier",))
    c = sub.add_parser("cache", help="run the draft cache alone (shares Redis with a verifier)")
    _add_server(c, ("cache",))

    d = sub.add_parser("drafter", help="run an edge drafter attached to a draft cache")
    d.add_argument("--cache", default="127.0.0.1:50051", metavar="HOST:PORT",
                   help="the draft cache's gRPC address, as given to serve or cache --listen, "
                        "e.g. 192.168.1.10:50051; one without a port or with a scheme (http://) "
                        "is refused (default: %(default)s)")
    d.add_argument("--device-id", required=True, metavar="ID",
                   help="this device's name in the fleet: 1-64 letters, digits, '.', '_', '-', "
                        "starting with a letter or digit")
    d.add_argument("--drafter", metavar="SPEC", default="mag",
                   help="who drafts: mag | cacheback | mag+cacheback | model:PATH | "
                        "llamacpp:FILE.gguf | cascade:SPEC,SPEC,... (default: %(default)s)")
    d.add_argument("--window", metavar="W", type=int, default=None,
                   help="tokens drafted beyond the committed position, W (default: the cache's)")
    d.add_argument("--chunk", metavar="C", type=int, default=None,
                   help="most tokens per chunk, c; unless given, a statistical drafter (mag, "
                        "cacheback) sends all the room a session has in one chunk (default: "
                        "the cache's)")
    d.add_argument("--no-pace", action="store_true",
                   help="draft chunks of c tokens always; by default a drafter slower than the "
                        "verifier's step drafts shorter chunks, sized from the step interval "
                        "and its own speed so that each lands before the next step")
    d.add_argument("--max-sessions", type=int, default=8,
                   help="sessions this device drafts for at once (default: %(default)s)")
    d.add_argument("--max-context", type=int, default=EngineConfig().max_context,
                   help="tokens per session for model drafters (default: %(default)s)")
    d.add_argument("--context-window", metavar="N", type=int, default=None,
                   help="a llamacpp: drafter reads a session longer than N tokens as its first "
                        f"{LLAMACPP_HEAD} and its last N - {LLAMACPP_HEAD} when it opens, so that "
                        "a long prompt opens in N tokens' time; 0 reads every token (default: "
                        f"{LLAMACPP_WINDOW}, or 0 where --max-context is under twice that)")
    d.add_argument("--device", metavar="D", default="cpu",
                   help="where a model drafter runs (default: %(default)s)")
    d.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="a model drafter's dtype (default: %(default)s)")
    add_threads_arg(d)
    add_tree_width_arg(d)
    d.add_argument("--log-level", metavar="LEVEL", default="INFO",
                   help="DEBUG, INFO, WARNING or ERROR (default: %(default)s)")
    d.add_argument("--metrics-port", metavar="PORT", type=int, default=None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (default: none)")
    d.add_argument("--metrics-host", metavar="HOST", default="127.0.0.1",
                   help="the interface --metrics-port listens on: the board's LAN address or "
                        "0.0.0.0 for a remote Prometheus (default: %(default)s)")
    _add_security(d, server=False)
    d.set_defaults(func=cmd_drafter)
