"""The interactive program, used as a person would: in tmux, typing keys and reading the screen."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tmux_helpers import Tmux, colichat_line, rows_after, start_colichat, streaming, visible, wrapped

pytestmark = [pytest.mark.process, pytest.mark.default_model]  # a terminal, on the default model

# a footer, also where the terminal's width broke it into rows (at spaces)
FOOTER = re.compile(r"\[\d+ tokens?, [\d.]+ tok/s, (?:[^\]]*, )?\d+ of \d+ context left".replace(" ", r"\s+"))

# Limits on waiting for a screen state. They are only reached when something is wrong, so they are
# generous: a busy machine (another process on every core) makes the model many times slower.
MODEL_WAIT = 600.0  # the model loads or answers
SCREEN_WAIT = 120.0  # the program reacts to a key


@pytest.fixture
def tmux_chat(colichat_home):
    t = start_colichat(colichat_home, "--temperature", "0", "--max-tokens", "24")
    yield t
    t.close()


def test_interactive_session(tmux_chat):
    t = tmux_chat
    t.wait_for(lambda s: "Type a message" in s, MODEL_WAIT, "the prompt")

    # a question: the answer streams, then the footer
    t.type("What is the capital of France?")
    t.keys("Enter")
    screen = t.wait_for(lambda s: len(FOOTER.findall(s)) >= 1 and s.rstrip().endswith(">"), MODEL_WAIT,
                        "the first footer and the next prompt")
    assert "Paris" in screen
    assert "saved to" in screen

    # Tab completes a command name
    t.type("/his")
    t.keys("Tab")
    t.wait_for(lambda s: s.rstrip().endswith("> /history"), SCREEN_WAIT, "Tab completion of /history")
    t.keys("Enter")
    t.wait_for(lambda s: "user> What is the capital of France?" in s, SCREEN_WAIT, "/history output")

    # a long answer, interrupted with Ctrl-C: it stops, keeps what it said, and the REPL goes on
    # (answers stay short, so that a busy machine is slow but not stuck; this one may be long)
    t.type("/set max_tokens 300")
    t.keys("Enter")
    t.wait_for(lambda s: "max_tokens = 300" in s, SCREEN_WAIT, "/set max_tokens")
    t.type("Write a long story about a dragon who lived in a castle.")
    t.keys("Enter")
    t.wait_for(lambda s: streaming("Write a long story about a dragon who lived in a castle.", 8)(s), MODEL_WAIT,
               "the long answer to stream")
    t.keys("C-c")
    screen = t.wait_for(lambda s: re.search(r", interrupted[,;]", s), SCREEN_WAIT, "the interrupted footer")
    assert len(FOOTER.findall(screen)) == 2

    t.type("/history")
    t.keys("Enter")

    def story_kept(s: str) -> bool:  # /history prints the story's question and, after it, the answer so far
        return ("user> Write a long story" in s and "assistant> " in s.split("user> Write a long story")[-1]
                and s.rstrip().endswith(">"))

    screen = t.wait_for(story_kept, SCREEN_WAIT, "the interrupted answer in /history")
    partial = screen.split("user> Write a long story")[-1].split("assistant> ", 1)[1]
    assert len(partial.split()) > 8  # the words streamed before Ctrl-C

    # the conversation continues after the interruption
    t.type("/set max_tokens 24")
    t.keys("Enter")
    t.wait_for(lambda s: "max_tokens = 24" in s, SCREEN_WAIT, "/set max_tokens")
    t.type("Thank you!")
    t.keys("Enter")
    t.wait_for(lambda s: len(FOOTER.findall(s)) >= 3, MODEL_WAIT, "the third footer")

    # multi-line input: Esc-Enter inserts a newline; a """ block spans lines (even one starting with /)
    t.type("/new")
    t.keys("Enter")
    t.wait_for(lambda s: "new conversation" in s, SCREEN_WAIT, "/new")
    t.type("Say yes.")
    t.keys("Escape", "Enter")
    t.type("Only yes.")
    t.keys("Enter")
    t.wait_for(lambda s: len(FOOTER.findall(s)) >= 4, MODEL_WAIT, "the fourth footer")
    t.type('"""')
    t.keys("Enter")
    t.wait_for(lambda s: s.rstrip().endswith("..."), SCREEN_WAIT, "the block prompt")
    t.type("/not a command")
    t.keys("Enter")
    t.wait_for(lambda s: s.rstrip().endswith("..."), SCREEN_WAIT, "the block prompt")
    t.type('"""')
    t.keys("Enter")
    t.wait_for(lambda s: len(FOOTER.findall(s)) >= 5, MODEL_WAIT, "the fifth footer")
    t.type("/history")
    t.keys("Enter")
    screen = t.wait_for(lambda s: "user> /not a command" in s.split("> /history")[-1] and s.rstrip().endswith(">"),
                        SCREEN_WAIT, "the block as a message in /history")
    assert "user> Say yes.\nOnly yes." in screen

    # Ctrl-C at the prompt drops the line (it stays on screen marked ^C, as in a shell); Ctrl-D quits cleanly
    t.type("some text")
    t.keys("C-c")
    t.wait_for(lambda s: "\n".join(lines_of(s)).endswith("> some text^C\n>"), SCREEN_WAIT,
               "the dropped line and a new prompt")
    assert "(Ctrl-D quits)" not in t.screen()
    t.keys("C-c")  # at an empty prompt: once, what quits
    t.wait_for(lambda s: "\n".join(lines_of(s)).endswith("> ^C\n(Ctrl-D quits)\n>"), SCREEN_WAIT,
               "the hint after Ctrl-C at an empty prompt")
    t.keys("C-c")
    screen = t.wait_for(lambda s: "\n".join(lines_of(s)).endswith("(Ctrl-D quits)\n> ^C\n>"), SCREEN_WAIT,
                        "a second Ctrl-C: no second hint")
    assert screen.count("(Ctrl-D quits)") == 1
    t.keys("C-d")
    t.exited(SCREEN_WAIT)


