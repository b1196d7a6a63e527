"""Commands whose behaviour only a terminal shows (a question asked back, Tab completion), and the
terminal's own keys and signals (Ctrl-Z, a closed window), in tmux on the tiny model."""

from __future__ import annotations

import itertools
import shlex
import time

import pytest
from cli_helpers import TINY_ARGS, chat, lines, saved_answers, saved_turns, saved_users
from tmux_helpers import Tmux, colichat_line, rows_after, start_colichat, streaming, visible, wrapped

from colichat.wrap import displayable

pytestmark = pytest.mark.process  # every test here starts a process or a terminal

# only reached when something is wrong: generous, as a busy machine is many times slower
WAIT = 300.0
LONG = ("--ctx", "2048", "--max-tokens", "2000")  # an answer that streams long enough to act on


def in_shell(home, *args: str, wrapped: bool = False) -> Tmux:
    """colichat started from an interactive bash, which has job control (Ctrl-Z, fg), at its prompt;
    `wrapped`: run by a shell that waits for it, as `make chat` does (not the job's first process)."""
    t = Tmux("env PS1='$ ' bash --norc --noprofile -i")
    line = colichat_line(home, *TINY_ARGS, *args)
    t.type(f"sh -c {shlex.quote(line + '; exit $?')}" if wrapped else line)
    t.keys("Enter")
    t.wait_for(lambda s: "Type a message" in s, WAIT, "the prompt")
    return t


@pytest.fixture
def terminal(colichat_home):
    opened = []

    def start(*args: str):
        opened.append(start_colichat(colichat_home, *TINY_ARGS, *args, until="Type a message", wait=WAIT))
        return opened[-1]

    yield start
    for t in opened:
        t.close()


@pytest.fixture
def shell(colichat_home):
    opened = []
    yield lambda *args, **kw: opened.append(in_shell(colichat_home, *args, **kw)) or opened[-1]
    for t in opened:
        t.close()


def test_exit_alone_asks_whether_quit_was_meant(terminal):
    t = terminal("--session", "ex")
    t.type("exit")
    t.keys("Enter")
    t.wait_for(lambda s: "Did you mean /quit?" in s, WAIT, "the question")
    t.type("n")
    t.keys("Enter")
    t.wait_for(lambda s: "saved to ex]" in s, WAIT, "the answer to 'exit'")
    t.type("quit")
    t.keys("Enter")
    t.wait_for(lambda s: s.count("Did you mean /quit?") == 2, WAIT, "the second question")
    t.type("y")
    t.keys("Enter")
    t.exited(WAIT)


def test_clear_alone_asks_whether_clear_was_meant(terminal, colichat_home):
    t = terminal("--session", "cl")
    t.type("hello")
    t.keys("Enter")
    t.wait_for(lambda s: "saved to cl]" in s, WAIT, "the answer")
    t.type("clear")
    t.keys("Enter")
    t.wait_for(lambda s: "Did you mean /clear? (n sends 'clear' to the model)" in s, WAIT, "the question")
    t.type("y")
    t.wait_for(lambda s: "new conversation (session cl is saved; /resume cl reopens it)" in s, WAIT, "/clear run")
    assert saved_users(colichat_home, "cl") == ["hello"]  # (not sent)


def test_commands_typed_while_it_answers_run_one_by_one_in_order(terminal, colichat_home):
    """/history, /rewind 1 and /stats typed while an answer streams wait at the prompt, and Enter runs them
    in turn, as a shell runs lines typed ahead (not one three-line message); /stats no longer shows the
    answer /rewind removed."""
    t = terminal(*LONG, "--session", "ta")
    t.type("hello")
    t.keys("Enter")
    t.wait_for(streaming("hello"), WAIT, "the answer to stream")
    for line in ("/history", "/rewind 1", "/stats"):
        t.type(line)
        t.keys("Enter")
    waiting = "> /history\n... /rewind 1\n... /stats"
    t.keys("C-c")
    t.wait_for(lambda s: "saved to ta]" in s and s.rstrip().endswith(waiting), WAIT, "the commands at the prompt")
    t.keys("Enter")
    screen = t.wait_for(lambda s: "context: 0 of 2048 tokens" in s and s.rstrip().endswith(">"), WAIT, "the three run")
    after = screen.split(waiting, 1)[1]
    assert after.index("user> hello") < after.index("> /rewind 1") < after.index("rewound 1 exchange") \
        < after.index("> /stats") < after.index("context: 0 of 2048 tokens"), after
    assert "last answer" not in after and "takes no argument" not in after


