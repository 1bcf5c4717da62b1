"""Command-line options every model-running command shares (the benchmarks and the role launchers
use the same options). The checks a role also runs live in the packages they check (a drafter
spec or model path in ``edgespec.drafters.spec_check``) and are re-exported here for the
commands."""

from __future__ import annotations

import argparse
import logging
import math
import sys

from edgespec.config import (DTYPE_NAMES, FILL_DRAFTS, ConfigError, EngineConfig, LooseParams,
                             PadParams, is_lossy, parse_verify)
from edgespec.drafters.spec_check import (  # noqa: F401 (the commands' API)
    check_drafter_arg, check_head_arg, check_model_arg)
from edgespec.runner.threads import default_threads, set_threads, threads_in_use  # noqa: F401 (the commands' API)


LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def positive_ints(text: str, option: str, what: str = "integers") -> list[int]:
    """An option's comma-separated integers, each >= 1 (ConfigError naming ``option`` and
    what it takes otherwise)."""
    from edgespec.config import ConfigError

    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{option} takes comma-separated {what}, got {text!r}") from None
    if not out or min(out) < 1:
        raise ConfigError(f"{option} needs {what} >= 1, got {text!r}")
    return out


def check_at_least(args, names: tuple[str, ...], low: int) -> None:
    """Each option ``names`` (argparse dests) that is set is at least ``low``, else one line."""
    from edgespec.config import ConfigError

    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < low:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")


def check_within(args, names: tuple[str, ...], low: float, high: float = math.inf) -> None:
    """Each option ``names`` (argparse dests) that is set is a finite number in [low, high]
    (NaN refused too), else one line."""
    from edgespec.config import ConfigError

    for name in names:
        value = getattr(args, name, None)
        if value is not None and not (low <= value <= high and value != math.inf):
            bounds = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
            raise ConfigError(f"--{name.replace('_', '-')} must be finite and {bounds}, got "
                              f"{value}")


def check_port(port: int | None, option: str) -> None:
    """A TCP port to listen on, if set (0: any free one)."""
    from edgespec.config import ConfigError

    if port is not None and not 0 <= port <= 65535:
        raise ConfigError(f"{option} must be in [0, 65535], got {port}")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL", "FATAL", "NOTSET")


def configure_logging(level: str = "INFO") -> None:
    """Logs of a role process (a command or a Ray actor) to stderr, one format for all."""
    from edgespec.config import ConfigError

    if level.upper() not in LOG_LEVELS:
        raise ConfigError(f"--log-level is one of {', '.join(LOG_LEVELS)} (any case), got "
                          f"{level!r}")
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format=LOG_FORMAT)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="M", default="default",
                   help="target model: 'default' (SmolLM2-135M-Instruct, pulled on first use), "
                        "a transformers directory or a .gguf file (default: %(default)s)")
    p.add_argument("--device", metavar="D", default="cpu",
                   help="cpu, cuda or cuda:N (default: %(default)s)")
    add_dtype_arg(p)


def add_dtype_arg(p: argparse.ArgumentParser, who: str = "") -> None:
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_NAMES],
                   help=f"{who}weights and activations dtype; auto: of bfloat16 and float32, "
                        "those whose exact (batch-invariant) path passes the start probes at the "
                        "thread count that serves, the faster as measured there (bfloat16 only "
                        "when clearly faster; measured once a machine setting and remembered in "
                        "the cache folder's dtype-auto.json, so every run serves the same; the "
                        "log says what was measured); a dtype that is not exact there is "
                        "refused (default: %(default)s)")