# ---- feedback on every wait -------------------------------------------------------------------------


def gated_chat(home, args: str, log, module: str = "colichat.terminal.cli") -> Tmux:
    """colichat in tmux, started only once everything it writes is recorded to `log` (the raw bytes,
    escapes included, in order: what a transient status line showed stays there after it is cleared)."""
    t = start_colichat(home, *args.split(), program=f"-m {module}", before="read _;")
    t.record(log)
    t.keys("Enter")
    return t


def lines_of(screen: str) -> list[str]:
    return [line.rstrip() for line in screen.splitlines() if line.strip()]


def test_waits_show_progress_and_it_never_runs_into_the_next_line(colichat_home, tmp_path):
    log = tmp_path / "raw.log"
    t = gated_chat(colichat_home, "--temperature 0 --max-tokens 8", log, module="colichat.terminal.launch")
    try:
        # the first start of a model (imports, metadata read, weights dequantized and kept): a line
        # at once, then the loading progress, replaced by the banner; keys typed meanwhile wait for the prompt
        t.wait_for(lambda s: b"loading SmolLM2" in log.read_bytes(), MODEL_WAIT, "the loading progress")
        t.type("typed early")
        screen = t.wait_for(lambda s: "Type a message" in s and s.rstrip().endswith("> typed early"), MODEL_WAIT,
                            "the prompt, with the keys typed while loading")
        raw = log.read_bytes()
        assert raw.index(b"typed early") > raw.index(b"Type a message")  # not echoed into the progress line
        t.keys("C-u")
        t.wait_for(lambda s: s.rstrip().endswith(">"), SCREEN_WAIT, "an empty prompt")
        assert raw.lstrip().startswith(b"starting colichat ...")
        assert b"loading SmolLM2-135M-Instruct.Q4_1.gguf ..." in raw
        assert raw.index(b"loading SmolLM2") < raw.index(b"(llama, 30 layers)")
        assert b": layer 30/30, keeping the weights for the next start ..." in raw
        assert not any(line.startswith("starting") for line in lines_of(screen))
        assert not any(line.startswith("loading") for line in lines_of(screen))

        # a short message: its token count shows until the answer starts, then is gone
        t.type("Name a color.")
        t.keys("Enter")
        screen = t.wait_for(lambda s: len(FOOTER.findall(s)) == 1 and s.rstrip().endswith(">"), 120,
                            "the first answer")
        assert re.search(rb"reading your message \(\d+ tokens\) \.\.\.", log.read_bytes())
        assert "reading your message" not in screen

        # a long message shows its progress; Ctrl-C drops it, and the error line starts clean
        t.type("Please summarize the following notes. " + "The river flows past the old mill. " * 160)
        t.keys("Enter")
        screen = t.wait_for(lambda s: re.search(r"reading your message: [\d,]+/[\d,]+ tokens, [\d.,]+ tok/s", s),
                            MODEL_WAIT, "the progress of a long message, with its rate")
        t.keys("C-c")
        screen = t.wait_for(lambda s: "interrupted while reading the message" in s and s.rstrip().endswith(">"),
                            300, "the interrupted message")
        shown = lines_of(screen)
        error = next(line for line in shown if "interrupted while reading" in line)
        assert error == "colichat: interrupted while reading the message; it was not sent"
        assert not any("reading your message" in line for line in shown)

        # /resume (a file read from disk) shows what it does until the result line
        t.type("/new")
        t.keys("Enter")
        t.wait_for(lambda s: "new conversation" in s, SCREEN_WAIT, "/new")
        t.type("/resume")
        t.keys("Enter")
        screen = t.wait_for(lambda s: re.search(r"^resumed \d+ tokens", s, re.M), SCREEN_WAIT, "/resume")
        raw = log.read_bytes()
        assert raw.rindex(b"reading the conversation from disk ...") < raw.rindex(b"resumed ")
        assert not any("reading the conversation" in line for line in lines_of(screen))
        t.keys("C-d")
        t.exited(SCREEN_WAIT)
    finally:
        t.close()


