"""Word wrapping of an answer as it streams to the terminal.

A word is held until it ends (a space or a newline arrives; the next token usually starts with
one), then shown on the current line if it fits, else on the next. The width is read at every
piece, so text that arrives after a resize wraps to the new width; lines already printed stay as
they are (rewrapping them would need a full-screen program). Only the display is wrapped: the
transcript keeps the model's text.
"""

from __future__ import annotations

from typing import Callable

from wcwidth import wcwidth

TAB = 8


class WordWrap:
    def __init__(self, columns: Callable[[], int]):
        self.columns = columns  # the terminal's width now
        self.col = 0            # where the cursor is on its line (== width: at the right edge)
        self.word = ""          # the word being received
        self.word_cols = 0

    def feed(self, text: str) -> str:
        """What to write for `text`, given what was written before."""
        width = max(2, self.columns())
        out = []
        for ch in text:
            if ch in "\n\r":
                out.append(self._word(width) + ch)
                self.col = 0
            elif ch in " \t":
                out.append(self._word(width))
                n = 1 if ch == " " else TAB - self.col % TAB
                if self.col + n > width:  # the space at the edge becomes the line break
                    out.append("\n")
                    self.col = 0
                else:
                    out.append(ch)
                    self.col += n
            else:
                self.word += ch
                self.word_cols += max(0, wcwidth(ch))
                if self.word_cols >= width:  # longer than a line: show it as it comes, cut at the edge
                    out.append(self._word(width))
        return "".join(out)

    def flush(self) -> str:
        """The held word (at the end of an answer); the next answer starts on a new line."""
        return self._word(max(2, self.columns()))

    def _word(self, width: int) -> str:
        if not self.word:
            return ""
        out = ""
        if self.col > 0 and self.col + self.word_cols > width:
            out, self.col = "\n", 0
        out += self.word
        end = self.col + self.word_cols
        self.col = end if end <= width else (end % width or width)
        self.word, self.word_cols = "", 0
        return out

    def reset(self) -> None:
        self.col, self.word, self.word_cols = 0, "", 0