def add_engine_args(p: argparse.ArgumentParser, in_process: bool = True) -> None:
    """The engine's options; ``in_process``: the command runs its drafter in process (generate,
    bench, bench-net), not a server's boards, and takes ``--draft-thread``."""
    d = EngineConfig()
    p.add_argument("--max-draft", metavar="K", type=int, default=d.max_draft,
                   help="most draft tokens verified per step, k (default: %(default)s)")
    p.add_argument("--window", metavar="W", type=int, default=d.window,
                   help="most tokens drafted beyond the committed position, W "
                        "(default: %(default)s)")
    in_process_chunk = "; a statistical drafter (mag, cacheback) drafts all the room it has " \
        "at once" if in_process else ""
    p.add_argument("--chunk", metavar="C", type=int, default=d.chunk,
                   help=f"tokens per draft chunk, c{in_process_chunk} (default: %(default)s)")
    if in_process:
        p.add_argument("--draft-thread", action="store_true",
                       help="run a statistical drafter (mag, cacheback) in a drafting thread of "
                            "its own, as a board runs it (default: it drafts in the verifier's "
                            "thread as each step takes its drafts; model drafters always have "
                            "their thread)")
    p.add_argument("--draft-wait-ms", metavar="MS", type=float, default=None,
                   help="how long a step waits for a draft on its way, each session at most "
                        "as long as its draft is worth; a session whose board drafts anew "
                        "after a fix, as long as its draft is worth even past this (adaptive "
                        "planning; 0: no wait at all) (default: in process, the "
                        "drafter's own: 10 for mag, 100 for model drafters; a distributed "
                        "verifier: 10)")
    if not in_process:
        p.add_argument("--fill-drafts", choices=FILL_DRAFTS, default=d.fill_drafts,
                       help="the verifier's own cheap draft for a session whose board's draft "
                            "is empty when a step asks for one (the board reading a prompt, or "
                            "redrafting after a fix): mag (a suffix match over the session's "
                            "tokens, drafted on the server's core; at most the step's ask "
                            "and --tree-nodes tokens; not with --head or --auto), none, or "
                            "auto: mag unless --head or --auto (default: %(default)s)")
    p.add_argument("--late-after", metavar="N", type=int, default=d.late_after,
                   help="steps in a row whose draft deadline a drafter's drafts miss before its "
                        "sessions are verified without waiting for it, until its drafts come in "
                        "time again; 0: always wait the deadline (default: %(default)s)")
    p.add_argument("--prefill-budget", metavar="TOKENS", type=int, default=d.prefill_budget,
                   help="prompt tokens admitted between two verification steps: waiting requests "
                        "are prefilled together up to it, at least one a step, so that a burst "
                        "of arrivals delays running streams by a bounded prefill a step "
                        "(default: %(default)s)")
    p.add_argument("--max-context", type=int, default=d.max_context,
                   help="tokens per KV slot: a session's prompt + output + --max-draft + 1 (a "
                        "step's draft room) (default: %(default)s)")
    p.add_argument("--no-adaptive", action="store_true",
                   help="keep the verified draft length fixed at --max-draft")
    p.add_argument("--keep-drafting", action="store_true",
                   help="never rest the drafters on the steps' measured speed; without it a "
                        "batch whose whole steps (waits and commits included) commit fewer "
                        "tokens a second while its drafters draft than while they rest is "
                        "decoded without drafts, its drafters told to rest, and drafting is "
                        "measured again now and then (only speed depends on it)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay the target's steps of up to 128 sessions x 16 tokens (chains and "
                        "trees) as CUDA graphs captured at start (default: on with --device "
                        "cuda, where the fused Triton kernels run; --no-cuda-graphs runs the "
                        "same kernels eagerly, the same bits)")
    p.add_argument("--decode-ahead", action=argparse.BooleanOptionalAction, default=None,
                   help="where steps decode each session by one token (no draft to "
                        "verify or ask for: no boards, drafter or head, or drafters resting), "
                        "launch the next step's forward from its choices on the device before "
                        "reading them, "
                        "so the device decodes while the host commits and plans (default: on "
                        "with --device cuda; off on a CPU, where a forward cannot run beside "
                        "the host; the same outputs either way)")
    p.add_argument("--tree-nodes", type=int, default=d.tree_nodes,
                   help="most branch tokens of a token-tree draft verified per session per "
                        "step, within the batch's token budget; 0: chains only "
                        "(default: %(default)s)")
    p.add_argument("--head", default=None, metavar="DIR",
                   help="a trained draft head drafting inside the verifier from its own "
                        "forward's features, for every session, beside its drafter's drafts: a "
                        "head folder (made by edgespec distill), 'default' (the default model's "
                        "shipped head) or a shipped kind (eagle, specformer, ctc) (default: none)")
    p.add_argument("--learn", action="store_true",
                   help="with --head: fine-tune the head on this verifier's own traffic in a "
                        "low-priority background thread, swapping in a new version only when it "
                        "drafts better on recent held-out sessions (version and acceptance in "
                        "status and metrics)")
    p.add_argument("--auto", action="store_true",
                   help="choose for each session, step by step, which draft sources to verify "
                        "(its drafter's drafts, the head's, both or none) by the latency per "
                        "token its own measured acceptance and the measured forward cost give; "
                        "lossless whatever it picks (--drafter auto: mag+cacheback and the "
                        "shipped head, with this on)")