# ---- keys while an answer streams, multi-line input --------------------------------------------------


def answer_after(screen: str, question: str) -> list[str]:
    """The screen lines between the last `> question` line and the footer that follows it."""
    shown = screen.splitlines()
    start = max(i for i, line in enumerate(shown) if line.rstrip() == f"> {question}")
    end = next(i for i in range(start + 1, len(shown)) if FOOTER.match("\n".join(shown[i:i + 4])))
    return shown[start + 1:end]


def test_keys_typed_while_answering_wait_for_the_next_prompt(colichat_home, tmp_path):
    t = gated_chat(colichat_home, "--temperature 0 --max-tokens 40", tmp_path / "raw.log")
    try:
        t.wait_for(lambda s: "Type a message" in s, MODEL_WAIT, "the prompt")

        # type-ahead: keys typed during the answer are not echoed into it; they are the next prompt's text
        question = "Write a long story about a dragon who lived in a castle."
        t.type(question)
        t.keys("Enter")
        t.wait_for(streaming(question), MODEL_WAIT, "the answer to stream")
        t.type("next question")
        screen = t.wait_for(lambda s: len(FOOTER.findall(s)) == 1 and s.rstrip().endswith("> next question"),
                            300, "the footer and the typed-ahead text at the prompt")
        assert "next question" not in "\n".join(answer_after(screen, question))
        t.keys("C-u")  # drop it
        t.wait_for(lambda s: s.rstrip().endswith(">"), SCREEN_WAIT, "an empty prompt")

        # Ctrl-C while streaming: ^C, then nothing more of the answer; the footer on its own line; the keys
        # typed before it wait at the prompt
        question = "Tell me a long story about a brave knight."
        t.type(question)
        t.keys("Enter")
        t.wait_for(streaming(question), MODEL_WAIT, "the answer to stream")
        t.type("then this")
        t.keys("C-c")
        screen = t.wait_for(lambda s: re.search(r", interrupted[,;]", s) and s.rstrip().endswith("> then this"),
                            MODEL_WAIT, "the interrupted footer and the typed-ahead text at the prompt")
        shown = answer_after(screen, question)
        assert shown[-1].endswith("^C") and screen.count("^C") == 1
        t.keys("C-u")
        t.wait_for(lambda s: s.rstrip().endswith(">"), SCREEN_WAIT, "an empty prompt")

        # a """ block: `... ` on its lines; Ctrl-D inside it ends the block (sent, not quit)
        t.type('"""')
        t.keys("Enter")
        t.wait_for(lambda s: s.rstrip().endswith("..."), SCREEN_WAIT, "the block's continuation prompt")
        t.type("Say yes.")
        t.keys("Enter")
        t.type("Only yes.")
        t.keys("C-d")
        screen = t.wait_for(lambda s: len(FOOTER.findall(s)) == 3 and s.rstrip().endswith(">"), 120,
                            "the block's answer")
        assert '> """\n... Say yes.\n... Only yes.\n... """\n' in screen

        # Up recalls the whole block as one entry; Enter sends it again
        t.keys("Up")
        t.wait_for(lambda s: s.rstrip().endswith('> """\n... Say yes.\n... Only yes.\n... """'), 10,
                   "the block recalled whole")
        t.keys("Enter")
        t.wait_for(lambda s: len(FOOTER.findall(s)) == 4 and s.rstrip().endswith(">"), MODEL_WAIT, "the second answer")
        t.type("/history")
        t.keys("Enter")
        screen = t.wait_for(lambda s: "assistant> " in s.split("/history")[-1] and s.rstrip().endswith(">"), 10,
                            "/history")
        assert screen.split("> /history")[-1].count("user> Say yes.\nOnly yes.\n") == 2

        # an empty block ended with Ctrl-D sends nothing; Ctrl-D on an empty prompt quits
        t.type('"""')
        t.keys("Enter")
        t.wait_for(lambda s: s.rstrip().endswith("..."), SCREEN_WAIT, "the block prompt")
        t.keys("C-d")
        t.wait_for(lambda s: s.rstrip().endswith('... """\n>'), SCREEN_WAIT, "a new prompt")
        t.keys("C-d")
        screen = t.exited(SCREEN_WAIT)
        assert len(FOOTER.findall(screen)) == 4
    finally:
        t.close()


