"""User errors are typed one-line errors; a caller bug is a traceback, never a line.

A user error (a bad file, option or input, damaged data, an unsupported model) is one of
errors.USER_ERRORS, raised `from None`, and the CLI and the REPL show it as one line (the many cases:
test_cli_errors.py). Anything else, a plain ValueError included, is a bug of colichat: nothing may
catch it on the way out. The scan below holds the code to that: no `except ValueError`,
`except Exception` or `except BaseException` (nor contextlib.suppress of them) outside the spots
listed here, each with the reason its catch cannot hide a bug. A handler that re-raises (ends with a
bare `raise`: clean up, then let it go) hides nothing and needs no entry.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

import colichat
from colichat.errors import USER_ERRORS, ChatError

ROOT = Path(colichat.__file__).parent
BROAD = {"ValueError", "Exception", "BaseException"}

ALLOWED = {  # (file, function) -> why its broad catch cannot hide a bug
    ("terminal/cli.py", "<module>"): "Ctrl-C during the imports: anything else is raised again",
    ("terminal/streams.py", "discard"): "the stdlib's ValueError of a closed stream (fileno) while pointing it "
                                        "at /dev/null",
    ("terminal/app.py", "App._show_cut"): "the stdlib's ValueError of a closed stdout (fileno) while writing ^C",
    ("terminal/streams.py", "terminal_size"): "the stdlib's ValueError of a closed stream (fileno) asking the "
                                              "terminal's size",
    ("terminal/repl.py", "keys_wait"): "the stdlib's ValueError of a closed stdin (fileno) before termios",
    ("terminal/commands.py", "_int_arg"): "int() of what the user typed; becomes a ChatError",
    ("engine/sampler.py", "Sampler.state"): "int() of a sidecar's hex strings and numpy's check of a PCG64 "
                                            "state; becomes one ValueError: not a random state",
    ("conversation/chat_settings.py", "ChatSettings.apply_saved"): "that ValueError of a damaged saved random "
                                                                   "state: the seed's first numbers instead",
    ("conversation/settings.py", "Setting.parse"): "int()/float() of what the user typed; becomes a SettingError",
    ("terminal/commands.py", "write_export"): "os.open() of a file name the user typed with a NUL in it; becomes "
                                              "a ChatError",
    ("persist/sidecar.py", "document"): "json.loads of a file's bytes: an integer of over 4,300 digits is a plain "
                                        "ValueError, not a JSONDecodeError; the sidecar is damaged",
    ("engine/model.py", "available_memory"): "int() of the kernel's /proc/meminfo text: no number, no limit",
    ("engine/gguf/tensors.py", "_open_one"): "gguf-py (a library) raises any type on a damaged file; that becomes "
                                     "a ModelError",
    ("engine/text/template.py", "ChatTemplate.render"): "expressions of the model's own chat template raise any "
                                                   "type; that becomes a TemplateError (a ModelError)",
    ("persist/kvfile.py", "read_records.second_half"): "the reading thread's exception, raised again in the "
                                                       "caller's thread",
    ("hints.py", "read_hint"): "the parsing of a hint file's bytes (json.loads, np.load: any error of what they "
                               "hold, a 5,001-digit integer's ValueError, deep nesting's RecursionError); the hint "
                               "is ignored and rebuilt, the problem said",
    ("engine/gguf/prepared.py", "Prepared.__init__"): "a cache entry's record of a quantized matrix checked against "
                                                     "the GGUF (Tensors.qmatrix's shape checks): the entry is damaged",
    ("persist/listing.py", "_timestamp"): "datetime.fromisoformat() of a sidecar's text: not a time, the "
                                        "file's own",
}


def _names(node) -> set[str]:
    if node is None:
        return {"BaseException"}  # a bare except
    elts = node.elts if isinstance(node, ast.Tuple) else [node]
    return {e.attr if isinstance(e, ast.Attribute) else getattr(e, "id", "?") for e in elts}


def broad_catches() -> list[tuple[str, str, int]]:
    """(file, function, line) of every broad catch in colichat/ that does not re-raise."""
    found = []

    def visit(node, rel, where):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            where = node.name if where == "<module>" else f"{where}.{node.name}"
        if isinstance(node, ast.ExceptHandler) and _names(node.type) & BROAD:
            last = node.body[-1]
            if not (isinstance(last, ast.Raise) and last.exc is None):
                found.append((rel, where, node.lineno))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "suppress":
            if set().union(*map(_names, node.args)) & BROAD:
                found.append((rel, where, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, rel, where)

    for path in sorted(ROOT.rglob("*.py")):
        visit(ast.parse(path.read_text(encoding="utf-8")), path.relative_to(ROOT).as_posix(), "<module>")
    return found


def test_no_broad_catch_outside_the_listed_spots():
    found = broad_catches()
    stray = [f"colichat/{f}:{line} in {where}" for f, where, line in found if (f, where) not in ALLOWED]
    assert not stray, "a catch of ValueError/Exception that may hide a bug (catch the typed error):\n" + \
        "\n".join(stray)
    stale = set(ALLOWED) - {(f, where) for f, where, _ in found}
    assert not stale, f"listed spots with no broad catch left (drop them): {sorted(stale)}"


def _typed_names() -> set[str]:
    """The names of the user errors and of every subclass of them."""
    names, todo = set(), list(USER_ERRORS)
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo += cls.__subclasses__()
    return names


def test_a_user_error_raised_in_an_except_block_is_raised_from_none():
    """`raise SessionError(...) from None` inside a handler: the user sees one line, not the chain."""
    import colichat.engine.text.template  # noqa: F401  (TemplateError, a ModelError, is defined there)
    import colichat.persist.locks  # noqa: F401  (SessionBusy, a SessionError: whatever this run imported before)

    typed, chained = _typed_names(), []
    for path in sorted(ROOT.rglob("*.py")):
        for handler in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(handler, ast.ExceptHandler):
                continue
            for node in ast.walk(handler):
                if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                    name = getattr(node.exc.func, "id", getattr(node.exc.func, "attr", ""))
                    from_none = isinstance(node.cause, ast.Constant) and node.cause.value is None
                    if name in typed and not from_none:
                        chained.append(f"colichat/{path.relative_to(ROOT).as_posix()}:{node.lineno} {name}")
    assert "TemplateError" in typed and "SessionBusy" in typed
    assert not chained, "\n".join(chained)


def test_the_scan_finds_a_broad_catch(tmp_path, monkeypatch):
    """The scan itself: a module with `except ValueError` that swallows is found, one that re-raises is not."""
    (tmp_path / "m.py").write_text("def f():\n    try:\n        g()\n    except (KeyError, ValueError):\n"
                                   "        pass\n\n\ndef h():\n    try:\n        g()\n    except Exception:\n"
                                   "        cleanup()\n        raise\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert broad_catches() == [("m.py", "f", 4)]


def _app(ask):
    from colichat.terminal.app import App
    from colichat.terminal.streams import StatusLine

    class Conv:
        model = SimpleNamespace(warming=lambda: None)  # (a model without experts warming)

    conv = Conv()
    conv.ask = ask
    status = StatusLine()
    status.tty = False
    return App(conv, interactive=False, status=status)


def test_a_user_error_in_a_message_is_one_line_and_counted(capsys):
    def ask(text, **kw):
        raise ChatError("the message needs 9 tokens but only 2 are left")

    app = _app(ask)
    app.handle("hello")
    assert capsys.readouterr().err == "colichat: the message needs 9 tokens but only 2 are left\n"
    assert app.errors == 1


def test_a_caller_bug_in_a_message_is_a_traceback_not_a_line(capsys):
    def ask(text, **kw):
        raise ValueError("turns end at record 9, past the cache length 4")  # what persist raises for a bug

    app = _app(ask)
    with pytest.raises(ValueError, match="past the cache length"):
        app.handle("hello")
    assert "colichat:" not in capsys.readouterr().err


def test_a_caller_bug_while_saving_is_not_reported_as_not_saved(tmp_path):
    """An answer's save turns a full disk (OSError) into "NOT saved: ..."; a ValueError from the session
    is a bug and goes up."""
    from conftest import TINY

    from colichat.conversation.chat import Conversation, Settings
    from colichat.engine import load
    from colichat.persist import Store

    class Session:  # the session in use, its append failing as told
        name, notes, on_disk = "s", [], True

        def __init__(self, error):
            self.error = error

        def append(self, cache, turns, sampler=None, keep=None):
            raise self.error

    conv = Conversation(load(str(TINY / "llama.gguf"), n_ctx=256), Settings(temperature=0, max_tokens=2),
                        store=Store(tmp_path / "s"))
    conv.session = Session(OSError(28, "No space left on device"))
    _, stats = conv.ask("hello")
    assert stats.saved is False and stats.save_error == "[Errno 28] No space left on device"
    conv.session = Session(ValueError("turn 'user' [0, 3) does not start at record 2"))
    with pytest.raises(ValueError):
        conv.ask("hello again")
    conv.session = None


def test_the_user_errors_are_the_projects_types():
    from colichat.conversation.settings import SettingError
    from colichat.engine import ModelError
    from colichat.engine.text.template import TemplateError
    from colichat.models.default import DefaultModelMissing
    from colichat.persist import SessionBusy, SessionError, SessionExists

    assert set(USER_ERRORS) == {ChatError, SettingError, ModelError, SessionError, DefaultModelMissing}
    assert all(issubclass(e, USER_ERRORS) for e in (TemplateError, SessionBusy, SessionExists))
    assert not any(issubclass(ValueError, e) or issubclass(e, ValueError) for e in USER_ERRORS)