def test_the_quit_question_waits_for_y_or_n_and_ctrl_z_stops_colichat(shell):
    """Enter alone does not answer the question (it neither quits nor sends the word); Ctrl-Z stops
    colichat as at the prompt, and `fg` asks again."""
    t = shell("--session", "qq")
    t.type("exit")
    t.keys("Enter")
    t.wait_for(lambda s: s.rstrip().endswith("Did you mean /quit? (n sends 'exit' to the model) (y/n)"), WAIT,
               "the question")
    t.keys("Enter")
    t.keys("C-z")
    t.wait_for(lambda s: "Stopped" in s and s.rstrip().endswith("$"), WAIT, "the shell, colichat stopped")
    t.type("fg")
    t.keys("Enter")
    t.wait_for(lambda s: s.rstrip().endswith("(n sends 'exit' to the model) (y/n)"), WAIT, "the question again")
    t.type("n")
    screen = t.wait_for(lambda s: "saved to qq]" in s and s.rstrip().endswith(">"), WAIT,
                        "the answer to 'exit', then an empty prompt")
    assert screen.count("saved to qq]") == 1
    t.type("quit")
    t.keys("Enter")
    t.wait_for(lambda s: s.rstrip().endswith("(n sends 'quit' to the model) (y/n)"), WAIT, "the second question")
    t.type("y")
    t.wait_for(lambda s: s.rstrip().endswith("$"), WAIT, "the shell again")
    t.type("echo EXITED $?")
    t.keys("Enter")
    t.exited(WAIT)


def test_a_long_line_wraps_without_the_block_prompt(terminal):
    """A line longer than the window goes on in the next rows with no `... ` (that is a block's line)."""
    t = terminal()
    t.run("resize-window", "-x", "40", "-y", "20")
    t.type("word " * 20 + "end")
    t.wait_for(lambda s: s.rstrip().endswith("end"), WAIT, "the long line typed")
    rows = [row.rstrip() for row in t.run("capture-pane", "-p").splitlines() if row.strip()]
    typed = rows[-3:]
    assert typed[0].startswith("> word") and not any(row.startswith("...") for row in typed[1:]), rows


def test_help_and_listings_go_on_under_their_second_column(terminal, colichat_home):
    """On a terminal, a table's long row (/help, /sessions) wraps at word boundaries and goes on
    under its second column."""
    for name in ("a-conversation-with-a-rather-long-name", "another-one"):
        chat(colichat_home, [*TINY_ARGS, "--session", name], lines("hello")).ok()
    t = terminal()
    t.run("resize-window", "-x", "60", "-y", "60")
    t.type("/help")
    t.keys("Enter")
    t.wait_for(lambda s: "Multi-line input" in s, WAIT, "the help")
    t.type("/sessions")
    t.keys("Enter")
    t.wait_for(lambda s: s.count("another-one: 2 turns") == 2 and s.rstrip().endswith(">"), WAIT,
               "the listing (after the start's line on the latest conversation)")
    rows = [row.rstrip() for row in t.run("capture-pane", "-p").splitlines()]
    forget = next(i for i, row in enumerate(rows) if row.startswith("/forget [N]"))
    more = list(itertools.takewhile(lambda row: not row.startswith("/"), rows[forget + 1:]))
    assert len(more) >= 2 and all(row.startswith(" " * 20) and row[20] != " " for row in more), rows
    assert all(len(row) <= 60 for row in rows)
    listed = next(i for i, row in enumerate(rows) if row.startswith("  a-conversation-with-a-rather-long-name: "))
    assert rows[listed + 1].startswith("    ") and rows[listed + 1][4] != " ", rows
    shell = start_colichat(colichat_home, "--sessions", *TINY_ARGS[2:], width=60)  # no --model: every model's
    try:  # `colichat --sessions` on a terminal lays the rows out the same way
        shell.exited(WAIT)
        rows = [row.rstrip() for row in shell.run("capture-pane", "-p").splitlines()]
        listed = next(i for i, row in enumerate(rows) if row.startswith("  a-conversation-with-a-rather-long-name: "))
        assert rows[listed + 1].startswith("    ") and rows[listed + 1][4] != " ", rows
        assert all(len(row) <= 60 for row in rows), rows
    finally:
        shell.close()


