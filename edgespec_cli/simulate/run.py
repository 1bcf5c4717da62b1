"""Running a simulated fleet: real roles as Ray actors, emulated devices, real clients.

One run = one batching mode and one device count: a draft cache (embedded Redis), one verifier
(KV slots = the device count with batching on, 1 with batching off: one session per forward),
N drafter actors each emulating its device profile (a ``LinkProxy`` on its gRPC link to the
cache, its drafting slowed down by the profile's factor), and N client threads in this process,
one per device, each talking to the verifier through its own ``LinkProxy`` with the device's
link and pinning its sessions to its device's drafter. The mode ``server-only`` is the baseline
a user without boards runs: no drafter at all, the same clients and requests, the verifier
decoding the sessions batched, one token a session a step.

With a ``CpuSplit`` the cache, its Redis and the verifier run on the server's cores and the
drafters on the boards' (``deployment.cpu_share``; ``simulate`` puts its own process, and with
it these clients, on the boards' cores too); each side's CPU seconds over
the run are recorded, and each drafter's loop counts (chunks sent, tokens kept and discarded).

Requests are Spec-Bench first turns through the model's chat template, dealt to devices in turn
(the same requests in the same order for every mode). Closed loop by default (a device sends its
next request when the last one finished); ``rate`` makes it open loop (requests arrive at that
rate overall, evenly spaced, whether or not earlier ones finished).
"""

from __future__ import annotations

import logging
import secrets
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..deployment.cpu_share import CpuSplit
from ..deployment.device_profiles import DeviceProfile
from ..deployment.cluster import FleetError
from ..deployment.placement import RoleActors

from .records import SERVER_ONLY, RequestRecord, RunRecord

if TYPE_CHECKING:
    from ..deployment.link_emulation import LinkProxy
    from ..deployment.link_faults import FaultyLink

log = logging.getLogger("edgespec.simulate")


@dataclass
class Prompt:
    category: str
    ids: list[int]


@dataclass
class SimSettings:
    model: str
    max_new_tokens: int = 64
    requests: int | None = None  # requests in all (default: 2 per device)
    duration_s: float | None = None  # instead: send until this much time has passed
    rate: float | None = None  # open loop, requests per second over the fleet
    threads: int | None = None  # the verifier's torch threads
    dtype: str = "auto"  # the verifier's
    device: str = "cpu"  # the verifier's
    seed: int = 0
    timeout_s: float = 900.0
    engine: dict = field(default_factory=dict)  # EngineConfig fields for the verifier
    tree_width: int = 1  # the drafters send token trees of this width (1: chains)
    # a partition schedule (``link_faults.parse_fault_schedule``), seconds from the first request
    link_faults: list = field(default_factory=list)
    cpus: CpuSplit | None = None  # the server's and the boards' cores (None: shared)


REATTACH_WAIT_S = 30.0  # how long a device's request waits for its reconnecting board


def device_ids(profiles: list[DeviceProfile]) -> list[str]:
    return [f"dev{i:02d}-{p.name}" for i, p in enumerate(profiles)]


def deal(n_requests: int, n_devices: int) -> list[list[int]]:
    """Request indices for each device: request k goes to device k mod n (request k asks
    prompt k mod len(prompts))."""
    out: list[list[int]] = [[] for _ in range(n_devices)]
    for k in range(n_requests):
        out[k % n_devices].append(k)
    return out


