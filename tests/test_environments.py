"""colichat in the settings a user's machine gives it: a locale without UTF-8, a dumb terminal, a
model path with `~` the shell did not expand. The tiny random-weight llama answers gibberish (U+FFFD
and other non-ASCII characters included), which is what the encodings are checked with."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import pytest
from cli_helpers import (
    CHAT,
    TINY_ARGS,
    TINY_LLAMA,
    _usable,
    answers_bytes,
    chat,
    env_for,
    lines,
    saved_answers,
    saved_users,
)

C_LOCALE = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0"}  # a C locale with Python's UTF-8 mode off


@pytest.mark.process
def test_messages_and_answers_are_utf8_through_pipes_whatever_the_locale(colichat_home):
    """Piped messages are read as UTF-8 (no 'not UTF-8' note for text that is), and the answers,
    /history and the saved conversation hold the same text as in a UTF-8 locale."""
    message = "héllo wörld ☃"
    run = chat(colichat_home, [*TINY_ARGS, "--session", "loc"], lines(message, "/history"), env_extra=C_LOCALE).ok()
    assert "not UTF-8" not in run.err
    assert saved_users(colichat_home, "loc") == [message]
    answers = saved_answers(colichat_home, "loc")
    assert not answers[0].isascii()  # the tiny model's gibberish: the check below needs a non-ASCII answer
    assert run.out == answers_bytes(answers)
    assert f"user> {message}" in run.err.splitlines()


@pytest.mark.process
def test_piped_messages_are_utf8_whatever_pythonioencoding_says(colichat_home):
    """PYTHONIOENCODING=ascii: the UTF-8 messages are read as they are (no traceback), and the
    answers are written in ASCII as asked, a character it cannot hold replaced."""
    message = "héllo wörld ☃"
    env = {**C_LOCALE, "PYTHONUTF8": "1", "PYTHONIOENCODING": "ascii"}
    run = chat(colichat_home, [*TINY_ARGS, "--session", "io"], lines(message), env_extra=env).ok()
    assert "not UTF-8" not in run.err
    assert saved_users(colichat_home, "io") == [message]
    assert run.out == b"".join(a.encode("ascii", "replace") + b"\n" for a in saved_answers(colichat_home, "io"))


@pytest.mark.process
def test_a_message_and_system_prompt_on_the_command_line_are_utf8_whatever_the_locale(colichat_home):
    """-p and --system typed in a C locale (Python decodes their non-ASCII bytes as surrogates) are
    the UTF-8 text that was typed."""
    run = chat(colichat_home, [*TINY_ARGS, "--session", "arg", "--system", "sé", "-p", "héllo ☃"],
               env_extra=C_LOCALE).ok()
    assert saved_users(colichat_home, "arg") == ["héllo ☃"]
    shown = chat(colichat_home, [*TINY_ARGS, "--session", "arg"], lines("/set system")).ok()
    assert "system = sé" in shown.err.splitlines()
    assert run.out == answers_bytes(saved_answers(colichat_home, "arg"))
    assert "not UTF-8" not in run.err


@pytest.mark.process
def test_a_message_on_the_command_line_that_is_not_utf8_says_so(colichat_home):
    """-p with a byte that is not UTF-8 (Latin-1 text, say): read as U+FFFD, with one note, as a piped
    line is (it was replaced in silence)."""
    run = chat(colichat_home, [*TINY_ARGS, "--session", "bad", "-p", os.fsdecode(b"caf\xe9 ok")]).ok()
    assert saved_users(colichat_home, "bad") == ["caf\ufffd ok"]
    assert run.err.splitlines().count("note: the text of -p is not UTF-8: its invalid bytes are read as U+FFFD") == 1


@pytest.mark.process
def test_a_model_path_with_a_tilde_the_shell_left_is_the_home_directory(colichat_home, tmp_path):
    """`--model=~/m.gguf` (bash expands no ~ there) and a quoted '~/m.gguf' name a file in $HOME."""
    home = tmp_path / "user"
    home.mkdir()
    os.symlink(TINY_LLAMA, home / "m.gguf")
    args = [a for a in TINY_ARGS if a not in ("--model", TINY_LLAMA)]
    for given in (["--model=~/m.gguf"], ["--model", "~/m.gguf"]):
        run = chat(colichat_home, [*given, *args, "-p", "hello"], env_extra={"HOME": str(home)}).ok()
        assert len(run.footers()) == 1


def _run_on_a_terminal(home, args, steps, env_extra) -> bytes:
    """Everything colichat writes to a terminal (stdin, stdout and stderr on one pty) until it exits;
    `steps` are (what it shows, what is typed then), in order."""
    main, child = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "colichat.terminal.launch", *args], stdin=child, stdout=child,
                         stderr=child, env=env_for(home, **env_extra), cwd=str(home), start_new_session=True)
    os.close(child)
    got, steps, deadline = b"", list(steps), time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            if steps and steps[0][0] in got:
                os.write(main, steps.pop(0)[1])
            if not select.select([main], [], [], 1)[0]:
                continue
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: colichat exited, nothing has the terminal open
                break
            if not chunk:
                break
            got += chunk
        assert p.wait(timeout=60) == 0, got.decode("utf-8", "replace")
    finally:
        if p.poll() is None:
            p.kill()
        os.close(main)
    return got


@pytest.mark.process
def test_a_dumb_terminal_gets_no_escape_sequences(colichat_home):
    """TERM=dumb (an editor's shell buffer, which edits the line itself): colichat chats in line mode
    without --plain, and the start line, the loading progress and the footer are plain text: carriage
    returns and spaces, never an escape sequence (the REPL wrote some)."""
    steps = [(b"Ctrl-D to quit.", b"hello\n"), (b"max_tokens reached", b"\x04")]
    shown = _run_on_a_terminal(colichat_home, TINY_ARGS, steps, {"TERM": "dumb"})
    assert b"Line mode: type a message and Enter" in shown
    assert b"starting colichat ..." in shown and b"loading llama.gguf" in shown  # the transient lines were shown
    assert b"max_tokens reached" in shown  # the footer: the message was answered
    assert b"\x1b" not in shown


def test_no_home_directory_is_one_line_that_says_what_to_set(monkeypatch):
    """HOME unset and no home in passwd (a container's arbitrary uid, `env -i`): where to keep
    conversations is unknown, and colichat says what to set instead of failing in platformdirs."""
    import pwd

    from colichat.paths import paths
    from colichat.persist import SessionError

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.delenv("COLICHAT_HOME", raising=False)
    monkeypatch.delenv("HOME", raising=False)
    for xdg in ("XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(xdg, raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    with pytest.raises(SessionError, match="set HOME, or COLICHAT_HOME to a directory for colichat's files"):
        paths()


@pytest.mark.process
def test_no_home_directory_refuses_the_start_in_one_line(tmp_path):
    """The same, end to end: a user with no passwd entry and no HOME."""
    prefix = _usable(["unshare", "--user", "--map-user=12345", "--map-group=12345"],
                     "running colichat as a user with no passwd entry")
    env = {k: v for k, v in env_for(tmp_path).items() if k not in ("HOME", "COLICHAT_HOME")}
    p = subprocess.run([*prefix, *CHAT, *TINY_ARGS, "--session", "x", "-p", "hello"], capture_output=True,
                       text=True, env=env, cwd=str(tmp_path), timeout=300)
    assert "Traceback" not in p.stderr and p.returncode == 1, p.stderr
    assert p.stderr.splitlines()[-1].startswith("colichat: cannot tell where to keep conversations: HOME is not set")
    assert list(tmp_path.iterdir()) == []  # nothing written in the working directory instead


@pytest.fixture
def no_home(monkeypatch):
    """HOME unset and no home directory in passwd, in this process."""
    import pwd

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)


def test_a_tilde_without_a_home_directory_says_so_not_no_such_file(no_home, monkeypatch):
    """`~` with no home directory to stand for: each place that expands it (COLICHAT_HOME, /export's
    FILE; --model below) says that ~ cannot be expanded and what to give instead, in the error of the
    place (a start's, a command's)."""
    from colichat.errors import ChatError
    from colichat.paths import paths
    from colichat.persist import SessionError
    from colichat.terminal.commands import export_path

    monkeypatch.setenv("COLICHAT_HOME", "~/colichat")
    with pytest.raises(SessionError, match=r"^COLICHAT_HOME=~/colichat: ~ cannot be expanded: HOME is not set "
                       r"\(or not an absolute path\) and this user has no home directory; give the full path"):
        paths()
    with pytest.raises(ChatError, match=r"^~/notes.md: ~ cannot be expanded: .*; give the full path, or set HOME$"):
        export_path("~/notes.md", "talk")
    assert export_path("notes.md", "talk") == ("notes.md", False)  # no ~: nothing to expand


@pytest.mark.parametrize("home", ["", "relative/dir"], ids=["empty", "relative"])
def test_a_tilde_with_home_empty_or_relative_is_the_home_directory_in_the_user_database(monkeypatch, home):
    """HOME= (empty) or relative: ~ is the user's home in the user database, as platformdirs takes it
    (Python's expanduser made '~/x.gguf' '/x.gguf' of an empty HOME: 'no such file: /x.gguf')."""
    import pwd

    from colichat.errors import UsageError
    from colichat.paths import expand_home

    monkeypatch.setenv("HOME", home)
    mine = pwd.getpwuid(os.getuid()).pw_dir
    assert expand_home("~/x.gguf", UsageError) == os.path.join(mine, "x.gguf")
    assert expand_home("~", UsageError) == mine


def test_a_tilde_of_a_user_that_does_not_exist_names_that_user():
    """`~nosuchuser/m.gguf`: the user is unknown, whatever HOME is; the line says that, not that HOME is unset."""
    from colichat.errors import UsageError
    from colichat.paths import expand_home

    with pytest.raises(UsageError, match=r"^--model ~nosuchuser/m.gguf: there is no user nosuchuser whose home "
                       r"directory ~nosuchuser would be; give the full path$"):
        expand_home("~nosuchuser/m.gguf", UsageError, "--model ")
    assert expand_home("~root/m.gguf", UsageError) == os.path.join(os.path.expanduser("~root"), "m.gguf")


def test_a_relative_colichat_home_is_taken_from_the_directory_colichat_starts_in(tmp_path, monkeypatch):
    """COLICHAT_HOME=data keeps the files under ./data of the directory colichat started in, named
    by their full path (a later change of directory moves nothing)."""
    from colichat.paths import paths

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLICHAT_HOME", "data")
    where = paths()
    assert where.data == tmp_path / "data" / "data" and where.cache == tmp_path / "data" / "cache"
    assert where.data.is_absolute()


@pytest.mark.process
def test_model_with_a_tilde_and_no_home_directory_is_one_line(tmp_path):
    """--model '~/m.gguf' (quoted, or after `=`) as a user with no home directory: one line saying
    ~ cannot be expanded (it said "no such file" of the literal path), exit 2."""
    prefix = _usable(["unshare", "--user", "--map-user=12345", "--map-group=12345"],
                     "running colichat as a user with no passwd entry")
    env = {k: v for k, v in env_for(tmp_path).items() if k != "HOME"}
    p = subprocess.run([*prefix, *CHAT, "--model=~/m.gguf", "-p", "hello"], capture_output=True,
                       text=True, env=env, cwd=str(tmp_path), timeout=300)
    assert "Traceback" not in p.stderr and p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == ["colichat: --model ~/m.gguf: ~ cannot be expanded: HOME is not set (or not an "
                                     "absolute path) and this user has no home directory; give the full path, or "
                                     "set HOME"]


def test_on_a_dumb_terminal_sessions_are_not_cut_to_the_window(monkeypatch):
    """/sessions on a terminal shows the newest that fit in its window (App.window); an editor's shell
    buffer (TERM=dumb) scrolls freely, so there it lists them all, as through a pipe."""
    from colichat.terminal.app import App

    main, side = pty.openpty()
    try:
        with os.fdopen(side, "w", closefd=False) as tty:
            monkeypatch.setattr(sys, "stderr", tty)
            monkeypatch.setenv("TERM", "xterm")
            assert App.window(None) is not None  # a terminal: the listing is cut to it
            monkeypatch.setenv("TERM", "dumb")
            assert App.window(None) is None
    finally:
        os.close(main)
        os.close(side)
