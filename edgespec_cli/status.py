"""``edgespec status``: what a running verifier and its fleet are doing, from its Status RPC."""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_status_command(sub) -> None:
    s = sub.add_parser("status", help="show the verifier's sessions, KV slots, throughput and "
                                      "attached drafters")
    s.add_argument("--address", default="127.0.0.1:50051", metavar="HOST:PORT",
                   help="the verifier's gRPC address, as given to serve or verifier --listen "
                        "(e.g. 192.168.1.10:50051; default: %(default)s)")
    s.add_argument("--watch", action="store_true", help="refresh every --interval seconds")
    s.add_argument("--interval", metavar="S", type=float, default=2.0,
                   help="seconds between two refreshes with --watch (default: %(default)s)")
    s.add_argument("--json", action="store_true", help="print one JSON object per refresh")
    s.add_argument("--auth-token", metavar="TOKEN", default=None,
                   help="shared token (default: $EDGESPEC_AUTH_TOKEN)")
    s.add_argument("--tls", action="store_true", help="connect with TLS (system roots)")
    s.add_argument("--tls-ca", metavar="FILE", help="PEM CA certificate to trust (implies --tls)")
    s.add_argument("--tls-cert", metavar="FILE",
                   help="PEM client certificate, for a verifier that requires one "
                        "(--tls-client-ca; implies --tls; needs --tls-key)")
    s.add_argument("--tls-key", metavar="FILE", help="PEM private key for --tls-cert")
    s.add_argument("--timeout", metavar="S", type=float, default=10.0,
                   help="seconds to wait for the verifier (default: %(default)s)")
    s.set_defaults(func=cmd_status)


def render(st: dict) -> str:
    lines = [f"model {st['model']} ({st.get('dtype') or 'dtype not reported'}, "
             f"edgespec {st['version']}), "
             + ("healthy" if st["healthy"] else
                f"NOT healthy ({st.get('unhealthy_reason') or 'no reason given'})"),
             f"sessions: {st['active_sessions']} active, {st['queued_sessions']} queued; "
             f"KV slots free: {st['free_kv_slots']}/{st['kv_slots']}; "
             f"throughput (last minute): {st['tokens_per_s_last_minute']:.1f} tok/s"]
    cost = _cost(st.get("cost") or {})
    if cost:
        lines.append(cost)
    h = st.get("head") or {}
    if h.get("kind"):
        drafted, accepted = int(h.get("draft_tokens", 0)), int(h.get("accepted_tokens", 0))
        lines.append(f"draft head: {h['kind']} from {h.get('source') or '?'}, version "
                     f"{h.get('version', 0)}, held-out {h.get('held_out_tokens_per_step', 0):.2f} "
                     f"tokens/step; accepted {accepted}/{drafted} proposed"
                     + (f"; learning ({int(h.get('buffered_tokens', 0))} tokens buffered)"
                        if h.get("learning") else ""))
    r = st.get("runner") or {}
    if r.get("kernels"):
        attention = f" ({r['attention']} attention)" if r.get("attention") else ""
        lines.append(f"runner: {r['kernels']} kernels{attention} on {r.get('device') or '?'}"
                     + _graphs(r))
        if r.get("kernel_set"):
            lines.append(f"kernel set {r.get('kernel_set_description') or r['kernel_set']}")
    lines.append("")
    head = ("device", "drafter", "attached", "sessions", "acc. rate", "acc. length", "last seen",
            "link")
    rows = [head] + [(d["device_id"], d["draft_model"], "yes" if d["attached"] else "no",
                      f"{d['sessions']}/{d['max_sessions'] or '-'}",
                      # counted as its sessions end: none ended yet is no figure, not 0 (an
                      # older server or replica says no finished_drafts: its rate is read)
                      *((f"{d['acceptance_rate']:.2f}", f"{d['mean_acceptance_length']:.2f}")
                        if int(d.get("finished_drafts") or 0) or d['acceptance_rate']
                        else ("-", "-")),
                      "now" if d["attached"] else f"{d['last_seen_s']:.0f}s ago", _link(d))
                     for d in st["drafters"]]
    if len(rows) == 1:
        return "\n".join(lines + ["no drafters registered"])
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def _cost(c: dict) -> str:
    """The server's cost since it started: CPU ms a committed token, tokens a verification
    forward, draft tokens verified and the share wasted."""
    tokens, forwards = int(c.get("committed_tokens") or 0), int(c.get("forwards") or 0)
    if not tokens or not forwards:
        return ""
    cpu_s = float(c.get("cpu_s") or 0.0)
    drafted, accepted = int(c.get("draft_tokens") or 0), int(c.get("accepted_tokens") or 0)
    out = "server cost since start: " + \
        (f"{1000 * cpu_s / tokens:.1f} CPU ms a committed token, " if cpu_s else "") + \
        f"{tokens / forwards:.2f} tokens a forward ({tokens} tokens in {forwards} forwards)"
    if drafted:
        out += (f"; draft tokens verified {drafted}, wasted {drafted - accepted} "
                f"({100 * (drafted - accepted) / drafted:.0f}%)")
    return out


