"""What was typed or pasted while colichat was busy reaches the next prompt as one text, which only an
Enter at that prompt sends: in-process, on a pseudo-terminal set as the REPL sets it while it answers
(tests/test_commands_tmux.py: the same in a real terminal, with tmux's paste)."""

from __future__ import annotations

import os
import pty
import termios
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from prompt_toolkit import PromptSession
from prompt_toolkit.input.typeahead import clear_typeahead
from prompt_toolkit.input.vt100 import Vt100Input
from prompt_toolkit.output import DummyOutput

from colichat.terminal.repl import PASTE_END, PASTE_START, typed_ahead


@pytest.fixture
def terminal():
    """(the terminal's side where keys are typed, a prompt session reading the program's side); the
    program's side in the mode of repl.keys_wait (no echo, no line editing: keys wait in its queue)."""
    main, side = pty.openpty()
    attrs = termios.tcgetattr(side)
    attrs[3] &= ~(termios.ECHO | termios.ICANON)
    termios.tcsetattr(side, termios.TCSANOW, attrs)
    with os.fdopen(side, "r", encoding="utf-8") as stdin:
        session = PromptSession(input=Vt100Input(stdin), output=DummyOutput())
        yield main, session
        clear_typeahead(session.input)  # (kept by the fd's number, which the next test's terminal may reuse)
    os.close(main)


def next_prompt(main: int, session: PromptSession, paste_wait: float = 1.0) -> str:
    """What the next prompt sends when `!` and Enter are typed at it, once it shows (with the keys
    typed ahead: a `!` at its end says that no Enter typed before it had sent them)."""
    typed_ahead(session.input, paste_wait)
    return session.prompt("> ", pre_run=lambda: os.write(main, b"!\r"))


def test_lines_typed_ahead_wait_as_one_text_that_one_enter_sends(terminal):
    main, session = terminal
    os.write(main, "what time\ris it?\r\r".encode())  # (the terminal makes each \r a \n meanwhile)
    assert next_prompt(main, session) == "what time\nis it?!"  # not two messages, nor an empty one


def test_a_paste_while_busy_is_one_text_and_the_enter_after_it_does_not_send_it(terminal):
    main, session = terminal
    os.write(main, f"{PASTE_START}first line\rsecond line\tindented{PASTE_END}\r".encode())
    assert next_prompt(main, session) == "first line\nsecond line\tindented!"  # a Tab too is text


def test_a_paste_still_arriving_is_waited_for(terminal):
    main, session = terminal
    os.write(main, f"{PASTE_START}the first half\r".encode())

    def rest() -> None:
        time.sleep(0.3)
        os.write(main, f"the second\rhalf{PASTE_END[:3]}".encode())  # its end mark cut between two writes too
        time.sleep(0.3)
        os.write(main, PASTE_END[3:].encode())

    with ThreadPoolExecutor(1) as pool:
        pool.submit(rest)
        assert next_prompt(main, session, paste_wait=30) == "the first half\nthe second\nhalf!"


def test_a_paste_that_never_ends_is_kept(terminal):
    main, session = terminal
    os.write(main, f"{PASTE_START}cut off\rhere".encode())
    assert next_prompt(main, session, paste_wait=0.2) == "cut off\nhere!"


def test_keys_other_than_enter_act_as_typed(terminal):
    """Esc-Enter is the newline key anyway; Ctrl-U drops what was typed before it on its line."""
    main, session = terminal
    os.write(main, "dropped\x15kept\x1b\rnext".encode())
    assert next_prompt(main, session) == "kept\nnext!"
