"""The README's two commands stay true: CI runs the test one verbatim, the CLI has what it names."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _first_commands():
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())[:2]


def test_ci_runs_the_readme_test_command():
    run, test = _first_commands()
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"TEST_COMMAND='{test}'" in ci
    assert "pytest" in test and "torch==2.13.0" in test


def test_readme_main_command_uses_existing_subcommand():
    from edgespec_cli.main import build_parser

    run, _ = _first_commands()
    assert "torch==2.13.0" in run
    sub = re.search(r"edgespec (\w+)", run).group(1)
    build_parser().parse_args([sub, "x"] if sub == "generate" else [sub])
