"""The controller the REPL, pipe mode and the commands act on: the conversation, what is shown on
the two output streams (the answer on stdout, status lines on stderr), Ctrl-C and the ending signals
while an input is handled, and one input handled (a command or a message).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

from ..conversation import report
from ..conversation.chat import Conversation
from ..conversation.thinking import LiveThinking
from ..engine.cancel import Cancel
from ..errors import USER_ERRORS, ChatError
from .commands import dispatch, is_command, meant_command, message_text
from .screen import Screen
from .streams import StatusLine, discard, dumb_terminal, terminal_size, to_stderr

BUSY = {"/resume": "reading the conversation from disk ..."}  # what a slow command shows meanwhile
PROGRESS_EVERY = 0.25  # seconds between two redraws of a prefill's progress (the engine tells it every layer)
RATE_AFTER = 1.0  # seconds of a prefill before its rate and the time left are shown


class App:
    """What commands act on: the conversation, and the two output streams."""

    def __init__(self, conv: Conversation, interactive: bool, status: StatusLine | None = None, banner=()):
        self.conv = conv
        self.interactive = interactive
        self.quitting = False
        self.errors = 0
        self.output_closed = False  # stdout's reader went away (broken pipe)
        self.ended_by = 0  # the signal (SIGTERM, SIGHUP) that ends colichat after this input, if any
        self.cancel = Cancel()  # the stop request of the input handled (a new one each: handle)
        self.warm_note = True  # the next answer says if the experts' warm start still runs (after a start, /resume)
        self.status = status or StatusLine()
        self.hushed = False  # Ctrl-C: the rest of the answer is not shown
        self.writing = False  # a piece of the answer is being written (out)
        self.cut_waits = False  # a Ctrl-C came meanwhile: its ^C goes after the piece
        # the footer is dim, apart from the answer; not for a terminal without styles, nor with NO_COLOR
        self.dim = sys.stderr.isatty() and not dumb_terminal() and not os.environ.get("NO_COLOR")
        # the REPL wraps answers at word boundaries and redraws what it showed when the width changes
        self.screen = (Screen(terminal_size, banner, lines_on_screen=sys.stderr.isatty(), dim=self.dim)
                       if interactive else None)
        self.thinking = LiveThinking(self)  # a thinking model's thinking while it streams
        self.keep = "/save NAME"  # what keeps an unsaved conversation (-p: an option, there is no next line)
        self.auto_forget = False  # --auto-forget: a message that does not fit is sent after a /forget

    def say(self, line: str, hang: int = 0) -> None:
        """A status line; `hang`: where its rows after a break start on a terminal (a table's second column)."""
        self.status.clear()
        if self.screen:
            self.write(self.screen.line(line, hang))
        to_stderr(line, hang)

    def window(self) -> tuple[int, int] | None:
        """The (columns, rows) of the terminal the status lines show on; None where they go to a pipe or a
        file, or to a dumb terminal (an editor's buffer, which scrolls freely: nothing is cut to a window)."""
        return terminal_size(sys.stderr) if sys.stderr.isatty() and not dumb_terminal() else None

    def out(self, text: str, thinking: bool = False) -> None:
        """A piece of the answer (or of its thinking, shown: thinking.LiveThinking) for stdout."""
        if not thinking and not self.hushed:
            self.thinking.end()  # the answer begins: what stays of the thinking goes above it
        self.writing = True  # a Ctrl-C from now on shows its ^C after this piece, which the answer keeps
        try:
            if self.output_closed or self.hushed:
                return
            self.status.clear()
            self.write(self.screen.answer(text, thinking) if self.screen else text)
        finally:
            self.writing = False
            if self.cut_waits:
                self.cut_waits = False
                self._show_cut()

    def write(self, text: str) -> None:
        if not text or self.output_closed:
            return
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except OSError as e:
            # Nobody reads the answer any more, or it cannot be written (a file on a full disk): end it
            # here (what was generated is kept and saved).
            self.output_closed = True
            self.cancel.set()
            self.errors += 1
            discard(sys.stdout)
            why = ("the output was closed" if isinstance(e, BrokenPipeError)
                   else f"cannot write the answer ({e.strerror or type(e).__name__})")
            self.say(f"colichat: {why}; stopping")

    def interrupted(self) -> None:
        """Ctrl-C (from a signal handler): stop the answer after the current token, show no more of
        it. The terminal shows `^C` after all the answer received (it does not echo while an answer
        streams), a piece being written when the signal came included."""
        if not self.hushed and self.writing:  # the signal came while a piece was written: ^C after it
            self.cut_waits = True
        elif not self.hushed:
            self._show_cut()
        self.cancel.set()
        self.hushed = True

    def _show_cut(self) -> None:
        shown = self.screen.interrupt(on_status=self.status.shown) if self.screen else "^C"
        with contextlib.suppress(OSError, ValueError):
            os.write(sys.stdout.fileno(), shown.encode(sys.stdout.encoding or "utf-8", "replace"))

    def continued(self) -> None:
        """colichat was continued after a stop (Ctrl-Z, `fg`; from a SIGCONT handler): the time
        stopped does not count in the speeds, and the REPL goes on below the shell's lines."""
        self.conv.clock.continued()
        if self.screen:
            self.screen.continued()

    @contextlib.contextmanager
    def ending_signals(self):
        """While an input is handled, SIGTERM (a shutdown, `kill`) and SIGHUP (the terminal closed)
        end the answer after the current token, as Ctrl-C does: what was generated is kept and saved,
        then colichat ends (`ended_by`; exit status 128 + the signal). Between inputs they end it at
        once, the default: nothing is unsaved then."""

        def on_signal(signum, frame):
            self.ended_by = signum
            self.cancel.set()
            self.quitting = True

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
        if self.ended_by:
            self.say(f"colichat: ended by {signal.Signals(self.ended_by).name}")

    def quit(self) -> None:
        self.quitting = True

    def quit_or_send(self, line: str, meant: str = "/quit") -> None:
        """`exit` (or `clear`) alone on a line: ask whether /quit (/clear) was `meant`; only a "no" sends it
        to the model."""
        word = line.strip()
        if not self.interactive:
            does = "quits" if meant == "/quit" else "starts a new conversation"
            raise ChatError(f"'{word}' alone is not sent to the model: {meant} {does}, a \"\"\" block sends it")
        from .repl import yes_or_no

        question = f"Did you mean {meant}? (n sends '{word}' to the model)"
        try:
            said_yes = yes_or_no(question, self.screen)
        except (KeyboardInterrupt, EOFError):
            return
        if self.screen:
            self.screen.echo(f"{question} (y/n) {'y' if said_yes else 'n'}")
        if said_yes:
            dispatch(self, meant)
        else:
            self.answer(word)

    def answer(self, text: str | None) -> None:
        """Answer the message `text`, or with None the last message again (/regen)."""
        if text is not None and self.auto_forget and self.conv.transcript.turns and not report.fits(self.conv, text):
            self.say(self.conv.forget(on_progress=self.prefill_progress("the exchanges kept"), cancel=self.cancel))
        warming = self.warm_note and self.conv.model.warming()
        if warming:
            self.say(f"note: the expert cache is still being filled from earlier runs ({warming[0]:,} of "
                     f"{warming[1]:,} experts read); it waits while colichat answers, so this answer reads "
                     "the experts it needs itself")
        self.warm_note = False
        self.status.show("reading your message ...")
        shown = {"on_text": self.out, "on_progress": self.prefill_progress(), "on_note": self.say,
                 "on_think": self.thinking.piece, "cancel": self.cancel}
        try:
            _, stats = self.conv.ask(text, **shown)  # (None: the last message again)
        finally:
            self.thinking.end()  # (an answer that ended inside it)
            self.hushed = False
            if self.screen:
                self.write(self.screen.end_answer())
        if not self.screen:
            self.out("\n")
        footer = report.footer(self.conv, stats, self.keep)
        self.say(f"\033[2m{footer}\033[0m" if self.dim else footer)
        if stats.still_thinking and stats.stopped == "length":
            most = self.conv.prefs.settings.max_tokens
            self.say(f"note: the answer reached max_tokens ({most}) while the model was still thinking: "
                     f"/set max_tokens {max(4096, 4 * most)} (or --max-tokens) leaves it room to answer; /regen "
                     "asks again")
        if stats.stopped == "context":  # cut, not ended: say what lets it go on
            self.say(f"note: the answer was cut: the context is full: {report.ways_out(self.conv)}")
        if self.conv.model.file_note:  # a model file replaced or deleted: this run goes on with its map
            self.say(self.conv.model.file_note)
            self.conv.model.file_note = None
        if stats.saved is False:
            self.errors += 1  # the footer says why; the exit status says so too

    def prefill_progress(self, what: str = "your message"):
        """The callback that shows how far a prefill of `what` is (a status line, on a terminal):
        progress(done, total), told at every layer (`done` a float: tokens read so far). Once it has run
        RATE_AFTER seconds, the line gives the tokens read, their rate and the time left (report.progress),
        redrawn at most every PROGRESS_EVERY seconds; a done below the last one starts a new prefill."""
        began, shown, last = [0.0], [0.0], [-1.0]

        def progress(done: float, total: int) -> None:
            now = time.monotonic()
            if done < last[0] or last[0] < 0:
                began[0], shown[0] = now, now
                self.status.show(f"reading {what} ({total:,} tokens) ...")
            last[0] = done
            if now - shown[0] < PROGRESS_EVERY or now - began[0] < RATE_AFTER:
                return
            shown[0] = now
            if self.screen:
                self.write(self.screen.follow())
            self.status.show(f"reading {what}: {report.progress(done, total, now - began[0])} ...")

        return progress

    def handle(self, line: str) -> None:
        """One input: a command or a message. Errors print one line and count."""
        self.hushed = False
        self.cancel = Cancel()
        try:
            if is_command(line):
                self.status.show(BUSY.get(line.split(maxsplit=1)[0].lower(), "working ..."))
                dispatch(self, line)
            elif meant_command(line):
                self.quit_or_send(line, meant_command(line))
            elif line.strip():
                self.answer(message_text(line))
        except USER_ERRORS as e:
            self.errors += 1
            self.say(f"colichat: {e}")
        finally:
            self.status.clear()


@contextlib.contextmanager
def stopped_by_ctrl_c(app: App):
    """While opening a conversation at start: Ctrl-C stops reading its damaged exchanges again (the
    ones read are kept, as /resume does) instead of ending colichat. Yields a list, non-empty once
    Ctrl-C came."""
    came: list[bool] = []

    def on_sigint(signum, frame):
        came.append(True)
        app.cancel.set()

    old = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield came
    finally:
        signal.signal(signal.SIGINT, old)