def many_sessions(home, n: int) -> list[str]:
    """`n` saved conversations of the tiny model, a minute apart (copies of one): their names, newest first."""
    import json
    from datetime import datetime, timedelta, timezone

    from colichat.persist.sidecar import doc_check

    chat(home, [*TINY_ARGS, "--session", "conv-0"], lines("hello")).ok()
    [side] = (home / "data" / "sessions").glob("*/conv-0.json")
    doc = json.loads(side.read_text())
    start = datetime.now(timezone.utc) - timedelta(days=1)
    for k in range(n):
        doc["updated"] = (start + timedelta(minutes=k)).isoformat()
        doc["check"] = doc_check(doc)
        (side.parent / f"conv-{k}.json").write_text(json.dumps(doc))
        if k:
            (side.parent / f"conv-{k}.coli_kv").write_bytes((side.parent / "conv-0.coli_kv").read_bytes())
    return [f"conv-{k}" for k in reversed(range(n))]


def test_sessions_shows_the_newest_that_fit_in_the_window(terminal, colichat_home):
    """/sessions with more conversations than the window holds: the newest, with the command above
    them and the prompt below, and a line on how many older ones there are and where they all are."""
    names = many_sessions(colichat_home, 40)
    t = terminal()
    t.run("resize-window", "-x", "80", "-y", "24")
    t.type("/sessions")
    t.keys("Enter")
    t.wait_for(lambda s: "older conversations (colichat --sessions" in s and s.rstrip().endswith(">"), WAIT,
               "the listing and the prompt")
    rows = [row for row in visible(t) if row]
    assert rows[-1] == ">", rows
    command = rows.index("> /sessions")  # still in view
    more = next(i for i, row in enumerate(rows) if row.startswith("... and "))
    listed = [row.split(":")[0].strip() for row in rows[command + 1:more]]
    assert listed == names[:len(listed)] and len(listed) >= 5, rows
    assert " ".join(rows[more:-1]) == (f"... and {len(names) - len(listed)} older conversations (colichat "
                                       "--sessions lists them all; Tab after /resume completes their names)"), rows


def test_control_characters_in_an_answer_are_shown_not_acted_on(terminal, colichat_home):
    """The tiny model's answer is random bytes: escape sequences, carriage returns, bells. On the
    terminal they show in caret notation (^[, ^M) where they are, rather than clear the screen or
    overwrite a line; /history too."""
    t = terminal("--session", "c", "--max-tokens", "60")
    t.run("resize-window", "-x", "80", "-y", "60")
    t.type("hello")
    t.keys("Enter")
    t.wait_for(lambda s: "saved to c]" in " ".join(s.split()) and s.rstrip().endswith(">"), WAIT,
               "the answer")  # (the footer may wrap: max_tokens reached)
    answer = saved_answers(colichat_home, "c")[0]
    assert "\x1b" in answer and "\r" in answer  # what the test is about
    assert rows_after(visible(t), "hello") == wrapped(displayable(answer), 80)
    t.type("/history")
    t.keys("Enter")
    t.wait_for(lambda s: s.count("user> hello") == 1 and s.rstrip().endswith(">"), WAIT, "/history")
    words = " ".join(" ".join(visible(t)).split())  # the rows' line breaks aside
    assert " ".join(f"assistant> {displayable(answer)}".split()) in words


def test_tab_completes_session_names_after_resume_and_delete(terminal, colichat_home):
    for name in ("trip-to-rome", "trip-to-oslo", "recipes"):
        chat(colichat_home, [*TINY_ARGS, "--session", name], lines("hello")).ok()
    t = terminal()
    t.type("/resume rec")
    t.keys("Tab")
    t.wait_for(lambda s: s.rstrip().endswith("> /resume recipes"), WAIT, "/resume completed to recipes")
    t.keys("Enter")
    t.wait_for(lambda s: "turns from recipes in" in s, WAIT, "the resume")
    t.type("/delete trip-to-o")
    t.keys("Tab")
    t.wait_for(lambda s: s.rstrip().endswith("> /delete trip-to-oslo"), WAIT, "/delete completed to trip-to-oslo")
    t.keys("Enter")
    t.wait_for(lambda s: "deleted session trip-to-oslo" in s, WAIT, "the delete")
    t.type("/delete trip")
    t.keys("Tab")  # one left that starts so: completed at once
    t.wait_for(lambda s: s.rstrip().endswith("> /delete trip-to-rome"), WAIT, "the one trip left")


