"""The drafter role as a Ray actor (``edgespec deploy``, ``edgespec simulate``).

The actor runs the same ``DrafterAgent`` as ``edgespec drafter``, in a thread of the actor's
process, attached to the draft cache over gRPC. Ray restarts a failed actor by calling
``__init__`` again with the same arguments, so a restarted drafter attaches again by itself.

In a simulated fleet the actor also emulates its device: its link to the cache goes through a
``LinkProxy`` in the actor (the drafter's real gRPC traffic is delayed, jittered, throttled and
suffers retransmissions) and its drafting is slowed down by the profile's factor.
"""

from __future__ import annotations

import logging
import os
import threading

from drafter_node.edge_drafter import build_edge_drafter, runs_torch
from edgespec.config import ConfigError
from edgespec_cli.cli_args import configure_logging, set_threads

from .device_emulation import SlowedDrafter

log = logging.getLogger("edgespec.drafter")


class DrafterActor:
    """One edge drafter. ``link`` (a ``LinkProfile``) and ``compute_slowdown`` emulate a device
    (simulation); without them the actor is a plain drafter on its board. ``link_seed``: the
    emulated link's jitter and loss draws. ``cpus``: confine it to these cores."""

    def __init__(self, cache: str, device_id: str, drafter: str = "mag", threads: int = 1,
                 auth_token: str | None = None, max_sessions: int = 8, link=None,
                 compute_slowdown: float = 1.0, tokens_per_s: float | None = None,
                 profile: str = "",
                 link_seed: int | None = None, tree_width: int = 1, device: str = "cpu",
                 cpus: tuple[int, ...] | None = None):
        from drafter_node.agent import DrafterAgent

        from edgespec.runner.kernel_caches import bound_kernel_caches

        from .cpu_share import pin_process

        bound_kernel_caches()  # a model drafter's products, as the commands bound theirs
        pin_process(cpus)  # a simulated board's cores, apart from the server's
        configure_logging()
        try:
            uses_torch = runs_torch(drafter)
        except ConfigError:  # a wrong spec: the build below says so, as before
            uses_torch = True
        set_threads(threads, torch_too=uses_torch)
        self.cache, self.device_id, self.spec, self.profile = cache, device_id, drafter, profile
        self.proxy = self.faults = None
        address = cache
        if link is not None:
            from .link_emulation import LinkProxy
            from .link_faults import FaultyLink

            self.proxy = LinkProxy(cache, link, seed=link_seed).start()
            # the board's side of its emulated link, where simulate's partition schedule acts
            self.faults = FaultyLink(self.proxy.address).start()
            address = self.faults.address
        self.error: str | None = None
        self.agent = self.thread = None
        self.slowed: SlowedDrafter | None = None
        try:  # a drafter that cannot be built says why (info) instead of restarting forever
            built, fingerprint = build_edge_drafter(drafter, max_sessions, device=device)
            if compute_slowdown != 1 or tokens_per_s:
                built = self.slowed = SlowedDrafter(built, compute_slowdown, tokens_per_s)
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            log.error("drafter %s cannot start: %s", device_id, self.error)
            return
        self.agent = DrafterAgent(address, device_id, built, fingerprint, token=auth_token,
                                  max_sessions=max_sessions, tree_width=tree_width)
        self.thread = threading.Thread(target=self._run, daemon=True, name="drafter-agent")
        self.thread.start()

    def _run(self) -> None:
        assert self.agent is not None  # the thread starts once the agent is built
        try:
            self.agent.run()
        except Exception as e:  # refused for good (a wrong token, a tokenizer mismatch)
            self.error = f"{type(e).__name__}: {e}"
            log.error("drafter %s stopped: %s", self.device_id, self.error)

    def info(self) -> dict:
        from .cluster import where

        return {"role": "drafter", **where(), "pid": os.getpid(),
                "device_id": self.device_id, "drafter": self.spec, "profile": self.profile,
                "cache": self.cache,
                "attached": self.agent is not None and self.agent.connected.is_set(),
                "attaches": self.agent.attaches if self.agent else 0, "error": self.error,
                "link": self.proxy.address if self.proxy else None}

    def cpu_seconds(self) -> float | None:
        """CPU seconds of this process so far."""
        from .cpu_share import process_tree_cpu_s

        return process_tree_cpu_s()

    def loop_counts(self) -> dict:
        """The drafting loop's counts (``edgespec.drafters.chunk_pace.LoopCounts``) as a dict:
        chunks and tokens drafted, sent, kept across fixes, discarded, dropped by reason."""
        if self.agent is None:
            return {}
        with self.agent.cond:
            c = self.agent.book.counts
            out = {**vars(c), "dropped": dict(c.dropped)}
        if self.slowed is not None and self.slowed.tokens_per_s:
            out["slower_than_published"] = self.slowed.slower_than_published
        return out

    def link_fault(self, fault: str | None) -> None:
        """Break the emulated link (a ``link_faults.FAULTS`` name), or heal it (None)."""
        if self.faults is not None:
            if fault is None:
                self.faults.heal()
            else:
                self.faults.apply(fault)

    def wait_attached(self, timeout: float) -> bool:
        return self.agent is not None and self.agent.connected.wait(timeout)

    def stop(self) -> None:
        if self.agent is not None:
            self.agent.stop()
            assert self.thread is not None  # started right after the agent was built
            self.thread.join(10)
        if self.faults is not None:
            self.faults.stop()
        if self.proxy is not None:
            self.proxy.stop()
