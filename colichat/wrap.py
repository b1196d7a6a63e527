"""Text as a terminal shows it: answers wrapped at word boundaries as they stream, status lines
wrapped the same way, the rows a text takes, and a model's control characters shown, not acted on.
(What the REPL has shown, drawn again at another width: terminal/screen.py.)

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
"""

from __future__ import annotations

import re
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
