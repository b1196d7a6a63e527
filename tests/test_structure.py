"""The shape the health issues set for the code, kept as behaviour: a command runs against a
conversation with no terminal and changes what is saved, no command handler reaches through the saving
side to the session, start-up decisions in one frozen Plan, one Store for a whole run. (The design's
module list and the import direction between the folders: test_layers.py; what the README must say:
test_readme.py.)"""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
from pathlib import Path

from cli_helpers import chat_here

import colichat
from colichat.persist import Store

ROOT = Path(colichat.__file__).parent


class NoTerminal:
    """A standard stream that is not there: any use of it fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"a command used the terminal ({name})")


def test_a_command_runs_against_a_conversation_with_no_terminal(tmp_path, monkeypatch):
    from app_helpers import Recorder, run
    from conftest import TINY

    from colichat.conversation.chat import Conversation, Settings
    from colichat.engine import load

    store = Store(tmp_path / "s")
    conv = Conversation(load(str(TINY / "llama.gguf"), n_ctx=256), Settings(temperature=0, max_tokens=4),
                        store=store)
    app = Recorder(conv)
    for stream in ("stdin", "stdout", "stderr", "__stdin__", "__stdout__", "__stderr__"):
        monkeypatch.setattr(sys, stream, NoTerminal())
    try:
        run(app, "hello")
        named = run(app, "/rename first")
        forked = run(app, "/fork 1")
        saved = sorted((i.turns, i.parent or "", i.name == "first") for i in store.list())
    finally:
        monkeypatch.undo()
        conv.close()
    assert app.errors == 0, named + forked
    assert saved == [(2, "", True), (2, "first", False)], (saved, named, forked)  # the fork: 1 exchange


def test_no_module_reaches_through_the_saving_side_to_the_session():
    chains = {p.name: m for p in ROOT.rglob("*.py")
              if (m := re.findall(r"\w+\.saving\.session\.\w+", p.read_text(encoding="utf-8")))}
    assert chains == {}


def test_command_handlers_reach_what_is_saved_only_through_the_history():
    touching = [f"{name}:{n.lineno}" for name in ("terminal/commands.py", "terminal/repl.py", "terminal/app.py")
                for n in ast.walk(ast.parse((ROOT / name).read_text(encoding="utf-8")))
                if isinstance(n, ast.Attribute) and n.attr in ("saving", "session", "cache")]
    assert touching == []


def test_the_start_plan_is_frozen():
    from colichat.terminal.start import Plan

    assert dataclasses.is_dataclass(Plan) and Plan.__dataclass_params__.frozen


def test_one_store_serves_a_whole_run(colichat_home, default_model, monkeypatch):
    made = []
    init = Store.__init__
    monkeypatch.setattr(Store, "__init__", lambda self, *a, **k: (made.append(self), init(self, *a, **k))[1])
    run = chat_here(colichat_home, ["--session", "one", "--max-tokens", "4"], "hello\n/sessions\n/fork 1\nhi\n")
    assert run.rc == 0, run.err
    assert len(made) == 1

