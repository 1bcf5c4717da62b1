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


def _parser_options() -> dict[str, set[str]]:
    import argparse

    from edgespec_cli.main import build_parser

    out: dict[str, set[str]] = {}

    def walk(parser, name):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, p in action.choices.items():
                    walk(p, f"{name} {sub}".strip())
            else:
                out.setdefault(name, set()).update(
                    o for o in action.option_strings if o.startswith("--") and o != "--help")
    walk(build_parser(), "")
    return out


def test_every_command_option_is_documented_and_every_documented_option_exists():
    text = (ROOT / "README.md").read_text()
    documented = set(re.findall(r"(--[a-z][a-z-]+)", text))
    options = _parser_options()
    every = set().union(*options.values())
    missing = {f"{cmd}: {o}" for cmd, opts in options.items() for o in opts
               if o not in documented}
    assert not missing, f"options missing from the README: {sorted(missing)}"
    other_tools = {"--index-url", "--no-deps", "--force-reinstall",  # pip
                   "--resources"}  # ray start
    unknown = {o for o in documented if o not in every and o not in other_tools}
    assert not unknown, f"the README names options no command has: {sorted(unknown)}"
