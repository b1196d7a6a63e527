"""The interactive terminal: a prompt_toolkit session with history, Tab completion of commands,
Esc-Enter or a \"\"\" block for multi-line input, streaming answers, Ctrl-C to stop an answer.
"""

from __future__ import annotations

import signal

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import Completer, Completion
from prompt_toolkit.history import FileHistory, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings

from . import inputs
from .commands import completions
from .paths import paths

PROMPT = "> "
CONTINUATION = "... "


class SlashCompleter(Completer):
    """Completes what commands.completions offers: command names, /set keys, session names."""

    def __init__(self, app=None):
        self.app = app

    def get_completions(self, document, complete_event):
        text = document.text_before_cursor
        if not text.startswith("/"):
            return
        for option in completions(text, self.app):
            yield Completion(option, start_position=-len(text))


def _bindings() -> KeyBindings:
    kb = KeyBindings()

    @kb.add("escape", "enter")
    def _newline(event):
        event.current_buffer.insert_text("\n")

    return kb


def _history():
    """Input history under the XDG state dir (COLICHAT_HOME/state); in memory if that fails."""
    try:
        state = paths().state
        state.mkdir(parents=True, exist_ok=True, mode=0o700)
        return FileHistory(str(state / "history"))
    except OSError:
        return InMemoryHistory()


def read_input(session: PromptSession) -> str:
    """One input: a line, an Esc-Enter multi-line text, or a \"\"\" block (inputs.read_input)."""
    return inputs.read_input(lambda in_block: session.prompt(CONTINUATION if in_block else PROMPT))


def run(app) -> int:
    """The REPL loop until Ctrl-D or /quit."""
    session = PromptSession(history=_history(), completer=SlashCompleter(app), key_bindings=_bindings(),
                            complete_while_typing=False)
    app.say('Type a message, /help for commands, Esc-Enter for a newline, Ctrl-D to quit.')

    def on_sigint(signum, frame):
        app.conv.stop_requested = True  # ends the answer after the current token

    while not app.quitting:
        try:
            text = read_input(session)
        except KeyboardInterrupt:
            app.say("(input cleared; Ctrl-D or /quit exits)")
            continue
        except EOFError:
            break
        old = signal.signal(signal.SIGINT, on_sigint)
        try:
            app.handle(text)
        except KeyboardInterrupt:
            app.say("(interrupted)")
        finally:
            signal.signal(signal.SIGINT, old)
    return 0
