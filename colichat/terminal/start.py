"""What is checked and loaded before a chat begins, in the order cli.main runs it: the model file
(--model, else the one a conversation to reopen was saved with, else the default), whether the
sessions directory can be written, what --session and --resume reopen and with which context size
(refused before the model loads when it cannot be): `plan` decides all that once, as a Plan; then
the model itself loads, with its progress shown.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
import time
from dataclasses import dataclass

from ..conversation import system_prompt
from ..conversation.reopen import (
    before_load,
    context_problem,
    model_fingerprint,
    model_to_reopen,
    moved_link_note,
    refuse_if_open,
    reopen_note,
    resume_context,
    resume_rope_factors,
)
from ..conversation.settings import SettingError, Settings
from ..engine import (
    ContextError,
    ModelError,
    default_context,
    kernels_kept,
    load,
    prepare_kernels,
    resume_problem,
    runs_kernels,
    trained_context,
)
from ..models import hub
from ..models.default import DefaultModelMissing, default_model_path, model_title
from ..paths import paths
from ..persist import SessionError, Store, check_name
from .streams import dumb_terminal


@dataclass(frozen=True)
class Plan:
    """Every option of a chat and what the start decided from them before the model loads (`plan`):
    read from then on, in place of the command line (args), which nothing reads after it. The options
    first, as given; then the decisions. An option is one field here, one line in `plan`."""

    settings: Settings  # the chat settings the options give (TABLE's rows), the defaults for the others
    given: frozenset  # the names of the settings an option gave: pinned, not replaced by a reopened one's
    prompt: str | None  # -p's message: answered, then colichat exits
    kv: str | None  # --kv: how a new conversation keeps its KV cache ("f32", "fp8", "int4"); None: not given
    reuse: bool  # not --no-reuse: a new prompt takes the records of a saved one it begins like
    no_save: bool  # --no-save: nothing of the user's is written
    auto_forget: bool  # --auto-forget: a message that does not fit goes on without the oldest exchanges
    expert_cache: float | None  # --expert-cache MiB, or None: the model's default
    verbose: bool  # --verbose: the start says where the model file is
    numerics: str  # --numerics: "fast" or "llama.cpp"
    model: str  # the GGUF file: --model's, else the one that saved the conversation reopened, else the default
    session: str | None  # --session NAME
    resume: bool  # a saved conversation reopens (--resume, or --session NAME of a saved one)
    ctx: int | None  # --ctx, else the context size the reopened conversation was saved with; None: the model's
    ctx_of: str | None  # the session whose saved context size `ctx` is (load_model's errors name it), else None
    read_only: bool  # the reopened conversation's directory cannot be written: nothing is saved
    save_new: bool  # a new conversation is saved (a person types its messages, or --session, --resume)
    interactive: bool  # the terminal REPL; else pipe mode (line mode, a pipe, -p)
    kernels: str  # "auto", "numba" (the compiled kernels on the GGUF's blocks) or "numpy" (f32 weights): --kernels


def plan(args, settings: Settings, given: frozenset, store: Store, model: str | None, say) -> Plan:
    """The Plan of the command line `args` (checked: cli.check_command_line, whose `settings` and
    `given` these are): its decisions in order, each refused (a user error) before the model loads
    where it cannot be carried out. `model`: --model's file (given_model), or None."""
    if model is None:
        model = choose_model(store, args.session, args.resume, say)
        check_model_file(model)
    # A dumb terminal (an editor's shell buffer) edits the line itself and takes no cursor moves: line mode.
    interactive = (sys.stdin.isatty() and sys.stdout.isatty() and not args.plain and not args.prompt
                   and not dumb_terminal())
    problem = check_saving(store, model, args.session, args.resume, args.no_save, interactive)
    # what --session and --resume mean, known before the model loads (--no-save too: it reads them)
    resume, note = reopen_at_start(store, model, args.session, args.resume, say)
    if note:
        say(note)
    ctx, ctx_of = saved_context(store, model, args.session, resume, args.ctx)
    check_context_fits(store, model, args.session, resume, ctx)
    check_rope_factors(store, model, args.session, resume, ctx)
    read_only = saving_mode(store, resume, problem, say)
    if not (args.no_save or read_only):  # (those read it without its lock: another colichat may have it)
        refuse_if_open(store, model, args.session, resume)
    person_types = sys.stdin.isatty() and args.prompt is None  # the messages: saved as in the REPL
    return Plan(
        settings=settings,
        given=given,
        prompt=args.prompt,
        kv=args.kv,
        reuse=not args.no_reuse,
        no_save=args.no_save,
        auto_forget=args.auto_forget,
        expert_cache=args.expert_cache,
        verbose=args.verbose,
        numerics=args.numerics or "fast",
        kernels=args.kernels,
        model=model,
        session=args.session,
        resume=resume,
        ctx=ctx,
        ctx_of=ctx_of,
        read_only=read_only,
        save_new=person_types or args.session is not None or resume,
        interactive=interactive,
    )


