"""Write the command reference (``docs/reference/commands.md``) from the ``edgespec`` parsers,
so the page says what ``edgespec COMMAND --help`` says and cannot drift from it:

    python -m edgespec_cli.docs_reference > docs/reference/commands.md

``tests/test_readme.py`` fails when the committed page differs from what this prints. Each
command gets its description, its arguments and one table of its options (the option, its
default, its help text); a help text's "(default: ...)" becomes the default column."""

from __future__ import annotations

import argparse
import re
import sys

from edgespec_cli.main import build_parser

OUT = "docs/reference/commands.md"

# where each command is explained (relative to docs/reference/)
GUIDES = {
    "generate": "../generate.md",
    "models": "../install.md#the-default-model",
    "bench": "../benchmarks.md", "bench-net": "../benchmarks.md",
    "bench-edge": "../benchmarks.md", "bench-host": "../benchmarks.md",
    "bench-drafters": "../benchmarks.md", "bench-forward": "../benchmarks.md",
    "bench-learn": "../benchmarks.md", "bench-burst": "../benchmarks.md#edgespec-bench-burst",
    "serve": "../serving.md", "verifier": "../serving.md", "cache": "../serving.md",
    "drafter": "../serving.md#edgespec-drafter",
    "status": "../metrics.md#edgespec-status",
    "deploy": "../deploy.md",
    "simulate": "../simulate.md",
    "distill": "../heads.md#making-heads-edgespec-distill",
    "pad-train": "../pad.md", "bench-pad": "../pad.md#measured-edgespec-bench-pad",
}

HEADER = f"""# Command reference

Every `edgespec` command and its options. This page is generated from the command's own
parsers (`python -m edgespec_cli.docs_reference > {OUT}`), so it says what
`edgespec COMMAND --help` says; a test fails when the two differ. What the commands are for, with
examples: the guide linked under each command, and the [README](../../README.md).

`edgespec` alone lists the commands (and exits with status 2, as a usage error);
`edgespec --version` prints the version. A mistake you can fix (a bad option, a missing model, a
prompt over the context limit) prints one line starting `edgespec: error:` and exits with
status 2; an option the parser itself refuses (an unknown option, a value of the wrong type:
`--max-new-tokens abc`) shows the usage first, then `edgespec COMMAND: error: ...`, also with
status 2.
"""


def _commands(parser: argparse.ArgumentParser, prefix: str = ""
              ) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of every command, subcommands included, in order."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                full = f"{prefix} {name}".strip()
                nested = _commands(sub, full)
                out += nested or [(full, helps.get(name, ""), sub)]
    return out


def _value(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """What follows the option, as its --help writes it (" N", " {on,off}", " CAT [CAT ...]")."""
    if action.nargs == 0:
        return ""
    formatter = parser._get_formatter()
    default = formatter._get_default_metavar_for_optional(action)
    return " " + formatter._format_args(action, default)


_DEFAULT = re.compile(r"default: ([^()]*(?:\([^()]*\)[^()]*)*)")


def _split_default(text: str) -> tuple[str, str | None]:
    """A help text's meaning and its stated default: "X (default: D)" -> ("X", "D"); a
    parenthesis that also says something else keeps it ("(e.g. E; default: D)" -> "(e.g. E)")."""
    for m in reversed(list(re.finditer(r"\(([^()]*(?:\([^()]*\)[^()]*)*)\)", text))):
        inner = m.group(1)
        d = _DEFAULT.search(inner)
        if d is None or (d.start() > 0 and inner[:d.start()].rstrip()[-1:] != ";"):
            continue
        rest = inner[:d.start()].rstrip().rstrip(";").strip()
        kept = f"({rest})" if rest else ""
        meaning = (text[:m.start()].rstrip() + (" " + kept if kept else "")
                   + text[m.end():]).strip()
        return meaning, d.group(1).strip()
    last = re.search(r"[;,]? default: (.+)$", text)
    if last:
        return text[:last.start()].strip(), last.group(1).strip()
    return text, None


def _default_of(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.nargs == 0:
        return "off"
    if action.default is None:
        return "none"
    if isinstance(action.default, list):
        return " ".join(str(d) for d in action.default) or "none"
    return str(action.default)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    return f"`{text}`".replace("|", "\\|")


def _expand(action: argparse.Action) -> str:
    text = action.help or ""
    params = {"default": action.default, "dest": action.dest}
    try:
        return text % params
    except (KeyError, TypeError, ValueError):
        return text


def _options_table(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        if "--help" in action.option_strings:
            continue
        meaning, stated = _split_default(_expand(action))
        default = "required" if action.required else (stated or _default_of(action))
        names = ", ".join(f"{o}{_value(parser, action)}" for o in action.option_strings)
        rows.append(f"| {_code(names)} | {_cell(default)} | {_cell(meaning)} |")
    if not rows:
        return ["No options."]
    return ["| option | default | meaning |", "|---|---|---|", *rows]


def _arguments(parser: argparse.ArgumentParser) -> list[str]:
    lines = []
    for action in parser._actions:
        if action.option_strings or isinstance(action, argparse._SubParsersAction):
            continue
        name = action.metavar or action.dest.upper()
        optional = " (optional)" if action.nargs in ("?", "*") else ""
        lines.append(f"- `{name}`{optional}: {_cell(_expand(action))}")
    return lines


def _anchor(name: str) -> str:
    """GitHub's anchor of the heading `` `edgespec NAME` ``."""
    return re.sub(r"[^\w\- ]", "", f"edgespec {name}".lower()).replace(" ", "-")


def reference() -> str:
    parser = build_parser()
    commands = _commands(parser)
    lines = [HEADER, "| command | what it does |", "|---|---|"]
    lines += [f"| [`edgespec {name}`](#{_anchor(name)}) | {_cell(summary)} |"
              for name, summary, _ in commands]
    for name, summary, sub in commands:
        lines += ["", f"## `edgespec {name}`", ""]
        text = sub.description or (summary[:1].upper() + summary[1:] + ".")
        lines.append(text)
        guide = GUIDES.get(name.split()[0])
        if guide:
            lines += ["", f"Guide: [{guide.split('#')[0].removeprefix('../')}]({guide})."]
        args = _arguments(sub)
        if args:
            lines += ["", "Arguments:", "", *args]
        lines += ["", *_options_table(sub)]
    return "\n".join(lines) + "\n"


def main() -> int:
    sys.stdout.write(reference())
    return 0


if __name__ == "__main__":
    sys.exit(main())
