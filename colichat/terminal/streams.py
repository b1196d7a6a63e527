"""The standard streams and the terminal: status lines on stderr (wrapped on a terminal, one
transient StatusLine shown in place), streams the caller closed or whose reader went away, their
encodings, the terminal's size, and whether it takes escape sequences (TERM=dumb does not).
"""

from __future__ import annotations

import contextlib
import os
import sys

from wcwidth import wcswidth

from ..errors import ChatError
from ..wrap import wrap_line


def to_stderr(line: str, hang: int = 0) -> None:
    """A status line: to stderr, so that stdout holds only the model's text; on a terminal, wrapped
    at word boundaries (the rows after a break start at column `hang`). If stderr cannot be written
    (a log file on a full disk), its lines are lost, not the answer."""
    try:
        if sys.stderr.isatty():
            line = wrap_line(line, terminal_columns(sys.stderr), hang)
        print(line, file=sys.stderr, flush=True)
    except OSError:
        discard(sys.stderr)


def ask_yes(question: str) -> bool:
    """`QUESTION [y/N]` on stderr, answered by a line on the terminal: yes only for y or yes; anything else,
    Enter, Ctrl-C or Ctrl-D is no (nothing is done)."""
    try:
        sys.stderr.write(f"{question} [y/N] ")
        sys.stderr.flush()
        answer = sys.stdin.readline()
    except (KeyboardInterrupt, OSError):
        answer = ""
    if not answer.endswith("\n"):  # (Ctrl-C, Ctrl-D: the next line starts below the question)
        to_stderr("")
    return answer.strip().lower() in ("y", "yes")


def discard(stream) -> None:
    """Point a standard stream that can no longer be written (its reader gone, its disk full) at
    /dev/null: what is still buffered, and every later write, goes nowhere quietly, at exit too."""
    with contextlib.suppress(OSError, ValueError):
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, stream.fileno())
        os.close(fd)


def open_standard_streams() -> None:
    """A standard stream the caller closed (`>&-`) is opened on /dev/null, as if redirected there:
    no file colichat opens can then take its number (and get the answer, or a status line, written
    into it), and closed stdin reads as empty, closed stdout or stderr writes nowhere."""
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            new = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)  # the lowest free number
            if new != fd:
                os.dup2(new, fd)
                os.close(new)
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", encoding="utf-8", closefd=False))


def set_encodings() -> None:
    """Messages read from a pipe or a file are UTF-8 whatever the locale says (a C locale with Python's
    UTF-8 mode off): only a byte that is not UTF-8 is read as U+FFFD (inputs_of says so). Answers and
    status lines written to a pipe or a file are UTF-8 too, the model's text as it is, unless
    PYTHONIOENCODING asks for another encoding. A terminal keeps the locale's encoding. Whatever
    the encoding, a character it cannot hold is replaced, and never ends the answer or the input."""
    asked = os.environ.get("PYTHONIOENCODING", "").partition(":")[0]
    for stream, errors in ((sys.stdin, "surrogateescape"), (sys.stdout, "replace"), (sys.stderr, "backslashreplace")):
        if not hasattr(stream, "reconfigure"):
            continue
        if stream.isatty() or (asked and stream is not sys.stdin):
            stream.reconfigure(errors=errors)
        else:
            stream.reconfigure(encoding="utf-8", errors=errors)


class StatusLine:
    """One transient line on a terminal's stderr (progress, "reading ..."): shown in place and
    cleared before anything else is printed, so it never runs into the next message. It is cut
    to the terminal's width (a wrapped line could not be cleared). Off a terminal it shows nothing.
    A terminal without cursor controls (TERM=dumb: an editor's shell buffer) gets no escape sequences:
    a carriage return, and spaces over what was shown before."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.dumb = dumb_terminal()
        self.shown = False
        self.columns = 0  # of the line shown

    def show(self, text: str) -> None:
        if not self.tty:
            return
        width = terminal_columns(self.stream)
        text = text[: max(1, width - 1)]
        if self.dumb:
            self.stream.write("\r" + text + " " * max(0, self.columns - _width(text)))
        else:
            self.stream.write("\r\033[K" + text)
        self.stream.flush()
        self.shown, self.columns = True, max(self.columns, _width(text))

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * self.columns + "\r" if self.dumb else "\r\033[K")
            self.stream.flush()
            self.shown, self.columns = False, 0



def _width(text: str) -> int:
    """Columns `text` takes on a terminal (at least one per character: a control character counts one)."""
    return max(len(text), wcswidth(text))


def dumb_terminal() -> bool:
    """TERM=dumb: a terminal that takes no escape sequences (no colours, no cursor moves)."""
    return os.environ.get("TERM") == "dumb"


def terminal_size(stream=None) -> tuple[int, int]:
    """The terminal's (columns, rows): (80, 24) where unknown (not a terminal, or one that reports 0)."""
    try:
        size = os.get_terminal_size((stream or sys.stdout).fileno())
    except (OSError, ValueError):
        return 80, 24
    return size.columns or 80, size.lines or 24


def terminal_columns(stream=None) -> int:
    return terminal_size(stream)[0]


def print_out(text: str) -> int:
    """Write `text` to stdout: 0, or 1 with one line if it cannot be written (a full disk). A reader
    that stopped early (`| head`) has what it wanted: 0, quietly."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        discard(sys.stdout)
    except OSError as e:
        discard(sys.stdout)
        raise ChatError(f"cannot write to standard output: {e.strerror or type(e).__name__}") from None
    return 0

