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
from .chat import ChatError, Conversation, Settings
from .commands import Message, dispatch, is_command
from .engine import ModelError, SamplerSettings, load
from .engine.ops import SMALL_BATCH
from .models import DefaultModelMissing, default_model_path
from .paths import paths
from .persist import SessionError


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="colichat",
        description="Chat with a GGUF model in the terminal; every conversation is kept on disk "
        "as its KV cache and reopens instantly with /resume.",
    )
    p.add_argument("--model", metavar="PATH", help="a GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--session", metavar="NAME", help="name of the conversation to save into (or resume)")
    p.add_argument("--resume", action="store_true", help="resume the latest (or --session) conversation")
    p.add_argument("--ctx", type=int, metavar="N", help="context size in tokens (default: model's, max 8192)")
    p.add_argument("--temperature", type=float, metavar="T", help="0 means greedy (default 0.7)")
    p.add_argument("--top-k", type=int, metavar="K", help="sample from the K most likely tokens (0 = off; default 40)")
    p.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling threshold (1 = off; default 0.95)")
    p.add_argument("--min-p", type=float, metavar="P", help="drop tokens below P x the best (0 = off; default 0.05)")
    p.add_argument("--repeat-penalty", type=float, metavar="R", help="penalty on recent tokens (1 = off, the default)")
    p.add_argument("--seed", type=int, help="random seed: the same seed gives the same answers")
    p.add_argument("--max-tokens", type=int, metavar="N", help="the longest answer (default 512)")
    p.add_argument("--system", metavar="TEXT", help="system prompt for new conversations")
    p.add_argument("--draft", type=int, metavar="N",
                   help="speculative decoding: check up to N tokens guessed from the conversation per step "
                   "(0 = off; same answers, faster when the answer repeats earlier text)")
    p.add_argument("--expert-cache", type=float, metavar="MIB",
                   help="MiB of dequantized MoE experts kept in memory (default: half of the memory left "
                   "after the weights and the context, at least 512)")
    p.add_argument("--numerics", choices=["fast", "llama.cpp"], default="fast",
                   help="llama.cpp: reproduce llama.cpp's CPU arithmetic bit for bit (F32, Q8_0, Q4_1 weights; "
                   "slow, for checking against llama.cpp)")
    p.add_argument("--no-save", action="store_true", help="do not write the conversation to disk")
    p.add_argument("--plain", action="store_true", help="line mode even on a terminal")
    p.add_argument("-p", "--prompt", metavar="TEXT", help="answer one message and exit")
    p.add_argument("--version", action="version", version=f"colichat {__version__}")
    return p.parse_args(argv)


def settings_from(args) -> Settings:
    s = SamplerSettings()
    for opt, key in [("temperature", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"),
                     ("min_p", "min_p"), ("repeat_penalty", "repeat_penalty"), ("seed", "seed")]:
        value = getattr(args, opt)
        if value is not None:
            s = s.with_(**{key: value})
    s.validate()
    out = Settings(sampler=s, system=args.system)
    if args.draft is not None:
        if not 0 <= args.draft < SMALL_BATCH:
            raise ValueError(f"--draft must be between 0 (off) and {SMALL_BATCH - 1}")
        out.draft = args.draft
    if args.max_tokens is not None:
        if args.max_tokens < 1:
            raise ValueError("--max-tokens must be at least 1")
        out.max_tokens = args.max_tokens
    return out


class App:
    """What commands act on: the conversation, and the two output streams."""

    def __init__(self, conv: Conversation, interactive: bool):
        self.conv = conv
        self.interactive = interactive
        self.quitting = False
        self.errors = 0
        self.output_closed = False  # stdout's reader went away (broken pipe)

    def say(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)

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

    def answer(self, text: str) -> None:
        progress = self._prefill_progress if sys.stderr.isatty() else None
        _, stats = self.conv.ask(text, on_text=self.out, on_progress=progress)
        self.out("\n")
        self.say(self.conv.footer(stats))
        if stats.saved is False:
            self.errors += 1  # the footer says why; the exit status says so too

    def _prefill_progress(self, done: int, total: int) -> None:
        sys.stderr.write(f"\rprefill {done}/{total} tokens" + ("\n" if done == total else ""))
        sys.stderr.flush()

    def handle(self, line: str) -> None:
        """One input: a command or a message. Errors print one line and count."""
        try:
            if is_command(line):
                dispatch(self, line)
            elif line.strip():
                self.answer(line)
        except (ChatError, SessionError, ModelError, ValueError) as e:
            self.errors += 1
            self.say(f"colichat: {e}")




def read_inputs(stream):
    """Lines of stdin as inputs; a block between two lines of `\"\"\"` is one input (a Message)."""
    block = None
    for raw in stream:
        line = raw.rstrip("\n")
        if block is not None:
            if line.strip() == '"""':
                yield Message("\n".join(block))
                block = None
            else:
                block.append(line)
        elif line.strip() == '"""':
            block = []
        elif line.strip().startswith('"""') and line.strip().endswith('"""') and len(line.strip()) > 6:
            yield Message(line.strip()[3:-3])
        else:
            yield line
    if block:
        yield Message("\n".join(block))


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
        for line in read_inputs(sys.stdin) if inputs is None else inputs:
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


def main(argv=None) -> int:
    args = parse_args(argv)

    def say(line):
        print(line, file=sys.stderr, flush=True)

    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")  # a character the terminal cannot show must not end the answer
    try:
        if args.prompt is not None and not args.prompt.strip():
            raise ValueError("-p/--prompt needs a message")
        settings = settings_from(args)
        model = load_model(args, say)
        conv = Conversation(model, settings, save=not args.no_save, session_name=args.session)
    except (ModelError, DefaultModelMissing, SessionError, ValueError) as e:
        say(f"colichat: {e}")
        return 1
    except KeyboardInterrupt:
        return 130
    interactive = sys.stdin.isatty() and sys.stdout.isatty() and not args.plain and not args.prompt
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
