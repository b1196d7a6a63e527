"""What reopening a saved conversation means, decided before any model loads: what --session NAME
and --resume take, and what they refuse or say. (`--sessions`, `--export NAME`: saved.py.)

    found = model_to_reopen(store, default_path, session, resume)  # (name, path, title) or None
    resume, note = before_load(store, model_path, session, resume)  # SessionError, else reopen or not, a note
    refuse_if_open(store, model_path, session, resume)  # SessionBusy: another colichat has it open
    moved_link_note(store, model_path) -> str | None  # --resume found none: those saved when PATH led elsewhere
    resume_rope_factors(store, model_path, session) -> (name, factors) | None  # its rope factors
    resume_context(store, model_path, session) -> (name, n_ctx) | None  # the context it was saved with
    context_problem(store, model_path, session, n_ctx, most) -> str | None  # its tokens do not fit n_ctx
    reopen_note(store, model_path, name) -> str | None  # --session NAME: other models' NAME, how to open one
"""

from __future__ import annotations

import os
import shlex

from ..engine.config import MIN_CTX
from ..models.default import model_title
from ..persist import SessionBusy, SessionError, SessionInfo, Store, check_name, weights_fingerprint
from ..persist.listing import model_file_now
from ..persist.loading import more_context, tokens_to_load
from ..persist.locks import lock_holder
from ..persist.names import SIDECAR_EXT, holds_conversation
from ..persist.sidecar import doc_check, document


def model_fingerprint(model_path: str) -> str | None:
    """The weights fingerprint of the GGUF at `model_path` (found before it loads), None if unreadable."""
    try:
        return weights_fingerprint(model_path)
    except OSError:
        return None  # the model cannot be read: loading it says why


def _exists(directory, name: str) -> bool:
    """Whether NAME is a conversation there (an emptied session, every exchange rewound, is not)."""
    base = os.path.join(directory, name)
    try:
        return holds_conversation(base)
    except SessionError:
        return True  # a link or a special file: opening it says why


def model_to_reopen(store: Store, default_path: str | None, session: str | None,
                    resume: bool) -> tuple[str, str, str] | None:
    """For a start without --model: (session name, path, title) of the model that saved the
    conversation --session NAME or --resume reopens, where that is not the default model and the
    model's file is still where the session last used it (the same weights); None to start with the
    default model.
    A name the default model has is the default model's; --resume alone takes the newest
    conversation of any model. A name only other models have, none of them where the session
    last used it, is a SessionError (never a new conversation of that name beside it)."""
    if session is None and not resume:
        return None
    if session is not None:
        check_name(session)
    fp = model_fingerprint(default_path) if default_path else None
    infos = [i for i in store.list() if session is None or i.name == session]  # newest first
    if session is not None and any(i.made_by(fp) for i in infos):
        return None
    if session is None:  # --resume alone: the newest conversation, or a refusal, never an older one
        infos = [i for i in infos if not i.damage][:1]
    seen: dict[str, str | None] = {}  # path: the fingerprint of the file there
    for info in infos:
        if info.damage:
            continue
        if info.made_by(fp):
            return None
        path = model_file_now(info, seen)  # where it was given, else the file that led to (a link moved)
        if path:
            return info.name, path, model_title(info.model, info.model_file)
    tried = {p for i in infos if not i.damage for p in i.model_paths()}
    changed = sorted(p for p in tried if seen.get(p) and os.path.isfile(p))
    if session is not None:  # only other models have it, none of their files is where it was
        store.refuse_elsewhere(session, (f"{changed[0]} holds another model now: " if changed else "")
                               + "start colichat with --model PATH of that model to reopen it, or choose another name")
    elif infos:  # the newest conversation's model is not where it was
        info = infos[0]
        raise SessionError(
            f"the newest conversation, {info.name}, belongs to {store.whose(infos)}"
            + (f"; {changed[0]} holds another model now" if changed else "")
            + ": start colichat with --model PATH of that model to reopen it, or --session NAME for another"
            " conversation (colichat --sessions lists them)")
    return None