def given_model(name: str, say) -> str:
    """--model's file: the path given, or a model of the Hugging Face Hub (from the hub's cache, else
    downloaded), checked to be a regular file."""
    path = hub.model_file(name, say) if hub.is_hub_model(name) else name
    check_model_file(path)
    return path


def choose_model(store: Store, session: str | None, resume: bool, say) -> str:
    """Without --model: the model that saved the conversation --session NAME or --resume reopens
    (where its file still is), else the default model."""
    try:
        default, missing = default_model_path(), None
    except DefaultModelMissing as e:
        default, missing = None, e
    found = model_to_reopen(store, default, session, resume)
    if found:
        name, path, title = found
        say(f"session {name} was saved with {title}: loading {path}")
    elif resume and session is None and nothing_saved(store):  # no model named: not "for this model"
        raise SessionError("no saved conversation yet")
    elif missing:
        raise missing
    path = found[1] if found else default
    note = reopen_note(store, path, session) if session is not None else None
    if note:  # the other models' conversations of that name, and how to open one
        say(note)
    return path


def reopen_at_start(store: Store, model: str, session: str | None, resume: bool, say) -> tuple[bool, str | None]:
    """before_load's answer: whether a saved conversation reopens, and a note. Where --model PATH
    --resume finds none of this model, the refusal comes after a note on the conversations saved
    with PATH while it led to another file (a link since pointed elsewhere), if there are any."""
    try:
        return before_load(store, model, session, resume)
    except SessionError:
        note = moved_link_note(store, model) if resume and session is None else None
        if note:
            say(note)
        raise


def nothing_saved(store: Store) -> bool:
    """No conversation of any model is saved (a sessions directory that cannot be read is check_saving's)."""
    return unreadable_sessions(store.root) is None and not store.list()


