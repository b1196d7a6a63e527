"""What the user typed, as inputs: one function turns lines into inputs for the terminal and for pipes.

An input is one line, or a block: the lines between two lines of `\"\"\"` (or `\"\"\"text\"\"\"` on one
line). A block is a Message: sent to the model even if it starts with `/`.
"""

from __future__ import annotations

import re
from typing import Callable

FENCE = '"""'
ESCAPED = re.compile("[\udc80-\udcff]")  # a byte that is not UTF-8, as stdin's surrogateescape reads it


class Message(str):
    """An input from a `\"\"\"` block: a message even if it starts with `/`."""


def read_input(next_line: Callable[[bool], str]) -> str:
    """One input from `next_line(in_block)`, which returns a line (without its newline) or raises
    EOFError. The end of input inside a block ends the block: what was typed is kept."""
    first = next_line(False)
    s = first.strip()
    if len(s) > 2 * len(FENCE) and s.startswith(FENCE) and s.endswith(FENCE):
        return Message(s[len(FENCE) : -len(FENCE)])
    if s != FENCE:
        return first
    lines: list[str] = []
    while True:
        try:
            line = next_line(True)
        except EOFError:
            return Message("\n".join(lines))
        if line.strip() == FENCE:
            return Message("\n".join(lines))
        lines.append(line)


def clean_line(raw: str, first: bool = False) -> tuple[str, bool]:
    """A line as read from stdin, without its line end (\\n or a Windows \\r\\n), without the byte order
    mark an editor may put at the start of a file (first line), and with each byte that is not UTF-8
    as U+FFFD (as llama.cpp reads it); and whether there was such a byte."""
    line = raw.removesuffix("\n").removesuffix("\r")
    if first:
        line = line.removeprefix("\ufeff")
    line, n = ESCAPED.subn("\ufffd", line)
    return line, n > 0


def inputs_of(stream, on_note: Callable[[str], None] = lambda note: None):
    """The inputs in a stream of lines (stdin in pipe mode); `on_note` hears of the first line that
    is not UTF-8."""

    def cleaned():
        told = False
        for i, raw in enumerate(stream):
            line, bad = clean_line(raw, first=i == 0)
            if bad and not told:
                on_note(f"note: line {i + 1} of the input is not UTF-8: its invalid bytes are read as U+FFFD")
                told = True
            yield line

    lines = cleaned()

    def next_line(in_block: bool) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    while True:
        try:
            text = read_input(next_line)
        except EOFError:
            return
        yield text
