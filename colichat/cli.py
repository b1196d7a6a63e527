"""argv -> a running chat: load the model, then the terminal REPL or pipe mode. Exit codes:
0 done, 1 error while running (bad model, saved conversation, bad input in pipe/one-shot mode),
2 a command line no run could carry out (an unknown option, a bad option value, options that
contradict each other; refused before anything is read), 130 interrupted, 143 and 129 ended by
SIGTERM and SIGHUP (the answer so far kept and saved).
"""

from __future__ import annotations

import os
import signal


def _interrupt_at_start(signum, frame):
    _interrupt_at_start.seen = True
    raise KeyboardInterrupt


# The imports take most of a start (numpy, jinja2): Ctrl-C there exits 130, quietly. An interrupt
# inside numpy's C imports becomes an ImportError (or is swallowed), so the handler notes that one came.
_interrupt_at_start.seen, _sigint = False, signal.signal(signal.SIGINT, _interrupt_at_start)
try:
    import argparse
    import contextlib
    import sys
    import warnings

    from wcwidth import wcswidth

    from . import __version__, report
    from .chat import Conversation
    from .commands import dispatch, is_command, is_quit_word, message_text
    from .engine import MIN_CTX
    from .errors import USER_ERRORS, ChatError, UsageError
    from .hub import is_hub_model, model_file
    from .hub import parse as parse_hub_model
    from .inputs import ESCAPED, FENCE, Message, clean_line, inputs_of, read_input
    from .model_list import NO_MODELS, model_rows
    from .models import DefaultModelMissing, default_model_path
    from .paths import expand_home, paths
    from .persist import SessionError, Store, check_name
    from .prune import prune_kv
    from .sessions import export_saved, listing, refuse_if_open
    from .settings import TABLE, SettingError, Settings
    from .start import (
        check_context_fits,
        check_model_file,
        check_rope_factors,
        check_saving,
        choose_model,
        load_model,
        model_sampling,
        reopen_at_start,
        saved_context,
        saving_mode,
        unreadable_sessions,
    )
    from .thinking import LiveThinking
    from .wrap import Screen, wrap_line
except BaseException:
    if not _interrupt_at_start.seen:
        raise
if _interrupt_at_start.seen:  # raised, or swallowed by an import that tolerates failures
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the exit
    # Not SystemExit: CPython can have marked the KeyboardInterrupt unhandled on its way through an
    # import, and then ends itself by SIGINT after the clean-up (status -2, not 130; seen in about 1
    # start in 60 with two Ctrl-C on a busy machine). Nothing is written yet that this exit could lose.
    os._exit(130)
signal.signal(signal.SIGINT, _sigint)


