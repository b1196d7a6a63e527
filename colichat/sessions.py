"""The saved conversations as the command line sees them, decided before any model loads: what
--session NAME and --resume mean, `colichat --sessions`, `--export NAME`; and the Markdown export.

    resume = before_load(store, model_path, session, resume)   # SessionError, else reopen or not
    listing(store) -> [line]          # every saved conversation, by model
    export_saved(store, model_path, name) -> str      # a saved conversation as Markdown
    markdown(title, model, turns, system) -> str      # (role, text) turns as Markdown
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from datetime import datetime

from .persist import SessionError, Store, check_name, weights_fingerprint
from .persist.session import KV_EXT, SIDECAR_EXT


def _fingerprint(model_path: str) -> str | None:
    try:
        return weights_fingerprint(model_path)
    except OSError:
        return None  # the model cannot be read: loading it says why


def _exists(directory, name: str) -> bool:
    return any(os.path.lexists(os.path.join(directory, name + ext)) for ext in (KV_EXT, SIDECAR_EXT))


def before_load(store: Store, model_path: str, session: str | None, resume: bool) -> bool:
    """Whether to reopen a saved conversation at start, decided without loading the model:
    --session NAME of an existing conversation reopens it; a name that cannot exist, --resume of
    a conversation that is not there (or belongs to another model) is a SessionError."""
    if session is not None:
        check_name(session)
    fp = _fingerprint(model_path)
    if fp is None:
        return resume
    mine = store.dirs_for(fp)
    if session is not None:
        if any(_exists(d, session) for d in mine):
            return True
        if resume:
            others = sorted({i.model for i in store.list() if i.name == session})
            if others:
                raise SessionError(f"session {session} belongs to another model ({', '.join(others)}); "
                                   "start colichat with that model to resume it")
            raise SessionError(f"no session named {session} for this model (/sessions lists them)")
        return False
    if resume and not [i for i in store.list() if i.model_dir.endswith("-" + fp[:12])]:
        raise SessionError("no saved conversation for this model yet")
    return resume


def listing(store: Store) -> list[str]:
    """Every saved conversation, grouped by model (newest first), for `colichat --sessions`."""
    by_model = defaultdict(list)
    for info in store.list():
        by_model[(info.model, info.model_dir)].append(info)
    lines = []
    for (model, directory), infos in by_model.items():
        lines.append(f"{model} ({directory}):")
        lines += ["  " + i.describe() for i in infos]
    return lines


def export_saved(store: Store, model_path: str | None, name: str) -> str:
    """Saved conversation NAME as Markdown (this model's first, else the only one of that name)."""
    check_name(name)
    fp = _fingerprint(model_path) if model_path else None
    found = [i for i in store.list() if i.name == name]
    mine = [i for i in found if fp and i.model_dir.endswith("-" + fp[:12])]
    if mine:
        found = mine
    if not found:
        raise SessionError(f"no session named {name} (colichat --sessions lists them)")
    if len(found) > 1:
        raise SessionError(f"session {name} exists for several models ({', '.join(i.model for i in found)}): "
                           "add --model PATH to say which")
    info = found[0]
    side = info.path.with_name(name + SIDECAR_EXT)
    try:
        doc = json.loads(side.read_bytes().decode("utf-8"))
        turns = [(t["role"], t["text"]) for t in doc["turns"]]
        system = doc.get("sampler", {}).get("system")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SessionError(f"cannot read the turns of session {name} from {side}: "
                           f"{type(e).__name__}") from None
    return markdown(name, info.model, turns, system if isinstance(system, str) else None)


def markdown(title: str, model: str, turns, system: str | None = None) -> str:
    """A conversation as Markdown: a heading per turn, the text as it was written."""
    out = [f"# {title}", "", f"Model: {model}. Exported {datetime.now().strftime('%Y-%m-%d %H:%M')}.", ""]
    if system:
        out += ["## System", "", system.strip(), ""]
    names = {"user": "User", "assistant": "Assistant"}
    for role, text in turns:
        out += [f"## {names.get(role, role.capitalize())}", "", text.strip(), ""]
    return "\n".join(out)
