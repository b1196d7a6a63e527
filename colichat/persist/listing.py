"""What the sessions on disk are, as /sessions, --sessions and the start-up notice list them, read
without opening them (no lock taken, nothing written).

    session_info(directory, name, layout=None) -> SessionInfo | None   # with `damage` if opening refuses it
    dir_layout(directory) -> CacheLayout | None   # the layout of the model whose sessions it holds
    under_parents(infos) -> [(SessionInfo, depth)]   # each fork after its parent
    total_line(infos), damaged_text(name, damage)    # the lines listings print
    model_file_now(info) -> str | None     # where the model that saved a session is now (path, real path)
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from ..units import count, format_size
from .identity import dir_suffix, weights_fingerprint
from .kvfile import (
    HEADER,
    HEADER_SIZE,
    KIND_OF_MAGIC,
    CacheLayout,
    Header,
    SessionError,
    header_damage,
    mode_damage,
    oserror_text,
)
from .loading import opening_keeps
from .names import KV_EXT, SIDECAR_EXT, holds_conversation, interrupted_create
from .sidecar import MAX_SIDECAR_BYTES, doc_check, document, lineage


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
        return fingerprint is not None and self.model_dir.endswith(dir_suffix(fingerprint))


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
        held = f"{count(self.turns, 'turn')}, {count(self.tokens, 'token')}" if self.turns or self.tokens else "empty"
        return (f"{self.name}: {held}, {format_size(self.size)}, "
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


def session_info(directory: Path, name: str, layout: CacheLayout | None = None) -> SessionInfo | None:
    """Read-only summary of one session (with `damage` set if opening would refuse it); None if
    nothing is there under that name. `layout`: the model's, where it is known (see `dir_layout`)."""
    kv, side = directory / (name + KV_EXT), directory / (name + SIDECAR_EXT)
    model = directory.name
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
        if damage is None and (_lists_turns(doc) or doc.get("emptied") is True):  # (an emptied one's KV file went)
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
                header = Header(*HEADER.unpack(raw))
                records = header.nrec, st.st_size, CacheLayout.from_header(header).record_bytes
                if header.nrec == 0 and not holds_or_damaged(directory / name):  # (no records and no sidecar)
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
    if isinstance(doc, dict) and doc.get("turns") == [] and doc.get("emptied") is not True:
        return None  # every exchange rewound: no conversation (names.holds_conversation), cut or not
    if isinstance(doc, dict) and isinstance(doc.get("turns"), list) and all(isinstance(t, dict) for t in doc["turns"]):
        return SessionInfo(name, model_dir=directory.name, size=size, path=kv,
                           **_sidecar_summary(doc, records, model, last_used))
    tokens = records[0] if doc is None else 0  # (no sidecar: one imported turn; no turn list: nothing opens)
    return SessionInfo(name, model, directory.name, 0, tokens, size, last_used, kv)


def _lists_turns(doc: dict | None) -> bool:
    """Whether a sidecar document lists turns (the text a session without usable records is read from)."""
    return isinstance(doc, dict) and isinstance(doc.get("turns"), list) and bool(doc["turns"]) \
        and all(isinstance(t, dict) for t in doc["turns"])


def holds_or_damaged(base: Path) -> bool:
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
    if not isinstance(fingerprint, str) or not directory.name.endswith(dir_suffix(fingerprint)):
        return None, st.st_size, f"the sidecar is of other weights ({str(doc['model'].get('name'))[:40]})"
    return doc, st.st_size, None


def dir_layout(directory: Path) -> CacheLayout | None:
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


def _sidecar_summary(doc: dict, records: tuple[int, int, int] | None, model: str, last_used: float) -> dict:
    """SessionInfo's turns, tokens, model (name, file name, path), first (line of the first message),
    last_used and a fork's parent and branch (sidecar.lineage) from a sidecar whose turns are a list
    of objects; a damaged value gives way to the header's (model, last_used), a missing or damaged
    file name or path to "". The turns and tokens counted are those opening keeps (their checks hold,
    the KV file holds their records or their text is read again: loading.opening_keeps), with `records`
    the KV file's (nrec, size, record bytes), None where there is no KV file it can read."""
    kept = opening_keeps(doc, *records) if records else opening_keeps(doc, None, 0, 1)
    saved = doc["model"] if isinstance(doc.get("model"), dict) else {}
    text = next((t.text for t in kept if t.role == "user"), "")
    parent, branch = lineage(doc)
    return {
        "turns": len(kept),
        "tokens": kept[-1].last if kept else 0,
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
