"""Emulated edge devices for ``edgespec simulate``: how fast each drafts, and its network link.

A ``DeviceProfile`` names a drafter, a compute slowdown (the device's drafting takes this many
times as long as on the machine running the simulation: after each draft step of duration t the
emulated drafter sleeps ``(compute_slowdown - 1) * t``) and a ``LinkProfile`` (applied to the
device's real gRPC traffic by ``link_emulation.LinkProxy``).

The shipped numbers are approximations built from public figures, cited next to each profile.
The slowdowns assume the simulating machine has a current desktop/server x86 core; on a slower
or loaded machine every emulated device is slower than its real counterpart by that much.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import cycle, islice

from edgespec.config import ConfigError
from .link_emulation import LinkProfile


def extra_compute_s(slowdown: float, step_s: float, tokens: int = 0,
                    tokens_per_s: float | None = None) -> float:
    """What a device ``slowdown`` times slower adds to a draft step of ``step_s`` seconds; a
    device that drafts ``tokens_per_s`` (a published speed) takes at least ``tokens`` /
    ``tokens_per_s`` for the step's ``tokens`` (a machine slower than that cannot be sped up:
    nothing is added)."""
    extra = (slowdown - 1) * max(0.0, step_s)
    if tokens_per_s:
        extra = max(extra, tokens / tokens_per_s - max(0.0, step_s))
    return max(0.0, extra)


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    drafter: str  # a drafter spec for parse_drafter_spec, e.g. "mag"
    compute_slowdown: float  # >= 1: drafting takes this many times as long as here
    link: LinkProfile
    description: str = ""
    # a published drafting speed: each draft step takes at least its tokens / this (the device
    # is then as fast as published wherever this machine is faster; None: the slowdown alone)
    tokens_per_s: float | None = None

    def __post_init__(self) -> None:
        if not self.name or "," in self.name:
            raise ConfigError(f"device profile name must be non-empty without commas, "
                              f"got {self.name!r}")
        s = self.compute_slowdown
        if not (isinstance(s, (int, float)) and math.isfinite(s) and s >= 1):
            raise ConfigError(f"compute_slowdown must be a finite number >= 1, got {s!r}")
        t = self.tokens_per_s
        if t is not None and not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise ConfigError(f"tokens_per_s must be a finite number > 0, got {t!r}")

    def extra_compute_s(self, step_s: float, tokens: int = 0) -> float:
        """How long to sleep after a draft step of ``tokens`` that took ``step_s`` seconds
        here."""
        return extra_compute_s(self.compute_slowdown, step_s, tokens, self.tokens_per_s)


PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (
    # For tests and a baseline: drafts at this machine's speed over a link that adds nothing.
    DeviceProfile("local", "mag", 1.0, LinkProfile(rtt_ms=0),
                  "this machine's speed, no added network delay"),
    # Compute: Raspberry Pi 5 (4x Cortex-A76 @ 2.4 GHz) scores 748 single-core in Geekbench 6
    # (Jeff Geerling, github.com/geerlingguy/sbc-reviews issue #21, Geekbench browser result
    # 2808487). Current desktop/server x86 cores score roughly 2,000-3,000 in the same test
    # (ballpark from public Geekbench listings, not one cited result): 2.7-4x, so 3. Benchmarks
    # disagree: sysbench's prime test puts the Pi 5 (2737 events/s, leoncode.co.uk "Raspberry
    # Pi CPU Benchmarks") level with an i7-12700K (2452, discuss.python.org topic 56229).
    # Link: the board on Wi-Fi to a verifier on the same LAN. Sui et al., "Characterizing and
    # Improving WiFi Latency in Large-Scale Operational Networks" (MobiCom 2016): the Wi-Fi
    # hop's latency has a median around 3 ms, p90 ~20 ms, p99 ~250 ms. rtt 5 ms = that 3 ms
    # plus ~2 ms of wired LAN and server stack (assumed); jitter 5 ms (assumed); loss 0.5%
    # makes ~0.5% of chunks stall >= 200 ms, standing in for that heavy tail (measured on a busy
    # campus network; a quiet home or lab Wi-Fi does better). The Pi's on-board Wi-Fi is 1x1
    # 802.11ac (433 Mbit/s PHY at most); 100 Mbit/s effective is an assumption. Drafts are a
    # few KB/s, so the bandwidth rarely matters.
    DeviceProfile("rpi5", "mag", 3.0,
                  LinkProfile(rtt_ms=5, jitter_ms=5, loss=0.005, bandwidth_mbps=100),
                  "Raspberry Pi 5 class board (Cortex-A76) on Wi-Fi, verifier on the LAN"),
    # Compute: the Orin Nano's CPU is 6x Cortex-A78AE at 1.5 GHz (1.7 GHz with the 2024
    # "Super" firmware; NVIDIA datasheet). sbc-bench's single-thread 7-zip: Orin Nano 2153 MIPS
    # against an Intel N100's 4020-4073 (github.com/ThomasKaiser/sbc-bench issue #65), i.e.
    # 1.9x slower than a low-power x86 core; desktop/server cores are about 1.5-2x an N100
    # single-threaded (ballpark), so 3-4x: 4, slower than the Pi 5 per core (1.5 vs 2.4 GHz,
    # similar IPC). This is for drafting on the CPU (MaG); a model drafter on the board's GPU
    # is not what this factor describes.
    # Link: wired gigabit Ethernet to an on-premises verifier. iperf3 over gigabit Ethernet to
    # a Raspberry Pi measured 941 Mbit/s (mpr-projects.com, "RPi NAS: Part 3 Network
    # Connections"); a switched LAN's ping is typically 0.1-0.5 ms (common experience, not a
    # cited study), so rtt 1 ms with switch hops and the server's stack, no loss.
    DeviceProfile("jetson-orin-nano", "mag", 4.0,
                  LinkProfile(rtt_ms=1, jitter_ms=0.2, loss=0.0, bandwidth_mbps=940),
                  "Jetson Orin Nano class board (Cortex-A78AE CPU) on wired gigabit Ethernet"),
    # Compute: mid-range phone SoCs (big core Cortex-A78 class, ~2.4 GHz) score roughly
    # 1,000-1,200 single-core in Geekbench 6, flagships (Cortex-X) 2,000 and more (ballpark from
    # public Geekbench listings): 2x a desktop core, thermal throttling aside.
    # Link: Ookla's Speedtest US market report for Q2 2020 (mostly LTE then; RCR Wireless,
    # 2020-07-09): median mobile latency 31-39 ms by operator, median upload 5.74 Mbit/s. Ookla
    # pings the nearest test server; a verifier in a cloud region adds ~10-20 ms (assumed):
    # rtt 50 ms. Upload 6 Mbit/s (drafts flow up; this model applies it both ways). Jitter
    # 15 ms is an assumption of the order of LTE scheduling plus HARQ retransmissions (8 ms each
    # in LTE FDD). Loss 0.5% is assumed too: HARQ/RLC hide most radio loss, and what remains
    # comes in bursts around radio state changes (Baltrunas et al., INFOCOM 2015, on UMTS),
    # which independent per-segment loss only approximates.
    DeviceProfile("phone-lte", "mag", 2.0,
                  LinkProfile(rtt_ms=50, jitter_ms=15, loss=0.005, bandwidth_mbps=6),
                  "a mid-range phone on LTE, verifier in a cloud region"),
    # Boards that draft with a model, as boards do: the default model's Q4_1 GGUF run by
    # llama.cpp on the board's CPU cores (the llamacpp extra). The compute factors are the
    # boards' single-core factors above: llama.cpp's decode of a 135M model is bound by the
    # core's arithmetic and its caches as MaG's look-ups are by the core, so the same ratio is
    # the assumption here (not a measured llama.cpp figure on the boards).
    DeviceProfile("rpi5-llamacpp", "llamacpp:default", 3.0,
                  LinkProfile(rtt_ms=5, jitter_ms=5, loss=0.005, bandwidth_mbps=100),
                  "Raspberry Pi 5 class board drafting with llama.cpp (the default model's "
                  "GGUF), on Wi-Fi"),
    DeviceProfile("jetson-orin-nano-llamacpp", "llamacpp:default", 4.0,
                  LinkProfile(rtt_ms=1, jitter_ms=0.2, loss=0.0, bandwidth_mbps=940),
                  "Jetson Orin Nano class board drafting with llama.cpp on its CPU, wired "
                  "gigabit Ethernet"),
    # A Jetson drafting on its GPU, at a published speed. Yuvraj Singh, "Tiny LLM Benchmark:
    # Jetson Orin Nano Super 8GB - Four Power Modes x Eight Models" (smolhub.com, 2026-06-28;
    # raw data on Hugging Face, YuvrajSingh9886/jetson-non-reasoning-benchmark-25w): llama.cpp
    # CUDA with every layer on the GPU (-ngl 99), one user, prompts of 128-2048 tokens and
    # 64-256 generated: SmolLM2-135M (the default model, a 101 MB GGUF) decodes 165 tokens a
    # second in the 25 W mode. The board drafts for its sessions one token a forward, so the
    # 165 are shared among them. Emulated here by pacing this machine's llama.cpp drafter to
    # at most that speed: a machine slower than 165 tokens a second emulates a slower board.
    DeviceProfile("jetson-orin-nano-super-gpu-llamacpp", "llamacpp:default", 1.0,
                  LinkProfile(rtt_ms=1, jitter_ms=0.2, loss=0.0, bandwidth_mbps=940),
                  "Jetson Orin Nano Super (25 W) drafting with llama.cpp on its GPU at the "
                  "published 165 tokens/s, wired gigabit Ethernet", tokens_per_s=165.0),
    # A board at this machine's speed drafting with llama.cpp: what bench-edge's boards are.
    DeviceProfile("local-llamacpp", "llamacpp:default", 1.0, LinkProfile(rtt_ms=0),
                  "this machine's speed drafting with llama.cpp, no added network delay"),
)}


def parse_profiles(text: str) -> list[DeviceProfile]:
    """``"rpi5,phone-lte"`` -> those profiles, in order; ConfigError naming the known ones."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    if not names:
        raise ConfigError(f"no device profile given; known: {', '.join(PROFILES)}")
    unknown = [n for n in names if n not in PROFILES]
    if unknown:
        raise ConfigError(f"unknown device profile {', '.join(map(repr, unknown))}; "
                          f"known: {', '.join(PROFILES)}")
    return [PROFILES[n] for n in names]


def fleet_profiles(names: str | Iterable[str | DeviceProfile], n_devices: int
                   ) -> list[DeviceProfile]:
    """One profile per device, cycling through ``names`` (a comma-separated string, or names
    and DeviceProfiles): ``fleet_profiles("rpi5,phone-lte", 3)`` -> rpi5, phone-lte, rpi5."""
    if not isinstance(n_devices, int) or n_devices < 1:
        raise ConfigError(f"n_devices must be an integer >= 1, got {n_devices!r}")
    if isinstance(names, str):
        profiles = parse_profiles(names)
    else:
        profiles = []
        for item in names:
            profiles.extend([item] if isinstance(item, DeviceProfile) else parse_profiles(item))
        if not profiles:
            raise ConfigError(f"no device profile given; known: {', '.join(PROFILES)}")
    return list(islice(cycle(profiles), n_devices))
