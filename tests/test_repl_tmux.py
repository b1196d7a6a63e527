"""The interactive program, used as a person would: in tmux, typing keys and reading the screen."""

from __future__ import annotations

import re
import sys

import pytest
from tmux_helpers import Tmux

pytestmark = pytest.mark.default_model

FOOTER = re.compile(r"\[\d+ tokens, [\d.]+ tok/s, prefill \d+ at \d+ tok/s, context \d+/\d+")


@pytest.fixture
def tmux_chat(colichat_home):
    cmd = (f"COLICHAT_HOME={colichat_home} {sys.executable} -m colichat.cli --temperature 0 --max-tokens 300; "
           "echo EXITED $?; sleep 600")
    t = Tmux(cmd)
    yield t
    t.close()


def test_interactive_session(tmux_chat):
    t = tmux_chat
    t.wait_for(lambda s: "Type a message" in s, 120, "the prompt")

    # a question: the answer streams, then the footer
    t.type("What is the capital of France?")
    t.keys("Enter")
    screen = t.wait_for(lambda s: len(FOOTER.findall(s)) >= 1, 60, "the first footer")
    assert "Paris" in screen
    assert "saved to" in screen

    # Tab completes a command name
    t.type("/his")
    t.keys("Tab")
    t.wait_for(lambda s: s.rstrip().endswith("> /history"), 10, "Tab completion of /history")
    t.keys("Enter")
    t.wait_for(lambda s: "user> What is the capital of France?" in s, 10, "/history output")

    # a long answer, interrupted with Ctrl-C: it stops, keeps what it said, and the REPL goes on
    t.type("Write a long story about a dragon who lived in a castle.")
    t.keys("Enter")
    t.wait_for(lambda s: "a castle." in s and len(s.split("a castle.", 1)[1].split()) > 8, 60,
               "the long answer to stream")
    t.keys("C-c")
    screen = t.wait_for(lambda s: "interrupted;" in s, 30, "the interrupted footer")
    assert len(FOOTER.findall(screen)) == 2

    t.type("/history")
    t.keys("Enter")
    screen = t.wait_for(lambda s: "assistant> " in s.split("/history")[-1] and "dragon" in s, 10, "history")
    partial = screen.split("user> Write a long story")[-1]
    assert "assistant> " in partial

    # the conversation continues after the interruption
    t.type("Thank you!")
    t.keys("Enter")
    t.wait_for(lambda s: len(FOOTER.findall(s)) >= 3, 60, "the third footer")

    # multi-line input: Esc-Enter inserts a newline; a """ block spans lines (even one starting with /)
    t.type("/reset")
    t.keys("Enter")
    t.wait_for(lambda s: "new conversation" in s, 10, "/reset")
    t.type("Say yes.")
    t.keys("Escape", "Enter")
    t.type("Only yes.")
    t.keys("Enter")
    t.wait_for(lambda s: len(FOOTER.findall(s)) >= 4, 60, "the fourth footer")
    t.type('"""')
    t.keys("Enter")
    t.wait_for(lambda s: s.rstrip().endswith("..."), 10, "the block prompt")
    t.type("/not a command")
    t.keys("Enter")
    t.wait_for(lambda s: s.rstrip().endswith("..."), 10, "the block prompt")
    t.type('"""')
    t.keys("Enter")
    t.wait_for(lambda s: len(FOOTER.findall(s)) >= 5, 60, "the fifth footer")
    t.type("/history")
    t.keys("Enter")
    screen = t.wait_for(lambda s: "user> /not a command" in s, 10, "the block as a message in /history")
    assert "user> Say yes.\nOnly yes." in screen

    # Ctrl-C at the prompt clears the line; Ctrl-D quits cleanly
    t.type("some text")
    t.keys("C-c")
    t.wait_for(lambda s: "input cleared" in s, 10, "the Ctrl-C hint")
    t.keys("C-d")
    t.wait_for(lambda s: "EXITED 0" in s, 30, "a clean exit")
