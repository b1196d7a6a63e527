"""The start Plan (colichat/terminal/start.py) carries every option of a chat: once it is made, nothing reads or
changes the command line (argparse's namespace) again."""

from __future__ import annotations

import dataclasses
import re

from cli_helpers import TINY_ARGS, chat_here, lines, saved_turns

from colichat.conversation.settings import TABLE
from colichat.terminal import cli
from colichat.terminal.start import Plan

# The options that are not a chat's (they print or tidy, then exit: one_shot.py), argparse's own, and
# those the Plan holds as a decision made from them rather than as given.
NOT_A_CHAT = {"sessions", "export", "models", "prune_kv", "yes", "all"}  # (--yes, --all: --prune-kv's)
DECIDED = {"plain": "interactive", "no_reuse": "reuse"}


def test_every_option_of_a_chat_is_a_field_of_the_plan():
    fields = {f.name for f in dataclasses.fields(Plan)}
    settings = {row.name for row in TABLE}  # in Plan.settings
    options = set(vars(cli.parse_args([]))) - NOT_A_CHAT - {"not_utf8"} - settings
    assert {DECIDED.get(name, name) for name in options} <= fields
    assert {"settings", "given"} <= fields


def forgetting_the_command_line(monkeypatch):
    """start.plan as cli.main calls it, then the namespace emptied: a later read of an option raises."""
    made = []

    def plan_then_forget(args, *rest):
        made.append(cli_plan(args, *rest))
        vars(args).clear()
        return made[-1]

    cli_plan = cli.start_plan
    monkeypatch.setattr(cli, "start_plan", plan_then_forget)
    return made


def test_nothing_reads_the_command_line_after_the_plan_is_made(colichat_home, monkeypatch):
    made = forgetting_the_command_line(monkeypatch)
    options = ["--kv", "fp8", "--no-reuse", "--auto-forget", "--verbose", "--expert-cache", "1", "--seed", "3"]
    run = chat_here(colichat_home, [*TINY_ARGS, *options, "--session", "p", "-p", "Hello"]).ok()
    assert "note: --expert-cache has no effect" in run.err and "from " in run.err.splitlines()[0]
    again = chat_here(colichat_home, [*TINY_ARGS, "--session", "p", "--no-save"], lines("/show", "Hi")).ok()
    assert re.search(r"^seed +3$", again.err, re.M) and "kept as" not in again.err  # (no --kv given: no note)
    kv = next(colichat_home.rglob("p.coli_kv")).read_bytes()
    assert kv[:8] == b"COLIGQ2\0"  # ... and the conversation kept its fp8 records (a GQA model's magic)
    assert [role for role, _ in saved_turns(colichat_home, "p")] == ["user", "assistant"]  # --no-save kept it
    plans = [p for p in made if isinstance(p, Plan)]
    assert [p.resume for p in plans] == [False, True] and plans[0].kv == "fp8" and not plans[0].reuse
    assert plans[0].auto_forget and plans[0].verbose and plans[0].expert_cache == 1 and plans[0].prompt == "Hello"
    assert plans[1].no_save and plans[0].given == {"temperature", "repeat_penalty", "max_tokens", "seed"}
