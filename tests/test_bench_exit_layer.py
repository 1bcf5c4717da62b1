"""bench's rows name an early-exit drafter's exit layer: ``layers:L``'s L and an imitation
network's, in every record and in the summary's table and drafters."""

from types import SimpleNamespace

from edgespec_cli.bench.methods import exit_layer
from edgespec_cli.bench.report import summarize


def _record(method: str, layer: int | None = None) -> dict:
    r = {"method": method, "category": "qa", "tokens": 10, "seconds": 1.0,
         "identical_to_target_only": True}
    if layer is not None:
        r["exit_layer"] = layer
    return r


def test_exit_layer_of_each_drafter_kind():
    imitation = SimpleNamespace(head=SimpleNamespace(head=SimpleNamespace(
        cfg=SimpleNamespace(exit_layer=4))), drafter=None)
    head = SimpleNamespace(head=SimpleNamespace(head=SimpleNamespace(
        cfg=SimpleNamespace(kind="eagle"))), drafter=None)
    layers = SimpleNamespace(head=None, drafter=SimpleNamespace(name="layers:8"))
    mag = SimpleNamespace(head=None, drafter=SimpleNamespace(name="mag"))
    assert [exit_layer(e) for e in (imitation, head, layers, mag)] == [4, None, 8, None]


def test_the_summary_carries_the_exit_layer():
    methods = ["target_only", "edgespec:imitation:default", "edgespec:mag"]
    report = summarize([_record("target_only"), _record("edgespec:imitation:default", 4),
                        _record("edgespec:mag")], methods)
    assert report["categories"]["all"]["edgespec:imitation:default"]["exit_layer"] == 4
    assert "exit_layer" not in report["categories"]["all"]["edgespec:mag"]
    assert report["summary"]["drafters"]["imitation:default"]["exit_layer"] == 4