def ray_reason(e: BaseException) -> str:
    """A Ray error in a line: an actor's death says what ended it on the lines after its
    first one and its tab-indented details (the last alone, "never ran", does not say why)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines()
             if ln.strip() and not ln.startswith("\t")]
    said = " ".join(lines[1:] if len(lines) > 1 else lines)
    return said[:400] or type(e).__name__


class FleetRun:
    """Place the roles for one run, drive the clients, collect the records, remove the roles."""

    def __init__(self, roles: RoleActors, settings: SimSettings, profiles: list[DeviceProfile],
                 batching: str, prompts: list[Prompt], progress=None):
        self.roles, self.s, self.profiles = roles, settings, profiles
        self.batching, self.prompts = batching, prompts
        self.progress = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.records: list[RequestRecord] = []
        self._lock = threading.Lock()
        self._actors: list[Any] = []  # Ray actor handles
        self._proxies: list[LinkProxy] = []
        self._faulty: list[FaultyLink] = []  # the clients' side of their links
        self._applied: list[dict] = []
        self._tmp = tempfile.mkdtemp(prefix="edgespec-sim-")

    def _place(self) -> tuple[str, Any]:  # the verifier's address and Ray actor
        import ray

        from ..deployment import cluster, placement

        head = cluster.head_node(cluster.nodes())
        split = self.s.cpus
        t0 = time.monotonic()

        def said(what: str) -> None:  # a fleet takes seconds to start: say what it is at
            self.progress(f"simulate:   {what} ({time.monotonic() - t0:.0f} s)")

        cache = placement.place(self.roles.cache, head).remote(
            0, self._tmp, secrets.token_urlsafe(16), max_drafters=len(self.profiles) + 8,
            cpus=split.server if split else None)
        self._actors.append(cache)
        info = ray.get(cache.info.remote(), timeout=self.s.timeout_s)
        said(f"the draft cache and its Redis are up; the verifier loads the model "
             f"({self.s.model}) and checks its kernels")
        slots = 1 if self.batching == "off" else len(self.profiles)
        gpu = self.s.device.startswith("cuda")
        verifier = placement.place(self.roles.verifier, head, num_gpus=1 if gpu else 0).remote(
            0, info["redis_url"], model=self.s.model, max_sessions=slots,
            threads=self.s.threads, dtype=self.s.dtype, device=self.s.device,
            max_queue=4 * len(self.profiles) + 16,
            engine=self.s.engine, cpus=split.server if split else None)
        self._actors.append(verifier)
        if self.batching == SERVER_ONLY:
            address = ray.get(verifier.info.remote(), timeout=self.s.timeout_s)["address"]
            said("the verifier serves (no board: the server alone)")
            return address, verifier
        for i, (dev, p) in enumerate(zip(device_ids(self.profiles), self.profiles)):
            d = placement.place(self.roles.drafter, head).remote(
                info["address"], dev, p.drafter, threads=1, link=p.link,
                compute_slowdown=p.compute_slowdown, tokens_per_s=p.tokens_per_s,
                profile=p.name,
                link_seed=self.s.seed * 10_000 + i, tree_width=self.s.tree_width,
                cpus=split.boards if split else None)
            self._actors.append(d)
        address = ray.get(verifier.info.remote(), timeout=self.s.timeout_s)["address"]
        said(f"the verifier serves; {len(self.profiles)} drafter(s) attaching")
        attached = ray.get([d.wait_attached.remote(self.s.timeout_s) for d in self._actors[2:]])
        if not all(attached):
            raise FleetError(f"{attached.count(False)} drafter(s) did not attach within "
                             f"{self.s.timeout_s:.0f} s")
        said("every drafter attached")
        return address, verifier

    def run(self) -> RunRecord:
        from ray.exceptions import RayError

        from ..deployment.link_emulation import LinkProxy
        from ..deployment.link_faults import FaultyLink

        n = len(self.profiles)
        self.progress(f"simulate: batching {self.batching}, {n} device(s): starting the fleet")
        done = threading.Event()
        try:
            try:
                address, verifier = self._place()
            except (RayError, TimeoutError) as e:
                raise FleetError(f"the fleet for batching {self.batching} with {n} device(s) "
                                 f"did not start: {ray_reason(e)}") from None
            for i, p in enumerate(self.profiles):  # one by one: each is stopped if one fails
                self._proxies.append(
                    LinkProxy(address, p.link, seed=self.s.seed * 10_000 + 5_000 + i).start())
                self._faulty.append(FaultyLink(self._proxies[-1].address).start())
            total = self.s.requests or 2 * n
            plan = deal(total if self.s.duration_s is None else 100_000, n)
            cpu_before = self._cpu_seconds()
            started = time.monotonic()
            stop_at = started + self.s.duration_s if self.s.duration_s else None
            threading.Thread(target=self._report_progress, args=(started, total, done),
                             daemon=True).start()
            if self.s.link_faults:
                threading.Thread(target=self._break_links, args=(started, done),
                                 daemon=True).start()
            with ThreadPoolExecutor(max(n, 1) * (4 if self.s.rate else 1)) as pool:
                if self.s.rate:
                    self._open_loop(pool, plan, started, stop_at)
                else:
                    list(pool.map(lambda i: self._closed_loop(i, plan[i], stop_at), range(n)))
            ended = time.monotonic()
            import ray

            cpu = self._cpu_use(cpu_before, self._cpu_seconds())
            batches = ray.get(verifier.batch_sizes.remote(), timeout=60)
            steps = ray.get(verifier.step_totals.remote(), timeout=60)
            boards = {dev: ray.get(a.loop_counts.remote(), timeout=60)
                      for dev, a in zip(device_ids(self.profiles), self._actors[2:])}
            return RunRecord(self.batching, n, started, ended, list(self.records),
                             {int(k): v for k, v in batches.items()},
                             max_sessions=1 if self.batching == "off" else n,
                             step_totals=steps, link_faults=list(self._applied), cpu=cpu,
                             boards=boards)
        finally:
            done.set()
            self.close()

    def _cpu_seconds(self) -> dict[str, float | None]:
        """CPU seconds so far of the server's side (cache with Redis, verifier), of its two
        parts apart, and of the boards' (every drafter)."""
        import ray

        secs = ray.get([a.cpu_seconds.remote() for a in self._actors], timeout=60)

        def total(xs):
            return None if any(x is None for x in xs) else float(sum(xs))

        return {"server": total(secs[:2]), "boards": total(secs[2:]) if secs[2:] else 0.0,
                "cache": secs[0], "verifier": secs[1]}

    def _cpu_use(self, before: dict, after: dict) -> dict:
        """Each side's cores and CPU seconds over the run; the server's also by its parts
        (the verifier; the cache with its Redis), which share its cores."""
        def spent(key: str) -> float | None:
            b, a = before[key], after[key]
            return None if a is None or b is None else a - b

        split = self.s.cpus
        out: dict = {"split": split.describe() if split else None}
        for side in ("server", "boards"):
            cores = len(getattr(split, side)) if split else None
            out[side] = {"cpus": cores, "cpu_s": spent(side)}
        out["server"].update(verifier_cpu_s=spent("verifier"), cache_cpu_s=spent("cache"))
        return out

    def _break_links(self, started: float, done: threading.Event) -> None:
        """Apply the partition schedule: each fault at its time on its links, healed after its
        duration (the run may end first: what was applied is recorded)."""
        timeline = []
        for f in self.s.link_faults:
            timeline.append((f.at_s, f, True))
            if f.for_s:
                timeline.append((f.at_s + f.for_s, f, False))
        for at, f, breaking in sorted(timeline, key=lambda e: e[0]):
            if done.wait(max(0.0, started + at - time.monotonic())):
                return
            links = self._links_here(f.links)
            if links is None:  # the server alone: no board, so no drafter's link to break
                if breaking:
                    self.progress(f"simulate: {f.describe()}: no board's link in this run")
                continue
            devices = range(len(self.profiles)) if f.device is None else [f.device]
            for dev in devices:
                if dev >= len(self.profiles):
                    continue
                try:
                    self._set_fault(dev, links, f.fault if breaking else None)
                except Exception as e:  # an actor gone: the run goes on, the log says
                    log.warning("link fault on device %d failed: %s", dev, e)
            now = time.monotonic() - started
            if breaking:
                said = f.describe() if links == f.links else \
                    f"{f.describe()}: the clients' links (no board in this run)"
                self.progress(f"simulate: {said} (at {now:.1f} s)")
                self._applied.append({"fault": f.fault, "links": links, "device": f.device,
                                      "at_s": now, "healed_at_s": None})
            else:
                for rec in self._applied:
                    if rec["fault"] == f.fault and rec["device"] == f.device and \
                            rec["links"] == links and rec["healed_at_s"] is None:
                        rec["healed_at_s"] = now
                self.progress(f"simulate: healed {f.fault} (at {now:.1f} s)")

    def _links_here(self, links: str) -> str | None:
        """The links a fault on ``links`` breaks in this run: the server alone
        (``server-only``) has its clients' links and no board's, so ``all`` breaks the
        clients' and ``drafters`` none (None)."""
        if self.batching != SERVER_ONLY:
            return links
        return None if links == "drafters" else "clients"

    def _set_fault(self, dev: int, links: str, fault: str | None) -> None:
        if links in ("clients", "all"):
            faulty = self._faulty[dev]
            faulty.heal() if fault is None else faulty.apply(fault)
        if links in ("drafters", "all"):
            import ray

            ray.get(self._actors[2 + dev].link_fault.remote(fault), timeout=60)

    def _closed_loop(self, dev: int, indices: list[int], stop_at: float | None) -> None:
        for k in indices:
            if stop_at is not None and time.monotonic() >= stop_at:
                return
            self._request(dev, k)

    def _open_loop(self, pool, plan, started: float, stop_at: float | None) -> None:
        order = sorted((k, dev) for dev, ks in enumerate(plan) for k in ks)
        futures = []
        for k, dev in order:
            due = started + k / self.s.rate
            if stop_at is not None and due >= stop_at:
                break
            time.sleep(max(0.0, due - time.monotonic()))
            futures.append(pool.submit(self._request, dev, k, due))
        for f in futures:
            f.result()

    def _request(self, dev: int, k: int, sent_at: float | None = None) -> None:
        """One request; ``sent_at``: when it was due (open loop: waiting for a free client
        thread counts in its latency). A device whose own board is reconnecting (the verifier
        answers that its drafter is not attached) sends again until the board is back, at most
        ``REATTACH_WAIT_S``: the wait counts in the request's latency."""
        from edgespec.client import PreconditionFailed

        prompt = self.prompts[k % len(self.prompts)]
        profile = self.profiles[dev]
        rec = RequestRecord(device_ids(self.profiles)[dev], profile.name, prompt.category,
                            prompt.ids, sent_at or time.monotonic())
        pinned = None if self.batching == SERVER_ONLY else rec.device_id
        give_up = time.monotonic() + REATTACH_WAIT_S
        try:
            while True:
                try:
                    self._stream(dev, prompt, pinned, rec)
                    break
                except PreconditionFailed as e:
                    if rec.tokens or "not attached" not in str(e) or \
                            time.monotonic() > give_up:
                        raise
                    time.sleep(0.1)
        except Exception as e:  # one failed request is a figure of the run, not its end
            rec.error = f"{type(e).__name__}: {e}"[:300]
        with self._lock:
            self.records.append(rec)

    def _stream(self, dev: int, prompt: Prompt, pinned: str | None, rec: RequestRecord) -> None:
        from edgespec.client import Client

        with Client(self._faulty[dev].address, timeout=self.s.timeout_s) as c:
            rec.read(c.stream(prompt_ids=prompt.ids, raw=True,
                              max_new_tokens=self.s.max_new_tokens, device_id=pinned))
            rec.session_id = c.last_session_id or ""

    def _report_progress(self, started: float, total: int, done: threading.Event) -> None:
        while not done.wait(5.0):
            with self._lock:
                finished = len(self.records)
                tokens = sum(len(r.tokens) for r in self.records)
            elapsed = time.monotonic() - started
            of = f"/{total}" if self.s.duration_s is None else ""
            self.progress(f"simulate: batching {self.batching}, {len(self.profiles)} device(s): "
                          f"{finished}{of} requests done, {tokens} tokens, "
                          f"{tokens / elapsed:.1f} tok/s, {elapsed:.0f} s")

    def close(self) -> None:
        import ray

        for f in self._faulty:
            f.stop()
        for p in self._proxies:
            p.stop()
        for a in self._actors:
            try:
                ray.get(a.stop.remote(), timeout=15)
            except Exception:
                pass
            ray.kill(a, no_restart=True)
        self._actors, self._proxies, self._faulty = [], [], []
        shutil.rmtree(self._tmp, ignore_errors=True)