def check_model_file(path: str) -> None:
    """Refuse a --model that is not a regular file (a FIFO or a device would hang the reads)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # the loader names what is wrong (no such file, permission)
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        raise ModelError(f"{path}: not a regular file; --model takes a GGUF file")


def sessions_dir_problem(root) -> str | None:
    """Why conversations cannot be saved under `root` (the sessions directory), or None: its deepest
    existing ancestor must be a directory colichat can read, write and enter."""
    d = os.path.abspath(root)
    try:
        while True:
            try:
                os.lstat(d)
                break
            except (FileNotFoundError, NotADirectoryError):  # (a file on the way is found as the parent)
                d = os.path.dirname(d)
        if not stat.S_ISDIR(os.stat(d).st_mode):
            return f"{d} is not a directory"
    except OSError as e:  # (an I/O error is said as one, not as "not a directory")
        return f"cannot examine {d}: {e.strerror or e}"
    if not os.access(d, os.R_OK | os.W_OK | os.X_OK):
        try:  # access() says no; the error of a real attempt says why (permission, read-only)
            os.close(os.open(d, os.O_RDONLY | os.O_DIRECTORY))
            with tempfile.TemporaryFile(dir=d):
                pass
        except OSError as e:
            return f"{d}: {e.strerror or e}"
        return f"{d}: permission denied"
    return None


def _cannot_save(root, problem: str) -> SessionError:
    hint = "; --resume opens a saved one read-only" if os.access(root, os.R_OK | os.X_OK) else ""
    return SessionError(f"cannot save conversations in {root} ({problem}); fix that, set COLICHAT_HOME "
                        f"to a writable directory, or use --no-save{hint}")


def check_saving(store: Store, model: str, session: str | None, resume: bool, no_save: bool,
                 interactive: bool) -> str | None:
    """Refuse at start what would make every save fail (a bad --session name is before_load's): a
    sessions directory (under COLICHAT_HOME) that is a file or unreadable. Returns why it cannot be
    written, or None: `saving_mode` decides once it is known whether a saved conversation reopens."""
    if session is not None:
        check_name(session)
    if no_save or not (interactive or session is not None or resume):
        return None  # nothing will be saved (a piped run saves with --session or --resume only)
    root = store.root
    problem = sessions_dir_problem(root)
    if problem and not (os.path.isdir(root) and os.access(root, os.R_OK | os.X_OK)):
        raise _cannot_save(root, problem)
    if problem is None:  # the model's own directory in it (found by its weights' fingerprint), if it has one
        fp = model_fingerprint(model)
        for d in store.dirs_for(fp) if fp else []:
            problem = sessions_dir_problem(d)
            if problem and not os.access(d, os.R_OK | os.X_OK):
                raise _cannot_save(d, problem)
            if problem:
                break
    return problem


def saving_mode(store: Store, resume: bool, problem: str | None, say) -> bool:
    """True (read-only) when a saved conversation reopens from a sessions directory that can be read
    but not written (a read-only file system), saying so; a new conversation there is refused."""
    if not problem:
        return False
    if not resume:
        raise _cannot_save(store.root, problem)
    say(f"note: {problem}: the conversation opens read-only (you can read and continue it; nothing is saved)")
    return True


def saved_context(store: Store, model: str, session: str | None, resume: bool,
                  ctx: int | None) -> tuple[int | None, str | None]:
    """The context size and where it came from: without --ctx (`ctx` None), a conversation reopens
    (--resume, --session NAME of a saved one) with the one it was saved with, and the session it came
    from is named (for load_model's errors); else (--ctx, or None: the model's default) from nowhere."""
    saved = resume_context(store, model, session) if resume and ctx is None else None
    if saved:
        ctx_of, ctx = saved
        return ctx, ctx_of
    return ctx, None


def check_context_fits(store: Store, model: str, session: str | None, resume: bool, ctx: int | None) -> None:
    """Refuse before the model loads a --resume whose saved tokens do not fit its context (Session.load
    says the same after loading, for /resume): --ctx, else the one it was saved with, else (a
    conversation of an older colichat) the model's default. The model's trained context, read from
    its metadata, is the most the refusal suggests."""
    if not resume:
        return
    most = trained_context(model)  # None: the file does not say (the load says why)
    n_ctx = ctx or (default_context(most) if most else None)
    problem = context_problem(store, model, session, n_ctx, most) if n_ctx else None
    if problem:
        raise SessionError(problem)


def check_rope_factors(store: Store, model: str, session: str | None, resume: bool, ctx: int | None) -> None:
    """Refuse before the model loads a --resume whose cache rows were rotated with rope factors
    that cannot serve this --ctx (Conversation.resume says the same after loading, for /resume)."""
    saved = resume_rope_factors(store, model, session) if resume else None
    problem = saved and resume_problem(model, ctx, saved[1])
    if problem:
        raise SessionError(f"session {saved[0]} cannot be resumed: {problem}")


def model_sampling(settings, given: frozenset, cfg) -> tuple:
    """The sampling defaults the model file carries (general.sampling.*, ModelConfig.sampling) for the
    settings no option gave: (settings, the note that names them, or None). A saved conversation's own
    settings still win when it reopens (ChatSettings.apply_saved); a value a setting cannot take is left out."""
    taken = {}
    for name, value in cfg.sampling:
        if name in given:
            continue
        value = round(value, 6) if isinstance(value, float) else value  # (a float32 0.6 is 0.60000002)
        try:
            settings = settings.with_(**{name: value})
        except SettingError:
            continue
        taken[name] = value
    if not taken:
        return settings, None
    said = ", ".join(f"{k} {v:g}" for k, v in taken.items())
    return settings, f"note: the model's own sampling defaults: {said} (/set or an option changes them)"


def load_model(plan: Plan, say, status):
    """The model of plan.model, with the progress shown on `status` (terminal.StatusLine); a --system
    its chat template refuses, or that leaves no room for a message, is refused before the weights are
    prepared. --draft 0 at start loads no MTP rows either (the model's, for its life; /set draft picks
    what it uses)."""
    path, system, expert_cache = plan.model, plan.settings.system, plan.expert_cache
    t0 = time.perf_counter()
    name = os.path.basename(path)
    status.show(f"loading {name} ...")  # the first start of a model reads its metadata for seconds

    def progress(done, total):
        more = ", keeping the weights for the next start ..." if done == total else ""
        status.show(f"loading {name}: layer {done}/{total}{more}")

    notes: list[str] = []
    compiled = []  # the first start compiles the kernels (seconds, said); later starts load them quietly

    def compiling():
        status.show("compiling kernels (first start) ...")
        compiled.append(time.perf_counter())

    if runs_kernels(path, plan.kernels, plan.numerics):
        prepare_kernels(path, paths().cache, compiling)
        compiled = [time.perf_counter() - t for t in compiled]
    try:
        model = load(path, n_ctx=plan.ctx, progress=progress, cache_dir=paths().cache / "weights",
                     expert_cache=expert_cache, on_note=notes.append, numerics=plan.numerics,
                     mtp=plan.settings.draft > 0,
                     check=lambda cfg, tokenizer, n_ctx: system_prompt.check_at_start(cfg, tokenizer, n_ctx, system),
                     kernels=plan.kernels)
    except ContextError as e:  # (a --system's too)
        if plan.ctx_of:  # not a --ctx given: say where it came from
            raise ContextError(f"{e} (the context size session {plan.ctx_of} was saved with: "
                               "--ctx N reopens it with another)") from None
        raise
    status.clear()
    cfg = model.cfg
    where = f" from {path}" if plan.verbose else ""
    say(f"{model_title(cfg.name, path)} ({cfg.arch}, {cfg.n_layer} layers){where}, "
        f"loaded in {time.perf_counter() - t0:.1f} s")
    if compiled and kernels_kept(paths().cache):
        say(f"kernels: compiled in {compiled[0]:.1f} s (the first start; later starts load them)")
    elif compiled:
        say(f"note: cannot keep the compiled kernels in {paths().cache / 'kernels'} (not writable); each start "
            f"compiles them ({compiled[0]:.1f} s)")
    say(f"memory: {model.memory_estimate()}")
    if model.experts is not None and model.experts.warming:
        say(f"experts: reading the {model.experts.warming:,} used most in earlier runs into the cache, in the "
            "background")
    if model.numerics != "fast":
        say("numerics: llama.cpp's CPU arithmetic, op by op (many times slower; for checking against llama.cpp; "
            "one token at a time, so no speculative decoding whatever --draft says)")
    if expert_cache is not None and not cfg.n_expert:
        say("note: --expert-cache has no effect: this model has no routed experts")
    for line in notes:
        say(f"note: {line}")
    return model


def unreadable_sessions(root) -> str | None:
    """Why the saved conversations under `root` (the sessions directory) cannot be read, or None: a
    directory not made yet holds none, but a file in its place, or one it cannot enter, hides them."""
    root = os.path.abspath(root)
    d = root
    while not os.path.lexists(d):
        d = os.path.dirname(d)
    if not os.path.isdir(d):
        return f"{d} is not a directory"
    if d == root and not os.access(d, os.R_OK | os.X_OK):
        return f"{d}: permission denied"
    return None