def test_ctrl_z_at_the_prompt_goes_back_to_the_shell_and_fg_returns_to_the_typed_line(shell):
    """As in a shell: Ctrl-Z stops colichat (a job of the shell), `fg` brings back its prompt with the
    half-typed line; the line is never sent with a ^Z in it."""
    t = shell()
    t.type("half typed")
    t.keys("C-z")
    t.wait_for(lambda s: "Stopped" in s and s.rstrip().endswith("$"), WAIT, "the shell, colichat stopped")
    t.type("fg")
    t.keys("Enter")
    t.wait_for(lambda s: s.rstrip().endswith("> half typed"), WAIT, "colichat's prompt and the typed line")
    t.type(" and done")
    t.keys("Enter")
    screen = t.wait_for(lambda s: "saved to half-typed-and-done]" in s, WAIT, "the answer, saved")
    assert "\x1a" not in screen and "^Z" not in screen
    t.type("/quit")
    t.keys("Enter")
    t.wait_for(lambda s: s.rstrip().endswith("$"), WAIT, "the shell again")
    t.type("echo EXITED $?")  # the status of the job `fg` brought back
    t.keys("Enter")
    t.exited(WAIT)


def test_fg_at_the_prompt_goes_on_below_the_shells_lines_and_overwrites_nothing(colichat_home):
    """After Ctrl-Z and `fg`, the prompt and its half-typed line come back on a fresh row under the
    shell's lines (`Stopped`, `fg`, the job's line), as a shell's programs do: nothing shown before,
    colichat's or the shell's, is drawn over or shown twice, however little of the window it fills."""
    t = Tmux("env PS1='$ ' bash --norc --noprofile -i")
    try:
        t.type("echo shell line one; echo shell line two")
        t.keys("Enter")
        t.type(colichat_line(colichat_home, *TINY_ARGS, "--session", "fg"))
        t.keys("Enter")
        t.wait_for(lambda s: "Type a message" in s, WAIT, "the prompt")
        t.type("hello")
        t.keys("Enter")
        shown = t.wait_for(lambda s: "saved to fg]" in s and s.rstrip().endswith(">"), WAIT, "the answer")
        before = [row.rstrip() for row in shown.rstrip().splitlines()][:-1]  # (the prompt's row is redrawn)
        t.type("half typed")
        t.keys("C-z")
        t.wait_for(lambda s: "Stopped" in s and s.rstrip().endswith("$"), WAIT, "the shell, colichat stopped")
        t.type("fg")
        t.keys("Enter")
        screen = t.wait_for(lambda s: s.rstrip().endswith("> half typed"), WAIT, "the prompt and the typed line")
        rows = [row.rstrip() for row in screen.rstrip().splitlines()]
        assert rows[:len(before)] == before, rows  # nothing drawn over
        assert rows.count("shell line one") == 1 and rows.count("> hello") == 1  # nothing shown twice
        after = [row for row in rows[len(before):] if row]
        assert "Stopped" in after[0] and after[1] == "$ fg" and "colichat.terminal.cli" in after[2], after
        assert after[3:] == ["> half typed"], after
    finally:
        t.close()


def test_a_resize_shows_the_quit_question_once(terminal):
    """The quit question, drawn again for a new width (narrower: it takes two rows; wider: one), shows
    once, under the line that asked it."""
    t = terminal("--session", "rq")
    t.type("exit")
    t.keys("Enter")
    question = "Did you mean /quit? (n sends 'exit' to the model) (y/n)"
    t.wait_for(lambda s: s.rstrip().endswith(question), WAIT, "the question")

    def asked_once(screen: str) -> bool:
        """Whether the rows after the last `> exit` hold the question, once (in one row or two)."""
        rows = visible(t)
        after = rows[len(rows) - rows[::-1].index("> exit"):] if "> exit" in rows else []
        return "".join("".join(after).split()) == "".join(question.split())

    for columns in ("40", "100"):
        t.run("resize-window", "-x", columns, "-y", "30")
        t.wait_for(asked_once, WAIT, "the question under the line that asked it")
    t.type("y")
    screen = t.exited(WAIT)
    assert screen.count("Did you mean") == 1 and screen.count("> exit") == 1, screen


