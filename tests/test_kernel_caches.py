"""oneDNN's kernel caches are bounded in a serving process (``edgespec.runner.kernel_caches``):
a process that meets many product shapes stays small where the bound is set after torch is
imported, and grows where the user's environment asks for oneDNN's own 1,024 entries (the
user's value is kept); ``edgespec`` sets the bound before any command runs, and a served
verifier says the bound in its log."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from edgespec.runner.kernel_caches import (CACHE_ENTRIES, CAPACITY_VARIABLES,
                                           LEGACY_PRIMITIVE_VARIABLE, bound_kernel_caches)

# the packed product over 2..599 rows: a shape each, a kernel built for each, as a server's
# varied steps and prompts build them; prints the growth of the process's resident memory in MB
SHAPES = textwrap.dedent("""
    import sys
    import torch
    from edgespec.runner.kernel_caches import bound_kernel_caches
    from edgespec.runner.linear import Linear

    torch.set_num_threads(1)
    bounds = bound_kernel_caches()  # after torch's import: the caches read it at first use
    def rss_mb():
        with open("/proc/self/status") as f:
            return int(next(l for l in f if l.startswith("VmRSS")).split()[1]) // 1024
    torch.manual_seed(0)
    linear = Linear(torch.randn(256, 256))
    x = torch.randn(600, 256)
    linear(x[:3])
    before = rss_mb()
    for n in range(2, 600):
        linear(x[:n])
    print(bounds.ideep, bounds.primitives, rss_mb() - before)
""")


def _env_without_bounds() -> dict[str, str]:
    """This process's environment without any cache bound (the user's or one main set)."""
    return {k: v for k, v in os.environ.items()
            if k not in (*CAPACITY_VARIABLES, LEGACY_PRIMITIVE_VARIABLE)}


def _shapes(env: dict) -> tuple[str, str, int]:
    done = subprocess.run([sys.executable, "-c", SHAPES], capture_output=True, text=True,
                          timeout=300, env={**_env_without_bounds(), **env})
    assert done.returncode == 0, done.stderr[-3000:]
    ideep, primitives, grown = done.stdout.split()
    return ideep, primitives, int(grown)


def _packed_products() -> bool:
    import torch

    from edgespec.runner.linear import _mkldnn_ok

    return _mkldnn_ok(torch.ones(1, 1))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.skipif(not _packed_products(), reason="this torch has no oneDNN packed products")
def test_the_bound_keeps_a_process_of_many_shapes_small_and_the_users_value_is_kept():
    ideep, primitives, bounded = _shapes({})
    assert (ideep, primitives) == (str(CACHE_ENTRIES), str(CACHE_ENTRIES))
    ideep, primitives, unbounded = _shapes({name: "1024" for name in CAPACITY_VARIABLES})
    assert (ideep, primitives) == ("1024", "1024")  # the user's value, not the bound
    # measured on a 2-core AMD EPYC: 52 MB bounded, 246 MB with 1,024 entries each
    assert unbounded > 2 * bounded + 40, (bounded, unbounded)


def test_bound_kernel_caches_sets_what_is_unset_and_keeps_the_rest(monkeypatch):
    monkeypatch.delenv(CAPACITY_VARIABLES[0], raising=False)
    monkeypatch.setenv(CAPACITY_VARIABLES[1], "512")
    bounds = bound_kernel_caches(32)
    assert (bounds.ideep, bounds.primitives) == ("32", "512")
    assert os.environ[CAPACITY_VARIABLES[0]] == "32"
    assert "32 entries (ideep" in bounds.describe() and "512 (primitives" in bounds.describe()
    # oneDNN's older spelling is the user's value too: not hidden behind the newer one
    for name in CAPACITY_VARIABLES:
        monkeypatch.delenv(name)
    monkeypatch.setenv(LEGACY_PRIMITIVE_VARIABLE, "300")
    bounds = bound_kernel_caches(32)
    assert (bounds.ideep, bounds.primitives) == ("32", "300")
    assert CAPACITY_VARIABLES[1] not in os.environ


def test_importing_the_command_line_runs_no_product():
    """The bound is set in main(): the module's imports must not have run a oneDNN product
    (they do not import torch at all)."""
    done = subprocess.run([sys.executable, "-c", "import sys, edgespec_cli.main; "
                           "print('torch' in sys.modules)"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False"


def test_the_command_line_bounds_the_caches_before_its_command_runs():
    code = textwrap.dedent("""
        import os, sys
        from edgespec_cli.main import main
        try:
            main(["serve", "--help"])  # argparse exits after the help
        except SystemExit:
            pass
        print(os.environ.get("LRU_CACHE_CAPACITY"),
              os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"), file=sys.stderr)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=_env_without_bounds())
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.split()[-2:] == [str(CACHE_ENTRIES)] * 2