class Parser(argparse.ArgumentParser):
    """argparse's errors (an unknown option, a value of the wrong type) in one line, as colichat's
    own usage errors, with the same exit status, 2."""

    def error(self, message):
        self.exit(2, f"colichat: {message} (colichat --help lists the options)\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(
        prog="colichat",
        description="Chat with a GGUF model in the terminal; every conversation is kept on disk "
        "as its KV cache and reopens instantly with /resume.",
    )
    p.add_argument("--model", metavar="PATH", help="a GGUF file, or hf:OWNER/REPO[:QUANT] (or hf:OWNER/REPO/FILE.gguf) "
                   "from the Hugging Face Hub, downloaded into its cache (default: the model that saved the "
                   "conversation --session or --resume reopens, else SmolLM2-135M-Instruct)")
    p.add_argument("--session", metavar="NAME", help="name of the conversation: a new one, or the saved one "
                   "of that name, reopened")
    p.add_argument("--resume", action="store_true", help="resume the latest conversation (of any model when "
                   "--model is not given), or --session NAME")
    p.add_argument("--ctx", type=int, metavar="N", help="context size in tokens (default: the one a reopened "
                   "conversation was saved with, else the model's, at most 8192)")
    for row in TABLE:  # the chat settings: read as text here, checked by settings_from
        p.add_argument(row.option, metavar=row.metavar, help=f"{row.help} (default {row.show(row.default)})")
    p.add_argument("--expert-cache", type=float, metavar="MIB",
                   help="MiB of dequantized MoE experts kept in memory (default: half of the memory left "
                   "after the weights and the context, at least 512)")
    p.add_argument("--kv", choices=["f32", "fp8", "int4"], default="f32",
                   help="how new conversations keep their KV cache on disk and in memory: f32 (exact, the default), "
                   "fp8 (colibri's COLIKV2, about 4x smaller) or int4 (COLIKV3, about 7x smaller); a saved "
                   "conversation keeps the one it was saved in")
    p.add_argument("--no-reuse", action="store_true", help="prefill every new conversation's prompt in full, "
                   "even where a saved conversation of the model begins with the same tokens (by default their "
                   "records are read instead, saying so)")
    p.add_argument("--numerics", choices=["fast", "llama.cpp"],  # default fast (None: not given)
                   help="llama.cpp: reproduce llama.cpp's CPU arithmetic bit for bit (F32, Q8_0, Q4_1 weights; "
                   "slow, for checking against llama.cpp; default fast)")
    p.add_argument("--auto-forget", action="store_true", help="when a message would not fit in the context left "
                   "(or would leave too little room for its answer), go on in a new conversation without the "
                   "oldest exchanges first, as /forget does, instead of refusing it (for scripts)")
    p.add_argument("--no-save", action="store_true", help="write nothing of yours (no conversation, no typed "
                   "line in the input history): a saved conversation (--session NAME, --resume, /resume) opens "
                   "and goes on unsaved (one-shot -p runs and messages from a pipe "
                   "are saved only with --session NAME or --resume)")
    p.add_argument("--sessions", action="store_true", help="list the saved conversations of every model and exit "
                   "(not with -p, --resume, --session, --model)")
    p.add_argument("--export", metavar="NAME", help="print saved conversation NAME as Markdown and exit; --model "
                   "chooses whose when several models have one of that name (not with -p, --resume, --session)")
    p.add_argument("--models", action="store_true", help="list the GGUF models colichat has used or finds in the "
                   "Hugging Face cache (architecture, size, whether they run here) and exit")
    p.add_argument("--prune-kv", metavar="DAYS", type=float, help="free the disk space of conversations not used "
                   "for DAYS days: their KV files go, their text stays (reopening one reads it again); then exit")
    p.add_argument("--plain", action="store_true", help="line mode even on a terminal")
    p.add_argument("--verbose", action="store_true", help="say where the model file is")
    p.add_argument("-p", "--prompt", metavar="TEXT", help="answer one message and exit")
    p.add_argument("--version", action="version", version=f"colichat {__version__}")
    args = p.parse_args(argv)
    args.not_utf8 = [option for option, text in (("-p", args.prompt), ("--system", args.system))
                     if text is not None and argument_text(text) != argument_text(text, "surrogateescape")]
    args.prompt, args.system = argument_text(args.prompt), argument_text(args.system)
    return args


def argument_text(text: str | None, errors: str = "replace") -> str | None:
    """A message typed on the command line (-p, --system), as UTF-8 whatever the locale: the bytes
    a locale without UTF-8 could not decode (Python keeps them as surrogates) are read as UTF-8,
    and a byte that is not UTF-8 as U+FFFD, as in messages read from a pipe (main says so)."""
    if text is None or not ESCAPED.search(text):
        return text
    return os.fsencode(text).decode("utf-8", errors)


def check_command_line(args) -> tuple[Settings, frozenset]:
    """Refuse, before anything is read, a command line no run could carry out (UsageError: exit 2):
    a bad option value, options that contradict each other. Returns settings_from's answer."""
    if args.model == "":
        raise UsageError("--model needs a path")
    if args.model:  # `--model=~/m.gguf`, or a quoted ~, which the shell leaves as it is
        args.model = expand_home(args.model, UsageError, "--model ")
    if is_hub_model(args.model):
        parse_hub_model(args.model)
    if args.prompt is not None and not args.prompt.strip():
        raise UsageError("-p/--prompt needs a message")
    if args.ctx is not None and args.ctx < MIN_CTX:
        raise UsageError(f"--ctx must be at least {MIN_CTX} (tokens of context), not {args.ctx}")
    for name in (args.session, args.export):
        if name is not None:
            try:
                check_name(name)
            except SessionError as e:
                raise UsageError(str(e)) from None
    check_combinations(args)
    try:
        return settings_from(args)
    except SettingError as e:
        raise UsageError(str(e)) from None


# The options of a chat (attribute, option): --sessions and --export, which print and exit, take none.
# what asks for a chat, which --sessions and --export do not start (settings and the other options only
# shape a chat: harmless there, and a shell alias may add them to every colichat)
CHAT_OPTIONS = (("prompt", "-p"), ("resume", "--resume"), ("session", "--session"))


