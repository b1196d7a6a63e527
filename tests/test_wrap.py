"""Word wrapping of streamed answers (colichat/wrap.py) and the screen drawn again at another width
(colichat/terminal/screen.py): what a terminal of a given width shows."""

from __future__ import annotations

import pyte
import pytest
from wcwidth import wcswidth

from colichat.terminal.screen import Screen
from colichat.wrap import WordWrap, displayable, rows, wrap_line


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


def test_wide_characters_count_two_columns_and_a_row_may_break_between_two_of_them():
    lines = render(["猫は ", "とても ", "かわいい です"], 10)
    assert lines == ["猫は とて", "も かわい", "い です"]
    assert render(["a" + "猫" * 50], 40) == ["a" + "猫" * 19, "猫" * 20, "猫" * 11]


def test_a_resize_applies_to_what_follows():
    width = [40]
    w = WordWrap(lambda: width[0])
    first = w.feed("one two three four five six seven eight nine ten ")
    width[0] = 15
    second = w.feed("alpha beta gamma delta epsilon zeta ") + w.flush()
    assert "\n" in first and all(len(line) <= 40 for line in first.split("\n"))
    assert all(len(line) <= 15 for line in second.split("\n")[1:])


# ---- the screen drawn again at another width (what a terminal shows, emulated by pyte) ---------------

STORY = ("Once upon a time a dragon lived in a castle on the hill. Every morning it flew over the valley "
         "and the villagers waved at it.\n\nIt was a kind dragon, and everybody in the kingdom knew its name.")


class Term:
    """A terminal of a given size: what is written is shown as a VT100 would (pyte); a resize
    keeps the characters where they were (a real terminal reflows them: a redraw must not care)."""

    def __init__(self, columns: int, lines: int):
        self.size = (columns, lines)
        self.screen = pyte.Screen(columns, lines)
        self.screen.set_mode(pyte.modes.LNM)  # "\n" also returns the carriage, as the tty's onlcr does
        self.stream = pyte.Stream(self.screen)

    def write(self, text: str) -> None:
        self.stream.feed(text)

    def resize(self, columns: int, lines: int) -> None:
        self.size = (columns, lines)
        self.screen.resize(lines, columns)

    def lines(self) -> list[str]:
        return [line.rstrip() for line in self.screen.display]

    def cursor(self) -> tuple[int, int]:
        return self.screen.cursor.y, self.screen.cursor.x


def shown_by(term: Term, screen: Screen):
    """Print as the REPL does: a status line (stderr, word-wrapped), the prompt's echo, pieces of an answer."""

    def say(line: str) -> None:
        term.write(screen.line(line))
        term.write(wrap_line(line, term.size[0]) + "\n")

    def echo(line: str) -> None:
        term.write(line + "\n")
        screen.echo(line)

    def answer(pieces) -> None:
        for piece in pieces:
            term.write(screen.answer(piece))

    return say, echo, answer


def pieces_of(text: str) -> list[str]:
    return [text[i:i + 3] for i in range(0, len(text), 3)]


def cut(line: str, width: int) -> list[str]:
    return [line[i:i + width].rstrip() for i in range(0, len(line), width)]


def wrapped(text: str, width: int) -> list[str]:
    w = WordWrap(lambda: width)
    return [line.rstrip() for line in (w.feed(text) + w.flush()).split("\n")]


def test_a_resize_while_an_answer_arrives_redraws_everything_shown_at_the_new_width():
    term = Term(60, 40)
    screen = Screen(lambda: term.size, banner=["Model (llama, 2 layers), loaded in 0.1 s"])
    term.write(wrap_line("Model (llama, 2 layers), loaded in 0.1 s", 60) + "\n")
    say, echo, answer = shown_by(term, screen)
    echo("> Tell me a story about a dragon and a castle, please.")
    pieces = pieces_of(STORY)
    answer(pieces[:20])
    term.resize(24, 40)
    answer(pieces[20:])
    term.write(screen.end_answer())
    say("\x1b[2m[42 tokens, 9.0 tok/s; saved to dragon]\x1b[0m")

    # the status lines and the answer word-wrapped; the prompt's echo as the terminal wrapped it
    expected = (wrapped("Model (llama, 2 layers), loaded in 0.1 s", 24)
                + cut("> Tell me a story about a dragon and a castle, please.", 24)
                + wrapped(STORY, 24) + wrapped("[42 tokens, 9.0 tok/s; saved to dragon]", 24))
    assert term.lines()[:len(expected)] == expected
    assert not any(term.lines()[len(expected):])
    assert term.cursor() == (len(expected), 0)  # the next line starts below the footer


