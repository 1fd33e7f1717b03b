"""docs/commands.md against the real command line: every command and option documented, none stale.

The doc's layout this relies on (docs/commands.md says so at its top):

- one section per command, a level-2 heading that starts with the command in backticks:
  "## `specx ingest PATH...`", "## `specx bench cost`" (the lowercase words after `specx` name
  the command; what follows, such as PATH..., is free);
- inside a command's section, an option written outside backticks, or in a backtick span or a
  code-block line that starts with the option (`--db PATH`), belongs to that command; one that
  follows `specx <command>` in a span or a code-block line (`specx entropy --cost-curve F`, in any
  section) belongs to that command; one in a span or code line of another program
  (`vllm serve ... --speculative-config`, `examples/text2sql_bench.py --shots 0`) is not checked.

Checked: each command (groups only when they have options of their own) has a section; each of its
long options is mentioned in that section (`--no-X`, the automatic negative of `--X`, may be left
out; `--help` is never needed); and no option is attributed to a command that lacks it, anywhere in
the doc. The CLI is walked in-process (typer.main.get_command): no model is loaded.

SPECX_COMMANDS_DOC=path checks another file (e.g. an older revision of the doc).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import typer

from specx.commands.app import app

DOC = Path(os.environ.get("SPECX_COMMANDS_DOC") or Path(__file__).resolve().parents[1] / "docs" / "commands.md")

OPTION = re.compile(r"(?<![\w=-])--[A-Za-z][\w-]*")
SPAN = re.compile(r"`([^`\n]+)`")
SECTION = re.compile(r"^##\s+`specx((?:\s+[a-z][a-z0-9-]*)*)(?=[\s`])")
INVOCATION = re.compile(r"(?<![\w./$-])specx((?:\s+[a-z][a-z0-9-]*)*)")


@dataclass
class Command:
    path: str  # "ingest", "bench cost"; "" for specx itself
    required: set[str] = field(default_factory=set)
    allowed: set[str] = field(default_factory=set)


def cli_commands() -> dict[str, Command]:
    """Every command of the typer app, leaf commands always, groups when they have options."""
    commands: dict[str, Command] = {}

    def walk(cmd, path: list[str]) -> None:
        if getattr(cmd, "hidden", False):
            return
        entry = Command(" ".join(path))
        for param in cmd.params:
            if getattr(param, "param_type_name", None) != "option":
                continue
            names = [n for n in (*param.opts, *param.secondary_opts) if n.startswith("--") and n != "--help"]
            entry.allowed.update(names)
            if getattr(param, "hidden", False):
                continue
            entry.required.update(n for n in param.opts if n.startswith("--") and n != "--help")
            # a bool's automatic `--no-X` may go unmentioned; a chosen name (`--path`, `--fixed-size`) may not
            entry.required.update(n for n in param.secondary_opts
                                  if n.startswith("--") and not (n.startswith("--no-") and f"--{n[5:]}" in param.opts))
        subcommands = getattr(cmd, "commands", None)
        if subcommands is None or entry.allowed:
            commands[entry.path] = entry
        for name, sub in (subcommands or {}).items():
            walk(sub, path + [name])

    walk(typer.main.get_command(app), [])
    return commands


def _command_at(words: str, known) -> str:
    """The longest known command path that `words` (what follows `specx`) starts with."""
    parts = words.split()
    for n in range(len(parts), -1, -1):
        if " ".join(parts[:n]) in known:
            return " ".join(parts[:n])
    return ""


@dataclass
class Doc:
    sections: dict[str, list[str]]  # command path -> the option names its own section gives it
    mentions: list[tuple[str, str, int]]  # (command path, option, line number) for every attributed option
    problems: list[str]


def parse_doc(text: str, known) -> Doc:
    doc = Doc({}, [], [])
    section: str | None = None  # the command whose section we are in; None outside command sections
    in_code = False

    def attribute(fragment: str, line_no: int) -> None:
        """Options of a backtick span or a code line: after `specx CMD` they are CMD's; when the
        fragment starts with an option, the section's; else another program's (not checked)."""
        owner, pos = None, 0
        stripped = fragment.lstrip()
        if stripped.startswith("--"):
            owner = section
        for match in INVOCATION.finditer(fragment):
            for opt in OPTION.findall(fragment, pos, match.start()):
                record(owner, opt, line_no)
            owner, pos = _command_at(match.group(1), known), match.end()
        for opt in OPTION.findall(fragment, pos):
            record(owner, opt, line_no)

    def record(owner: str | None, opt: str, line_no: int) -> None:
        if owner is None:
            return
        doc.mentions.append((owner, opt, line_no))
        if owner == section:
            doc.sections[section].append(opt)

    for line_no, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if not in_code and line.startswith("## "):
            match = SECTION.match(line)
            section = None
            if match:
                path = " ".join(match.group(1).split())
                if path not in known:
                    doc.problems.append(f"line {line_no}: a section for {_name(path)}, which is no command")
                elif path in doc.sections:
                    doc.problems.append(f"line {line_no}: a second section for {_name(path)}")
                else:
                    section = path
                    doc.sections[path] = []
            continue
        if in_code:
            attribute(line, line_no)
            continue
        for span in SPAN.finditer(line):
            attribute(span.group(1), line_no)
        prose = SPAN.sub(" ", line)
        if section is not None:
            for opt in OPTION.findall(prose):
                record(section, opt, line_no)
    return doc


def _name(path: str) -> str:
    return f"`specx {path}`" if path else "`specx`"


def known_paths(commands: dict[str, Command]) -> set[str]:
    """Command paths a heading or an invocation may name: the commands and the groups above them."""
    paths = {""}
    for path in commands:
        parts = path.split()
        paths.update(" ".join(parts[:n]) for n in range(len(parts) + 1))
    return paths


def doc_problems(text: str, commands: dict[str, Command]) -> dict[str, list[str]]:
    """{"commands": [...], "missing options": [...], "stale options": [...]} of problems."""
    doc = parse_doc(text, known_paths(commands))
    problems: dict[str, list[str]] = {"commands": list(doc.problems), "missing options": [], "stale options": []}
    for path, command in sorted(commands.items()):
        if path not in doc.sections:
            problems["commands"].append(f"{_name(path)} has no section (a heading \"## {_name(path)}\")")
            continue
        missing = sorted(command.required - set(doc.sections[path]))
        if missing:
            problems["missing options"].append(f"{_name(path)}: {', '.join(missing)} not in its section")
    for owner, opt, line_no in doc.mentions:
        command = commands.get(owner)
        allowed = command.allowed if command is not None else set()
        if opt != "--help" and opt not in allowed:
            problems["stale options"].append(f"line {line_no}: {opt} given to {_name(owner)}, which has no such "
                                             "option")
    return problems


@pytest.fixture(scope="module")
def commands() -> dict[str, Command]:
    return cli_commands()


@pytest.fixture(scope="module")
def problems(commands) -> dict[str, list[str]]:
    return doc_problems(DOC.read_text(encoding="utf-8"), commands)


def test_the_cli_is_walked(commands):
    # the walk itself: sub-commands of groups, aliases, custom negative names
    assert {"ingest", "serve", "bench index", "bench cost"} <= set(commands)
    assert {"--model", "--tokenizer"} <= commands["ingest"].required
    assert "--path" in commands["replay"].required and "--no-warm" not in commands["replay"].required
    assert "--no-warm" in commands["replay"].allowed
    assert all("--help" not in c.allowed for c in commands.values())


def test_every_command_has_a_section(problems):
    assert not problems["commands"], f"{DOC}:\n" + "\n".join(problems["commands"])


def test_every_option_is_documented(problems):
    assert not problems["missing options"], f"{DOC}:\n" + "\n".join(problems["missing options"])


def test_no_documented_option_is_stale(problems):
    assert not problems["stale options"], f"{DOC}:\n" + "\n".join(problems["stale options"])


def test_the_check_catches_what_it_should(commands):
    """A doc that passes stops passing when an option is made up, one is dropped, a section goes."""
    text = DOC.read_text(encoding="utf-8")
    if any(doc_problems(text, commands).values()):
        pytest.skip("the doc itself fails (reported by the tests above)")
    made_up = text + "\n\n```bash\nspecx ls --no-such-option\n```\n"
    assert any("--no-such-option" in p for p in doc_problems(made_up, commands)["stale options"])
    dropped = re.sub(r"(?<![\w=-])--prefix-cache-tokens\b", "--prefix-cache", text)
    found = doc_problems(dropped, commands)
    assert any("--prefix-cache-tokens" in p for p in found["missing options"])
    assert any("--prefix-cache" in p for p in found["stale options"])
    no_check = re.sub(r"(?m)^## `specx check`", "## the store check", text)
    assert any("`specx check`" in p for p in doc_problems(no_check, commands)["commands"])
    other_program = text + "\n\n`vllm serve M --speculative-config {}` and `examples/x.py --shots 0`\n"
    assert not any(doc_problems(other_program, commands).values())
