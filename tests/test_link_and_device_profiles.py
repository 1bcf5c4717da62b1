"""Link and device emulation's models, without a socket: a link profile's arithmetic (delay,
jitter clamped at zero, bandwidth queueing, loss and its retransmission timeout, refused
profiles and addresses) and the emulated device profiles (the shipped ones, parsing, a fleet's
cycle, the compute slowdown and a published speed, the drafter slowed or paced to it). The proxy
on real traffic: tests/test_link_emulation.py."""

import random

import pytest

from edgespec.config import ConfigError
from edgespec_cli.deployment.device_profiles import (PROFILES, DeviceProfile, fleet_profiles,
                                                     parse_profiles)
from edgespec_cli.deployment.link_emulation import (LinkDirection, LinkProfile, LinkProxy,
                                                    split_host_port)


# --- the link model


def test_bandwidth_queues_chunks_behind_earlier_ones():
    link = LinkDirection(LinkProfile(rtt_ms=0, bandwidth_mbps=8), random.Random(0))
    assert link.arrival(0.0, 1000) == pytest.approx(0.001)
    assert link.arrival(0.0, 1000) == pytest.approx(0.002)
    assert link.arrival(1.0, 1000) == pytest.approx(1.001)


def test_loss_delays_chunks_by_the_retransmission_timeout():
    profile = LinkProfile(rtt_ms=10, loss=0.3)
    link = LinkDirection(profile, random.Random(42))
    arrivals = [link.arrival(0.0, 1000) for _ in range(200)]
    assert link.retransmissions > 0
    assert min(arrivals) >= 0.005
    assert max(arrivals) >= 0.005 + profile.rto_s
    assert LinkProfile(rtt_ms=10).rto_s == 0.2 and LinkProfile(rtt_ms=300).rto_s == 0.6


def test_no_loss_never_retransmits_in_the_model():
    link = LinkDirection(LinkProfile(rtt_ms=10, jitter_ms=5), random.Random(0))
    assert all(link.retransmission_delay_s(10 ** 6) == 0 for _ in range(100))
    assert link.retransmissions == 0


def test_jitter_varies_the_delay_and_a_negative_draw_is_clamped_to_zero():
    """Jitter far above the one-way delay (1 ms): about half the draws would be negative; they
    are delivered at once (0 s), not reflected or redrawn, and the rest vary around 1 ms."""
    link = LinkDirection(LinkProfile(rtt_ms=2, jitter_ms=50), random.Random(0))
    delays = [link.propagation_s() for _ in range(1000)]
    clamped = sum(d == 0.0 for d in delays)
    assert 300 < clamped < 700 and min(delays) == 0.0
    assert len(set(delays)) > 300  # the others vary
    steady = LinkDirection(LinkProfile(rtt_ms=2, jitter_ms=0), random.Random(0))
    assert {steady.propagation_s() for _ in range(10)} == {0.001}


@pytest.mark.parametrize("kwargs", [
    {"rtt_ms": -1}, {"rtt_ms": float("nan")}, {"rtt_ms": float("inf")},
    {"rtt_ms": 10, "jitter_ms": -0.5}, {"rtt_ms": 10, "loss": 1.0},
    {"rtt_ms": 10, "loss": -0.1}, {"rtt_ms": 10, "bandwidth_mbps": 0},
    {"rtt_ms": 10, "bandwidth_mbps": -5},
])
def test_invalid_link_profiles_are_refused(kwargs):
    with pytest.raises(ConfigError):
        LinkProfile(**kwargs)


def test_describe():
    assert LinkProfile(30, 5, 0.01, 20).describe() == "rtt 30 ms ±5, loss 1%, 20 Mbit/s"
    assert LinkProfile(0).describe() == "rtt 0 ms, unlimited bandwidth"


@pytest.mark.parametrize("address", ["nohost", "host:", ":50051", "host:port", "host:70000"])
def test_bad_target_addresses_are_refused(address):
    with pytest.raises(ConfigError):
        LinkProxy(address, LinkProfile(1))


def test_split_host_port():
    assert split_host_port("127.0.0.1:50051") == ("127.0.0.1", 50051)
    assert split_host_port("[::1]:80") == ("::1", 80)


# --- device profiles


def test_shipped_profiles_are_valid_and_their_drafters_parse():
    from edgespec.drafters import parse_drafter_spec

    assert {"local", "rpi5", "jetson-orin-nano", "phone-lte", "rpi5-llamacpp",
            "jetson-orin-nano-llamacpp", "local-llamacpp"} <= set(PROFILES)
    for name, profile in PROFILES.items():
        assert profile.name == name and profile.description
        assert profile.compute_slowdown >= 1
        parse_drafter_spec(profile.drafter, allowed=("mag", "model", "llamacpp"))
    local = PROFILES["local"]
    assert local.compute_slowdown == 1 and local.link.rtt_ms == 0 and not local.link.loss