def check_combinations(args) -> None:
    """Options that contradict each other, or that would do nothing, are refused (never ignored)."""
    shell = [o for o, given in (("--sessions", args.sessions), ("--export", args.export is not None),
                                ("--prune-kv", args.prune_kv is not None), ("--models", args.models)) if given]
    if len(shell) > 1:
        raise UsageError(f"{' and '.join(shell)} each do their work and exit: give one of them")
    if args.prune_kv is not None and not 0 <= args.prune_kv < float("inf"):
        raise UsageError("--prune-kv takes a number of days, 0 or more")
    if not shell:
        return
    if args.prune_kv is not None:
        unused = [option for attr, option in CHAT_OPTIONS if getattr(args, attr) not in (None, False)]
        if unused:
            raise UsageError(f"--prune-kv frees disk space and exits: {', '.join(unused)} cannot be used with it")
        return
    unused = [option for attr, option in CHAT_OPTIONS if getattr(args, attr) not in (None, False)]
    if (args.sessions or args.models) and args.model is not None:  # --export NAME --model PATH: that model's NAME
        unused.insert(0, "--model")
    if unused:
        what = ("--sessions lists every model's saved conversations" if args.sessions
                else "--models lists the models" if args.models else "--export prints a saved conversation")
        raise UsageError(f"{what} and exits: {', '.join(unused)} cannot be used with it")


def settings_from(args) -> tuple[Settings, frozenset]:
    """The settings the options give (the defaults for the others), and the names of those given."""
    given = {row.name: row.parse(getattr(args, row.name), row.option) for row in TABLE
             if getattr(args, row.name) is not None}
    if args.expert_cache is not None and not 0 <= args.expert_cache < float("inf"):
        raise SettingError("--expert-cache must be a number of MiB, 0 or more")
    return Settings(**given), frozenset(given)


def to_stderr(line: str, hang: int = 0) -> None:
    """A status line: to stderr, so that stdout holds only the model's text; on a terminal, wrapped
    at word boundaries (the rows after a break start at column `hang`). If stderr cannot be written
    (a log file on a full disk), its lines are lost, not the answer."""
    try:
        if sys.stderr.isatty():
            line = wrap_line(line, _columns(sys.stderr), hang)
        print(line, file=sys.stderr, flush=True)
    except OSError:
        discard(sys.stderr)


def discard(stream) -> None:
    """Point a standard stream that can no longer be written (its reader gone, its disk full) at
    /dev/null: what is still buffered, and every later write, goes nowhere quietly, at exit too."""
    with contextlib.suppress(OSError, ValueError):
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, stream.fileno())
        os.close(fd)


def open_standard_streams() -> None:
    """A standard stream the caller closed (`>&-`) is opened on /dev/null, as if redirected there:
    no file colichat opens can then take its number (and get the answer, or a status line, written
    into it), and closed stdin reads as empty, closed stdout or stderr writes nowhere."""
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            new = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)  # the lowest free number
            if new != fd:
                os.dup2(new, fd)
                os.close(new)
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", encoding="utf-8", closefd=False))


def set_encodings() -> None:
    """Messages read from a pipe or a file are UTF-8 whatever the locale says (a C locale with Python's
    UTF-8 mode off): only a byte that is not UTF-8 is read as U+FFFD (inputs_of says so). Answers and
    status lines written to a pipe or a file are UTF-8 too, the model's text as it is, unless
    PYTHONIOENCODING asks for another encoding. A terminal keeps the locale's encoding. Whatever
    the encoding, a character it cannot hold is replaced, and never ends the answer or the input."""
    asked = os.environ.get("PYTHONIOENCODING", "").partition(":")[0]
    for stream, errors in ((sys.stdin, "surrogateescape"), (sys.stdout, "replace"), (sys.stderr, "backslashreplace")):
        if not hasattr(stream, "reconfigure"):
            continue
        if stream.isatty() or (asked and stream is not sys.stdin):
            stream.reconfigure(errors=errors)
        else:
            stream.reconfigure(encoding="utf-8", errors=errors)