def before_load(store: Store, model_path: str, session: str | None, resume: bool) -> tuple[bool, str | None]:
    """Whether to reopen a saved conversation at start, decided without loading the model, and a
    note to show first (or None): --session NAME of an existing conversation reopens it; a name
    that cannot exist, --resume of a conversation that is not there (or belongs to another model)
    is a SessionError."""
    if session is not None:
        check_name(session)
    fp = model_fingerprint(model_path)
    if fp is None:
        return resume, None
    mine = store.dirs_for(fp)
    if session is not None:
        if any(_exists(d, session) for d in mine):
            return True, None
        if resume:
            store.refuse_elsewhere(session)
            raise SessionError(f"no session named {session} for this model (colichat --sessions lists them)")
        _refuse_a_moved_link(store, fp, model_path, session)
        return False, _namesakes_note(store, fp, session)
    if resume and not any(i.made_by(fp) for i in store.list()):
        raise SessionError("no saved conversation for this model yet")
    return resume, None


def _refuse_a_moved_link(store: Store, fp: str, model_path: str, session: str) -> None:
    """--model PATH --session NAME where another model's conversation NAME was saved through PATH (a
    link since pointed at another file, a file replaced) and that model is still where PATH led: it
    is the conversation meant, refused with the --model that reopens it (never a second NAME beside it)."""
    given = os.path.abspath(model_path)
    for info in store.list():
        if info.name != session or info.damage or info.made_by(fp) or info.model_path != given:
            continue
        now = model_file_now(info)
        if now:
            raise SessionError(f"session {session} was saved with {now}, which {given} led to then ({given} "
                               f"holds another model now): colichat --model {shlex.quote(now)} --session {session} "
                               "reopens it, or choose another name")


def moved_link_note(store: Store, model_path: str) -> str | None:
    """For --model PATH --resume finding no conversation of this model: a note when conversations were
    saved with PATH while it led to another file (a link since pointed elsewhere) that still holds their
    model, naming that file and the command that reopens them (None otherwise)."""
    fp, given = model_fingerprint(model_path), os.path.abspath(model_path)
    theirs = [i for i in store.list() if i.model_path == given and not i.damage and not i.made_by(fp)]
    now = model_file_now(theirs[0]) if theirs else None  # the newest one's model, if still there
    if not now or now == given:
        return None
    same = [i for i in theirs if i.model_dir == theirs[0].model_dir]  # newest first
    command = f"colichat --model {shlex.quote(now)} --resume"
    if len(same) == 1:
        return f"note: conversation {same[0].name} was saved with {given} when it led to {now}: {command} reopens it"
    return (f"note: {len(same)} conversations were saved with {given} when it led to {now} (the newest: "
            f"{same[0].name}): {command} reopens the newest, with --session NAME another")


def _namesakes_note(store: Store, fp: str, session: str) -> str | None:
    """For a new conversation --session NAME: a note if other models have a conversation NAME (with
    --model, which a name does not override): theirs stays as it is, this one starts empty."""
    others = [i for i in store.list() if i.name == session and not i.damage and not i.made_by(fp)]
    if not others:
        return None
    return (f"note: session {session} of another model ({store.whose(others)}) stays as it is; "
            f"this is a new conversation {session} with this model")


def _reopened(store: Store, model_path: str, session: str | None) -> SessionInfo | None:
    """The conversation --resume reopens with this model (--session NAME, else this model's latest);
    None when there is none (or the model cannot be read: loading it says why)."""
    fp = model_fingerprint(model_path)
    if fp is None:
        return None
    return next((i for i in store.list() if i.made_by(fp) and not i.damage
                 and (session is None or i.name == session)), None)


