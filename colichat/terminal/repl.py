"""The interactive terminal: a prompt_toolkit session with history, Tab completion of commands,
multi-line input (Esc-Enter, or a \"\"\" block), streaming answers, Ctrl-C to stop an answer.

Multi-line input is one prompt_toolkit buffer: Enter inside an open \"\"\" block inserts a newline,
so a block is one entry in the history (Up recalls it whole) and its lines show a `... ` prompt.
While colichat is busy (an answer streams, a command runs, the model loads) the terminal does not
echo: keys typed then wait in the terminal's input queue and become the next prompt's text, which
only an Enter at that prompt sends (typed_ahead): a paste of many lines is never many messages, and
nothing typed unseen is sent unseen. Bracketed paste stays on meanwhile, so a paste is text, not keys.

When the terminal's width changes, what was shown is drawn again for the new width (screen.Screen):
while an answer streams, before its next piece; at a prompt (the quit question's too), just before
prompt_toolkit draws the prompt again for the new size (it handles SIGWINCH itself), above the
prompt, whose typed text stays as it is. After Ctrl-Z and `fg`, nothing is drawn again: colichat
goes on below the shell's lines (screen.Screen.continued).

Esc then Enter inserts a newline however long the pause between them (the application waits for
the key after Esc, as readline does: no timeout turns the Esc into a key of its own).
"""

from __future__ import annotations

import codecs
import contextlib
import io
import os
import select
import signal
import stat
import sys

from prompt_toolkit import PromptSession
from prompt_toolkit.application.current import get_app
from prompt_toolkit.completion import Completer, Completion
from prompt_toolkit.filters import Condition
from prompt_toolkit.history import FileHistory, InMemoryHistory
from prompt_toolkit.input.typeahead import get_typeahead, store_typeahead
from prompt_toolkit.input.vt100 import Vt100Input
from prompt_toolkit.input.vt100_parser import Vt100Parser
from prompt_toolkit.key_binding import KeyBindings, KeyPress
from prompt_toolkit.keys import Keys

from ..paths import paths, private_dir, private_file
from ..wrap import rows
from . import inputs
from .commands import commands_of, completions
from .screen import Screen

PROMPT = "> "
CONTINUATION = "... "
FENCE = inputs.FENCE
PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"  # what a terminal sends around a paste (bracketed paste)
ENTERS = (Keys.ControlM, Keys.ControlJ)  # Enter: \r, or \n where the terminal turned it into one (ICRNL)


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


def open_block(text: str) -> bool:
    """Whether `text` is a \"\"\" block still waiting for its closing \"\"\" line."""
    lines = text.split("\n")
    return lines[0].strip() == FENCE and (len(lines) == 1 or lines[-1].strip() != FENCE)


def _bindings(screen: Screen | None = None) -> KeyBindings:
    kb = KeyBindings()
    in_block = Condition(lambda: open_block(get_app().current_buffer.text))

    @kb.add("escape", "enter")
    def _newline(event):
        event.current_buffer.insert_text("\n")

    @kb.add("enter", filter=in_block)
    def _block_newline(event):
        event.current_buffer.insert_text("\n")

    @kb.add("c-d", filter=in_block)
    def _end_block(event):
        """Ctrl-D in a block ends it (the closing line is added, so the history holds a whole block)."""
        buf = event.current_buffer
        buf.text = buf.text.rstrip("\n") + "\n" + FENCE
        buf.validate_and_handle()

    @kb.add("c-c")
    def _interrupt(event):
        """Ctrl-C at the prompt drops the line, which stays on screen marked `^C` (as in a shell)."""
        buf = event.current_buffer
        event.app.empty_interrupt = not buf.text  # (run() says once that Ctrl-D quits)
        buf.text += "^C"
        buf.cursor_position = len(buf.text)
        event.app.exit(exception=KeyboardInterrupt, style="class:aborting")

    @kb.add("c-l")
    def _clear(event):
        """Ctrl-L clears the window; what was shown stays cleared when the window is drawn again."""
        if screen:
            screen.cleared()
        event.app.renderer.clear()

    return kb


class _ReadOnlyHistory(FileHistory):
    """The history file's lines for Up, and nothing typed now written to it (--no-save)."""

    def store_string(self, string: str) -> None:
        pass


def input_history(no_save: bool = False):
    """Input history under the XDG state dir (COLICHAT_HOME/state); in memory if that fails, or if
    what is there is not a regular file (a FIFO would hang the start, a link to /dev/zero read without
    end: it is opened without blocking, and its descriptor checked, first). With --no-save the file's lines are
    recalled but nothing is added (nor the file created)."""
    path = paths().state / "history"
    try:
        if no_save:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        else:
            private_dir(path.parent)
            fd = private_file(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK)  # 0600 before use
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
        finally:
            os.close(fd)
    except OSError:
        return InMemoryHistory()
    if not regular:
        return InMemoryHistory()
    return (_ReadOnlyHistory if no_save else FileHistory)(str(path))