# ---- display -------------------------------------------------------------------------------------


def test_fg_mid_answer_goes_on_below_the_shells_lines_and_overwrites_nothing(colichat_home):
    """While colichat is stopped, the shell writes below it (`Stopped`, `fg`, the job's line): after
    `fg` the rows shown before stay as they were (the shell's own lines above colichat too, none
    shown twice), and the answer goes on from the start of the row under the shell's lines, wrapped
    at word boundaries. (tests/test_commands_tmux.py: the prompt after `fg`, and the keys typed meanwhile.)"""
    from cli_helpers import saved_answers

    t = Tmux("env PS1='$ ' bash --norc --noprofile -i", width=80, height=60)  # room for it all: nothing scrolls
    try:
        t.type("echo shell line one; echo shell line two")
        t.keys("Enter")
        t.type(colichat_line(colichat_home, "--temperature", "0", "--max-tokens", "200", "--session", "z"))
        t.keys("Enter")
        t.wait_for(lambda s: "Type a message" in s, MODEL_WAIT, "the prompt")
        question = "Write a long story about a dragon who lived in a castle."
        t.type(question)
        t.keys("Enter")
        t.wait_for(streaming(question), MODEL_WAIT, "the answer to stream")
        t.keys("C-z")
        stopped = t.wait_for(lambda s: "Stopped" in s and s.rstrip().endswith("$"), SCREEN_WAIT,
                             "the shell, colichat stopped")
        stopped = [row.rstrip() for row in stopped.rstrip().splitlines()]
        before = stopped[:next(i for i, row in enumerate(stopped) if "Stopped" in row)]
        t.type("fg")
        t.keys("Enter")
        screen = t.wait_for(lambda s: len(FOOTER.findall(s)) == 1 and s.rstrip().endswith(">"), MODEL_WAIT,
                            "the answer's end")
        rows = [row.rstrip() for row in screen.rstrip().splitlines()]
        assert rows[:len(before)] == before  # nothing shown before the stop was drawn over
        assert rows.count("shell line one") == 1 and rows.count(f"> {question}") == 1
        assert "Stopped" in rows[len(before)] and rows[len(before) + 1] == "$ fg"
        job = next(i for i in range(len(before) + 2, len(rows)) if "colichat.terminal.cli" in rows[i])
        end = next(i for i in range(job, len(rows)) if FOOTER.match("\n".join(rows[i:i + 4])))
        answer = saved_answers(colichat_home, "z")[0]
        # the answer goes on under the job's line: what came after the stop, wrapped from a row's start
        # (the stop may have come inside a word: its rest starts the row; a space there is the row's break)
        shown_before = len("".join("".join(before[before.index(f"> {question}") + 1:]).split()))
        cut = next(i for i in range(len(answer) + 1) if len("".join(answer[:i].split())) == shown_before)
        rest = answer[cut:].removeprefix(" ")
        assert rest and rows[job + 1:end] == wrapped(rest, 80)
    finally:
        t.close()


def raw_lines(t: Tmux, escapes: bool = False) -> list[str]:
    """The screen's lines as the terminal shows them (not joined where the terminal wrapped)."""
    return t.run("capture-pane", "-p", *(["-e"] if escapes else []), "-S", "-200").splitlines()


def shown_answer(t: Tmux, question: str) -> list[str]:
    shown = raw_lines(t)
    start = max(i for i, line in enumerate(shown) if line.rstrip() == f"> {question}")
    end = next(i for i in range(start + 1, len(shown)) if shown[i].startswith("["))
    return [line.rstrip() for line in shown[start + 1:end]]