def refuse_if_open(store: Store, model_path: str, session: str | None, resume: bool) -> None:
    """SessionBusy, before the model loads, if the conversation this start takes (--session NAME, new
    or saved; --resume's) is open in another colichat: the refusal opening it after the load would
    give. A look, not the lock: the lock is taken when the session is opened, and refuses then a
    colichat that took the session meanwhile."""
    if session is None and not resume:
        return
    fp = model_fingerprint(model_path)
    if fp is None:
        return
    if session is None:
        info = _reopened(store, model_path, None)
        if info is None:
            return
        session, dirs = info.name, [info.path.parent]
    else:
        dirs = store.dirs_for(fp)
    for directory in dirs:
        pid = lock_holder(os.path.join(directory, session + ".lock"))
        if pid is not None:
            raise SessionBusy(f"session {session} is open in another colichat (pid {pid})")


def _saved_model(store: Store, model_path: str, session: str | None) -> tuple[str, dict, bool] | None:
    """(name, the sidecar's model section, whether its check matches) of the conversation --resume
    reopens (--session NAME, else this model's latest); None when there is none or it cannot be
    read (resuming it then says why)."""
    info = _reopened(store, model_path, session)
    if info is None:
        return None
    try:
        with open(info.path.parent / (info.name + SIDECAR_EXT), "rb") as f:
            doc = document(f.read())
    except OSError:
        return None  # resuming it says why
    model = doc.get("model") if isinstance(doc, dict) else None
    if not isinstance(model, dict):
        return None  # (the same)
    return info.name, dict(model), doc.get("check") == doc_check(doc)


def resume_rope_factors(store: Store, model_path: str, session: str | None) -> tuple[str, str] | None:
    """(name, rope factors) of the conversation --resume reopens where its sidecar records the
    factors its cache rows were rotated with; None otherwise."""
    saved = _saved_model(store, model_path, session)
    rope = saved[1].get("rope_factors") if saved else None
    return (saved[0], rope) if isinstance(rope, str) else None


def resume_context(store: Store, model_path: str, session: str | None) -> tuple[str, int] | None:
    """(name, context size) the conversation --resume reopens was last saved with (model.n_ctx), to
    reopen it with that one when --ctx is not given; None where the sidecar does not say (an older
    colichat) or its check does not vouch for it."""
    saved = _saved_model(store, model_path, session)
    n_ctx = saved[1].get("n_ctx") if saved and saved[2] else None
    return (saved[0], n_ctx) if type(n_ctx) is int and n_ctx >= MIN_CTX else None


def context_problem(store: Store, model_path: str, session: str | None, n_ctx: int,
                    most: int | None = None) -> str | None:
    """Why the conversation --resume reopens (--session NAME, else this model's latest) cannot open in
    a context of `n_ctx` tokens, from its files alone (the refusal opening it after the load would
    give: what reopens it, within the model's largest context `most` when known), or None."""
    info = _reopened(store, model_path, session)
    n = tokens_to_load(info.path.parent, info.name) if info else None
    return more_context(info.name, n, n_ctx, most) if n is not None and n > n_ctx else None


def reopen_note(store: Store, model_path: str, name: str) -> str | None:
    """For --session NAME without --model, reopening this model's conversation NAME: a note naming
    the other models' conversations NAME, and how to open one of them (None if there are none)."""
    fp = model_fingerprint(model_path)
    mine = [i for i in store.list() if i.name == name and i.made_by(fp)]
    if not mine:
        return None
    return namesakes_note(store, name, mine[0].model_dir, f"colichat --model {{path}} --session {name} opens it")


def namesakes_note(store: Store, name: str, model_dir: str, command: str) -> str | None:
    """'note: other models have a conversation NAME too (MODEL, last run from PATH): COMMAND', for the
    conversations NAME beside the one of `model_dir` taken (None if there are none). `command`, with
    {path} for the other model's path, is how to take that one instead."""
    others = [i for i in store.list() if i.name == name and not i.damage and i.model_dir != model_dir]
    if not others:
        return None
    paths = {model_file_now(i) for i in others}
    path = paths.pop() if len(paths) == 1 else None
    how = command.format(path=shlex.quote(path)) if path else "add --model PATH of that model to take that one"
    one = len({i.model_dir for i in others}) == 1
    return (f"note: {'another model has' if one else 'other models have'} a conversation {name} too "
            f"({store.whose(others)}): {how}")
