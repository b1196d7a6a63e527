"""Word wrapping of streamed answers (colichat/wrap.py): what a terminal of a given width shows."""

from __future__ import annotations

import pytest
from wcwidth import wcswidth

from colichat.wrap import WordWrap


def render(pieces, width: int) -> list[str]:
    """The lines a terminal `width` columns wide shows for the wrapped output of `pieces`
    (it breaks a line itself only where one is longer than the width)."""
    w = WordWrap(lambda: width)
    text = "".join(w.feed(p) for p in pieces) + w.flush()
    lines = []
    for line in text.split("\n"):
        assert "\t" not in line or width >= 8
        while wcswidth(line) > width:  # the terminal's own wrap (only for a word longer than a line)
            cut = next(i for i in range(len(line), 0, -1) if wcswidth(line[:i]) <= width)
            lines.append(line[:cut])
            line = line[cut:]
        lines.append(line)
    return lines


TEXT = ("The dragon lived in a castle on the hill. Every morning it flew over the valley, "
        "and the villagers waved.\nIt was a kind dragon.")


@pytest.mark.parametrize("width", [12, 20, 33, 80])
def test_no_word_is_cut_and_no_line_is_too_wide(width):
    pieces = [TEXT[i:i + 3] for i in range(0, len(TEXT), 3)]  # token-like pieces cutting words
    lines = render(pieces, width)
    assert all(wcswidth(line) <= width for line in lines)
    assert " ".join(lines).split() == TEXT.split()
    assert [line.rstrip() for line in "\n".join(lines).split("\n")] == [line.rstrip() for line in lines]


def test_short_text_is_unchanged_and_newlines_are_kept():
    assert render(["Hello", " there", ".\n\nBye"], 80) == ["Hello there.", "", "Bye"]


def test_a_word_longer_than_the_line_is_cut_at_the_edge():
    lines = render(["see ", "x" * 25, " end"], 10)
    assert [line.rstrip() for line in lines] == ["see", "xxxxxxxxxx", "xxxxxxxxxx", "xxxxx end"]


def test_wide_characters_count_two_columns():
    lines = render(["猫は ", "とても ", "かわいい です"], 10)
    assert all(wcswidth(line) <= 10 for line in lines)
    assert " ".join(lines).split() == "猫は とても かわいい です".split()


def test_a_resize_applies_to_what_follows():
    width = [40]
    w = WordWrap(lambda: width[0])
    first = w.feed("one two three four five six seven eight nine ten ")
    width[0] = 15
    second = w.feed("alpha beta gamma delta epsilon zeta ") + w.flush()
    assert "\n" in first and all(len(line) <= 40 for line in first.split("\n"))
    assert all(len(line) <= 15 for line in second.split("\n")[1:])