def test_parse_profiles():
    assert [p.name for p in parse_profiles(" rpi5, phone-lte,rpi5 ")] == [
        "rpi5", "phone-lte", "rpi5"]
    with pytest.raises(ConfigError, match="jetson-orin-nano"):
        parse_profiles("rpi5,toaster")
    with pytest.raises(ConfigError):
        parse_profiles(" , ")


def test_fleet_profiles_cycle_through_the_list():
    assert [p.name for p in fleet_profiles("rpi5,phone-lte", 5)] == [
        "rpi5", "phone-lte", "rpi5", "phone-lte", "rpi5"]
    assert fleet_profiles(["local"], 2) == [PROFILES["local"]] * 2
    custom = DeviceProfile("slow", "mag", 10.0, LinkProfile(rtt_ms=200))
    assert fleet_profiles([custom, "rpi5"], 3) == [custom, PROFILES["rpi5"], custom]
    for bad in (0, -1):
        with pytest.raises(ConfigError):
            fleet_profiles("rpi5", bad)
    with pytest.raises(ConfigError):
        fleet_profiles([], 1)


def test_device_profile_slowdown():
    with pytest.raises(ConfigError):
        DeviceProfile("fast", "mag", 0.5, LinkProfile(rtt_ms=1))
    assert PROFILES["rpi5"].extra_compute_s(0.01) == pytest.approx(0.02)
    assert PROFILES["local"].extra_compute_s(0.01) == 0


def test_a_device_with_a_published_speed_drafts_no_faster_than_it():
    """A profile's tokens_per_s: a step of n tokens takes at least n / tokens_per_s; a machine
    slower than that adds nothing (it cannot be sped up); the slowdown still applies."""
    jetson = PROFILES["jetson-orin-nano-super-gpu-llamacpp"]
    assert jetson.tokens_per_s == 165.0 and jetson.drafter == "llamacpp:default"
    assert jetson.extra_compute_s(0.01, 33) == pytest.approx(0.19)  # 33 / 165 = 0.2 s
    assert jetson.extra_compute_s(0.5, 33) == 0  # this machine is slower than the board
    assert jetson.extra_compute_s(0.01, 0) == 0
    paced = DeviceProfile("p", "mag", 3.0, LinkProfile(rtt_ms=1), tokens_per_s=100.0)
    assert paced.extra_compute_s(0.1, 4) == pytest.approx(0.2)  # the slowdown is longer
    for bad in (0, -5.0, float("inf")):
        with pytest.raises(ConfigError):
            DeviceProfile("p", "mag", 1.0, LinkProfile(rtt_ms=1), tokens_per_s=bad)


def test_a_paced_drafter_sleeps_to_its_published_speed_and_counts_what_it_cannot(monkeypatch):
    from edgespec.config import SamplingParams
    from edgespec.drafters import MaGDrafter
    from edgespec_cli.deployment import device_emulation

    clock = iter([10.0, 10.01, 20.0, 21.0])
    slept = []
    monkeypatch.setattr(device_emulation.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(device_emulation.time, "sleep", slept.append)
    paced = device_emulation.SlowedDrafter(MaGDrafter(), 1.0, tokens_per_s=100.0)
    session = paced.open([1, 5, 6, 7, 5, 6, 7, 5], SamplingParams())
    n = len(session.propose_tree(4, 1).tokens)
    assert n > 0 and slept[0] == pytest.approx(n / 100 - 0.01)
    session.propose_tree(4, 1)  # a whole second here: slower than the board, nothing added
    assert slept[1] == 0 and paced.slower_than_published == 1
    with pytest.raises(ConfigError):
        device_emulation.SlowedDrafter(MaGDrafter(), 1.0, tokens_per_s=0)


def test_a_slowed_drafter_sleeps_its_slowdown_after_each_proposal(monkeypatch):
    """The simulated device's compute: (slowdown - 1) x each proposal's own time asleep after
    it; the drafts themselves are the inner drafter's."""
    from edgespec.config import SamplingParams
    from edgespec.drafters import MaGDrafter
    from edgespec_cli.deployment import device_emulation

    clock = iter([10.0, 10.5, 20.0, 20.25, 30.0, 30.5])
    slept = []
    monkeypatch.setattr(device_emulation.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(device_emulation.time, "sleep", slept.append)
    slowed = device_emulation.SlowedDrafter(MaGDrafter(), 3.0)
    tokens = [1, 5, 6, 7, 5, 6]
    session = slowed.open(tokens, SamplingParams())
    plain = MaGDrafter().open(tokens, SamplingParams())
    # what the drafting loop calls: a chain (width 1, which MaG drafts with its own propose)
    # and a tree, each slowed once
    assert session.propose_tree(2, 1).tokens == plain.propose_tree(2, 1).tokens
    assert session.propose_tree(2, 2).tokens == plain.propose_tree(2, 2).tokens
    assert slept == [1.0, 0.5]
    assert session.propose(1).tokens == plain.propose(1).tokens and len(slept) == 2
    with pytest.raises(ConfigError):
        device_emulation.SlowedDrafter(MaGDrafter(), 0.5)
