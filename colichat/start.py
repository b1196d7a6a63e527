"""What is checked and loaded before a chat begins, in the order cli.main runs it: the model file
(--model, else the one a conversation to reopen was saved with, else the default), whether the
sessions directory can be written, what --session and --resume reopen and with which context size
(refused before the model loads when it cannot be), then the model itself, with its progress shown.
"""

from __future__ import annotations

import os
import stat
import tempfile
import time

from . import hub, system_prompt
from .engine import ContextError, ModelError, default_context, load, resume_problem, trained_context
from .models import DefaultModelMissing, default_model_path, model_title
from .paths import paths
from .persist import SessionError, Store, check_name
from .sessions import (
    before_load,
    context_problem,
    model_fingerprint,
    model_to_reopen,
    moved_link_note,
    reopen_note,
    resume_context,
    resume_rope_factors,
)
from .settings import SettingError


def choose_model(args, say) -> str:
    """--model (a file, or a model of the Hugging Face Hub), else the model that saved the conversation
    --session NAME or --resume reopens (where its file still is), else the default model."""
    if args.model is not None:  # (hf:OWNER/REPO...: from the hub's cache, else downloaded)
        return hub.model_file(args.model, say) if hub.is_hub_model(args.model) else args.model
    try:
        default, missing = default_model_path(), None
    except DefaultModelMissing as e:
        default, missing = None, e
    store = Store()
    found = model_to_reopen(store, default, args.session, args.resume)
    if found:
        name, path, title = found
        say(f"session {name} was saved with {title}: loading {path}")
    elif args.resume and args.session is None and nothing_saved():  # no model named: not "for this model"
        raise SessionError("no saved conversation yet")
    elif missing:
        raise missing
    path = found[1] if found else default
    note = reopen_note(store, path, args.session) if args.session is not None else None
    if note:  # the other models' conversations of that name, and how to open one
        say(note)
    return path


def reopen_at_start(args, say) -> tuple[bool, str | None]:
    """before_load's answer: whether a saved conversation reopens, and a note. Where --model PATH
    --resume finds none of this model, the refusal comes after a note on the conversations saved
    with PATH while it led to another file (a link since pointed elsewhere), if there are any."""
    try:
        return before_load(Store(), args.model, args.session, args.resume)
    except SessionError:
        note = moved_link_note(Store(), args.model) if args.resume and args.session is None else None
        if note:
            say(note)
        raise


def nothing_saved() -> bool:
    """No conversation of any model is saved (a sessions directory that cannot be read is check_saving's)."""
    root = paths().data / "sessions"
    return unreadable_sessions(root) is None and not Store().list()


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


def check_saving(args) -> str | None:
    """Refuse at start what would make every save fail (a bad --session name is before_load's): a
    sessions directory (under COLICHAT_HOME) that is a file or unreadable. Returns why it cannot be
    written, or None: `saving_mode` decides once it is known whether a saved conversation reopens."""
    if args.session is not None:
        check_name(args.session)
    if args.no_save or not (args.interactive or args.session is not None or args.resume):
        return None  # nothing will be saved (a piped run saves with --session or --resume only)
    root = paths().data / "sessions"
    problem = sessions_dir_problem(root)
    if problem and not (os.path.isdir(root) and os.access(root, os.R_OK | os.X_OK)):
        raise _cannot_save(root, problem)
    if problem is None:  # the model's own directory in it (found by its weights' fingerprint), if it has one
        fp = model_fingerprint(args.model)
        for d in Store(root).dirs_for(fp) if fp else []:
            problem = sessions_dir_problem(d)
            if problem and not os.access(d, os.R_OK | os.X_OK):
                raise _cannot_save(d, problem)
            if problem:
                break
    return problem


def saving_mode(args, problem: str | None, say) -> bool:
    """True (read-only) when a saved conversation reopens from a sessions directory that can be read
    but not written (a read-only file system), saying so; a new conversation there is refused."""
    if not problem:
        return False
    if not args.resume:
        raise _cannot_save(paths().data / "sessions", problem)
    say(f"note: {problem}: the conversation opens read-only (you can read and continue it; nothing is saved)")
    return True


def saved_context(args) -> None:
    """Without --ctx, a conversation reopens (--resume, --session NAME of a saved one) with the
    context size it was saved with (`args.ctx_of`: the session it came from, for load_model's errors)."""
    args.ctx_of = None
    saved = resume_context(Store(), args.model, args.session) if args.resume and args.ctx is None else None
    if saved:
        args.ctx_of, args.ctx = saved


def check_context_fits(args) -> None:
    """Refuse before the model loads a --resume whose saved tokens do not fit its context (Session.load
    says the same after loading, for /resume): --ctx, else the one it was saved with, else (a
    conversation of an older colichat) the model's default. The model's trained context, read from
    its metadata, is the most the refusal suggests."""
    if not args.resume:
        return
    most = trained_context(args.model)  # None: the file does not say (the load says why)
    n_ctx = args.ctx or (default_context(most) if most else None)
    problem = context_problem(Store(), args.model, args.session, n_ctx, most) if n_ctx else None
    if problem:
        raise SessionError(problem)


def check_rope_factors(args) -> None:
    """Refuse before the model loads a --resume whose cache rows were rotated with rope factors
    that cannot serve this --ctx (Conversation.resume says the same after loading, for /resume)."""
    saved = resume_rope_factors(Store(), args.model, args.session) if args.resume else None
    problem = saved and resume_problem(args.model, args.ctx, saved[1])
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


def load_model(args, say, status, mtp: bool = True, system: str | None = None):
    """The model of args.model, with the progress shown on `status` (terminal.StatusLine); a --system
    `system` its chat template refuses, or that leaves no room for a message, is refused before the
    weights are prepared."""
    path = args.model  # chosen by choose_model
    t0 = time.perf_counter()
    name = os.path.basename(path)
    status.show(f"loading {name} ...")  # the first start of a model reads its metadata for seconds

    def progress(done, total):
        more = ", keeping the weights for the next start ..." if done == total else ""
        status.show(f"loading {name}: layer {done}/{total}{more}")

    notes: list[str] = []
    try:
        model = load(path, n_ctx=args.ctx, progress=progress, cache_dir=paths().cache / "weights",
                     expert_cache=args.expert_cache, on_note=notes.append, numerics=args.numerics, mtp=mtp,
                     check=lambda cfg, tokenizer, n_ctx: system_prompt.check_at_start(cfg, tokenizer, n_ctx, system))
    except ContextError as e:  # (a --system's too)
        if getattr(args, "ctx_of", None):  # not a --ctx given: say where it came from
            raise ContextError(f"{e} (the context size session {args.ctx_of} was saved with: "
                               "--ctx N reopens it with another)") from None
        raise
    status.clear()
    cfg = model.cfg
    where = f" from {path}" if args.verbose else ""
    say(f"{model_title(cfg.name, path)} ({cfg.arch}, {cfg.n_layer} layers){where}, "
        f"loaded in {time.perf_counter() - t0:.1f} s")
    say(f"memory: {model.memory_estimate()}")
    if model.numerics != "fast":
        say("numerics: llama.cpp's CPU arithmetic, op by op (many times slower; for checking against llama.cpp; "
            "one token at a time, so no speculative decoding whatever --draft says)")
    if args.expert_cache is not None and not cfg.n_expert:
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