class StatusLine:
    """One transient line on a terminal's stderr (progress, "reading ..."): shown in place and
    cleared before anything else is printed, so it never runs into the next message. It is cut
    to the terminal's width (a wrapped line could not be cleared). Off a terminal it shows nothing.
    A terminal without cursor controls (TERM=dumb: an editor's shell buffer) gets no escape sequences:
    a carriage return, and spaces over what was shown before."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.dumb = dumb_terminal()
        self.shown = False
        self.columns = 0  # of the line shown

    def show(self, text: str) -> None:
        if not self.tty:
            return
        width = _columns(self.stream)
        text = text[: max(1, width - 1)]
        if self.dumb:
            self.stream.write("\r" + text + " " * max(0, self.columns - _width(text)))
        else:
            self.stream.write("\r\033[K" + text)
        self.stream.flush()
        self.shown, self.columns = True, max(self.columns, _width(text))

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * self.columns + "\r" if self.dumb else "\r\033[K")
            self.stream.flush()
            self.shown, self.columns = False, 0


def _width(text: str) -> int:
    """Columns `text` takes on a terminal (at least one per character: a control character counts one)."""
    return max(len(text), wcswidth(text))


def dumb_terminal() -> bool:
    """TERM=dumb: a terminal that takes no escape sequences (no colours, no cursor moves)."""
    return os.environ.get("TERM") == "dumb"


class App:
    """What commands act on: the conversation, and the two output streams."""

    def __init__(self, conv: Conversation, interactive: bool, status: StatusLine | None = None, banner=()):
        self.conv = conv
        self.interactive = interactive
        self.quitting = False
        self.errors = 0
        self.output_closed = False  # stdout's reader went away (broken pipe)
        self.ended_by = 0  # the signal (SIGTERM, SIGHUP) that ends colichat after this input, if any
        self.status = status or StatusLine()
        self.hushed = False  # Ctrl-C: the rest of the answer is not shown
        self.writing = False  # a piece of the answer is being written (out)
        self.cut_waits = False  # a Ctrl-C came meanwhile: its ^C goes after the piece
        # the footer is dim, apart from the answer; not for a terminal without styles, nor with NO_COLOR
        self.dim = sys.stderr.isatty() and not dumb_terminal() and not os.environ.get("NO_COLOR")
        # the REPL wraps answers at word boundaries and redraws what it showed when the width changes
        self.screen = Screen(_size, banner, lines_on_screen=sys.stderr.isatty(), dim=self.dim) if interactive else None
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
        return _size(sys.stderr) if sys.stderr.isatty() and not dumb_terminal() else None

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
            self.conv.stop_requested = True
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
        self.conv.stop_requested = True
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
            self.conv.stop_requested = True
            self.quitting = True

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
        if self.ended_by:
            self.say(f"colichat: ended by {signal.Signals(self.ended_by).name}")

    def resume(self, name: str | None) -> None:
        """Reopen a saved conversation; on the terminal, show where it stands (its last exchange)."""
        self.say(self.conv.resume(name, on_progress=self.prefill_progress("the damaged exchanges' saved text")))
        for line in report.recap(self.conv.turns, self.conv, self.dim) if self.interactive else ():
            self.say(line)

    def quit(self) -> None:
        self.quitting = True

    def quit_or_send(self, line: str) -> None:
        """`exit` alone on a line: ask whether /quit was meant; only a "no" sends it to the model."""
        word = line.strip()
        if not self.interactive:
            raise ChatError(f"'{word}' alone is not sent to the model: /quit quits, a \"\"\" block sends it")
        from .repl import yes_or_no

        question = f"Did you mean /quit? (n sends '{word}' to the model)"
        try:
            meant_quit = yes_or_no(question, self.screen)
        except (KeyboardInterrupt, EOFError):
            return
        if self.screen:
            self.screen.echo(f"{question} (y/n) {'y' if meant_quit else 'n'}")
        if meant_quit:
            self.quit()
        else:
            self.answer(word)

    def answer(self, text: str | None) -> None:
        """Answer the message `text`, or with None the last message again (/regen)."""
        if text is not None and self.auto_forget and self.conv.turns and not self.conv.fits(text):
            self.say(self.conv.forget(on_progress=self.prefill_progress("the exchanges kept")))
        self.status.show("reading your message ...")
        shown = {"on_text": self.out, "on_progress": self.prefill_progress(), "on_note": self.say,
                 "on_think": self.thinking.piece}
        try:
            _, stats = self.conv.ask(text, **shown) if text is not None else self.conv.regen(**shown)
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
            most = self.conv.settings.max_tokens
            self.say(f"note: the answer reached max_tokens ({most}) while the model was still thinking: "
                     f"/set max_tokens {max(4096, 4 * most)} (or --max-tokens) leaves it room to answer; /regen "
                     "asks again")
        if stats.stopped == "context":  # cut, not ended: say what lets it go on
            self.say("note: the answer was cut: the context is full. /forget goes on in a new conversation without "
                     "the oldest exchanges (--auto-forget does so by itself before a message that does not fit)")
        if stats.saved is False:
            self.errors += 1  # the footer says why; the exit status says so too

    def prefill_progress(self, what: str = "your message"):
        """The callback that shows how far a prefill of `what` is (a status line, on a terminal)."""

        def progress(done: int, total: int) -> None:
            if self.screen:
                self.write(self.screen.follow())
            if done == 0:
                self.status.show(f"reading {what} ({total:,} tokens) ...")
            else:
                self.status.show(f"reading {what}: {done:,}/{total:,} tokens ...")

        return progress

    def handle(self, line: str) -> None:
        """One input: a command or a message. Errors print one line and count."""
        self.hushed = False
        try:
            if is_command(line):
                self.status.show(BUSY.get(line.split(maxsplit=1)[0].lower(), "working ..."))
                dispatch(self, line)
            elif is_quit_word(line):
                self.quit_or_send(line)
            elif line.strip():
                self.answer(message_text(line))
        except USER_ERRORS as e:
            self.errors += 1
            self.say(f"colichat: {e}")
        finally:
            self.status.clear()


def _size(stream=None) -> tuple[int, int]:
    """The terminal's (columns, rows): (80, 24) where unknown (not a terminal, or one that reports 0)."""
    try:
        size = os.get_terminal_size((stream or sys.stdout).fileno())
    except (OSError, ValueError):
        return 80, 24
    return size.columns or 80, size.lines or 24