def test_the_redraw_ends_where_the_answer_goes_on_and_keeps_the_word_held():
    term = Term(40, 30)
    screen = Screen(lambda: term.size)
    say, echo, answer = shown_by(term, screen)
    echo("> Go on.")
    text = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda"
    answer(["alpha beta gamma delta epsilon zeta eta th"])  # "th" is held: the word has not ended
    term.resize(20, 30)
    answer(["eta iota kappa lambda"])
    term.write(screen.end_answer())
    assert term.lines()[:5] == ["> Go on."] + wrapped(text, 20)
    assert term.cursor() == (5, 0)


def test_after_a_stop_nothing_is_drawn_again_and_the_answer_goes_on_below_the_shells_lines():
    term = Term(40, 30)
    term.write("$ echo before\nbefore\n$ colichat\n")  # the shell's lines above colichat's
    screen = Screen(lambda: term.size)
    say, echo, answer = shown_by(term, screen)
    echo("> Go on.")
    answer(["alpha beta gamma delta epsilon zeta eta th"])  # stopped inside a word
    term.write("\n[1]+  Stopped                 colichat\n$ fg\ncolichat\n")  # the shell, meanwhile
    screen.continued()  # SIGCONT
    assert screen.current()  # (the prompt is drawn where the shell left the cursor)
    answer(["eta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon"])
    term.write(screen.end_answer())
    assert term.lines()[:11] == ["$ echo before", "before", "$ colichat", "> Go on.",
                                 "alpha beta gamma delta epsilon zeta eta", "th",
                                 "[1]+  Stopped                 colichat", "$ fg", "colichat",
                                 "eta iota kappa lambda mu nu xi omicron", "pi rho sigma tau upsilon"]
    assert term.cursor() == (11, 0)


def test_after_a_stop_the_answer_goes_on_from_a_rows_start_at_the_width_then():
    term = Term(40, 30)
    screen = Screen(lambda: term.size)
    say, echo, answer = shown_by(term, screen)
    echo("> Go on.")
    answer(["alpha beta"])
    term.resize(20, 30)  # while stopped: the window is narrower when colichat goes on
    term.write("\n$ fg\ncolichat\n")
    screen.continued()
    answer([" gamma delta epsilon zeta eta theta"])  # the space that ended the word is the row's break
    term.write(screen.end_answer())
    assert term.lines()[:6] == ["> Go on.", "alpha beta", "$ fg", "colichat", "gamma delta epsilon", "zeta eta theta"]
    term.resize(30, 30)  # a resize afterwards draws what colichat showed again, re-wrapped
    term.write(screen.redraw())
    assert term.lines()[:3] == ["> Go on.", "alpha beta gamma delta epsilon", "zeta eta theta"]


def test_only_the_last_rows_that_fit_are_drawn_and_the_prompt_gets_its_rows():
    term = Term(50, 10)
    screen = Screen(lambda: term.size)
    say, echo, answer = shown_by(term, screen)
    for i in range(6):
        echo(f"> question {i}")
        answer(pieces_of(f"answer number {i} is here."))
        term.write(screen.end_answer())
        say(f"[footer {i}]")
    term.resize(30, 10)
    term.write(screen.redraw(below=2))  # a prompt of three rows follows
    assert term.lines()[:8] == ["[footer 3]", "> question 4", "answer number 4 is here.", "[footer 4]",
                                "> question 5", "answer number 5 is here.", "[footer 5]", ""]
    assert term.cursor() == (7, 0)  # the prompt's three rows are the last three


def test_an_interrupted_answer_keeps_its_mark_after_a_redraw():
    term = Term(40, 20)
    screen = Screen(lambda: term.size)
    say, echo, answer = shown_by(term, screen)
    echo("> Count.")
    answer(["one two three fo"])
    term.write(screen.interrupt(on_status=False))
    term.write(screen.end_answer())
    say("[footer, interrupted]")
    term.resize(12, 20)
    term.write(screen.redraw())
    assert term.lines()[:6] == ["> Count.", "one two", "three fo^C", "[footer,", "interrupted]", ""]
    assert term.cursor() == (5, 0)