def add_tree_width_arg(p: argparse.ArgumentParser) -> None:
    """Token-tree drafting, for the commands that draft (``generate``, ``drafter``, ``deploy``,
    ``simulate``)."""
    p.add_argument("--tree-width", type=int, default=EngineConfig().tree_width,
                   help="draft token trees: each chunk carries up to N - 1 alternative "
                        "continuations (branches) beside its chain; 1: chains "
                        "(default: %(default)s)")


def add_verify_args(p: argparse.ArgumentParser) -> None:
    """The verification mode, for the commands that verify (``generate``, the servers)."""
    d, pad = LooseParams(), PadParams()
    p.add_argument("--verify", metavar="MODE", default="exact",
                   help="exact: output identical to the target model's; loose: FLy's lenient "
                        "acceptance, faster but LOSSY (output may differ); pad:DIR: PAD's "
                        "pivot classifier in DIR keeps draft tokens it judges harmless, also "
                        "LOSSY (pad:default: the classifier shipped for the default model) "
                        "(default: %(default)s)")
    p.add_argument("--pad-sigma", metavar="S", type=float, default=pad.sigma,
                   help="with --verify pad:DIR: keep a mismatching draft token whose pivot "
                        "probability is at most S (0: none, as exact verification) "
                        "(default: %(default)s)")
    p.add_argument("--pad-min-prob", metavar="P", type=float, default=pad.min_prob,
                   help="with --verify pad:DIR: ... and that the target gives at least "
                        "probability P (default: %(default)s)")
    p.add_argument("--loose-entropy", metavar="H", type=float, default=d.entropy,
                   help="with --verify loose: accept a mismatching draft token only where the "
                        "target's entropy exceeds this many nats (default: %(default)s)")
    p.add_argument("--loose-window", type=int, default=d.window,
                   help="with --verify loose: accept it only when the N draft tokens after it "
                        "all agree with the target; 0: the entropy gate alone "
                        "(default: %(default)s)")


LOSSY_WARNING = ("edgespec: warning: --verify {mode} is lossy: the output may differ from what "
                 "the target model alone would produce")


def warn_if_lossy(cfg: EngineConfig) -> None:
    """Say on stderr that an engine verifying in a lossy mode emits what the target alone may
    not."""
    if is_lossy(cfg.verify):
        mode = "loose" if cfg.verify == "loose" else f"pad:{cfg.pad.classifier}"
        print(LOSSY_WARNING.format(mode=mode), file=sys.stderr, flush=True)