def test_answers_wrap_at_word_boundaries_and_the_footer_is_dim(colichat_home, tmp_path):
    from cli_helpers import saved_answers

    t = gated_chat(colichat_home, "--temperature 0 --max-tokens 70 --session w", tmp_path / "raw.log")
    try:
        t.run("resize-window", "-x", "50", "-y", "60")
        t.wait_for(lambda s: "Type a message" in s, MODEL_WAIT, "the prompt")

        # the answer breaks at spaces, never inside a word, within the 50 columns
        question = "Describe a dragon."
        t.type(question)
        t.keys("Enter")
        t.wait_for(lambda s: len(FOOTER.findall(s)) == 1 and s.rstrip().endswith(">"), MODEL_WAIT, "the answer")
        answer = saved_answers(colichat_home, "w")[0]
        shown = shown_answer(t, question)
        assert " ".join(shown).split() == answer.split()
        assert all(len(line) <= 50 for line in shown) and len(shown) > answer.count("\n") + 1

        # the footer is dim, on its own line, and wraps at word boundaries as the answer does
        footer = next(line for line in raw_lines(t, escapes=True) if "tokens, " in line and "tok/s" in line)
        assert footer.startswith("\x1b[2m[")
        rows = [row.rstrip() for row in raw_lines(t)]
        first = next(i for i, row in enumerate(rows) if row.startswith("[") and "tokens, " in row)
        last = next(i for i in range(first, len(rows)) if rows[i].endswith("saved to w]"))
        assert last > first and all(len(row) <= 50 for row in rows[first:last + 1])
        assert re.fullmatch(r"\[\d+ tokens, [\d.]+ tok/s, \d+ of \d+ context left"
                            r"(, max_tokens reached)?; saved to w\]",
                            " ".join(rows[first:last + 1])), rows[first:last + 1]

        # after a resize, new text wraps to the new width
        t.run("resize-window", "-x", "90", "-y", "60")
        question = "Describe a castle."
        t.type(question)
        t.keys("Enter")
        t.wait_for(lambda s: len(FOOTER.findall(s)) == 2 and s.rstrip().endswith(">"), MODEL_WAIT, "the second answer")
        answer = saved_answers(colichat_home, "w")[1]
        shown = shown_answer(t, question)
        assert " ".join(shown).split() == answer.split()
        assert all(len(line) <= 90 for line in shown) and max(len(line) for line in shown) > 50

        # Esc-Enter: the next line of the message shows the continuation prompt
        t.type("Say yes.")
        t.keys("Escape", "Enter")
        t.type("Only yes.")
        t.wait_for(lambda s: s.rstrip().endswith("> Say yes.\n... Only yes."), SCREEN_WAIT, "the continuation prompt")
        t.keys("C-c")
        t.keys("C-d")
        t.exited(SCREEN_WAIT)
    finally:
        t.close()


# ---- a resize: what is on screen is drawn again for the new width -----------------------------------


def resize(t: Tmux, columns: int) -> None:
    t.run("resize-window", "-x", str(columns), "-y", "60")


