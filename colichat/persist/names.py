"""What a session and its files are called, and what a name holds on disk.

    check_name(name) -> name                  # or SessionError: the names a session may have
    slug(first message), auto_name(taken, stem)   # a new conversation's name
    holds_conversation(base)                  # whether NAME (base = directory/NAME) is a conversation
    interrupted_create(base), remove_leftovers(base)   # what an interrupted create or an emptied
                                              # session leaves: no conversation, replaced by the next claim
    remove_files(directory, json_path, kv_path), remake_directory(directory, name)   # for the writer

A session NAME is NAME.coli_kv (its records) and NAME.json (its sidecar) in its model's directory;
NAME.lock (locks.py) and NAME.renaming (renaming.py) sit beside them.
"""

from __future__ import annotations

import os
import re
import time
import unicodedata

from ..paths import private_dir
from .kvfile import SessionError, fsync_dir, lstat_regular, oserror_text, read_nrec_if_empty
from .sidecar import MAX_SIDECAR_BYTES, document

KV_EXT, SIDECAR_EXT = ".coli_kv", ".json"  # NAME.coli_kv holds the records, NAME.json the turns
NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")


def check_name(name) -> str:
    """A session name, or SessionError: up to 64 of A-Z a-z 0-9 - _ . (not first), no '..'."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or ".." in name:
        raise SessionError(f"invalid session name {name!r}: use 1 to 64 ASCII letters, digits, "
                           "'-', '_' or '.' (not first, no '..')")
    return name


def slug(text: str, limit: int = 32) -> str:
    """A readable name from a message: its first words as lowercase ASCII joined by '-', at most
    `limit` characters ("What is the capital of France?" -> what-is-the-capital-of-france); "" for
    a message without letters or digits."""
    words = re.findall(r"[a-z0-9]+", unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode().lower())
    name = words[0][:limit] if words else ""
    for w in words[1:]:
        if len(name) + 1 + len(w) > limit:
            break
        name += "-" + w
    return name


def auto_name(taken, stem: str | None = None) -> str:
    """A fresh name: `stem` (else the local time, e.g. 20250301-142233), then -2, -3, ... if taken."""
    base = stem or time.strftime("%Y%m%d-%H%M%S")
    name, k = base, 1
    while name in taken:
        k += 1
        name = f"{base}-{k}"
    return name


def interrupted_create(base: str) -> bool:
    """Whether NAME is what a create killed before its last step leaves: NAME.coli_kv.tmp, maybe a
    sidecar, no NAME.coli_kv. That is no session (the next create of the name replaces it)."""
    return os.path.lexists(base + KV_EXT + ".tmp") and not os.path.lexists(base + KV_EXT)


def remove_leftovers(base: str) -> None:
    """Remove what NAME may have on disk while it holds no conversation (see holds_conversation: an
    interrupted create, an empty session), its lock held, before the name is taken. OSError if one
    cannot be removed."""
    for path in (base + KV_EXT + ".tmp", base + KV_EXT, base + SIDECAR_EXT, base + SIDECAR_EXT + ".tmp"):
        if os.path.lexists(path):
            os.unlink(path)


def holds_conversation(base: str) -> bool:
    """Whether NAME.coli_kv or NAME.json exists as anything but the leftover of an interrupted
    create (see `interrupted_create`) or an empty session: a KV file with no records and no sidecar,
    or a sidecar that lists no turns and was not emptied by /reset (what a rewind of every exchange
    leaves when a crash or an error kept its files, and older versions left). Such a name is no
    conversation: not listed, not reopened, and the next claim of it removes the files. A conversation
    /reset emptied ("emptied" in its sidecar) is one. SessionError for a link or a special file."""
    if interrupted_create(base):
        return False
    kv = lstat_regular(base + ".coli_kv", "session file")
    side = lstat_regular(base + ".json", "sidecar")
    if kv is None:
        return side is not None
    if side is None:
        return not read_nrec_if_empty(base + ".coli_kv")
    try:
        with open(base + ".json", "rb") as f:
            doc = document(f.read(MAX_SIDECAR_BYTES))
    except OSError:
        return True
    return not (isinstance(doc, dict) and doc.get("turns") == [] and doc.get("emptied") is not True)


def remove_files(directory: str, json_path: str, kv_path: str) -> bool:
    """Remove a session's sidecar, then its KV file, and sync their directory: True if all went (a
    session cut to no turn is no conversation)."""
    try:
        for path in (json_path, kv_path):
            os.unlink(path)
        fsync_dir(directory)
    except OSError:
        return False
    return True


def unlink_quietly(path: str) -> bool:
    """Remove a file if it is there; True if something was removed. Errors are left to the caller's
    next step (a failed cleanup must not hide the error being reported)."""
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def remake_directory(directory: str, name: str) -> bool:
    """If session NAME's directory was removed (a clean-up while colichat ran), make it again (the
    files follow: the lock, then the session from memory). True if it did; SessionError if it cannot."""
    if os.path.isdir(directory):
        return False
    try:
        private_dir(directory)
    except OSError as e:
        raise SessionError(f"could not save session {name}: its directory {directory} was "
                           f"removed and cannot be made again: {oserror_text(e)}") from None
    return True
