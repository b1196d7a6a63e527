"""Pipe mode: inputs read from stdin (a pipe, a file, or a person typing in line mode) or given
(-p) until the end; only the model's text goes to stdout. Ctrl-C, SIGCONT and the exit status."""

from __future__ import annotations

import signal
import sys

from .app import App
from .inputs import FENCE, clean_line, inputs_of, read_input
from .streams import discard

LINE_MODE_HINT = (f"Line mode: type a message and Enter, a {FENCE} line for several lines, /help for commands, "
                  "Ctrl-D to quit.")


def _to_terminal(text: str) -> None:
    """Text for the person at the terminal, on stderr, without a line end (a prompt)."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except OSError:
        discard(sys.stderr)


def typed_lines(app: App):
    """The inputs a person types at the terminal in line mode (stdout not a terminal, or --plain): a
    hint, then the REPL's prompts on stderr before each line. As in the REPL, Ctrl-C at a prompt
    (KeyboardInterrupt, from pipe_mode's handler) drops what was typed, the line or the block so far,
    and Ctrl-D at a prompt ends the input (and the prompt's row)."""
    app.say(LINE_MODE_HINT)

    def next_line(in_block: bool) -> str:
        _to_terminal("... " if in_block else "> ")
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return clean_line(line)[0]

    while True:
        try:
            text = read_input(next_line)
        except EOFError:
            _to_terminal("\n")
            return
        except KeyboardInterrupt:  # the terminal dropped the line typed so far, and showed ^C
            _to_terminal("\n")
            continue
        yield text


def pipe_mode(app: App, inputs=None) -> int:
    """Read inputs from stdin (or `inputs`, for -p) until the end; only the model's text goes to stdout.
    Ctrl-C stops the answer, then colichat (130); while it waits for input, at once. With a person
    typing at the terminal (stdin and stderr terminals: `prompting`, typed_lines), Ctrl-C is the
    REPL's instead: it stops the answer or drops the input typed so far, and colichat goes on."""
    interrupted = busy = False
    prompting = inputs is None and sys.stdin.isatty() and sys.stderr.isatty()
    if inputs is None:
        inputs = typed_lines(app) if prompting else inputs_of(sys.stdin, app.say)

    def on_sigint(signum, frame):
        nonlocal interrupted
        if not busy:  # waiting for input: at a prompt typed_lines drops the line, else colichat ends
            interrupted = not prompting
            raise KeyboardInterrupt
        app.cancel.set()  # the answer or command ends at the engine's next safe point, what was shown kept
        if not prompting:  # then colichat ends; a second Ctrl-C ends it now
            if interrupted:
                raise KeyboardInterrupt
            interrupted = True

    old = signal.signal(signal.SIGINT, on_sigint)
    on_continue = signal.signal(signal.SIGCONT, lambda signum, frame: app.continued())
    try:
        for line in inputs:
            busy = True
            with app.ending_signals():
                app.handle(line)
            busy = False
            if interrupted:
                return 130
            if app.ended_by:
                return 128 + app.ended_by
            if app.quitting or app.output_closed:
                break
    except KeyboardInterrupt:
        return 130
    finally:  # once interrupted, the program is ending: a further Ctrl-C must not cut its exit short
        signal.signal(signal.SIGINT, signal.SIG_IGN if interrupted else old)
        signal.signal(signal.SIGCONT, on_continue)
    return 1 if app.errors else 0