def engine_config(args, max_sessions: int | None = None) -> EngineConfig:
    """The engine options of a command (those it lacks keep EngineConfig's defaults)."""
    d = EngineConfig()
    check_head_arg(getattr(args, "head", None))
    loose = LooseParams(getattr(args, "loose_entropy", d.loose.entropy),
                        getattr(args, "loose_window", d.loose.window))
    verify, classifier = parse_verify(getattr(args, "verify", d.verify))
    if verify == "pad" and classifier != "default":  # a folder: there, before a model loads
        from edgespec.pad.verify_rule import resolve_classifier_dir

        if not (resolve_classifier_dir(classifier) / "pad.json").exists():
            raise ConfigError(f"--verify pad:{classifier}: not a PAD classifier folder (no "
                              "pad.json; make one with edgespec pad-train)")
    pad = PadParams(classifier, getattr(args, "pad_sigma", d.pad.sigma),
                    getattr(args, "pad_min_prob", d.pad.min_prob))
    return EngineConfig(max_draft=getattr(args, "max_draft", d.max_draft),
                        window=args.window, chunk=args.chunk,
                        draft_inline=not getattr(args, "draft_thread", False),
                        draft_wait_ms=getattr(args, "draft_wait_ms", d.draft_wait_ms),
                        late_after=getattr(args, "late_after", d.late_after),
                        fill_drafts=getattr(args, "fill_drafts", d.fill_drafts),
                        max_context=getattr(args, "max_context", d.max_context),
                        adaptive=not getattr(args, "no_adaptive", False),
                        rest_drafters=not getattr(args, "keep_drafting", False),
                        # 0 is refused by name, not read as the default
                        max_sessions=d.max_sessions if max_sessions is None else max_sessions,
                        max_batch_tokens=getattr(args, "max_batch_tokens", d.max_batch_tokens),
                        prefill_budget=getattr(args, "prefill_budget", d.prefill_budget),
                        verify=verify, loose=loose, pad=pad,
                        tree_width=getattr(args, "tree_width", d.tree_width),
                        tree_nodes=getattr(args, "tree_nodes", d.tree_nodes),
                        head=getattr(args, "head", None) or d.head,
                        learn=getattr(args, "learn", False),
                        auto=getattr(args, "auto", False),
                        cuda_graphs=getattr(args, "cuda_graphs", None),
                        decode_ahead=getattr(args, "decode_ahead", None))


THREADS_DEFAULT = ("cores - 1, at least 1 (lowered at start where the model's dtype is not "
                   "batch-invariant at it); $EDGESPEC_THREADS overrides the default")
# a command that runs its verifier on --server-cpus (bench-edge, simulate)
SERVER_CORES_THREADS = "one a core of --server-cpus"


def add_threads_arg(p: argparse.ArgumentParser, default: str = THREADS_DEFAULT) -> None:
    p.add_argument("--threads", type=int, default=None,
                   help=f"torch CPU threads for the model (default: {default})")


PLOT_FOLDERS = {"simulate"}  # commands whose --plot names a folder of pictures


def check_output_files(args) -> None:
    """The files a command writes its results to (``--json``, a file ``--plot``), checked
    before it starts, not after a run of minutes: not a folder, and the nearest folder of it
    that exists can be written in."""
    import tempfile
    from pathlib import Path

    from edgespec.config import ConfigError

    for dest, option in (("json_out", "--json"), ("json", "--json"), ("plot", "--plot")):
        value = getattr(args, dest, None)
        if not isinstance(value, str) or not value:
            continue  # unset, or a switch (status --json)
        path = Path(value)
        if option == "--plot" and getattr(args, "cmd", None) in PLOT_FOLDERS:
            if path.exists() and not path.is_dir():
                raise ConfigError(f"--plot {value}: a file, not a folder")
            continue  # made by the command; its pictures are PNGs
        if option == "--plot" and path.suffix and path.suffix.lower() not in _picture_suffixes():
            raise ConfigError(f"--plot {value}: a picture is one of "
                              f"{', '.join(sorted(_picture_suffixes()))}")
        if path.is_dir():
            raise ConfigError(f"{option} {value}: a folder, not a file")
        try:
            if path.exists():  # written over: open it as the command will (not emptied here)
                with open(path, "a"):
                    pass
                continue
            folder = path.parent.absolute()
            while not folder.exists() and folder != folder.parent:
                folder = folder.parent  # the command makes the rest: the nearest that is
            with tempfile.TemporaryFile(dir=folder):  # written to once (a permission check
                pass  # alone would pass anything as root)
        except OSError as e:
            raise ConfigError(f"{option} {value}: cannot be written: "
                              f"{e.strerror or e}") from None


def _picture_suffixes() -> set[str]:
    """The file suffixes matplotlib saves pictures as (its own list where it is installed)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return {".png", ".pdf", ".svg", ".jpg", ".jpeg"}
    return {f".{s}" for s in FigureCanvasBase.get_supported_filetypes()}
