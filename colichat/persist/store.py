"""Where sessions live, what they are called, which model they belong to.

    paths() -> Paths(data, state, cache)       # COLICHAT_HOME/{data,state,cache}, else the XDG dirs
    ident = model_identity(gguf_path, arch, name, rope_factors=None)   # reads ~2 MB: {"arch", "name",
                                               # "fingerprint", "file", "path"} (+ "rope_factors")
    store = Store()                            # sessions under paths().data / "sessions"
    sess = store.create(ident, layout, name=None, sampler=None)   # new empty session, locked
    sess = store.claim(ident, name, layout, sampler=None)   # the same, its files made by the first save
    sess = store.open(ident, name, layout)     # existing session, locked (then sess.load(...))
    store.list(ident=None) -> [SessionInfo]    # newest first; all models when ident is None
    under_parents(infos) -> [(SessionInfo, depth)]   # the same, each fork after its parent
    store.latest(ident) -> SessionInfo | None
    store.is_empty(ident, name)                # an empty session left on disk: no conversation
    store.rename(sess, new)                    # an open session under another name
    store.dirs_for(fingerprint) -> [Path]      # a model's session directories, before it loads
    store.refuse_elsewhere(name, hint=...)     # SessionError if another model has session NAME
    model_file_now(info) -> str | None         # where the model that saved a session is now (path, real path)

Layout on disk: <data>/sessions/<model dir>/NAME.{coli_kv,json,lock}, where the model dir is the
sanitized model name plus 12 hex digits of the weights fingerprint, so two fine-tunes of one base
model never share sessions. Directories are created 0700, session files 0600.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shlex
import stat
import struct
import time
import unicodedata
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from ..engine.gguf_header import HeaderError, read_header
from ..paths import Paths, paths, private_dir  # noqa: F401  (re-exported)
from ..units import count, format_size
from . import renaming
from .kvfile import (
    HEADER,
    HEADER_SIZE,
    KIND_OF_MAGIC,
    CacheLayout,
    Header,
    SessionBusy,
    SessionError,
    SessionExists,
    fsync_dir,
    header_damage,
    mode_damage,
    oserror_text,
)
from .locks import flock_for_save, release_lock, take_lock
from .names import KV_EXT, SIDECAR_EXT, holds_conversation, interrupted_create, remove_leftovers
from .prefixes import PrefixIndex
from .session import Session
from .sidecar import MAX_SIDECAR_BYTES, doc_check, document, lineage, parse_turns

NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")
PREFIXES = "prefixes"  # beside the sessions directory: per model, the prefix index (prefixes.py)
LAST_USED = "last-used"  # beside the sessions directory: per model, the conversation last reopened (Store.used)


# ---- model identity ---------------------------------------------------------------------------

TENSOR_SAMPLES, TENSOR_SAMPLE = 256, 4096  # a 4 KiB sample from the middle of up to 256 tensors
SPREAD_SAMPLES, SPREAD_SAMPLE = 16, 65536  # plus 16 x 64 KiB spread evenly over the data region


def _gguf_layout(buf: bytes) -> tuple[int, list[int]]:
    """(data region offset, sorted tensor offsets within it) from the start of a GGUF v2/v3 file.

    struct.error: `buf` is too short to hold the whole header; HeaderError: not a GGUF we can walk."""
    head = read_header(buf)
    if head.data_start > len(buf):
        raise struct.error("short")
    return head.data_start, sorted(t.offset for t in head.tensors)


def _read_at(f, offset: int, n: int) -> bytes:
    f.seek(offset)
    return f.read(n)


def weights_fingerprint(path: str) -> str:
    """32 hex digits identifying a GGUF file's weights without reading it in full.

    Hashes the file size, the whole header (metadata + tensor infos), a 4 KiB sample from the middle
    of up to 256 tensors, and 16 x 64 KiB spread over the data region: ~2 MB read whatever the size.
    Two files of the same shapes with other weights (fine-tunes) differ in every sampled tensor."""
    h = hashlib.sha256(b"colichat weights fingerprint 1\0")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(size.to_bytes(8, "little"))
        n, layout = min(size, 1 << 20), None
        while layout is None:
            head = _read_at(f, 0, n)
            try:
                layout = _gguf_layout(head)
            except struct.error:
                if n >= min(size, 1 << 28):
                    break
                n = min(size, n * 4, 1 << 28)
            except HeaderError:
                break
        if layout is None:  # not a GGUF we can walk: hash its start and the spread samples
            data_start, starts = min(size, 1 << 20), []
            h.update(head[:data_start])
        else:
            data_start = layout[0]
            h.update(head[:data_start])
            starts = [data_start + o for o in layout[1]]
        ends = starts[1:] + [size] if starts else []  # no tensors (or not walkable): no tensor samples
        step = max(1, -(-len(starts) // TENSOR_SAMPLES))
        for s, e in list(zip(starts, ends, strict=True))[::step]:
            e = min(e, size)
            if e > s:
                mid = max(s, (s + e - TENSOR_SAMPLE) // 2)
                h.update(_read_at(f, mid, min(TENSOR_SAMPLE, e - mid)))
        span = max(0, size - data_start - SPREAD_SAMPLE)
        for k in range(SPREAD_SAMPLES):
            h.update(_read_at(f, data_start + span * k // (SPREAD_SAMPLES - 1), SPREAD_SAMPLE))
    return h.hexdigest()[:32]


def model_identity(gguf_path: str, arch: str, name: str, rope_factors: str | None = None) -> dict:
    """What a session records about its model: {"arch", "name", "fingerprint", "file", "path",
    "real_path"} ("file": the GGUF's file name, for listings; "path": its absolute path as given, and
    "real_path": the file it led to, symbolic links resolved, to find the model again when the session
    is reopened without --model, also once a link given points to another file; these never
    compared), and "rope_factors" (the rope frequency factors the cache rows are rotated with,
    Model.rope_factors) where the architecture picks them by context size."""
    try:
        fp = weights_fingerprint(str(gguf_path))
    except OSError as e:
        raise SessionError(f"cannot fingerprint model {gguf_path}: {oserror_text(e)}") from None
    path = os.path.abspath(str(gguf_path))
    ident = {"arch": str(arch), "name": str(name), "fingerprint": fp, "file": os.path.basename(path), "path": path,
             "real_path": os.path.realpath(path)}
    return ident if rope_factors is None else {**ident, "rope_factors": str(rope_factors)}


def _dir_suffix(fingerprint: str) -> str:
    return "-" + fingerprint[:12]


def model_dirname(ident: dict) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", str(ident.get("name") or "")).strip("-.")[:40]
    return f"{base or ident.get('arch') or 'model'}{_dir_suffix(ident['fingerprint'])}"


# ---- names ------------------------------------------------------------------------------------


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


# ---- the store --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionInfo:
    name: str
    model: str  # the model's name as saved in the sidecar (else its directory name)
    model_dir: str
    turns: int
    tokens: int
    size: int  # bytes on disk (KV file + sidecar)
    last_used: float  # epoch seconds (sidecar "updated", else the KV file's mtime)
    path: Path  # the .coli_kv file
    first: str = ""  # the first user message's first line
    damage: str | None = None  # why this is not a loadable session (then /delete NAME clears it)
    model_file: str = ""  # the GGUF's file name as saved in the sidecar (sessions of older versions: "")
    model_path: str = ""  # the GGUF's absolute path as saved in the sidecar (sessions of older versions: "")
    model_real_path: str = ""  # the file that path led to, links resolved (sessions of older versions: "")
    parent: str | None = None  # a fork's: the conversation it was forked from
    branch: int | None = None  # and the exchanges of it it began with

    def model_paths(self) -> list[str]:
        """Where the model that saved it was: the path it was given by, then the file that led to."""
        return list(dict.fromkeys(p for p in (self.model_path, self.model_real_path) if p))

    def made_by(self, fingerprint: str | None) -> bool:
        """Whether the model with this weights fingerprint saved it (its directory says so)."""
        return fingerprint is not None and self.model_dir.endswith(_dir_suffix(fingerprint))


    def describe(self, now: float | None = None) -> str:
        """'NAME: 4 turns, 812 tokens, 1.2 MiB, 3 h ago' for listings and the start-up notice."""
        if self.damage:
            return damaged_text(self.name, self.damage)
        age = max(0.0, (time.time() if now is None else now) - self.last_used)
        for unit, secs in (("d", 86400), ("h", 3600), ("min", 60), ("s", 1)):
            if age >= secs or unit == "s":
                break
        first = self.first if len(self.first) <= 50 else self.first[:47] + "..."
        fork = f" (fork of {self.parent} at exchange {self.branch})" if self.parent else ""
        return (f"{self.name}: {count(self.turns, 'turn')}, {count(self.tokens, 'token')}, {format_size(self.size)}, "
                f"{int(age // secs)} {unit} ago" + (f', "{first}"' if first else "") + fork)


def under_parents(infos: list[SessionInfo]) -> list[tuple[SessionInfo, int]]:
    """A listing's rows in order, with their depth: each conversation (in the order given, newest first)
    followed by its forks (theirs after each), one level deeper. A fork whose parent is not listed
    (deleted, renamed) is a row of its own; so are forks that name each other (renames)."""
    listed = {(i.model_dir, i.name) for i in infos}
    forks: dict[tuple[str, str], list[SessionInfo]] = {}
    for i in infos:
        if i.parent and (i.model_dir, i.parent) in listed:
            forks.setdefault((i.model_dir, i.parent), []).append(i)
    rows: list[tuple[SessionInfo, int]] = []
    seen: set[tuple[str, str]] = set()
    tops = [i for i in infos if not (i.parent and (i.model_dir, i.parent) in listed)]
    for top in tops + infos:  # (then what a loop of forks left out)
        stack = [(top, 0)]
        while stack:
            info, depth = stack.pop()
            if (info.model_dir, info.name) in seen:
                continue
            seen.add((info.model_dir, info.name))
            rows.append((info, depth))
            stack += [(f, depth + 1) for f in reversed(forks.get((info.model_dir, info.name), []))]
    return rows


def model_file_now(info: SessionInfo, fingerprints: dict | None = None) -> str | None:
    """Where the model that saved `info` is now: the first of its recorded paths (the one it was given
    by, then the file that led to) that is a regular file with its weights; None if neither.
    `fingerprints`: {path: fingerprint or None} already read (filled in)."""
    seen = {} if fingerprints is None else fingerprints
    for path in info.model_paths():
        if path not in seen:  # a regular file only (a FIFO named by a damaged sidecar would hang)
            try:
                seen[path] = weights_fingerprint(path) if os.path.isfile(path) else None
            except OSError:
                seen[path] = None
        if info.made_by(seen[path]):
            return path
    return None


def total_line(infos: list[SessionInfo]) -> str:
    """'5 conversations, 12.3 MiB on disk': the foot of /sessions and --sessions."""
    return f"{count(len(infos), 'conversation')}, {format_size(sum(i.size for i in infos))} on disk"


def damaged_text(name: str, damage: str) -> str:
    """The one line for a damaged session, the same in /sessions, --session and --resume."""
    return f"{name}: damaged ({damage}); /delete {name} removes it"


def _session_info(directory: Path, name: str, layout: CacheLayout | None = None) -> SessionInfo | None:
    """Read-only summary of one session (with `damage` set if opening would refuse it); None if
    nothing is there under that name. `layout`: the model's, where it is known (see `_dir_layout`)."""
    kv, side = directory / (name + KV_EXT), directory / (name + SIDECAR_EXT)
    tokens, model = 0, directory.name
    try:
        st = kv.lstat()
    except FileNotFoundError:
        st = None
    except OSError as e:
        return SessionInfo(name, model, directory.name, 0, 0, 0, 0.0, kv, damage=f"cannot read: {oserror_text(e)}")
    damage = None
    if st is None:  # a sidecar alone (its KV file deleted, to free its space say): opening reads its text again
        if interrupted_create(str(directory / name)):
            return None
        try:
            sst = side.lstat()
        except OSError:
            return None
        doc, _, damage = _listed_sidecar(side, directory)
        if damage is None and _lists_turns(doc):
            return SessionInfo(name, model_dir=directory.name, size=sst.st_size, path=kv,
                               **_sidecar_summary(doc, None, model, sst.st_mtime))
        return SessionInfo(name, model, directory.name, 0, 0, sst.st_size, sst.st_mtime, kv,
                           damage=damage or f"the sidecar {name}.json lists no turns and has no KV file {name}{KV_EXT}")
    last_used, size = st.st_mtime, st.st_size
    if stat.S_ISLNK(st.st_mode):
        damage = "the KV file is a symbolic link"
    elif not stat.S_ISREG(st.st_mode):
        damage = "the KV file is not a regular file"
    else:
        try:
            fd = os.open(kv, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                raw = os.pread(fd, HEADER_SIZE, 0)
            finally:
                os.close(fd)
            damage = header_damage(st.st_size, raw)
            foreign = None if damage else mode_damage(raw[:8], HEADER.unpack(raw)[8])
            damage = damage or _layout_damage(raw, layout)
            if foreign:  # a codec colichat does not read: opening refuses it (its text is not read again)
                damage = foreign
            elif damage is None:
                tokens = HEADER.unpack(raw)[7]
                if tokens == 0 and not _holds(directory / name):  # emptied (every exchange rewound)
                    return None
            else:  # no records to read: a sidecar that lists the text makes it a conversation read again
                doc, side_size, side_damage = _listed_sidecar(side, directory)
                if side_damage is None and _lists_turns(doc):
                    return SessionInfo(name, model_dir=directory.name, size=size + side_size, path=kv,
                                       **_sidecar_summary(doc, None, model, last_used))
        except OSError as e:
            damage = f"cannot read: {oserror_text(e)}"
    if damage:
        return SessionInfo(name, model, directory.name, 0, 0, size, last_used, kv, damage=damage)
    doc, side_size, damage = _listed_sidecar(side, directory)
    size += side_size
    if damage:
        return SessionInfo(name, model, directory.name, 0, 0, size, last_used, kv, damage=damage)
    if isinstance(doc, dict) and isinstance(doc.get("turns"), list) and all(isinstance(t, dict) for t in doc["turns"]):
        return SessionInfo(name, model_dir=directory.name, size=size, path=kv,
                           **_sidecar_summary(doc, tokens, model, last_used))
    return SessionInfo(name, model, directory.name, 0, tokens, size, last_used, kv)


def _lists_turns(doc: dict | None) -> bool:
    """Whether a sidecar document lists turns (the text a session without usable records is read from)."""
    return isinstance(doc, dict) and isinstance(doc.get("turns"), list) and bool(doc["turns"]) \
        and all(isinstance(t, dict) for t in doc["turns"])


def _holds(base: Path) -> bool:
    """holds_conversation, where a file it cannot judge counts as something (the listing says why)."""
    try:
        return holds_conversation(str(base))
    except SessionError:
        return True


def _layout_damage(raw: bytes, layout: CacheLayout | None) -> str | None:
    """Why a KV header is not one this model can load (another model's cache), or None."""
    if layout is None:
        return None
    header = Header(*HEADER.unpack(raw))
    if KIND_OF_MAGIC[header.magic] != layout.kind:
        return f"a cache of another kind of model: magic {header.magic!r}"
    bad = header.mismatches(layout)
    return f"a cache of another model: {', '.join(bad)}" if bad else None


def _listed_sidecar(side: Path, directory: Path) -> tuple[dict | None, int, str | None]:
    """(document, size, damage) of a sidecar as a listing sees it: the damage is what opening refuses
    before reading any record (a link, a special file, not colichat's, another model's weights);
    no sidecar is (None, 0, None). The opening refusal names the cause and what to do."""
    try:
        st = side.lstat()
    except FileNotFoundError:
        return None, 0, None
    except OSError as e:
        return None, 0, f"cannot read the sidecar: {oserror_text(e)}"
    if stat.S_ISLNK(st.st_mode):
        return None, st.st_size, "the sidecar is a symbolic link"
    if not stat.S_ISREG(st.st_mode):
        return None, st.st_size, "the sidecar is not a regular file"
    if st.st_size > MAX_SIDECAR_BYTES:
        return None, st.st_size, "the sidecar is implausibly large"
    try:
        doc = document(side.read_bytes())
    except OSError as e:
        return None, st.st_size, f"cannot read the sidecar: {oserror_text(e)}"
    if not isinstance(doc, dict) or type(doc.get("format")) is not int or doc["format"] < 1 \
            or not isinstance(doc.get("model"), dict):
        return None, st.st_size, "the sidecar is not a colichat sidecar"
    fingerprint = doc["model"].get("fingerprint")
    if not isinstance(fingerprint, str) or not directory.name.endswith(_dir_suffix(fingerprint)):
        return None, st.st_size, f"the sidecar is of other weights ({str(doc['model'].get('name'))[:40]})"
    return doc, st.st_size, None


def _dir_layout(directory: Path) -> CacheLayout | None:
    """The cache layout of the model whose sessions `directory` holds, as an intact sidecar there
    records it (the directory is the model's, so every session in it has that layout); None if no
    sidecar says."""
    try:
        sides = sorted(p for p in directory.iterdir() if p.suffix == SIDECAR_EXT)
    except OSError:
        return None
    for side in sides:
        doc, _, damage = _listed_sidecar(side, directory)
        if damage or doc is None or doc.get("check") != doc_check(doc) or not isinstance(doc.get("layout"), dict):
            continue
        try:
            layout = CacheLayout(**doc["layout"])
        except TypeError:
            continue
        if layout.kind in ("mla", "gqa") and all(type(v) is int for k, v in doc["layout"].items()
                                                 if k not in ("kind", "codec")):
            return layout
    return None


def _sidecar_summary(doc: dict, tokens: int | None, model: str, last_used: float) -> dict:
    """SessionInfo's turns, tokens, model (name, file name, path), first (line of the first message),
    last_used and a fork's parent and branch (sidecar.lineage) from a sidecar whose turns are a list
    of objects; a damaged value gives way to the header's (model, last_used), a missing or damaged
    file name or path to "". The token count is the end of the turns whose checks hold, at most the
    records the KV file has (`tokens`; None: no KV file); with no such turn, the KV file's."""
    turns = doc["turns"]
    sound = parse_turns(doc)[0]  # (a damaged count, say 10**12, is not believed)
    checked = sound[-1].last if sound else 0
    saved = doc["model"] if isinstance(doc.get("model"), dict) else {}
    text = next((t.get("text") for t in turns if t.get("role") == "user"), "")
    parent, branch = lineage(doc)
    return {
        "turns": len(turns),
        "tokens": checked if tokens is None else min(checked, tokens) if sound else tokens,
        "model": str(saved.get("name") or model),
        "model_file": saved.get("file") if isinstance(saved.get("file"), str) else "",
        "model_path": saved.get("path") if isinstance(saved.get("path"), str) else "",
        "model_real_path": saved.get("real_path") if isinstance(saved.get("real_path"), str) else "",
        "first": next((x.strip() for x in text.splitlines() if x.strip()), "") if isinstance(text, str) else "",
        "last_used": _timestamp(doc.get("updated"), last_used),
        "parent": parent,
        "branch": branch,
    }


def _timestamp(text, default: float) -> float:
    """The time an ISO 8601 text says, or `default` when it is not one."""
    if not isinstance(text, str):
        return default
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return default


def _open_to_remove(path: str) -> int | None:
    """A regular KV file opened and flocked exclusively before its removal (a reader without the
    session's lock holds it shared while it reads: locks.reading); None if there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    flock_for_save(fd)
    return fd


class Store:
    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else paths().data / "sessions"

    def model_dir(self, ident: dict) -> Path:
        """The model's session directory: the one named after it, else the one its weights already have
        under another name (a GGUF without general.name is named after its file, which may have been
        renamed or reached through another path since: its conversations stay its own)."""
        named = self.root / model_dirname(ident)
        if os.path.lexists(named):
            return named
        return next(iter(sorted(self.dirs_for(ident["fingerprint"]))), named)

    def create(self, ident: dict, layout: CacheLayout, name: str | None = None,
               sampler: dict | None = None, stem: str | None = None, files: bool = True) -> Session:
        """A new empty session (locked); `name=None` picks a fresh name from `stem` (a slug of the
        first message), else from the time. `files=False`: its files are made by its first save,
        whole (a conversation saved there at once never shows as an empty session)."""
        directory = self._make_dir(self.model_dir(ident))
        make = Session.create if files else Session.claim
        if name is not None:
            try:
                return make(directory, check_name(name), ident, layout, sampler)
            except FileExistsError:
                raise self._exists(directory, name) from None
        busy: set[str] = set()
        while True:
            taken = {p.stem for p in directory.iterdir() if p.suffix in (KV_EXT, SIDECAR_EXT)} | busy
            name = auto_name(taken, stem)
            try:
                return make(directory, name, ident, layout, sampler)
            except (FileExistsError, SessionBusy):
                busy.add(name)  # another colichat took the same name just now

    def claim(self, ident: dict, name: str, layout: CacheLayout, sampler: dict | None = None) -> Session | None:
        """A new session NAME, locked now, whose files the first save creates. SessionExists if the
        name holds a conversation, SessionBusy if another colichat has it; None if the session
        directory cannot be made (nothing can be saved there: the first save says why)."""
        check_name(name)
        try:
            directory = self._make_dir(self.model_dir(ident))
        except SessionError:
            return None
        renaming.finish_renames(str(directory))
        try:
            return Session.claim(directory, check_name(name), ident, layout, sampler)
        except FileExistsError:
            raise self._exists(directory, name) from None

    def _exists(self, directory: Path, name: str) -> SessionExists:
        """NAME holds something: the damage line /sessions shows (SessionError), else SessionExists."""
        self._refuse_damaged(directory, name)
        return SessionExists(f"session {name} already exists; resume it with /resume {name} "
                             "or choose another name")

    def open(self, ident: dict, name: str, layout: CacheLayout, read_only: bool = False) -> Session:
        """An existing session of this model, locked for writing (or `read_only`); load it next."""
        directory = self.model_dir(ident)
        check_name(name)
        renaming.finish_renames(str(directory))
        if not any(os.path.lexists(directory / (name + ext)) for ext in (KV_EXT, SIDECAR_EXT)):
            self.refuse_elsewhere(name)
        self._refuse_damaged(directory, name, layout)
        return Session.open(directory, name, ident, layout, read_only)

    def is_empty(self, ident: dict, name: str) -> bool:
        """Whether NAME of this model is an empty session left on disk (no records, no turns): no
        conversation, though `open` opens it (the chat program refuses it as it lists it: not at all)."""
        base = self.model_dir(ident) / check_name(name)
        return os.path.lexists(str(base) + KV_EXT) and not _holds(base)

    def refuse_elsewhere(self, name: str, hint: str | None = None) -> None:
        """SessionError 'session NAME belongs to another model (MODEL, last run from PATH); HINT' if
        another model has a loadable session NAME (asked where the model in use has none of that name).
        The hint by default: the command that reopens it, where its model's file is still there."""
        found = [i for i in self.list() if i.name == name]  # newest first
        infos = [i for i in found if not i.damage]
        if not infos:
            if found:  # (a damaged one: not a new conversation of that name beside it, unsaid)
                raise SessionError(f"session {name} of another model ({found[0].model_dir}) is damaged "
                                   f"({found[0].damage}); start colichat with that model's --model PATH to "
                                   "see it in /sessions, or choose another name")
            return
        there = [p for p in map(model_file_now, infos) if p]
        if hint is None:
            hint = (f"colichat --model {shlex.quote(there[0])} --session {name} reopens it" if there
                    else "start colichat with that model to resume it")
        raise SessionError(f"session {name} belongs to another model ({self.whose(infos)}); {hint}")

    @staticmethod
    def whose(infos: list[SessionInfo]) -> str:
        """'MODEL, last run from PATH[, not there now]; ...': the models that saved these sessions."""
        return "; ".join(model if not path else f"{model}, last run from {path}" if os.path.isfile(path)
                         else f"{model}, last run from {path}, not there now"
                         for model, path in sorted({(i.model, i.model_path) for i in infos}))

    @staticmethod
    def _refuse_damaged(directory: Path, name: str, layout: CacheLayout | None = None) -> None:
        """SessionError with the line /sessions shows, if NAME is there but cannot be a session
        (a link, a special file, a file we may not read, a sidecar or a header opening cannot use
        keep the refusals that name the cause and what to do)."""
        info = _session_info(directory, name, layout or _dir_layout(directory))
        if info and info.damage and not info.damage.startswith(
                ("cannot read", "the KV file is", "the sidecar is", "a cache of another")):
            raise SessionError(f"session {damaged_text(name, info.damage)}")

    def delete(self, ident: dict, name: str) -> int:
        """Remove a saved session of this model and return the bytes freed. Its lock is taken first,
        so a session open in another colichat is refused. The sidecar goes first: a crash in between
        leaves a bare KV file, which still loads (as one imported turn) and can be deleted again."""
        directory = self.model_dir(ident)
        check_name(name)
        base = os.path.join(str(directory), name)
        if not any(os.path.lexists(base + ext) for ext in (KV_EXT, ".json")):
            raise SessionError(f"no session named {name} for this model (/sessions lists them)")
        paths = (base + SIDECAR_EXT, base + KV_EXT, base + SIDECAR_EXT + ".tmp", base + KV_EXT + ".tmp")
        for path in paths:  # checked before anything goes: a directory there is not colichat's to remove
            if os.path.isdir(path) and not os.path.islink(path):
                raise SessionError(f"cannot delete session {name}: {path} is a directory, which colichat did not "
                                   f"make; nothing was deleted (remove it yourself: rm -r '{path}')")
        fd = take_lock(base + ".lock", name)
        freed = 0
        kv = _open_to_remove(base + KV_EXT)  # a reader without the lock (--export) ends its read first
        try:  # links are removed, never followed; the temporary files of an interrupted save go too
            for path in paths:
                try:
                    freed += os.lstat(path).st_size
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    raise SessionError(f"cannot delete session {name}: {oserror_text(e)}") from None
            fsync_dir(str(directory))
        finally:
            if kv is not None:
                os.close(kv)
            release_lock(fd)
        self.prefix_index(ident).drop(name)
        return freed

    def rename(self, sess: Session, new: str) -> None:
        """Give an open session another name. Both files are linked under the new name before the
        old names go, so a crash in between leaves the conversation under both names, never none.
        A reader without the lock (--no-save, --export) ends its read first (Session._saving)."""
        with sess._saving():
            self._rename(sess, new)

    def _rename(self, sess: Session, new: str) -> None:
        check_name(new)
        base, old = os.path.join(sess.directory, new), os.path.join(sess.directory, sess.name)
        fd = take_lock(base + ".lock", new)
        try:
            if holds_conversation(base):  # (a link or a special file there is a SessionError naming it)
                raise SessionError(f"session {new} already exists: choose another name")
            try:
                remove_leftovers(base)  # an empty session or an interrupted create: no conversation
            except OSError as e:
                raise SessionError(f"cannot rename session {sess.name} to {new}: {oserror_text(e)}") from None
            exts: list[str] = []
            done: list[str] = []
            try:
                renaming.mark(sess.directory, new, sess.name)
                for ext in (KV_EXT, SIDECAR_EXT):  # (an error here must not read as "no such file")
                    try:
                        os.lstat(old + ext)
                        exts.append(ext)
                    except FileNotFoundError:
                        pass
                for ext in exts:
                    os.link(old + ext, base + ext)
                    done.append(base + ext)
                fsync_dir(sess.directory)
            except OSError as e:
                for path in done:
                    os.unlink(path)
                renaming.unmark(sess.directory, new)
                raise SessionError(f"cannot rename session {sess.name}: {oserror_text(e)}") from None
            try:
                for ext in reversed(exts):
                    os.unlink(old + ext)
                fsync_dir(sess.directory)
                copy = False
            except OSError:
                copy = True  # the old name stays as a second copy; /delete removes it
            renaming.unmark(sess.directory, new)
        except BaseException:
            release_lock(fd)
            raise
        release_lock(sess._lock_fd)
        sess._lock_fd, sess.name = fd, new
        sess.kv_path, sess.json_path = base + KV_EXT, base + SIDECAR_EXT
        if copy and sess.on_disk:  # a copy, not a second link to the files this session writes
            try:
                sess._check_files(sess.turns, sess._crcs)
                sess._write_sidecar(sess.turns, sess._crcs)
                sess.notes.clear()
            except (OSError, SessionError):
                pass  # the next save writes the file again (it sees the second link)

    def dirs_for(self, fingerprint: str) -> list[Path]:
        """The session directories of the model with this weights fingerprint (found before it loads)."""
        try:
            return [p for p in self.root.iterdir() if p.name.endswith(_dir_suffix(fingerprint)) and p.is_dir()
                    and not p.is_symlink()]
        except OSError:
            return []

    def list(self, ident: dict | None = None) -> list[SessionInfo]:
        """Sessions of one model (or all), newest first. Never raises on damaged entries; a directory
        that cannot be read (an I/O error) is a SessionError naming it."""
        if ident is not None:
            dirs = [self.model_dir(ident)]
        else:
            try:
                dirs = [p for p in self.root.iterdir() if p.is_dir() and not p.is_symlink()]
            except OSError:
                dirs = []
        infos = []
        for d in dirs:
            renaming.finish_renames(str(d))
            try:
                names = [p.name[: -len(ext)] for p in d.iterdir() for ext in (KV_EXT, ".json")
                         if p.name.endswith(ext)]
            except (FileNotFoundError, NotADirectoryError):
                continue  # (no conversation of that model yet)
            except OSError as e:  # said as what failed: not "no such session", then "already exists"
                raise SessionError(f"cannot list the conversations in {d}: {oserror_text(e)}") from None
            layout = _dir_layout(d)
            infos += [i for i in (_session_info(d, n, layout) for n in sorted(set(names)) if NAME_RE.fullmatch(n))
                      if i]
        return sorted(infos, key=lambda i: (i.last_used, i.name), reverse=True)

    def latest(self, ident: dict) -> SessionInfo | None:
        """The conversation of this model last used: the one last reopened (`used`) if that was after
        the newest save, else the newest saved."""
        found = [i for i in self.list(ident) if not i.damage]
        try:
            mark = self.root.parent / LAST_USED / self.model_dir(ident).name
            name, when = mark.read_text("utf-8").strip(), mark.stat().st_mtime
        except (OSError, UnicodeDecodeError):
            return found[0] if found else None
        used = next((i for i in found if i.name == name), None)
        return used if used is not None and when > found[0].last_used else (found[0] if found else None)

    def prefix_index(self, ident: dict) -> PrefixIndex:
        """This model's prefix index (prefixes.py): a small file in PREFIXES beside the sessions directory."""
        directory = self.model_dir(ident)
        return PrefixIndex(self.root.parent / PREFIXES / (directory.name + ".json"), directory)

    def used(self, ident: dict, name: str) -> None:
        """Conversation NAME was reopened now: `latest` names it until another is saved or reopened. A
        small file per model in LAST_USED beside the sessions directory, written whole (nothing under the
        sessions directory is touched: reopening a conversation writes nothing of it); where it cannot be
        written, nothing is said."""
        mark = self.root.parent / LAST_USED / self.model_dir(ident).name
        tmp = mark.with_name(mark.name + ".tmp")
        try:
            private_dir(mark.parent)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, name.encode("utf-8"))
            finally:
                os.close(fd)
            os.replace(tmp, mark)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    @staticmethod
    def _make_dir(directory: Path) -> Path:
        """Create missing directories down to `directory`, each 0700."""
        try:
            private_dir(directory)
        except OSError as e:
            raise SessionError(f"cannot create session directory {e.filename or directory}: "
                               f"{oserror_text(e)}") from None
        if not directory.is_dir():
            raise SessionError(f"session directory {directory} is not a directory")
        return directory
