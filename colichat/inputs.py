"""What the user typed, as inputs: one function turns lines into inputs for the terminal and for pipes.

An input is one line, or a block: the lines between two lines of `\"\"\"` (or `\"\"\"text\"\"\"` on one
line). A block is a Message: sent to the model even if it starts with `/`.
"""

from __future__ import annotations

from typing import Callable

FENCE = '"""'


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


def inputs_of(stream):
    """The inputs in a stream of lines (stdin in pipe mode)."""
    lines = (raw.rstrip("\n") for raw in stream)

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
