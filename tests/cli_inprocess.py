"""An ``edgespec`` command run in the test's own process: ``edgespec_cli.main.main(argv)``, the
function ``python -m edgespec_cli`` exits with, its stdout and stderr captured. It spares each
command a new interpreter that imports torch and transformers again (seconds per call), for tests
about what a command does rather than about the process; those keep a real subprocess
(tests/procs.py's ``run_edgespec``).

What a command changes in the process is put back afterwards: torch's thread count and the one
edgespec's thread policy recorded, the global RNGs (training seeds them), the root logger's
handlers and level, standard input, ``sys.argv`` (``["edgespec", *ARGS]`` meanwhile, as the
commands that record their command line read it) and the oneDNN cache bounds main sets in the
environment."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import subprocess
import sys


def run_cli(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    """``edgespec ARGS`` in this process: its exit status (main's return, or an argparse
    SystemExit's code), stdout and stderr, as subprocess.run(capture_output=True) reports them.
    An exception main lets out is raised (a subprocess would have printed a traceback)."""
    import torch

    from edgespec.runner import threads
    from edgespec.runner.kernel_caches import CAPACITY_VARIABLES
    from edgespec_cli.main import main

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    saved = (torch.get_num_threads(), threads._threads, threads._adjustable,
             torch.get_rng_state(),
             random.getstate(), root.handlers[:], root.level, sys.stdin, sys.argv)
    saved_env = {name: os.environ.get(name) for name in CAPACITY_VARIABLES}  # main bounds them
    try:
        sys.argv = ["edgespec", *argv]
        if stdin is not None:
            sys.stdin = io.StringIO(stdin)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as e:  # argparse's usage errors
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        (n_threads, threads._threads, threads._adjustable, rng, py_rng, handlers, level,
         sys.stdin, sys.argv) = saved
        torch.set_num_threads(n_threads)
        torch.set_rng_state(rng)
        random.setstate(py_rng)
        for h in root.handlers[:]:
            if h not in handlers:
                root.removeHandler(h)
        root.setLevel(level)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return subprocess.CompletedProcess(["edgespec", *argv], code, out.getvalue(), err.getvalue())
