"""The README stays true: CI runs its test command verbatim, the CLI has what its main command
names, every option is documented, its links resolve, and nothing tells users to install
edgespec from PyPI (it is not there)."""

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
    every = set().union(*options.values()) | {"--help"}  # every command has it
    missing = {f"{cmd}: {o}" for cmd, opts in options.items() for o in opts
               if o not in documented}
    assert not missing, f"options missing from the README: {sorted(missing)}"
    other_tools = {"--index-url", "--no-deps", "--force-reinstall",  # pip
                   "--resources",  # ray start
                   "--wheels", "--dry-run"}  # scripts/gpu_sitting.sh
    unknown = {o for o in documented if o not in every and o not in other_tools}
    assert not unknown, f"the README names options no command has: {sorted(unknown)}"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page: lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_readme_and_docs_links_resolve():
    """Every relative link of the README, docs/ (the measured reports included), deploy/ and the
    packages' READMEs points at a file or folder that exists, and at a heading of it that
    exists."""
    pages = [ROOT / "README.md", *ROOT.glob("*/README.md"), *(ROOT / "docs").rglob("*.md")]
    broken = []
    for page in pages:
        for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if link.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link}")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such heading)")
    assert not broken, f"links to nothing: {broken}"


def test_headline_figures_link_to_measured_reports():
    """The README keeps one short table of headline figures; each row names its report under
    docs/measured/, and the reports keep the commands that produced their figures."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Measured here", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| ") and not r.startswith("| figure")]
    assert 0 < len(rows) <= 8, "one short table of headline figures"
    assert all("docs/measured/" in r or r.rstrip(" |").endswith("all") for r in rows), rows
    index = ROOT / "docs" / "measured" / "README.md"
    reports = [p for p in (ROOT / "docs" / "measured").rglob("*.md") if p != index]
    assert reports
    for report in reports:
        assert re.search(r"edgespec [a-z-]+|pip install", report.read_text()), \
            f"{report.relative_to(ROOT)} gives no command"


def test_measured_reports_commands_name_existing_options():
    """The commands the measured reports give (`edgespec CMD --option ...`, continued lines
    included) use options CMD still has, so they can be run again."""
    options = _parser_options()
    wrong = []
    for report in (ROOT / "docs" / "measured").rglob("*.md"):
        for m in re.finditer(r"edgespec ([a-z-]+)((?:[ \\\n]+(?:--[a-z-]+|[^\s`|]+))*)",
                             report.read_text()):
            cmd, rest = m.groups()
            if cmd in options:
                wrong += [f"{report.relative_to(ROOT)}: {cmd} {o}"
                          for o in re.findall(r"--[a-z][a-z-]+", rest) if o not in options[cmd]]
    assert not wrong, wrong


def test_nothing_installs_edgespec_from_pypi():
    """edgespec is not on PyPI: the README, docs/, deploy/ and the launcher YAMLs install it from
    a clone or a wheel, never by its bare name."""
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "deploy").rglob("*")]
    bad = re.compile(r"""pip install\s+(-\S+\s+)*["']?edgespec(\[[^\]]*\])?["']?(\s|$|`)""")
    found = [f"{f.relative_to(ROOT)}: {m.group(0).strip()}" for f in files if f.is_file()
             and f.suffix in {".md", ".yaml", ".service"} for m in bad.finditer(f.read_text())]
    assert not found, found
