"""What the REPL shows (text laid out by wrap.py), kept, so that a change of the terminal's width redraws
the screen laid out for the new width.

Screen: the status lines, the prompt's echo (as prompt_toolkit drew it) and the answers as the
model wrote them (a thinking model's thinking, when shown, as an answer of its own, dim). Before
anything more is shown, if the width changed since the screen was laid out, the window is drawn
again from its top: the last rows of everything shown, laid out at the window's width (answers
re-wrapped at word boundaries), ending where the cursor was. The scrollback
above the window stays as the terminal made it. Ctrl-L (clear the window) forgets what was shown: a
redraw starts from the cleared window. After a stop (Ctrl-Z, then `fg`) nothing is drawn again: the
shell wrote its lines below what colichat showed (`Stopped`, `fg`, the job's line), pushing rows of
it into the scrollback, and where on the window colichat's rows now are, it cannot know. colichat
goes on below the shell's lines, from the start of a row, as a shell's programs do (an answer
arriving goes on there; the prompt is drawn there), at the window's width then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..wrap import DIM, PLAIN, WordWrap, dimmed, displayable, layout, wrap_line


@dataclass
class Shown:
    """One thing shown: a status line (word-wrapped at every drawing, as printed), the prompt's echo
    (as prompt_toolkit drew it), or an answer (word-wrapped at every drawing)."""
    text: str
    echo: bool = False
    answer: bool = False
    hang: int = 0       # a status line's hanging indent
    open: bool = False  # an answer still arriving: the cursor is at its end
    cut: bool = False   # ^C shown after it
    thinking: bool = False  # an answer's thinking (dim where the screen has styles)


class Screen:
    """What the REPL has shown, to be drawn again at another width. Each method returns what to
    write to the terminal (stdout) now: a redraw first when the width changed, then its own text."""

    def __init__(self, size: Callable[[], tuple[int, int]], banner=(), lines_on_screen: bool = True,
                 dim: bool = False):
        self.size = size  # the terminal's (columns, rows) now
        self.lines_on_screen = lines_on_screen  # the printed lines reach the screen (stderr is the terminal)
        self.dim = dim  # thinking is shown dim (a terminal with styles, no NO_COLOR)
        self.shown = [Shown(line) for line in banner] if lines_on_screen else []
        self.width = self.columns()  # the width the screen is laid out for
        self.stopped = False  # colichat was stopped and continued since (see continued())
        self.wrap = WordWrap(lambda: self.width, live=True)  # the answer arriving

    def columns(self) -> int:
        return max(2, self.size()[0])

    def current(self) -> bool:
        """Whether the window shows what was shown, laid out for its width (after a stop: whether
        what comes next goes on below the shell's lines, at the width then; see continued())."""
        if self.stopped:
            self.stopped = False
            self.width = self.columns()
            if self.shown and self.shown[-1].open:
                self.wrap.new_row()
        return self.columns() == self.width

    def continued(self) -> None:
        """colichat was continued after a stop (Ctrl-Z, `fg`; from a SIGCONT handler): the shell has
        written its lines below what was shown, and the cursor is at the start of a row under them.
        Nothing is drawn again (which rows of the window are colichat's is unknown now): what comes
        next goes on there."""
        self.stopped = True

    def cleared(self) -> None:
        """The window was cleared (Ctrl-L at the prompt): what was shown is gone from it, and a redraw
        starts from the cleared window."""
        self._close()
        self.shown = []

    # --- what is shown --------------------------------------------------------------------------

    def line(self, text: str, hang: int = 0) -> str:
        """A status line (or lines) about to be printed (word-wrapped: wrap_line), from the start of a row."""
        before = self.follow()
        if self.lines_on_screen:
            self._close()
            self.shown.append(Shown(text, hang=hang))
        return before

    def echo(self, text: str) -> None:
        """A line already on the screen (the prompt's echo of what was typed)."""
        self._close()
        self.shown.append(Shown(text, echo=True))

    def answer(self, text: str, thinking: bool = False) -> str:
        """A piece of the answer (or of its `thinking`, shown) arriving: it is wrapped at word
        boundaries, its control characters shown (displayable). The answer after the thinking starts
        on a row of its own."""
        before = self.follow()
        if self.shown and self.shown[-1].open and self.shown[-1].thinking != thinking:
            before += self.end_answer()
        shown = self._open(thinking)
        text = displayable(text)
        shown.text += text
        return before + self._styled(self.wrap.feed(text), thinking)

    def _styled(self, text: str, thinking: bool) -> str:
        return f"{DIM}{text}{PLAIN}" if thinking and self.dim and text else text

    def interrupt(self, on_status: bool) -> str:
        """Ctrl-C during an answer: the word held, and `^C` (unless it goes with the status line shown)."""
        shown = self._open()
        out = self._styled(self.wrap.flush(), shown.thinking) + "^C"
        if not on_status:
            shown.cut = True
            self.wrap.col += 2
        return out

    def end_answer(self) -> str:
        """The answer (or the thinking shown before it) is complete: the word held, and the end of its line."""
        if not (self.shown and self.shown[-1].open):
            return ""
        self.shown[-1].open = False
        out = self._styled(self.wrap.flush(), self.shown[-1].thinking) + ("\n" if self.wrap.col else "")
        self.wrap.reset()
        return out

    def _close(self) -> None:
        """(A line after an answer not ended: a ^C that came after its end.)"""
        if self.shown and self.shown[-1].open:
            self.shown[-1].open = False
            self.wrap.reset()

    def _open(self, thinking: bool = False) -> Shown:
        if not (self.shown and self.shown[-1].open):
            self.shown.append(Shown("", answer=True, open=True, thinking=thinking))
            self.wrap.reset()
        return self.shown[-1]

    # --- drawing --------------------------------------------------------------------------------

    def follow(self, below: int = 0) -> str:
        """A redraw if the window does not show what was shown as laid out now, else nothing."""
        return "" if self.current() else self.redraw(below)

    def redraw(self, below: int = 0) -> str:
        """The window drawn again from its top at the current width: the last rows of what was shown,
        ending on the cursor's row (the answer arriving, or an empty row), with `below` more rows
        left free under it (for a prompt of several rows)."""
        self.width, height = self.columns(), max(1, self.size()[1])
        want = max(1, height - below)
        tail: list[tuple[str, bool]] = []
        cursor = [("", False)]
        for shown in reversed(self.shown):
            text, wrap = self._laid_out(shown)
            if shown.open:
                cursor, self.wrap = layout(text, self.width), wrap
                tail, cursor = cursor[:-1], cursor[-1:]
                continue
            if text:
                tail = layout(text[:-1], self.width) + tail  # (it ends with its line's end)
            if len(tail) + 1 >= want:
                break
        tail = (tail + cursor)[-want:]
        # Clear from the second row down, then the first (a clear from the top corner would push
        # the window into the scrollback in some terminals), then draw. A row the terminal wraps
        # (a long echo, a word longer than a row) is written whole, as it was: one line to copy.
        out = ["\x1b[0m\x1b[2;1H\x1b[J\x1b[H\x1b[2K"]
        for i, (row, cont) in enumerate(tail):
            out.append(row if cont or i == 0 else "\r\n" + row)
        return "".join(out)

    def _laid_out(self, shown: Shown) -> tuple[str, WordWrap | None]:
        """What `shown` writes at the current width (ending with "\n", unless it is an open answer)."""
        if shown.echo:
            return shown.text + "\n", None
        if not shown.answer:
            return wrap_line(shown.text, self.width, shown.hang) + "\n", None
        wrap = WordWrap(lambda: self.width, live=True)  # (it becomes the live one if the answer is arriving)
        out = wrap.feed(shown.text)
        if shown.cut or not shown.open:
            out += wrap.flush()
        if shown.cut:
            out += "^C"
            wrap.col += 2
        if not shown.open and wrap.col:
            out += "\n"
        if shown.thinking and self.dim:
            out = dimmed(out)
        return out, wrap
