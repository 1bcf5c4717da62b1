"""The test extra's requirements leave the torch that the README installs first in place.

The README's test command installs ``torch==2.13.0`` in a command of its own, then
``.[test]``. On Linux x86_64 that torch, from PyPI, is the CUDA build, which pins the Triton it
was built with; a test extra that pinned another Triton made pip swap the README's torch for an
older release whose pin matched (a Python 3.13 venv got torch 2.11.0 and Triton 3.6.0; on that
torch this CPU's float32 products vary with the batch, so the start check refused every
runner). These tests read ``pyproject.toml`` and the README themselves, so a change to either is
checked before anything is installed from it.
"""

from __future__ import annotations

import re
from pathlib import Path

from packaging.requirements import Requirement
from test_readme import _first_commands

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, which pytest itself needs there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
# the Triton that PyPI's CUDA builds of torch pin, read from their wheels' METADATA: 2.11.0 (the
# torch the GPU sittings ran with) and 2.13.0 (the README's)
TORCH_PINNED_TRITON = {"2.11.0": "3.6.0", "2.13.0": "3.7.1"}


def _triton() -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    [triton] = [r for r in map(Requirement, project["optional-dependencies"]["test"])
                if r.name == "triton"]
    return triton


def _readme_test_torch() -> str:
    """The torch version the README's test command installs."""
    _, test = _first_commands()
    found = re.search(r"pip install torch==([0-9.]+)", test)
    assert found, f"the README's test command installs no pinned torch: {test}"
    return found.group(1)


def test_the_test_extra_admits_the_triton_each_torch_build_pins():
    triton = _triton()
    for torch, pinned in TORCH_PINNED_TRITON.items():
        assert triton.specifier.contains(pinned), (
            f"torch {torch}'s CUDA build pins triton {pinned}, which the test extra's "
            f"'{triton.specifier}' refuses: pip would replace that torch to satisfy both")
    # Triton's wheels are Linux x86_64's: elsewhere the Triton tests skip, and pip must not try
    assert triton.marker is not None
    assert triton.marker.evaluate({"platform_system": "Darwin", "platform_machine": "arm64"}) \
        is False
    assert triton.marker.evaluate({"platform_system": "Linux", "platform_machine": "x86_64"})


def test_the_readme_test_commands_torch_has_a_known_triton_pin():
    """The torch the README's test command installs is one of ``TORCH_PINNED_TRITON``'s, so
    the test above holds the extra to its pin: a README moved to another torch names the Triton
    its CUDA build pins here."""
    torch = _readme_test_torch()
    assert torch in TORCH_PINNED_TRITON, (
        f"the README's test command installs torch {torch}, whose CUDA build's Triton pin "
        f"TORCH_PINNED_TRITON does not hold")