def test_rows_are_what_the_terminal_shows():
    assert rows("abcdefgh", 3) == ["abc", "def", "gh"]
    assert rows("ab\tc", 10) == ["ab      c"]
    assert rows("\x1b[2m[a long footer]\x1b[0m", 8) == ["\x1b[2m[a long ", "\x1b[2mfooter]\x1b[0m"]
    assert rows("猫猫猫", 5) == ["猫猫", "猫"]
    assert rows("one\ntwo", 10) == ["one", "two"]


def test_a_status_line_wraps_at_word_boundaries_and_again_at_the_new_width():
    term = Term(80, 10)
    screen = Screen(lambda: term.size)
    say, echo, answer = shown_by(term, screen)
    footer = "[120 tokens, 8.5 tok/s, prefill 20 at 52 tok/s, context 224/8192; saved to r]"
    say("\x1b[2m" + footer + "\x1b[0m")  # dim, as the footer is
    assert term.lines()[:2] == [footer, ""]
    term.resize(30, 10)
    term.write(screen.redraw())
    assert term.lines()[:4] == wrapped(footer, 30) + [""] and len(wrapped(footer, 30)) == 3
    echo("> " + "a long question, " * 3)  # the prompt's echo stays as the terminal wrapped it
    term.resize(20, 10)
    term.write(screen.redraw())
    shown = wrapped(footer, 20) + cut("> " + "a long question, " * 3, 20)
    assert term.lines()[:len(shown)] == shown


def test_wrap_line_keeps_style_codes_with_the_words():
    assert wrap_line("\x1b[2m[a long footer]\x1b[0m", 8) == "\x1b[2m[a long \nfooter]\x1b[0m"
    assert wrap_line("short", 8) == "short"
    assert wrap_line("one two\nthree four", 9) == "one two\nthree \nfour"


ROW = "/forget [N]         continue in a new conversation without the N oldest exchanges"


def test_a_table_row_goes_on_under_its_second_column():
    assert wrap_line(ROW, 50, hang=20) == ("/forget [N]         continue in a new conversation\n" + " " * 20
                                           + "without the N oldest exchanges")
    assert wrap_line(ROW, 40, hang=20) == wrap_line(ROW, 40)  # too narrow for the indent: none
    term = Term(80, 10)
    screen = Screen(lambda: term.size)
    term.write(screen.line(ROW, hang=20) + wrap_line(ROW, 80, hang=20) + "\n")
    term.resize(50, 10)
    term.write(screen.redraw())  # drawn again with its indent
    assert term.lines()[:3] == wrap_line(ROW, 50, hang=20).split("\n") + [""]


def test_control_characters_in_an_answer_are_shown_not_acted_on():
    assert displayable("a\x1b[2Jb\r\nc\rd\x07e\x7ff\x9bg\th\n") == "a^[[2Jb\nc^Md^Ge^?f\ufffdg\th\n"
    term = Term(40, 10)
    screen = Screen(lambda: term.size)
    say, echo, answer = shown_by(term, screen)
    echo("> Go on.")
    answer(["Some text.", "\x1b[2J\x1b[H", "Still\rhere."])  # would clear the screen, then overwrite a line
    term.write(screen.end_answer())
    assert term.lines()[:3] == ["> Go on.", "Some text.^[[2J^[[HStill^Mhere.", ""]


def streamed(term: Term, screen: Screen, pieces, before: str = "") -> None:
    """The pieces of an answer written as the REPL streams them (after `before`); after each, the
    terminal shows all of the answer so far (nothing held back), each character once."""
    for i, piece in enumerate(pieces):
        term.write(screen.answer(piece))
        assert "".join(term.lines()).replace(" ", "") == (before + "".join(pieces[:i + 1])).replace(" ", "")


