"""What the REPL shows: answers wrapped at word boundaries as they stream, and everything shown
kept, so that a change of the terminal's width redraws the screen laid out for the new width.

WordWrap: rows break at spaces, and before or after a wide character (Chinese, Japanese: a row may
break between any two of them, as terminals and browsers do). A word goes on the current row if it
fits, else on the next; a word longer than a row starts a row and the terminal cuts it at the edge.
An answer (live) shows each piece as it arrives: a word is written as it grows, and once it no
longer fits on its row (it does not start the row), what of it was written there is erased and it
goes on at the start of the next, as a browser moves a growing word. The result is the layout the
whole text gets at once (a redraw). Only the display is wrapped: the conversation keeps the
model's text.

wrap_line: a status line (the banner, command output, a footer) as printed on a terminal, wrapped
at word boundaries the same way.

displayable: what a model (or a person) wrote, with its control characters shown rather than acted
on by the terminal (an answer on screen, /history).

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

import re
from dataclasses import dataclass
from typing import Callable

from wcwidth import wcwidth

TAB = 8
# what a terminal acts on instead of showing (an escape sequence, a carriage return, a bell), \t and \n aside
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
HANG_ROOM = 24  # a hanging indent only where it leaves a row at least this many columns
SGR = re.compile(r"(\x1b\[[0-9;]*m)")  # a colour or style code: no room on screen
DIM, PLAIN = "\x1b[2m", "\x1b[0m"


class WordWrap:
    def __init__(self, columns: Callable[[], int], hang: int = 0, live: bool = False):
        self.columns = columns  # the terminal's width now
        self.hang = hang        # where a row after a break starts (a hanging indent; answers: 0)
        self.live = live        # each piece shown as it arrives (an answer), not a word held until it ends
        self.col = 0            # where the word being received starts (== width: at the right edge)
        self.word = ""          # the word being received (since a space, a line's end, a wide character)
        self.word_cols = 0
        self.written = 0        # how much of it is written (live)
        self.moved = False      # it went to a new row: it stays there, however long it grows
        self.at_break = False   # a row was started for the text to come: a space next is that break

    def feed(self, text: str) -> str:
        """What to write for `text`, given what was written before."""
        width = max(2, self.columns())
        out = []
        for ch in text:
            cols = wcwidth(ch)
            if self.at_break:
                self.at_break = False
                if ch == " ":
                    continue
            if ch in "\n\r":
                out.append(self._word(width) + ch)
                self.col = 0
            elif ch in " \t":
                out.append(self._word(width))
                n = 1 if ch == " " else TAB - self.col % TAB
                if self.col + n > width:  # the space at the edge becomes the line break
                    out.append(self._break(width))
                else:
                    out.append(ch)
                    self.col += n
            elif cols == 2:  # a wide character is a word of its own: a row may break before and after it
                out.append(self._word(width))
                self.word, self.word_cols = ch, 2
                out.append(self._word(width))
            else:
                self.word += ch
                self.word_cols += max(0, cols)
                if self.live and self._overflows(width):
                    out.append(self._move(width))
        if self.live:  # the word so far, in its place
            out.append(self.word[self.written:])
            self.written = len(self.word)
        return "".join(out)

    def flush(self) -> str:
        """The held word (at the end of an answer); the next answer starts on a new line."""
        return self._word(max(2, self.columns()))

    def _overflows(self, width: int) -> bool:
        """Whether the word goes past the row's edge and can go to the next row instead."""
        return self.col > 0 and not self.moved and self.col + self.word_cols > width

    def _move(self, width: int) -> str:
        """The word goes to the start of the next row; what of it was written on this row is erased
        (back to the row's start, forward to the word, erase to the row's end: never a backspace at the
        edge, where terminals disagree)."""
        out = f"\r\x1b[{self.col}C\x1b[K" if self.written else ""
        self.written, self.moved = 0, True
        return out + self._break(width)

    def _word(self, width: int) -> str:
        """The rest of the word, ended (on the next row if it does not fit on this one)."""
        if not self.word:
            return ""
        out = self._move(width) if self._overflows(width) else ""
        out += self.word[self.written:]
        end = self.col + self.word_cols
        self.col = end if end <= width else (end % width or width)  # (the terminal cut a word longer than a row)
        self.word, self.word_cols, self.written, self.moved = "", 0, 0, False
        return out

    def _break(self, width: int) -> str:
        """A new row, after the hanging indent where the width leaves room for it."""
        self.col = self.hang if width - self.hang >= HANG_ROOM else 0
        return "\n" + " " * self.col

    def new_row(self) -> None:
        """The cursor was put at the start of a new row by someone else (the shell, after `fg`): the
        text goes on there, as after a break. What of the word being received was written stays
        where it was; the rest of it starts the row."""
        rest = self.word[self.written:]
        self.reset()
        self.word, self.word_cols, self.moved = rest, sum(max(0, wcwidth(ch)) for ch in rest), True
        self.at_break = not rest

    def reset(self) -> None:
        self.col, self.word, self.word_cols, self.written, self.moved = 0, "", 0, 0, False
        self.at_break = False


def displayable(text: str) -> str:
    """A model's (or a person's) text as a terminal must show it: its control characters shown, not
    acted on (an escape sequence in an answer could clear the screen, move the cursor, retitle the
    window): caret notation (^[, ^M, ^?) for C0 and DEL, U+FFFD for C1; "\r\n" is a line end."""
    return CONTROL.sub(lambda m: "^" + chr(ord(m[0]) ^ 0x40) if m[0] <= "\x7f" else "\ufffd",
                       text.replace("\r\n", "\n"))


def dimmed(text: str) -> str:
    """`text` dim on a terminal, line by line (a redraw lays each line out on its own: layout())."""
    return "\n".join(f"{DIM}{line}{PLAIN}" if line else line for line in text.split("\n"))


def wrap_line(text: str, width: int, hang: int = 0) -> str:
    """A status line (or lines) as a terminal `width` columns wide shows it: word-wrapped like an
    answer, its style codes taking no room (a style goes on in the next row, as terminals keep it);
    the rows after a break start at column `hang` (a table's second column), room allowing."""
    wrap, out = WordWrap(lambda: width, hang), []
    for part in SGR.split(text):
        if SGR.fullmatch(part):
            wrap.word += part  # held with the word it touches: never alone at a row's start
        else:
            out.append(wrap.feed(part))
    return "".join(out) + wrap.flush()


def rows(text: str, width: int) -> list[str]:
    """The rows a terminal `width` columns wide shows for `text`: a line longer than the width goes
    on in the next row (the terminal's own wrap), a tab moves to the next multiple of 8 (as spaces
    here), a style code takes no room and goes on in the next row of its line."""
    return [row for row, _ in layout(text, width)]


def layout(text: str, width: int) -> list[tuple[str, bool]]:
    """rows(), each with whether it goes on from the row before (the terminal's wrap, not a line's end)."""
    out = []
    for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        row, col, style, cont = "", 0, "", False
        for part in SGR.split(line):
            if SGR.fullmatch(part):
                row += part
                style = "" if part in ("\x1b[0m", "\x1b[m") else style + part
                continue
            for ch in part:
                w = min(TAB - col % TAB, width - col) if ch == "\t" else max(0, wcwidth(ch))
                if col + w > width and col > 0:
                    out.append((row, cont))
                    row, col, cont = style, 0, True
                row += " " * w if ch == "\t" else ch
                col += w
        out.append((row, cont))
    return out


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