def test_a_resize_draws_the_answers_again_at_the_new_width(colichat_home, tmp_path):
    from cli_helpers import saved_answers

    t = gated_chat(colichat_home, "--temperature 0 --max-tokens 50 --session r", tmp_path / "raw.log")
    try:
        resize(t, 100)
        t.wait_for(lambda s: "Type a message" in s, MODEL_WAIT, "the prompt")
        first = "Describe a dragon."
        t.type(first)
        t.keys("Enter")
        t.wait_for(lambda s: len(FOOTER.findall(s)) == 1 and s.rstrip().endswith(">"), MODEL_WAIT, "the answer")
        answer = saved_answers(colichat_home, "r")[0]
        assert max(map(len, rows_after(visible(t), first) or [""])) > 50  # laid out for 100 columns

        # narrower while the next answer streams: at its next words the window is drawn again, the
        # answer before re-wrapped at word boundaries; keys typed meanwhile wait for the prompt
        t.type("/set max_tokens 120")
        t.keys("Enter")
        t.wait_for(lambda s: "max_tokens = 120" in s, SCREEN_WAIT, "/set max_tokens")
        second = "Tell me a long story about a castle."
        t.type(second)
        t.keys("Enter")
        t.wait_for(streaming(second), MODEL_WAIT, "the answer to stream")
        resize(t, 50)
        t.wait_for(lambda s: rows_after(visible(t), first) == wrapped(answer, 50) and FOOTER.findall(s)[1:] == [],
                   SCREEN_WAIT, "the window drawn again at 50 columns while the answer streams")
        partial = rows_after(visible(t), second)
        assert partial and all(len(row) <= 50 for row in partial)  # the answer so far, drawn again too
        t.type("typed ahead")
        t.wait_for(lambda s: len(FOOTER.findall(s)) == 2 and s.rstrip().endswith("> typed ahead"), MODEL_WAIT,
                   "the second answer and the typed-ahead text at the prompt")
        answers = saved_answers(colichat_home, "r")
        shown = visible(t)
        for question, text in zip((first, second), answers[:2], strict=True):
            rows = rows_after(shown, question)
            assert rows == wrapped(text, 50)  # each row within 50 columns, broken at a space, all words once
            assert all(len(row) <= 50 for row in rows) and " ".join(rows).split() == text.split()
        so_far = " ".join(partial).split()  # the last word may still have been growing (answers show as they come)
        assert so_far[:-1] == answers[1].split()[:len(so_far) - 1]
        assert answers[1].split()[len(so_far) - 1].startswith(so_far[-1])
        assert len(FOOTER.findall("\n".join(visible(t)))) == 2

        # wider at the prompt: the window is drawn again above it; the typed text stays as it was
        # (the redraw reaches the terminal in more than one write: wait for all of it, the prompt last)
        resize(t, 80)
        t.wait_for(lambda s: rows_after(visible(t), second) == wrapped(answers[1], 80)
                   and [row for row in visible(t) if row][-1] == "> typed ahead", SCREEN_WAIT,
                   "the window drawn again at 80 columns, the typed text at its prompt")
        assert rows_after(visible(t), first) == wrapped(answers[0], 80)
        t.keys("Enter")  # the typed-ahead text is sent as it was typed
        screen = t.wait_for(lambda s: len(FOOTER.findall(s)) == 3 and s.rstrip().endswith(">"), MODEL_WAIT,
                            "the third answer")
        assert len(saved_answers(colichat_home, "r")) == 3

        # a line dropped with Ctrl-C stays as it showed, once, through a redraw
        t.type("dropped")
        t.keys("C-c")
        t.wait_for(lambda s: "\n".join(lines_of(s)).endswith("> dropped^C\n>"), SCREEN_WAIT, "the dropped line")
        resize(t, 60)
        t.wait_for(lambda s: rows_after(visible(t), second) == wrapped(answers[1], 60)
                   and [row for row in visible(t) if row][-2:] == ["> dropped^C", ">"], SCREEN_WAIT,
                   "the window drawn again at 60 columns, the dropped line and a new prompt below")
        t.keys("C-d")
        screen = t.exited(SCREEN_WAIT)
        assert "Traceback" not in screen
    finally:
        t.close()


def test_piped_output_is_never_drawn_again(colichat_home, tmp_path):
    """Typed on the terminal, the answer piped to a file: a resize changes nothing in the file."""
    from cli_helpers import saved_answers

    out = tmp_path / "out.txt"
    t = start_colichat(colichat_home, "--temperature", "0", "--max-tokens", "120", "--session", "p",
                       then=f"| tee {out}", width=100)
    try:
        t.wait_for(lambda s: "loaded in" in s, MODEL_WAIT, "the model")
        t.type("Tell me a long story about a castle.")
        t.keys("Enter")
        t.wait_for(lambda s: out.exists() and len(out.read_text().split()) > 3, MODEL_WAIT, "the answer to stream")
        resize(t, 40)
        t.wait_for(lambda s: FOOTER.search(s), MODEL_WAIT, "the footer")
        t.keys("C-d")
        t.exited(SCREEN_WAIT, code=None)
        assert out.read_text() == saved_answers(colichat_home, "p")[0] + "\n"  # the text alone: no escape, no redraw
    finally:
        t.close()


SAVED_TO_FRUIT = re.compile(r"saved\s+to\s+name-a-fruit\]")  # the footer's end, where a row may break


