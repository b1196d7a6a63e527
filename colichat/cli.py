"""argv -> a running chat: load the model, then the terminal REPL or pipe mode. Exit codes:
0 done, 1 error (bad model, bad input in pipe/one-shot mode), 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from . import __version__
from .chat import ChatError, Conversation
from .commands import dispatch, is_command, is_quit_word
from .engine import ModelError, load
from .inputs import inputs_of
from .models import DefaultModelMissing, default_model_path
from .paths import paths
from .persist import SessionError, Store
from .sessions import before_load, export_saved, listing
from .settings import TABLE, SettingError, Settings


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="colichat",
        description="Chat with a GGUF model in the terminal; every conversation is kept on disk "
        "as its KV cache and reopens instantly with /resume.",
    )
    p.add_argument("--model", metavar="PATH", help="a GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--session", metavar="NAME", help="name of the conversation: a new one, or the saved one "
                   "of that name, reopened")
    p.add_argument("--resume", action="store_true", help="resume the latest (or --session) conversation")
    p.add_argument("--ctx", type=int, metavar="N", help="context size in tokens (default: model's, max 8192)")
    for row in TABLE:  # the chat settings: read as text here, checked by settings_from
        p.add_argument(row.option, metavar=row.metavar, help=f"{row.help} (default {row.show(row.default)})")
    p.add_argument("--expert-cache", type=float, metavar="MIB",
                   help="MiB of dequantized MoE experts kept in memory (default: half of the memory left "
                   "after the weights and the context, at least 512)")
    p.add_argument("--numerics", choices=["fast", "llama.cpp"], default="fast",
                   help="llama.cpp: reproduce llama.cpp's CPU arithmetic bit for bit (F32, Q8_0, Q4_1 weights; "
                   "slow, for checking against llama.cpp)")
    p.add_argument("--no-save", action="store_true", help="do not write the conversation to disk (one-shot -p "
                   "and piped runs are saved only with --session NAME or --resume)")
    p.add_argument("--sessions", action="store_true", help="list the saved conversations of every model and exit")
    p.add_argument("--export", metavar="NAME", help="print saved conversation NAME as Markdown and exit")
    p.add_argument("--plain", action="store_true", help="line mode even on a terminal")
    p.add_argument("-p", "--prompt", metavar="TEXT", help="answer one message and exit")
    p.add_argument("--version", action="version", version=f"colichat {__version__}")
    return p.parse_args(argv)


def settings_from(args) -> tuple[Settings, frozenset]:
    """The settings the options give (the defaults for the others), and the names of those given."""
    given = {row.name: row.parse(getattr(args, row.name), row.option) for row in TABLE
             if getattr(args, row.name) is not None}
    return Settings(**given), frozenset(given)


def say(line: str) -> None:
    """A status line: to stderr, so that stdout holds only the model's text."""
    print(line, file=sys.stderr, flush=True)


class App:
    """What commands act on: the conversation, and the two output streams."""

    def __init__(self, conv: Conversation, interactive: bool):
        self.conv = conv
        self.interactive = interactive
        self.quitting = False
        self.errors = 0
        self.output_closed = False  # stdout's reader went away (broken pipe)

    def say(self, line: str) -> None:
        say(line)

    def out(self, text: str) -> None:
        if self.output_closed:
            return
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:
            # Nobody reads the answer any more: end it here (what was generated is kept and saved).
            self.output_closed = True
            self.conv.stop_requested = True
            self.errors += 1
            self.say("colichat: the output was closed; stopping")
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # a quiet flush at exit
            except (OSError, ValueError):
                pass

    def quit(self) -> None:
        self.quitting = True

    def quit_or_send(self, line: str) -> None:
        """`exit` alone on a line: ask whether /quit was meant; only a "no" sends it to the model."""
        word = line.strip()
        if not self.interactive:
            raise ChatError(f"'{word}' alone is not sent to the model: /quit quits, a \"\"\" block sends it")
        from prompt_toolkit.shortcuts import confirm

        try:
            meant_quit = confirm(f"Did you mean /quit? (n sends '{word}' to the model)")
        except (KeyboardInterrupt, EOFError):
            return
        if meant_quit:
            self.quit()
        else:
            self.answer(word)

    def answer(self, text: str) -> None:
        _, stats = self.conv.ask(text, on_text=self.out, on_progress=self.prefill_progress(), on_note=self.say)
        self.out("\n")
        self.say(self.conv.footer(stats))
        if stats.saved is False:
            self.errors += 1  # the footer says why; the exit status says so too

    def prefill_progress(self):
        """The callback that shows how far a long prefill is (on a terminal), or None."""
        return self._prefill_progress if sys.stderr.isatty() else None

    def _prefill_progress(self, done: int, total: int) -> None:
        sys.stderr.write(f"\rprefill {done}/{total} tokens" + ("\n" if done == total else ""))
        sys.stderr.flush()

    def handle(self, line: str) -> None:
        """One input: a command or a message. Errors print one line and count."""
        try:
            if is_command(line):
                dispatch(self, line)
            elif is_quit_word(line):
                self.quit_or_send(line)
            elif line.strip():
                self.answer(line)
        except (ChatError, SessionError, ModelError, SettingError, ValueError) as e:
            self.errors += 1
            self.say(f"colichat: {e}")




