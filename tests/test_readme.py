"""The README and docs/ stay true: CI runs the README's test command verbatim, the CLI has what
its main command names, the command reference (docs/reference/commands.md) is what its generator
prints from the parsers and documents every option of every command and no other, the commands
the pages show use options those commands have, the HTTP examples name the model the server
serves, links resolve, and nothing tells users to install edgespec from PyPI (it is not there)."""

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


REFERENCE = ROOT / "docs" / "reference" / "commands.md"


def test_the_command_reference_is_what_the_parsers_generate():
    """The reference page is generated from the parsers; after changing an option, regenerate it:
    python -m edgespec_cli.docs_reference > docs/reference/commands.md"""
    from edgespec_cli.docs_reference import OUT, reference

    assert ROOT / OUT == REFERENCE
    assert REFERENCE.read_text() == reference(), (
        "docs/reference/commands.md is stale: run "
        "python -m edgespec_cli.docs_reference > docs/reference/commands.md")


def _reference_sections() -> dict[str, str]:
    """The reference page's text under each command's heading ("## `edgespec CMD`"), by CMD."""
    parts = re.split(r"^## `edgespec ([a-z -]+)`$", REFERENCE.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_the_reference_documents_every_option_of_every_command_and_no_other():
    """Each command's section lists exactly the options its parser has: none missing, none that
    the command does not have (whatever wrote the page)."""
    options = _parser_options()
    sections = _reference_sections()
    commands = {cmd for cmd in options  # leaves only: "models pull", not "models"
                if cmd and not any(c.startswith(f"{cmd} ") for c in options)}
    assert set(sections) == commands, "one section per command"
    wrong = []
    for cmd, text in sections.items():
        rows = [r for r in text.splitlines() if r.startswith("| `--")]
        listed = {o for r in rows for o in re.findall(r"--[a-z][a-z-]+", r.split(" | ")[0])}
        wrong += [f"{cmd}: {o} missing" for o in options[cmd] - listed]
        wrong += [f"{cmd}: {o} is not an option of it" for o in listed - options[cmd]]
    assert not wrong, wrong
    assert options[""] <= set(re.findall(r"--[a-z][a-z-]+", REFERENCE.read_text()))  # --version


def _pages() -> list[Path]:
    """The README and every page of docs/ (the measured reports included)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


OTHER_TOOLS = {"--index-url", "--no-deps", "--force-reinstall",  # pip
               "--resources", "--node-ip-address",  # ray start
               "--retry", "--retry-connrefused",  # curl
               "--wheels", "--dry-run", "--budget-s", "--skip", "--breakdown",  # gpu_sitting.sh
               "--tests-first", "--tests-timeout-s", "--shapes", "--tests-workers",
               "--deadline-s", "--end-s",
               "--calls", "--deadline",  # scripts/admission_burst.py
               "--loops",  # scripts/resting_take_bench.py
               "--windows",  # scripts/llamacpp_window_sweep.py
               "--chunks", "--per-commit",  # scripts/chunk_push_cost.py
               "--boards", "--steps", "--sessions-per-board",  # scripts/cache_fleet_cost.py
               "--rounds",  # docs/measured/logprobs/cost.py
               "--tasks", "--batch", "--include", "--log", "--output"}  # lm_eval


def test_every_option_the_pages_name_exists():
    """An option the README or a docs page names is an option of some command (or of pip, curl,
    ray start, scripts/gpu_sitting.sh)."""
    options = _parser_options()
    every = set().union(*options.values()) | {"--help"}  # every command has it
    unknown = [f"{page.relative_to(ROOT)}: {o}" for page in _pages()
               for o in sorted(set(re.findall(r"(--[a-z][a-z-]+)", page.read_text())))
               if o not in every and o not in OTHER_TOOLS]
    assert not unknown, f"pages name options no command has: {unknown}"


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


# `edgespec CMD` and what follows it: in code, on its line or lines continued with a backslash;
# in a measured report's prose, across lines too (as its commands are written)
COMMAND_IN_CODE = re.compile(r"edgespec ([a-z-]+)((?:(?:[ \t]+|[ \t]*\\\n[ \t]*)[^\s`|]+)*)")
COMMAND_IN_PROSE = re.compile(r"edgespec ([a-z-]+)((?:[ \\\n]+(?:--[a-z-]+|[^\s`|]+))*)")


PASSED_ON = {"serve": "serve", "board": "drafter"}  # bench-edge's --serve-arg, --board-arg


def test_commands_the_pages_give_use_options_those_commands_have():
    """The commands the README and docs/ give (`edgespec CMD --option ...`) use options CMD has,
    so they can be run as written: those in code (blocks and `spans`) on every page, and those
    in the measured reports' prose."""
    options = _parser_options()
    wrong = []
    for page in _pages():
        text = page.read_text()
        code = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
        code += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
        found = [m.groups() for piece in code for m in COMMAND_IN_CODE.finditer(piece)]
        if page.is_relative_to(ROOT / "docs" / "measured"):
            found += [m.groups() for m in COMMAND_IN_PROSE.finditer(text)]
        wrong += [f"{page.relative_to(ROOT)}: {cmd} {o}" for cmd, rest in found if cmd in options
                  for o in re.findall(r"(?<![=\w-])--[a-z][a-z-]+", rest)
                  if o not in options[cmd]]
        # an option passed on to the command another runs (bench-edge --serve-arg=--late-after=0)
        wrong += [f"{page.relative_to(ROOT)}: {cmd} --{via}={o}" for cmd, rest in found
                  for via, o in re.findall(r"--(serve|board)-arg=(--[a-z][a-z-]+)", rest)
                  if o not in options[PASSED_ON[via]]]
    assert not wrong, sorted(set(wrong))


def test_the_readme_http_examples_name_the_model_the_server_serves():
    """The README's curl and openai examples use the port the server is started with, send the
    default model's id, show /v1/models's answer with it, and give the openai client a base_url
    ending in /v1 (tests/test_http_api.py runs them against a live server)."""
    import json

    from edgespec.config import DEFAULT_MODEL_NAME

    text = (ROOT / "README.md").read_text()
    port = re.search(r"edgespec serve [^\n]*--http-port (\d+)", text).group(1)
    urls = re.findall(r"http://127\.0\.0\.1:(\d+)(/\S*)", text)
    assert urls and {p for p, _ in urls} == {port}
    assert any(path.startswith("/v1/models") for _, path in urls)
    assert any(path.startswith("/v1/chat/completions") for _, path in urls)
    listing = json.loads(re.search(r"```json\n(.+?)\n```", text, flags=re.S).group(1))
    assert [m["id"] for m in listing["data"]] == [DEFAULT_MODEL_NAME]
    bodies = [json.loads(b) for b in re.findall(r"-d '(\{.+?\})'", text)]
    assert bodies and all(b["model"] == DEFAULT_MODEL_NAME for b in bodies)
    base_url = re.search(r'base_url="([^"]+)"', text).group(1)
    assert base_url == f"http://127.0.0.1:{port}/v1"


def test_nothing_installs_edgespec_from_pypi():
    """edgespec is not on PyPI: the README, docs/, deploy/ and the launcher YAMLs install it from
    a clone or a wheel, never by its bare name."""
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "deploy").rglob("*")]
    bad = re.compile(r"""pip install\s+(-\S+\s+)*["']?edgespec(\[[^\]]*\])?["']?(\s|$|`)""")
    found = [f"{f.relative_to(ROOT)}: {m.group(0).strip()}" for f in files if f.is_file()
             and f.suffix in {".md", ".yaml", ".service"} for m in bad.finditer(f.read_text())]
    assert not found, found