def test_line_mode_at_a_terminal_prompts_on_stderr_and_saves_like_the_repl(colichat_home, tmp_path):
    """Typed on the terminal, the answers piped (`colichat | tee FILE`): a hint, then the REPL's prompts on
    stderr ("> ", and "... " inside a block); the conversation is saved under its first message, as in the
    REPL (a person typed it: not a script's run); Ctrl-D leaves the prompt's row to the shell's next line."""
    from cli_helpers import answers_bytes, saved_answers, saved_users

    out = tmp_path / "out.txt"
    t = start_colichat(colichat_home, "--temperature", "0", "--max-tokens", "12", then=f"| tee {out}", width=100)
    try:
        t.wait_for(lambda s: "Line mode: type a message and Enter" in s and s.rstrip().endswith("\n>"), MODEL_WAIT,
                   "the hint, then a prompt")
        t.type("Name a fruit.")
        t.keys("Enter")
        t.wait_for(lambda s: len(SAVED_TO_FRUIT.findall(s)) == 1 and s.rstrip().endswith("\n>"), MODEL_WAIT,
                   "the footer, then a prompt")
        t.type('"""')
        t.keys("Enter")
        # tee may write the answer's line end after the prompt (the pipe and the terminal are not in step), so
        # the typed quotes can stand on the row below the prompt
        t.wait_for(lambda s: re.search(r'^> *\n?"""\n\.\.\.\Z', s.rstrip(), re.M), SCREEN_WAIT, "the block's prompt")
        t.type("Name a")
        t.keys("Enter")
        t.wait_for(lambda s: s.rstrip().endswith("... Name a\n..."), SCREEN_WAIT, "the block's next prompt")
        t.type("vegetable.")
        t.keys("Enter")
        t.type('"""')
        t.keys("Enter")
        t.wait_for(lambda s: len(SAVED_TO_FRUIT.findall(s)) == 2 and s.rstrip().endswith("\n>"), MODEL_WAIT,
                   "the second footer, then a prompt")
        t.keys("C-d")
        screen = t.exited(SCREEN_WAIT)
        # the prompt's row ended, the shell's below (an empty row between when tee wrote the answer's last line
        # end after the prompt: the pipe and the terminal are not in step)
        assert re.search(r"^> *\n( *\n)?EXITED 0$", screen, re.M), screen
        assert saved_users(colichat_home, "name-a-fruit") == ["Name a fruit.", "Name a\nvegetable."]
        assert out.read_bytes() == answers_bytes(saved_answers(colichat_home, "name-a-fruit"))
    finally:
        t.close()


def test_line_mode_at_a_terminal_takes_ctrl_c_as_the_repl_does(colichat_home):
    """In line mode at a terminal (--plain), Ctrl-C at the prompt drops the line typed so far and prompts again,
    and Ctrl-C during an answer stops it (kept, the footer says so) and prompts again: as in the REPL,
    colichat goes on until Ctrl-D."""
    from cli_helpers import saved_users

    t = start_colichat(colichat_home, "--temperature", "0", "--max-tokens", "400", "--session", "c", "--plain",
                       width=100)
    try:
        t.wait_for(lambda s: "Line mode: type a message" in s and s.rstrip().endswith("\n>"), MODEL_WAIT,
                   "the hint, then a prompt")
        t.type("half a line")
        t.keys("C-c")
        t.wait_for(lambda s: re.search(r"^> half a line\^C *\n>\s*$", s, re.M), SCREEN_WAIT,
                   "the line dropped, a new prompt")
        t.type("Write a long story about a lighthouse keeper.")
        t.keys("Enter")
        t.wait_for(streaming("Write a long story about a lighthouse keeper.", 8), MODEL_WAIT, "the answer to stream")
        t.keys("C-c")
        t.wait_for(lambda s: re.search(r",\s+interrupted;\s+saved\s+to\s+c\]\s*\n>\s*$", s), SCREEN_WAIT,
                   "the answer stopped, its footer, a new prompt")
        t.keys("C-d")
        screen = t.exited(SCREEN_WAIT, code=None)
        assert re.search(r"^> *\nEXITED 0$", screen, re.M), screen
        assert saved_users(colichat_home, "c") == ["Write a long story about a lighthouse keeper."]
    finally:
        t.close()