def test_a_word_shows_as_it_arrives_and_goes_whole_to_the_next_row_once_it_does_not_fit():
    term = Term(30, 10)
    screen = Screen(lambda: term.size)
    text = "Repeat this URL: https://example.com/a/b and https://example.com/very/long/path/to/a/page ok"
    streamed(term, screen, pieces_of(text))
    term.write(screen.end_answer())
    # the first URL fits on a row of its own: it moved there whole; the second is longer than a row:
    # it starts one and the terminal cuts it at the edge
    assert term.lines()[:5] == ["Repeat this URL:", "https://example.com/a/b and", "https://example.com/very/long/",
                                "path/to/a/page ok", ""]
    assert term.cursor() == (4, 0)

    term = Term(20, 10)  # a word that reached the row's last column exactly, then grew
    screen = Screen(lambda: term.size)
    streamed(term, screen, ["abc 0123", "456789012345", "x", " y"])
    assert term.lines()[:3] == ["abc", "0123456789012345x y", ""]


def test_wide_characters_show_as_they_arrive_and_a_row_breaks_between_any_two():
    term = Term(40, 10)
    screen = Screen(lambda: term.size)
    streamed(term, screen, pieces_of("a" + "猫" * 50))
    assert term.lines()[:4] == ["a" + "猫" * 19, "猫" * 20, "猫" * 11, ""]
    term.write(screen.end_answer())
    assert term.cursor() == (3, 0)


MIXED = ("Repeat this URL three times: https://example.com/very/long/path/that/goes/on. 猫はとてもかわいいです。"
         "在这里我们可以看到一个很长的中文句子，它没有空格。 A normal sentence follows it, with words.")


@pytest.mark.parametrize("width", [17, 30, 41])
def test_a_redraw_gives_the_layout_the_stream_gave(width):
    term = Term(width, 30)
    screen = Screen(lambda: term.size)
    pieces = pieces_of(MIXED)
    streamed(term, screen, pieces[:25])  # in the middle of the URL
    term.write(screen.redraw())
    streamed(term, screen, pieces[25:], "".join(pieces[:25]))  # drawn again, then on
    term.write(screen.end_answer())
    once = Term(width, 30)
    once.write(Screen(lambda: once.size).answer(MIXED))  # all of it at once
    assert term.lines() == once.lines() and term.cursor() == (once.cursor()[0] + 1, 0)
    term.write(screen.redraw())
    assert term.lines() == once.lines()


def test_a_ctrl_c_while_a_piece_of_the_answer_is_written_shows_its_mark_after_the_piece(capfd, monkeypatch):
    """The signal comes at any moment, also while the REPL writes a piece it has been given (which is
    kept in the answer): the ^C goes after that piece, not before it or inside it."""
    import os
    import signal
    import sys

    from colichat.terminal.app import App
    from colichat.terminal.streams import StatusLine

    class Conv:
        pass

    status = StatusLine()
    status.tty = False
    app = App(Conv(), interactive=True, status=status)
    real = sys.stdout.write

    def write(text):  # the Ctrl-C arrives as the piece goes to the terminal
        os.kill(os.getpid(), signal.SIGINT)
        return real(text)

    old = signal.signal(signal.SIGINT, lambda signum, frame: app.interrupted())
    try:
        app.out('"The Lucky')
        monkeypatch.setattr(sys.stdout, "write", write)
        app.out(' Cat".')
        app.out(" It")  # after the ^C: not shown
    finally:
        signal.signal(signal.SIGINT, old)
    assert capfd.readouterr().out == '"The Lucky Cat".^C'


def test_after_ctrl_l_a_redraw_starts_from_the_cleared_window():
    term = Term(40, 10)
    screen = Screen(lambda: term.size, banner=["Model (llama, 2 layers)"])
    term.write("Model (llama, 2 layers)\n")
    say, echo, answer = shown_by(term, screen)
    echo("> Count.")
    answer(["one two three"])
    term.write(screen.end_answer())
    say("[footer]")
    term.write("\x1b[H\x1b[2J")  # Ctrl-L at the prompt: prompt_toolkit clears the window
    screen.cleared()
    echo("> Again.")
    answer(["four five"])
    term.resize(30, 10)
    answer([" six"])  # drawn again at the new width: what was cleared stays cleared
    term.write(screen.end_answer())
    assert term.lines()[:3] == ["> Again.", "four five six", ""]
    assert not any(term.lines()[3:]) and term.cursor() == (2, 0)