def _continuation(width, line_number, wrap_count):
    """`... ` before the lines of a block; none before the rows of a long line wrapped by the width
    (they are one line, as the terminal shows it again after a redraw)."""
    return CONTINUATION if wrap_count == 0 else ""


def echo(text: str) -> str:
    """The prompt with `text` typed, as it shows."""
    return PROMPT + text.replace("\n", "\n" + CONTINUATION)


def yes_or_no(question: str, screen: Screen | None = None) -> bool:
    """Ask `question (y/n)` and wait for y or n; other keys, Enter among them, do nothing (a question
    answered by a stray Enter would quit, or send a word to the model). Ctrl-C: KeyboardInterrupt;
    Ctrl-D: EOFError; Ctrl-Z stops colichat as at the prompt (`fg` asks again). A change of width
    draws `screen` again above the question, as at the prompt."""
    kb = KeyBindings()

    def answer(value: bool):
        def handler(event) -> None:
            session.default_buffer.text = "y" if value else "n"
            event.app.exit(result=value)
        return handler

    for key, value in (("y", True), ("Y", True), ("n", False), ("N", False)):
        kb.add(key)(answer(value))
    kb.add("c-c")(lambda event: event.app.exit(exception=KeyboardInterrupt, style="class:aborting"))
    kb.add("c-d")(lambda event: event.app.exit(exception=EOFError))
    kb.add("c-z")(lambda event: event.app.suspend_to_background())
    kb.add(Keys.Any)(lambda event: None)  # nothing else is typed in
    kb.add("enter")(lambda event: None)
    prompt = f"{question} (y/n) "
    session: PromptSession[bool] = PromptSession(prompt, key_bindings=kb)
    if screen:
        session.app.before_render += _redraw_on_resize(screen, lambda: prompt)
    return session.prompt()


def make_session(app) -> PromptSession:
    session = PromptSession(history=input_history(app.conv.shelf.no_save), completer=SlashCompleter(app),
                            key_bindings=_bindings(app.screen),
                            complete_while_typing=False, prompt_continuation=_continuation,
                            enable_suspend=True)  # Ctrl-Z: back to the shell (`fg` returns), as while answering
    session.app.timeoutlen = None  # Esc waits for the next key: Esc, a pause, Enter is still a newline
    if app.screen:
        session.app.before_render += _redraw_on_resize(app.screen, lambda: echo(session.default_buffer.text))
    return session


def _redraw_on_resize(screen: Screen, prompt):
    """A handler of a prompt's before_render event: when the width changed since the screen was
    laid out, what was shown is drawn again above the prompt, with room left for the prompt as it
    shows (`prompt()`: its text with what is typed)."""

    def before_render(pt_app) -> None:
        if screen.current():
            return
        below = len(rows(prompt(), screen.columns())) - 1
        pt_app.renderer.erase(leave_alternate_screen=False)  # the prompt as drawn; its renderer starts over
        pt_app.output.write_raw(screen.redraw(below))
        pt_app.output.flush()
        pt_app.renderer.request_absolute_cursor_position()  # where the prompt now starts

    return before_render


def typed_ahead(pt_input: Vt100Input, paste_wait: float = 1.0) -> None:
    """The keys typed while colichat was busy, waiting in the terminal's input queue (and any the last
    prompt read after its Enter), handed to the next prompt with each Enter among them made a line
    break and the last ones dropped: what was typed, or pasted without bracketed paste, shows at the
    prompt as one text that an Enter there sends (a 20-line paste is one message, not 20). A paste
    still arriving is waited for up to `paste_wait` seconds, so that it is not cut in two."""
    found: list[KeyPress] = get_typeahead(pt_input)
    parser = Vt100Parser(found.append)
    decoder = codecs.getincrementaldecoder(pt_input.stdin.encoding or "utf-8")("surrogateescape")  # as prompt_toolkit's
    fd, tail, in_paste = pt_input.fileno(), "", False
    while True:
        try:
            ready = select.select([fd], [], [], paste_wait if in_paste else 0)[0]
            data = os.read(fd, 4096) if ready else b""
        except OSError:  # the terminal is gone: the prompt says so (EOFError)
            data = b""
        if not data:
            break
        piece = decoder.decode(data)
        seen = tail + piece  # (a mark may be cut between two reads)
        start, end = seen.rfind(PASTE_START), seen.rfind(PASTE_END)
        in_paste = start > end if start >= 0 or end >= 0 else in_paste
        tail = seen[-len(PASTE_END) + 1:]
        parser.feed(piece)
    parser.feed(decoder.decode(b"", final=True) + (PASTE_END if in_paste else ""))  # a paste never ended: kept
    parser.flush()
    while found and found[-1].key in ENTERS:
        found.pop()
    store_typeahead(pt_input, [KeyPress(Keys.BracketedPaste, "\n") if k.key in ENTERS else k for k in found])


