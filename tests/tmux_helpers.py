"""Drive colichat in tmux as a person would: start it, type keys, read the screen, wait for a state of
it. Every tmux test starts colichat through here.

    t = start_colichat(home, "--max-tokens", "24", until="Type a message")  # its own tmux session
    t.type("hello"); t.keys("Enter")
    screen = t.wait_for(lambda s: "[" in s, 60, "the footer")    # polls, never a fixed sleep
    t.keys("C-d"); t.exited(60)                                    # ended, with status 0
    t.close()
"""

from __future__ import annotations

import atexit
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

# This test run's own tmux server (no configuration file): its panes get this run's environment, and no
# other tmux server (the user's, another test run's) is used or touched. It stays up between tests (a
# server that exits with its last session races with the next test's new session) and ends with the run.
SOCKET = os.path.join(tempfile.gettempdir(), f"colichat-tests-{os.getpid()}.tmux")
TMUX = ["tmux", "-S", SOCKET, "-f", os.devnull]


@atexit.register
def _end_server() -> None:
    subprocess.run([*TMUX, "kill-server"], capture_output=True)
    if os.path.exists(SOCKET):
        os.unlink(SOCKET)


def _tmux(*args: str) -> str:
    return subprocess.run([*TMUX, *args], capture_output=True, text=True, check=True).stdout


class Tmux:
    def __init__(self, command: str, width: int = 160, height: int = 60):
        if shutil.which("tmux") is None:
            raise RuntimeError("tmux is not installed (make test installs it)")
        self.name = f"colichat-{uuid.uuid4().hex[:8]}"
        _tmux("new-session", "-d", "-s", self.name, "-x", str(width), "-y", str(height), command,
              ";", "set-option", "-g", "exit-empty", "off")

    def run(self, command: str, *args: str) -> str:
        """A tmux command on this session (e.g. `run("resize-window", "-x", "50")`); its output."""
        return _tmux(command, "-t", self.name, *args)

    def record(self, log) -> None:
        """From now on, every byte the pane shows is appended to the file `log` (escapes included, in order).
        The file exists when this returns (the shell tmux starts for the pipe may open it later)."""
        log.touch()
        self.run("pipe-pane", "-o", f"cat >> {log}")

    def keys(self, *keys: str) -> None:
        self.run("send-keys", *keys)

    def type(self, text: str) -> None:
        self.run("send-keys", "-l", text)

    def paste(self, text: str) -> None:
        """`text` pasted as a terminal pastes: its lines ended by \\r, and between ESC[200~ and ESC[201~
        (bracketed paste) when the program has asked for that."""
        _tmux("set-buffer", "-b", self.name, "--", text)
        self.run("paste-buffer", "-p", "-d", "-b", self.name)

    def screen(self) -> str:
        """The pane with all its history (a footer scrolled away still counts)."""
        return self.run("capture-pane", "-p", "-J", "-S", "-")

    def wait_for(self, predicate, timeout: float = 120.0, what: str = "") -> str:
        """The screen once `predicate(screen)` holds; polls the pane until then. `timeout` is only
        reached when something is wrong: keep it generous (a busy machine is many times slower)."""
        end = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if predicate(screen):
                return screen
            if time.monotonic() > end:
                raise AssertionError(f"no {what} within {timeout:.0f} s; screen:\n{screen}")
            time.sleep(0.2)  # between two looks at the pane

    def exited(self, timeout: float = 120.0, code: int | None = 0) -> str:
        """The screen once the program `start_colichat` ran has ended, with status `code` (None: any)."""
        mark = EXITED if code is None else f"{EXITED} {code}"
        return self.wait_for(lambda s: mark in s, timeout, "a clean exit" if code == 0 else f"the end ({mark})")

    def close(self) -> None:
        subprocess.run([*TMUX, "kill-session", "-t", self.name], capture_output=True)


EXITED = "EXITED"  # what the shell shows, with the status, once the program start_colichat ran has ended
CLI = "-m colichat.terminal.cli"


def colichat_line(home, *args: str, env: str = "", program: str = CLI) -> str:
    """The shell line that runs colichat with `args`, in directory `home` with COLICHAT_HOME `home`
    (`env`: more variables, e.g. "NO_COLOR=1"; `program`: what Python runs, e.g. a script that
    starts colichat slowed down, with its own arguments)."""
    cmd = " ".join([shlex.quote(sys.executable), program, *(shlex.quote(str(a)) for a in args)])
    return f"cd {shlex.quote(str(home))} && {env} COLICHAT_HOME={shlex.quote(str(home))} {cmd}"


def start_colichat(home, *args: str, env: str = "", program: str = CLI, then: str = "", before: str = "",
                   width: int = 160, height: int = 60, until: str | None = None, wait: float = 600.0) -> Tmux:
    """colichat in a new tmux session (`colichat_line`), then `echo EXITED $?` and a pause that keeps the
    window readable after it ends. `then`: what follows it in the shell line (e.g. "| tee OUT"),
    `before`: what goes first (e.g. "read _;"). With `until`, once the screen shows that text."""
    line = colichat_line(home, *args, env=env, program=program)
    t = Tmux(f"{before} {line} {then}; echo {EXITED} $?; sleep 600", width, height)
    if until is not None:
        t.wait_for(lambda s: until in s, wait, repr(until))
    return t


def streaming(question: str, words: int = 3):
    """A screen predicate: the answer to `question` has begun to show (more than `words` words of it). The
    status line shown while the message is read ("reading your message ...", with its progress) is not
    the answer: a signal sent then finds no answer begun, and the message is not sent."""

    def begun(screen: str) -> bool:
        if f"> {question}\n" not in screen:
            return False
        after = screen.split(f"> {question}\n", 1)[1].splitlines()
        return len(" ".join(line for line in after if "reading your message" not in line).split()) > words

    return begun


def visible(t: Tmux, joined: bool = False) -> list[str]:
    """The rows the window shows now (the scrollback aside), as the terminal shows them (`joined`:
    a line the terminal wrapped is one)."""
    out = t.run("capture-pane", "-p", *(["-J"] if joined else []))
    return [line.rstrip() for line in out.splitlines()]


def wrapped(text: str, width: int) -> list[str]:
    """An answer as it shows wrapped at word boundaries, `width` columns wide."""
    from colichat.wrap import WordWrap

    w = WordWrap(lambda: width)
    return [line.rstrip() for line in (w.feed(text) + w.flush()).split("\n")]


def rows_after(shown: list[str], question: str) -> list[str] | None:
    """The rows after the `> question` row, up to its footer (or the last row shown); None unless
    that row is shown, once."""
    if shown.count(f"> {question}") != 1:
        return None
    start = shown.index(f"> {question}") + 1
    end = next((i for i in range(start, len(shown)) if shown[i].startswith("[")), len(shown))
    return shown[start:end]
