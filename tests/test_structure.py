"""The shape the health issues set for the code, kept as behaviour: a command runs against a
conversation with no terminal and changes what is saved, each verb is the conversation's and only it
writes a session, start-up decisions in one frozen Plan, one Store for a whole run. (The design's
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


VERBS = ("ask", "rewind", "reset", "forget", "fork", "save_as", "rename", "new", "resume", "close")


def test_each_verb_of_a_conversation_is_defined_once_above_persist():
    """A command's verb is the Conversation's (conversation/chat.py), not forwarded through another
    object on its way to persist/."""
    defined = sorted(f"{p.relative_to(ROOT)}:{c.name}.{f.name}"
                     for folder in ("conversation", "terminal") for p in (ROOT / folder).rglob("*.py")
                     for c in ast.walk(ast.parse(p.read_text(encoding="utf-8"))) if isinstance(c, ast.ClassDef)
                     for f in c.body if isinstance(f, ast.FunctionDef) and f.name in VERBS)
    assert defined == sorted(f"conversation/chat.py:Conversation.{v}" for v in VERBS)


def test_only_the_conversation_writes_a_session():
    """Above persist/, the session's writes (append, truncate, fork, rename, save_sampler) are called
    from conversation/chat.py alone."""
    writes = re.compile(r"\b(session|parent|copy)\.(append|truncate|fork|save_sampler)\(|store\.rename\(")
    callers = sorted({str(p.relative_to(ROOT)) for folder in ("conversation", "terminal", "models")
                      for p in (ROOT / folder).rglob("*.py") if writes.search(p.read_text(encoding="utf-8"))})
    assert callers == ["conversation/chat.py"]


def test_command_handlers_reach_what_is_saved_only_through_the_conversation():
    touching = [f"{name}:{n.lineno}" for name in ("terminal/commands.py", "terminal/repl.py", "terminal/app.py")
                for n in ast.walk(ast.parse((ROOT / name).read_text(encoding="utf-8")))
                if isinstance(n, ast.Attribute) and n.attr in ("session", "cache", "store")]
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

