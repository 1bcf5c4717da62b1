"""The test extra's requirements leave the torch that the README installs first in place.

The README's test command installs ``torch==2.13.0`` in a command of its own, then
``.[test]``. On Linux x86_64 that torch, from PyPI, is the CUDA build, which pins the Triton it
was built with; a test extra that pinned another Triton made pip swap the README's torch for an
older release whose pin matched (a Python 3.13 venv got torch 2.11.0 and Triton 3.6.0, whose CPU
products then failed the start check). These tests read ``pyproject.toml`` itself, so a change
to it is checked before anything is installed from it.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, which pytest itself needs there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
# the Triton that PyPI's CUDA builds of torch pin: 2.11.0 (the GPU sittings' torch) and 2.13.0
# (the README's), read from their wheels' METADATA
TORCH_PINNED_TRITON = {"2.11.0": "3.6.0", "2.13.0": "3.7.1"}


def _test_extra() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["optional-dependencies"]["test"]]


def _triton() -> Requirement:
    [triton] = [r for r in _test_extra() if r.name == "triton"]
    return triton


def test_the_test_extra_admits_the_triton_each_torch_build_pins():
    spec = _triton().specifier
    for torch, triton in TORCH_PINNED_TRITON.items():
        assert spec.contains(triton), (
            f"torch {torch}'s CUDA build pins triton {triton}, which the test extra's "
            f"'{spec}' refuses: pip would replace that torch to satisfy both")


def test_the_test_extra_admits_the_installed_torchs_triton():
    """Where the torch installed here pins a Triton (PyPI's CUDA builds do; the CPU build
    pins none), the test extra admits it: installing the extra keeps this torch."""
    env = default_environment()
    pins = [Requirement(r) for r in importlib.metadata.requires("torch") or []]
    pins = [r for r in pins if r.name == "triton" and (r.marker is None or r.marker.evaluate(env))]
    if not pins:
        pytest.skip("this torch pins no Triton (its CPU build)")
    ours = _triton().specifier
    for pin in pins:
        versions = [s.version for s in pin.specifier if s.operator == "=="]
        assert versions, f"torch asks for {pin}, not one version"
        for v in versions:
            assert ours.contains(v), f"torch pins triton {v}; the test extra asks '{ours}'"


def test_the_readme_torch_is_one_whose_triton_pin_is_known():
    """The README's torch is one of ``TORCH_PINNED_TRITON``'s, so the first test reads its pin:
    a README moved to another torch names the Triton its CUDA build pins here."""
    readme = (ROOT / "README.md").read_text()
    pinned = {v for v in TORCH_PINNED_TRITON if f"pip install torch=={v}" in readme}
    assert pinned, "the README installs a torch whose Triton pin this test does not know"