def test_esc_then_enter_inserts_a_newline_however_long_the_pause(terminal):
    """Esc-Enter is the newline key: a pause between the two keys (longer than prompt_toolkit's
    1.5 s of escape timeouts) does not make the Enter send. Esc still starts the other Esc keys."""
    t = terminal()
    t.type("Say yes.")
    t.keys("Escape")
    time.sleep(3)  # the pause is what is tested (not a wait for a screen state)
    t.keys("Enter")
    t.type("Only yes")
    screen = t.wait_for(lambda s: s.rstrip().endswith("... Only yes") or "saved to" in s, WAIT,
                        "the second line, or an answer")
    assert screen.rstrip().endswith("> Say yes.\n... Only yes"), screen
    t.keys("Escape", "b")  # Esc-b: back a word
    t.type("very ")
    t.wait_for(lambda s: s.rstrip().endswith("... Only very yes"), WAIT, "the word typed before the last one")
    t.keys("C-c")
    t.keys("C-d")
    t.exited(WAIT)


@pytest.mark.parametrize("wrapped", [False, True], ids=["run-by-the-shell", "run-by-make"])
def test_ctrl_z_while_it_answers_and_fg_keep_typed_keys_out_of_the_answer(wrapped, shell):
    """Stopped mid-answer and brought back with `fg` (the shell has set the terminal its own way
    meanwhile): the answer goes on, and keys typed then still wait for the next prompt. Also when
    colichat is not the process the shell waits for (`make chat`)."""
    t = shell(*LONG, wrapped=wrapped)
    t.type("hello")
    t.keys("Enter")
    t.wait_for(streaming("hello"), WAIT, "the answer to stream")
    t.keys("C-z")
    t.wait_for(lambda s: "Stopped" in s and s.rstrip().endswith("$"), WAIT, "the shell, colichat stopped")
    t.type("fg")
    t.keys("Enter")
    # colichat back in the foreground, its answer going on (keys typed before it runs again are the shell's
    # terminal's, echoed by the kernel: no program can keep those out): past the job line fg prints, more words
    t.wait_for(lambda s: s.split("$ fg\n")[-1].strip(), WAIT, "fg's job line")
    after_fg = len(t.run("capture-pane", "-p", "-S", "-").split())
    t.wait_for(lambda s: len(t.run("capture-pane", "-p", "-S", "-").split()) > after_fg + 3, WAIT,
               "the answer to go on after fg")
    t.type("qqqzzz")
    screen = t.wait_for(lambda s: "saved to hello]" in s and s.rstrip().endswith("> qqqzzz"), WAIT,
                        "the answer's end, and the keys typed at the next prompt")
    assert screen.count("qqqzzz") == 1  # not echoed into the answer


def test_a_paste_while_it_answers_waits_at_the_prompt_as_one_message(terminal, colichat_home, tmp_path):
    """Two lines pasted while an answer streams are not two messages: when the answer ends they wait at the
    prompt as one, sent by Enter there (one answer). A line typed ahead with its Enter waits too (it was typed
    unseen); Ctrl-C still stops the answer. A paste at the idle prompt waits there, as it always did."""
    log = tmp_path / "raw.log"
    t = terminal("--ctx", "2048", "--max-tokens", "800", "--session", "p")  # (room for two long answers)
    t.record(log)
    t.type("hello")
    t.keys("Enter")
    t.wait_for(streaming("hello"), WAIT, "the answer to stream")
    t.paste("first pasted line\nsecond pasted line")
    assert "saved to p]" not in t.screen()  # (pasted while it answered)
    waiting = "> first pasted line\n... second pasted line"
    screen = t.wait_for(lambda s: "saved to p]" in s and s.rstrip().endswith(waiting), WAIT,
                        "the answer's end, and the paste waiting at the prompt")
    assert screen.count("pasted line") == 2 and saved_users(colichat_home, "p") == ["hello"]  # not sent
    raw = log.read_bytes()
    assert raw[:raw.index(b"saved to p]")].rsplit(b"\x1b[?2004", 1)[1].startswith(b"h")  # bracketed while it answered

    t.keys("Enter")

    def answering(s: str) -> bool:
        return len(s.split("... second pasted line\n", 1)[-1].split()) > 8 and s.count("saved to p]") == 1

    t.wait_for(answering, WAIT, "the answer to the paste to stream")
    t.type("next question")
    t.keys("Enter")
    t.keys("C-c")
    screen = t.wait_for(lambda s: s.count("saved to p]") == 2 and s.rstrip().endswith("> next question"), WAIT,
                        "the answer stopped, and the line typed ahead waiting at the prompt")
    assert ", interrupted;" in screen.split("second pasted line")[-1]
    assert saved_users(colichat_home, "p") == ["hello", "first pasted line\nsecond pasted line"]  # one message

    t.keys("C-u")
    t.type("/set max_tokens 8")
    t.keys("Enter")
    t.wait_for(lambda s: "max_tokens = 8" in s and s.rstrip().endswith(">"), WAIT, "/set max_tokens")
    t.paste("Name a fruit.\nName a vegetable.")
    t.wait_for(lambda s: s.rstrip().endswith("> Name a fruit.\n... Name a vegetable."), WAIT, "the paste at the prompt")
    assert len(saved_users(colichat_home, "p")) == 2
    t.keys("Enter")
    t.wait_for(lambda s: s.count("saved to p]") == 3 and s.rstrip().endswith(">"), WAIT, "the answer to the paste")
    assert saved_users(colichat_home, "p")[2:] == ["Name a fruit.\nName a vegetable."]
    t.keys("C-d")
    t.exited(WAIT)
    assert log.read_bytes().rsplit(b"\x1b[?2004", 1)[1].startswith(b"l")  # the terminal left as it was