def read_input(session: PromptSession, screen: Screen | None = None) -> str:
    """One input: a line, an Esc-Enter multi-line text, or a \"\"\" block (as a Message, even if
    it starts with "/"; an empty block is the empty input). The prompt's echo goes to `screen`.
    What was typed before it shows waits at the prompt (typed_ahead)."""
    typed_ahead(session.input)
    try:
        text = session.prompt(PROMPT)
    except KeyboardInterrupt:
        if screen:
            screen.echo(echo(session.default_buffer.text))  # the dropped line, marked ^C
        raise
    if screen:
        screen.echo(echo(text))
    if text.split("\n", 1)[0].strip() != FENCE:
        return text
    found = list(inputs.inputs_of(io.StringIO(text)))  # the one reader of \"\"\" blocks
    return found[0] if found else ""


def _marked_pastes(on: bool) -> None:
    """Bracketed paste on or off: while it is on, the terminal sends a paste between PASTE_START and
    PASTE_END, so that a paste typed ahead reaches the next prompt as text (not as keys: no Enter, no Tab)."""
    with contextlib.suppress(OSError):  # (a terminal gone; no flush: also called from a signal handler)
        if os.isatty(sys.stdout.fileno()):
            os.write(sys.stdout.fileno(), b"\x1b[?2004h" if on else b"\x1b[?2004l")


@contextlib.contextmanager
def keys_wait(on_continue=lambda: None):
    """No echo and no line editing on the terminal outside prompt_toolkit's prompts (while an answer
    streams): typed keys wait in the input queue for the next prompt, a Ctrl-C too. Ctrl-C still raises SIGINT.
    Bracketed paste is on, so a paste waits marked as one (typed_ahead). Ctrl-Z stops colichat as usual
    (the shell sets the terminal its own way meanwhile); `fg` (SIGCONT) sets this mode again, and calls
    `on_continue`. Yields what sets this mode again after a prompt (which leaves bracketed paste off)."""
    try:
        import termios

        fd = sys.stdin.fileno()
        old = termios.tcgetattr(fd)
    except (ImportError, OSError, ValueError):
        yield lambda: None
        return
    new = list(old)
    new[3] &= ~(termios.ECHO | termios.ICANON)
    new[3] |= termios.NOFLSH  # Ctrl-C (or Ctrl-Z) keeps the keys typed ahead: the next prompt's text
    new[6] = list(old[6])
    new[6][termios.VMIN], new[6][termios.VTIME] = 1, 0

    def mode(attrs) -> None:
        with contextlib.suppress(OSError, termios.error):  # a terminal gone (SIGHUP) cannot be set
            termios.tcsetattr(fd, termios.TCSANOW, attrs)  # TCSANOW: the typed-ahead keys stay queued
        _marked_pastes(attrs is new)

    def continued(signum, frame) -> None:  # `fg` after Ctrl-Z
        mode(new)
        on_continue()

    handler = signal.signal(signal.SIGCONT, continued)
    try:
        mode(new)
        yield lambda: mode(new)
    finally:
        signal.signal(signal.SIGCONT, handler)
        mode(old)


def run(app) -> int:
    """The REPL loop until Ctrl-D or /quit."""
    session = make_session(app)
    app.say(f'Type a message, /help for commands, Esc-Enter or a {FENCE} line for several lines, Ctrl-D to quit.')

    def on_sigint(signum, frame):
        app.interrupted()  # ^C shown; the answer ends after the current token and shows nothing more

    told = False  # that Ctrl-D quits, after a Ctrl-C at an empty prompt (once: Ctrl-C does not quit)
    with keys_wait(app.continued) as busy:  # also between prompts: a key typed as a prompt ends is not echoed astray
        while not app.quitting:
            try:
                text = read_input(session, app.screen)  # prompt_toolkit's own terminal mode while it reads
            except KeyboardInterrupt:
                if getattr(session.app, "empty_interrupt", False) and not told:
                    app.say("(Ctrl-D quits)")
                    told = True
                continue
            except (EOFError, OSError):  # Ctrl-D, or the terminal is gone (its window closed, SIGHUP ignored)
                break
            busy()  # (the prompt turned bracketed paste off)
            for k, line in enumerate(commands_of(text)):  # lines that are all commands: each in turn
                if app.quitting:
                    break
                if k:
                    app.say(echo(line))  # as a shell shows the next line typed ahead, then its output
                old = signal.signal(signal.SIGINT, on_sigint)
                try:
                    with app.ending_signals():
                        app.handle(line)
                except KeyboardInterrupt:
                    app.say("(interrupted)")
                finally:
                    signal.signal(signal.SIGINT, old)
    return 128 + app.ended_by if app.ended_by else 0