def _columns(stream=None) -> int:
    return _size(stream)[0]


BUSY = {"/resume": "reading the conversation from disk ..."}  # what a slow command shows meanwhile
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
        app.conv.stop_requested = True  # the answer or command ends after the current token, kept
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


def from_the_shell(args) -> int:
    """--sessions and --export NAME: read the saved conversations, print to stdout; --prune-kv DAYS: free
    their KV files' space; --models: the models known, on stdout. No model is loaded."""
    root = paths().data / "sessions"
    problem = unreadable_sessions(root)
    if problem:  # else the listing would say "no saved conversations" of conversations it cannot see
        raise SessionError(f"cannot read the saved conversations in {root} ({problem}); fix that, or set "
                           "COLICHAT_HOME to the directory that holds them")
    store = Store()
    if args.models:
        return print_out("".join(f"{row}\n" for row in model_rows(store)) or NO_MODELS)
    if args.prune_kv is not None:
        for line in prune_kv(store, args.prune_kv):
            to_stderr(line)
        return 0
    if args.sessions:
        rows = listing(store)
        if sys.stdout.isatty():  # as /sessions shows them
            rows = [wrap_line(row, _columns(), hang=4) for row in rows]
        return print_out("\n".join(rows) + "\n" if rows else "no saved conversations\n")
    if is_hub_model(args.model):  # --export NAME --model hf:...: the one downloaded (nothing is downloaded)
        args.model = model_file(args.model, to_stderr, offline=True)
    try:
        model = args.model or default_model_path()
    except DefaultModelMissing:
        model = None
    text, warnings, note = export_saved(store, model, args.export, given=args.model is not None)
    if note:  # the other models' conversations of that name, and how to print one
        to_stderr(note)
    for line in warnings:  # as opening says what it drops
        to_stderr(f"warning: {line}")
    return print_out(text)


def print_out(text: str) -> int:
    """Write `text` to stdout: 0, or 1 with one line if it cannot be written (a full disk). A reader
    that stopped early (`| head`) has what it wanted: 0, quietly."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        discard(sys.stdout)
    except OSError as e:
        discard(sys.stdout)
        raise ChatError(f"cannot write to standard output: {e.strerror or type(e).__name__}") from None
    return 0


@contextlib.contextmanager
def stopped_by_ctrl_c(conv):
    """While opening a conversation at start: Ctrl-C stops reading its damaged exchanges again (the
    ones read are kept, as /resume does) instead of ending colichat. Yields a list, non-empty once
    Ctrl-C came."""
    came: list[bool] = []

    def on_sigint(signum, frame):
        came.append(True)
        conv.stop_requested = True

    old = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield came
    finally:
        signal.signal(signal.SIGINT, old)


def interrupted() -> int:
    """Exit status 130; further Ctrl-C are ignored while the program ends (no traceback on the way out)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return 130