def test_closing_the_terminal_while_it_answers_keeps_the_answer_so_far(colichat_home):
    """The window closed mid-answer (SIGHUP, then a terminal that cannot be written): the answer so far
    is saved and colichat ends."""
    t = Tmux(colichat_line(colichat_home, *TINY_ARGS, *LONG, "--session", "s"))
    try:
        t.wait_for(lambda s: "Type a message" in s, WAIT, "the prompt")
        t.type("hello")
        t.keys("Enter")
        t.wait_for(streaming("hello"), WAIT, "the answer to stream")
    finally:
        t.close()  # the window goes: colichat gets SIGHUP
    deadline = time.monotonic() + WAIT
    sidecars = (colichat_home / "data" / "sessions").glob
    while len(saved_turns(colichat_home, "s") if list(sidecars("*/s.json")) else []) < 2:
        assert time.monotonic() < deadline, "the answer so far was not saved"
        time.sleep(0.2)
    assert [role for role, _ in saved_turns(colichat_home, "s")] == ["user", "assistant"]
    whole = chat(colichat_home, [*TINY_ARGS, *LONG], lines("hello")).ok().out.decode()  # not interrupted
    kept = saved_turns(colichat_home, "s")[1][1]
    assert kept.strip() and whole.startswith(kept) and len(kept) < len(whole.rstrip("\n"))


@pytest.mark.parametrize("env", ["NO_COLOR=1", "TERM=dumb"])
def test_no_styles_with_no_color_or_a_dumb_terminal(env, colichat_home):
    """The footer is dim on a terminal (tests/test_repl_tmux.py), but not with NO_COLOR (no-color.org)
    or on a terminal that shows no styles (TERM=dumb: line mode)."""
    t = start_colichat(colichat_home, *TINY_ARGS, env=env)
    try:
        t.wait_for(lambda s: ("Line mode:" if "TERM=dumb" in env else "Type a message") in s, WAIT, "the prompt")
        t.type("hello")
        t.keys("Enter")
        t.wait_for(lambda s: "saved to hello]" in s, WAIT, "the answer")
        raw = t.run("capture-pane", "-p", "-e", "-S", "-")
        footer = next(line for line in raw.splitlines() if "saved to hello]" in line)
        assert footer.startswith("[") and "\x1b[2m" not in raw, footer
    finally:
        t.close()


def test_a_terminal_gone_at_the_prompt_ends_colichat_as_ctrl_d(colichat_home):
    """With SIGHUP ignored (as under `nohup`), a closed window leaves colichat at its prompt reading a
    terminal that is gone: it ends as at Ctrl-D, exit 0 (not a traceback's 1)."""
    line = f"trap '' HUP; {colichat_line(colichat_home, *TINY_ARGS, '--session', 's')}; echo $? >rc"
    t = Tmux(f"sh -c {shlex.quote(line)}")
    try:
        t.wait_for(lambda s: "Type a message" in s, WAIT, "the prompt")
        t.type("hello")
        t.keys("Enter")
        t.wait_for(lambda s: "saved to s]" in s and s.rstrip().endswith(">"), WAIT, "the answer and the next prompt")
    finally:
        t.close()
    rc = colichat_home / "rc"
    deadline = time.monotonic() + WAIT
    while not rc.exists() or not rc.read_text():
        assert time.monotonic() < deadline, "colichat did not end"
        time.sleep(0.2)
    assert rc.read_text().strip() == "0"  # a traceback exits 1
    assert [role for role, _ in saved_turns(colichat_home, "s")] == ["user", "assistant"]