def pipe_mode(app: App, inputs=None) -> int:
    """Read inputs from stdin (or `inputs`, for -p) until the end; only the model's text goes to stdout."""
    interrupted = False

    def on_sigint(signum, frame):
        nonlocal interrupted
        if interrupted:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        interrupted = True
        app.conv.stop_requested = True

    old = signal.signal(signal.SIGINT, on_sigint)
    try:
        for line in inputs_of(sys.stdin) if inputs is None else inputs:
            app.handle(line)
            if interrupted:
                return 130
            if app.quitting or app.output_closed:
                break
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGINT, old)
    return 1 if app.errors else 0


def load_model(args, say):
    path = args.model or default_model_path()
    t0 = time.perf_counter()
    tty = sys.stderr.isatty()

    def progress(done, total):
        if tty:
            sys.stderr.write(f"\rloading {os.path.basename(path)}: layer {done}/{total}")
            sys.stderr.flush()

    notes: list[str] = []
    model = load(path, n_ctx=args.ctx, progress=progress, cache_dir=paths().cache / "weights",
                 expert_cache=args.expert_cache, on_note=notes.append, numerics=args.numerics)
    if tty:
        sys.stderr.write("\r\033[K")
    cfg = model.cfg
    say(f"{cfg.name} ({cfg.arch}, {cfg.n_layer} layers) from {path}, loaded in {time.perf_counter() - t0:.1f} s")
    say(f"memory: {model.memory_estimate()}")
    if model.numerics != "fast":
        say("numerics: llama.cpp's CPU arithmetic, op by op (many times slower; for checking against llama.cpp)")
    for line in notes:
        say(f"note: {line}")
    return model


def from_the_shell(args) -> int:
    """--sessions and --export NAME: read the saved conversations, print to stdout, no model loaded."""
    store = Store()
    if args.sessions:
        rows = listing(store)
        print("\n".join(rows) if rows else "no saved conversations", flush=True)
        return 0
    try:
        model = args.model or default_model_path()
    except DefaultModelMissing:
        model = None
    sys.stdout.write(export_saved(store, model, args.export))
    sys.stdout.flush()
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")  # a character the terminal cannot show must not end the answer
    try:
        if args.prompt is not None and not args.prompt.strip():
            raise ValueError("-p/--prompt needs a message")
        settings, given = settings_from(args)
        if args.sessions or args.export is not None:
            return from_the_shell(args)
        args.model = args.model or default_model_path()
        if not args.no_save:  # what --session and --resume mean, known before the model loads
            args.resume = before_load(Store(), args.model, args.session, args.resume)
        interactive = sys.stdin.isatty() and sys.stdout.isatty() and not args.plain and not args.prompt
        model = load_model(args, say)
        conv = Conversation(model, settings, save=not args.no_save, session_name=args.session, pinned=given,
                            save_new=interactive or args.session is not None or args.resume)
    except (ModelError, DefaultModelMissing, SessionError, SettingError, ValueError) as e:
        say(f"colichat: {e}")
        return 1
    except KeyboardInterrupt:
        return 130
    app = App(conv, interactive)
    try:
        if args.resume:
            say(conv.resume(args.session))
        else:
            if args.session and not args.no_save:
                conv.check_new_session(args.session)
            hint = conv.latest_hint() if args.prompt is None else None  # one-shot: no hint to act on
            if hint:
                say(hint)
        if args.prompt is not None:
            return pipe_mode(app, [args.prompt])
        if interactive:
            from .repl import run

            return run(app)
        return pipe_mode(app)
    except (ChatError, SessionError, ModelError) as e:
        say(f"colichat: {e}")
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        conv.close()


if __name__ == "__main__":
    sys.exit(main())