def main(argv=None) -> int:
    open_standard_streams()
    # Weights that overflow float32 (a damaged or odd file): the model's own check says so in one line
    # (the NaN it computes); numpy's warnings, printed with their source lines, are not for the user.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"colichat\.")
    args = parse_args(argv)
    status = StatusLine()
    banner: list[str] = []  # the lines shown before the REPL (it draws them again on a resize)

    def say(line):  # a status line that replaces the progress shown, if any
        status.clear()
        banner.append(line)
        to_stderr(line)

    set_encodings()
    for option in args.not_utf8:
        say(f"note: the text of {option} is not UTF-8: its invalid bytes are read as U+FFFD")
    try:
        settings, given = check_command_line(args)
    except UsageError as e:
        say(f"colichat: {e}")
        return 2
    args.numerics = args.numerics or "fast"
    try:
        if args.sessions or args.export is not None or args.prune_kv is not None or args.models:
            return from_the_shell(args)
        args.model = choose_model(args, say)
        check_model_file(args.model)
        # A dumb terminal (an editor's shell buffer) edits the line itself and takes no cursor moves: line mode.
        args.interactive = (sys.stdin.isatty() and sys.stdout.isatty() and not args.plain and not args.prompt
                            and not dumb_terminal())
        problem = check_saving(args)
        # what --session and --resume mean, known before the model loads (--no-save too: it reads them)
        args.resume, note = reopen_at_start(args, say)
        if note:
            say(note)
        saved_context(args)
        check_context_fits(args)
        check_rope_factors(args)
        read_only = saving_mode(args, problem, say)
        if not (args.no_save or read_only):  # (those read it without its lock: another colichat may have it)
            refuse_if_open(Store(), args.model, args.session, args.resume)
        interactive = args.interactive
        person_types = sys.stdin.isatty() and args.prompt is None  # the messages: saved as in the REPL
        waiting = contextlib.nullcontext()
        if interactive:  # keys typed while it loads wait for the prompt, not echoed into the progress line
            from .repl import keys_wait

            waiting = keys_wait()
        with waiting:
            # --draft 0 at start: no MTP rows either (the model's, for its life; /set draft picks what it uses)
            model = load_model(args, say, status, mtp=settings.draft > 0, system=settings.system)
        settings, note = model_sampling(settings, given, model.cfg)
        if note:
            say(note)
        problem = model.cache.codec_problem(args.kv)
        if problem:
            raise SettingError(f"--kv {args.kv}: {problem}")
        conv = Conversation(model, settings, session_name=args.session, pinned=given, no_save=args.no_save,
                            save_new=person_types or args.session is not None or args.resume, read_only=read_only,
                            kv=args.kv, reuse=not args.no_reuse)
    except USER_ERRORS as e:
        say(f"colichat: {e}")
        return 1
    except KeyboardInterrupt:
        status.clear()
        to_stderr("colichat: interrupted while starting")
        return interrupted()
    app = App(conv, interactive, status, banner)
    app.auto_forget = args.auto_forget
    say = app.say
    try:
        if args.resume:
            status.show(BUSY["/resume"])
            with stopped_by_ctrl_c(conv) as stopped:  # damaged exchanges read again: keep those read
                app.resume(args.session)
            if stopped and not interactive:  # Ctrl-C in pipe mode ends colichat, once what was read is said
                return interrupted()
        else:
            if args.session is not None and not args.no_save:
                conv.saving.claim(args.session, conv.settings.to_dict())
            hint = conv.saving.latest_hint() if args.prompt is None else None  # one-shot: no hint to act on
            if hint:
                say(hint)
        if args.prompt is not None:
            app.keep = "--session NAME"
            return pipe_mode(app, [Message(args.prompt)])  # a message, even one that starts with /
        if interactive:
            from .repl import run

            return run(app)
        return pipe_mode(app)
    except USER_ERRORS as e:
        say(f"colichat: {e}")
        return 1
    except KeyboardInterrupt:
        return interrupted()
    finally:
        conv.close()


if __name__ == "__main__":
    sys.exit(main())