def _graphs(r: dict) -> str:
    """The runner's CUDA graphs: captured, or why not (steps then run eagerly)."""
    buckets = int(r.get("graph_buckets") or 0)
    if not buckets:
        return ", no CUDA graphs"
    if r.get("graphs_failed"):
        return f", CUDA graphs FAILED (steps run eagerly): {r['graphs_failed']}"
    return (f", CUDA graphs {int(r.get('graphs_captured') or 0)}/{buckets} captured in "
            f"{float(r.get('graphs_capture_s') or 0):.1f} s, "
            f"{int(r.get('graph_replays') or 0)} steps replayed")


def _link(d: dict) -> str:
    """A drafter's link as the verifier's steps saw it: late (not waited for) or waited for, the
    deadlines its drafts missed, and of its sessions' steps those whose draft was ready and
    those that verified a draft."""
    missed = int(d.get("drafts_missed") or 0)
    state = "LATE (not waited for)" if d.get("late") else "waited for"
    out = f"{state}, {missed} deadlines missed" if missed else state
    steps = int(d.get("session_steps") or 0)
    if steps:
        ready, verified = int(d.get("ready_drafts") or 0), int(d.get("verified_drafts") or 0)
        out += (f"; drafts ready in {ready}/{steps} session steps "
                f"({100 * ready / steps:.0f}%), verified in {verified} "
                f"({100 * verified / steps:.0f}%)")
    return out


def cmd_status(args: argparse.Namespace) -> int:
    import grpc

    import edgespec
    from edgespec.config import ConfigError

    for name in ("interval", "timeout"):
        value = getattr(args, name)
        if not value > 0:  # NaN too
            raise ConfigError(f"--{name} takes seconds > 0, got {value}")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigError("a client certificate needs both --tls-cert and --tls-key")
    from edgespec.wire.convert import resolve_token
    from edgespec.wire.reachability import check_address

    check_address(args.address, "--address")
    token = resolve_token(args.auth_token)  # refused where no header can carry it
    try:
        client = edgespec.Client(args.address, token=token, tls_ca=args.tls_ca, tls=args.tls,
                                 tls_cert=args.tls_cert, tls_key=args.tls_key,
                                 timeout=args.timeout)
    except edgespec.InvalidRequest as e:  # a TLS file it cannot read, say: an option to fix
        raise ConfigError(str(e)) from None
    with client:
        while True:
            try:
                st = client.status()
            except edgespec.Unauthenticated as e:  # a fixable mistake: waiting cannot end it
                raise ConfigError(f"{args.address} refused the call: {e}; give the server's "
                                  "token with --auth-token or $EDGESPEC_AUTH_TOKEN") from None
            except edgespec.EdgespecError as e:
                why = str(e)
                if e.code == grpc.StatusCode.UNIMPLEMENTED:  # no Verifier service there
                    why = ("it answers gRPC but serves no verifier (an edgespec cache's "
                           "port? status reads a verifier's: edgespec serve or edgespec "
                           "verifier)")
                print(f"edgespec: error: cannot read the status of {args.address}: {why}",
                      file=sys.stderr, flush=True)
                if not args.watch:
                    return 1
                time.sleep(args.interval)  # watching: keep trying until interrupted
                continue
            if args.json:
                print(json.dumps(st), flush=True)
            else:
                if args.watch and sys.stdout.isatty():  # a pipe or a file: one after another
                    sys.stdout.write("\033[H\033[2J")
                print(render(st), flush=True)
            if not args.watch:
                return 0
            time.sleep(args.interval)