def test_a_resumed_conversation_shows_its_last_exchange(colichat_home):
    """Back after a week: the conversation reopens with its last exchange on the screen, as /history
    shows it, above the prompt (earlier ones counted; /history has them)."""
    from cli_helpers import chat, lines, saved_answers

    args = ["--temperature", "0", "--max-tokens", "16"]
    chat(colichat_home, [*args, "--session", "food"], lines("Name a fruit.", "Name a vegetable.")).ok()
    chat(colichat_home, [*args, "--session", "sky"], lines("Why is the sky blue?")).ok()
    t = start_colichat(colichat_home, *args, "--session", "food", width=100)
    try:
        screen = t.wait_for(lambda s: "Type a message" in s and s.rstrip().endswith(">"), MODEL_WAIT, "the prompt")
        shown = lines_of(screen)
        answer = saved_answers(colichat_home, "food")[1]
        start = shown.index("user> Name a vegetable.")
        assert shown[start - 1:start] == ["(1 earlier exchange; /history shows the whole conversation)"]
        assert shown[start + 1].startswith("assistant> ")
        assert " ".join(shown[start + 1:-2]).split() == ["assistant>", *answer.split()]  # then the hint, the prompt
        assert "Name a fruit." not in screen

        t.type("/resume sky")  # reopened by the command: the same, with nothing earlier to count
        t.keys("Enter")
        screen = t.wait_for(lambda s: "user> Why is the sky blue?" in s and s.rstrip().endswith(">"), SCREEN_WAIT,
                            "the last exchange of sky")
        shown = lines_of(screen.split("> /resume sky", 1)[1])
        answer = saved_answers(colichat_home, "sky")[0]
        assert shown[0].startswith("resumed ") and shown[1] == "user> Why is the sky blue?"
        assert " ".join(shown[2:-1]).split() == ["assistant>", *answer.split()]
        t.keys("C-d")
        t.exited(SCREEN_WAIT)
    finally:
        t.close()


def test_ctrl_c_acts_at_the_next_layer_of_a_slow_model_and_a_ctrl_d_typed_after_it_quits(colichat_home, tmp_path):
    """A model whose every layer takes a second (an injected slow layer: tests/slow_layers.py) reading a
    message: its progress moves at every layer (tokens, rate); Ctrl-C drops the message once the layer
    under way ends (no other begins), and a Ctrl-D typed right after it quits at once, at the next prompt."""
    from cli_helpers import TINY_ARGS

    log = tmp_path / "layers.log"
    t = start_colichat(colichat_home, *TINY_ARGS, program=f"{Path(__file__).parent / 'slow_layers.py'} 1.0 {log} --")
    try:
        t.wait_for(lambda s: "Type a message" in s, MODEL_WAIT, "the prompt")
        t.type("Tell me about rivers and the sea.")
        t.keys("Enter")
        t.wait_for(lambda s: re.search(r"reading your message: [\d,]+/[\d,]+ tokens, [\d.,]+ tok/s", s),
                   SCREEN_WAIT, "the progress line, moving within the first layers")
        begun = len(log.read_text().split())  # layers begun when the key is sent
        t.keys("C-c")
        t.keys("C-d")
        screen = t.exited(SCREEN_WAIT, code=None)
        assert "colichat: interrupted while reading the message; it was not sent" in screen
        assert re.search(r"^EXITED 0$", screen, re.M), screen
        assert len(log.read_text().split()) <= begun + 1  # at most the layer that began as the key was sent
    finally:
        t.close()


def test_keys_typed_while_a_pruned_conversation_is_read_again_at_start_wait_for_the_prompt(colichat_home, tmp_path):
    """--resume of a pruned conversation reads it again from its text before the prompt (slowed here: half a
    second a layer, tests/slow_layers.py); keys typed meanwhile are not echoed into its progress: they wait
    for the prompt, as keys typed while the model loads do."""
    from cli_helpers import TINY_ARGS, chat, lines

    chat(colichat_home, [*TINY_ARGS, "--session", "s"], lines("Tell me about rivers.")).ok()
    chat(colichat_home, ["--prune-kv", "0", "--all"]).ok()
    layers, raw = tmp_path / "layers.log", tmp_path / "raw.log"
    t = start_colichat(colichat_home, *TINY_ARGS, "--resume", "--session", "s", before="read _;",
                       program=f"{Path(__file__).parent / 'slow_layers.py'} 0.5 {layers} --")
    t.record(raw)
    t.keys("Enter")
    try:
        t.wait_for(lambda s: layers.exists() and layers.read_text().split(), MODEL_WAIT, "the reading again begun")
        t.type("typed early")
        begun = len(layers.read_text().split())  # layers begun when the keys were sent
        t.wait_for(lambda s: "Type a message" in s and s.rstrip().endswith("> typed early"), MODEL_WAIT,
                   "the prompt, with the keys typed while the conversation was read again")
        assert len(layers.read_text().split()) > begun  # the reading went on after the keys: they came during it
        data = raw.read_bytes()
        assert b"s: its KV file was pruned; reading its 1 exchange again" in data, data
        assert data.index(b"typed early") > data.index(b"Type a message")  # not echoed into the progress line
    finally:
        t.close()
