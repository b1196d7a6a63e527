"""The shape the health issue set for the code, kept: a Session under 20 methods, chat.py
at or under 300 lines, no command handler reaching through the saving side to the session, start-up
decisions in one frozen Plan, one Store for a whole run. (Module sizes, the design's module list and
the import layers: test_layers.py; what the README must say: test_readme.py.)"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from cli_helpers import chat_here

import colichat

ROOT = Path(colichat.__file__).parent


def _class(path: Path, name: str) -> ast.ClassDef:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def test_session_has_fewer_than_20_methods():
    session = _class(ROOT / "persist" / "session.py", "Session")
    methods = [n.name for n in session.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert len(methods) < 20, methods


def test_chat_py_is_at_most_300_lines():
    assert len((ROOT / "chat.py").read_text(encoding="utf-8").splitlines()) <= 300


def test_no_module_reaches_through_the_saving_side_to_the_session():
    chains = {p.name: m for p in ROOT.rglob("*.py")
              if (m := re.findall(r"\w+\.saving\.session\.\w+", p.read_text(encoding="utf-8")))}
    assert chains == {}


def test_command_handlers_reach_what_is_saved_only_through_the_history():
    touching = [f"{name}:{n.lineno}" for name in ("commands.py", "repl.py", "app.py")
                for n in ast.walk(ast.parse((ROOT / name).read_text(encoding="utf-8")))
                if isinstance(n, ast.Attribute) and n.attr in ("saving", "session", "cache")]
    assert touching == []


def test_the_start_plan_is_frozen():
    from colichat.start import Plan

    assert dataclasses.is_dataclass(Plan) and Plan.__dataclass_params__.frozen


def test_one_store_serves_a_whole_run(colichat_home, default_model, monkeypatch):
    from colichat.persist.store import Store

    made = []
    init = Store.__init__
    monkeypatch.setattr(Store, "__init__", lambda self, *a, **k: (made.append(self), init(self, *a, **k))[1])
    run = chat_here(colichat_home, ["--session", "one", "--max-tokens", "4"], "hello\n/sessions\n/fork 1\nhi\n")
    assert run.rc == 0, run.err
    assert len(made) == 1

