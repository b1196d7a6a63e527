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

    from .. import __version__
    from ..conversation.chat import Conversation
    from ..conversation.settings import TABLE, SettingError, Settings
    from ..engine import MIN_CTX
    from ..errors import USER_ERRORS, UsageError
    from ..models.hub import is_hub_model
    from ..models.hub import parse as parse_hub_model
    from ..paths import expand_home
    from ..persist import SessionError, Store, check_name
    from .app import BUSY, App, stopped_by_ctrl_c
    from .commands import cmd_resume
    from .inputs import ESCAPED, Message
    from .one_shot import from_the_shell
    from .pipe import pipe_mode
    from .start import Plan, given_model, load_model, model_sampling
    from .start import plan as start_plan
    from .streams import StatusLine, open_standard_streams, set_encodings, to_stderr
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


def parser() -> Parser:
    """colichat's options: --help shows them, and README.md's synopsis is checked against them."""
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
    p.add_argument("--kv", choices=["f32", "fp8", "int4"],
                   help="how new conversations keep their KV cache on disk and in memory: f32 (exact, the default), "
                   "fp8 (colibri's COLIKV2, about 4x smaller) or int4 (COLIKV3, about 7x smaller); a saved "
                   "conversation keeps the one it was saved in")
    p.add_argument("--no-reuse", action="store_true", help="prefill every new conversation's prompt in full, "
                   "even where a saved conversation of the model begins with the same tokens (by default their "
                   "records are read instead, saying so)")
    p.add_argument("--numerics", choices=["fast", "llama.cpp"],  # default fast (None: not given)
                   help="llama.cpp: reproduce llama.cpp's CPU arithmetic bit for bit (F32, Q8_0, Q4_1 weights; "
                   "slow, for checking against llama.cpp; default fast)")
    p.add_argument("--kernels", choices=["auto", "numba", "numpy"], default="auto",
                   help="numba: multiply by the weights as the GGUF holds them, with compiled kernels (the first "
                   "start compiles them); numpy: dequantize every weight to f32 (more memory; the reference, and "
                   "what runs where numba cannot); auto (the default): numba, but numpy for a model under 1 GiB "
                   "as f32, which it runs faster")
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
                   "for DAYS days: their KV files go, their text stays (reopening one reads it again); it lists them "
                   "and asks first; 0 keeps the last hour's; then exit")
    p.add_argument("--yes", action="store_true", help="--prune-kv without asking")
    p.add_argument("--all", action="store_true", help="--prune-kv 0 prunes the last hour's conversations too")
    p.add_argument("--plain", action="store_true", help="line mode even on a terminal")
    p.add_argument("--verbose", action="store_true", help="say where the model file is")
    p.add_argument("-p", "--prompt", metavar="TEXT", help="answer one message and exit")
    p.add_argument("--version", action="version", version=f"colichat {__version__}")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The options as meant: -p's and --system's text read as UTF-8 (`not_utf8` names those that were
    not), --model's ~ expanded; what argparse cannot read exits 2 here. Read only by check_command_line,
    start.plan (the Plan of a chat) and from_the_shell."""
    p = parser()
    args = p.parse_args(argv)
    args.not_utf8 = [option for option, text in (("-p", args.prompt), ("--system", args.system))
                     if text is not None and argument_text(text) != argument_text(text, "surrogateescape")]
    args.prompt, args.system = argument_text(args.prompt), argument_text(args.system)
    if args.model == "":
        p.exit(2, "colichat: --model needs a path\n")
    try:  # `--model=~/m.gguf`, or a quoted ~, which the shell leaves as it is
        args.model = args.model and expand_home(args.model, UsageError, "--model ")
    except UsageError as e:
        p.exit(2, f"colichat: {e}\n")
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
    if args.prune_kv is None and (args.yes or args.all):
        raise UsageError(f"{'--yes' if args.yes else '--all'} goes with --prune-kv DAYS, which it answers or widens")
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


def interrupted() -> int:
    """Exit status 130; further Ctrl-C are ignored while the program ends (no traceback on the way out)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return 130


def keys_waiting(interactive: bool):
    """In the REPL's terminal, keys typed while colichat starts (loads, reopens a conversation) wait for
    the prompt, not echoed into the progress line (repl.keys_wait); nothing otherwise."""
    if not interactive:
        return contextlib.nullcontext()
    from .repl import keys_wait

    return keys_wait()


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
    try:
        shell = args.sessions or args.export is not None or args.prune_kv is not None or args.models
        # --model's file first (found, downloaded, checked: its errors come before the sessions directory's)
        path = given_model(args.model, say) if args.model is not None and not shell else None
        store = Store(on_note=lambda line: say(f"note: {line}"))  # the saved conversations, for the whole run
        if shell:
            return from_the_shell(args, store)
        plan = start_plan(args, settings, given, store, path, say)  # from here on, the Plan alone
        with keys_waiting(plan.interactive):
            model = load_model(plan, say, status)
        settings, note = model_sampling(plan.settings, plan.given, model.cfg)
        if note:
            say(note)
        problem = plan.kv and model.cache.codec_problem(plan.kv)
        if problem:
            raise SettingError(f"--kv {plan.kv}: {problem}")
        claim = plan.session is not None and not plan.resume and not plan.no_save
        conv = Conversation(model, settings, session_name=plan.session, store=store, pinned=plan.given,
                            no_save=plan.no_save, save_new=plan.save_new, read_only=plan.read_only, kv=plan.kv,
                            reuse=plan.reuse, claim=claim)
    except USER_ERRORS as e:
        say(f"colichat: {e}")
        return 1
    except KeyboardInterrupt:
        status.clear()
        to_stderr("colichat: interrupted while starting")
        return interrupted()
    app = App(conv, plan.interactive, status, banner)
    store.said.on_note = lambda line: app.say(f"note: {line}")  # (a hint's problem: on the chat's screen)
    try:
        return chat(app, plan)
    finally:
        store.said.on_note = None  # (the store no longer holds the chat)


def chat(app: App, plan: Plan) -> int:
    """The chat, once the model is loaded: the conversation reopened or begun, then the REPL, or pipe
    mode (-p's message, or stdin's); the exit status."""
    conv, say, interactive = app.conv, app.say, plan.interactive
    app.auto_forget = plan.auto_forget
    try:
        if plan.resume:
            app.status.show(BUSY["/resume"])
            with stopped_by_ctrl_c(app) as stopped, keys_waiting(interactive):  # exchanges read again
                cmd_resume(app, plan.session or "")  # (Ctrl-C keeps those read)
            if stopped and not interactive:  # Ctrl-C in pipe mode ends colichat, once what was read is said
                return interrupted()
        else:
            hint = conv.shelf.latest_hint() if plan.prompt is None else None  # one-shot: no hint to act on
            if hint:
                say(hint)
        if plan.prompt is not None:
            app.keep = "--session NAME"
            return pipe_mode(app, [Message(plan.prompt)])  # a message, even one that starts with /
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
