"""Which saved conversation of a model starts with the tokens a new prompt starts with: the prefix index.

One small file per model, `prefixes/MODEL-DIR.json` beside the sessions directory:

    {"format": 1, "sessions": {NAME: {"codec": "f32", "points": [[n, hash of tokens[:n]], ...]}}}

with a point at every turn boundary and every STEP tokens (hash: blake2b-64 of the int32 token ids).
It is only a hint: a new prompt looks up the saved conversations with a point it shares, the caller
opens the best of them as /resume does (header, fingerprint, checksums) and keeps the records whose
tokens are the prompt's own. So a stale, lost or damaged index costs a prefill, never a wrong cache:
it is written whole (a temporary file renamed over it) after each save, never fsynced, and rebuilt
from the sessions' own files (their sidecars' turns and their KV files' tokens) when it cannot be
read. It is read as every hint is (hints.py: without blocking, at most LIMIT bytes, any damage one line),
and one that cannot be used is said once (`said`), then written anew by the next save.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import numpy as np

from ..hints import Said, read_hint
from .kvfile import CODEC_OF_MAGIC, HEADER, HEADER_SIZE, CacheLayout, Header, header_damage, mode_damage
from .names import KV_EXT, SIDECAR_EXT
from .sidecar import MAX_SIDECAR_BYTES, document, parse_turns

STEP = 64  # tokens between two points inside a turn
FORMAT = 1
LIMIT = 1 << 26  # bytes of an index read at most (some 2,000 conversations of 32k tokens)


def points(tokens: np.ndarray, ends: list[int]) -> list[list]:
    """[[n, hash of tokens[:n]], ...] at every STEP tokens and at each of `ends` (turn boundaries)."""
    tokens = np.asarray(tokens, dtype="<i4")
    at = sorted({n for n in (*range(STEP, tokens.size + 1, STEP), *ends) if 0 < n <= tokens.size})
    h, done, out = hashlib.blake2b(digest_size=8), 0, []
    for n in at:
        h.update(tokens[done:n].tobytes())
        done = n
        out.append([n, h.hexdigest()])
    return out


def _sessions(data: bytes) -> dict:
    """An index file's {NAME: entry} (ValueError: not an index of this format)."""
    doc = json.loads(data)
    if not (isinstance(doc, dict) and doc.get("format") == FORMAT and isinstance(doc.get("sessions"), dict)):
        raise ValueError(f"not a prefix index of format {FORMAT}")
    return doc["sessions"]


class PrefixIndex:
    def __init__(self, path: Path, sessions: Path, said: Said | None = None):
        self.path = Path(path)  # this model's index file
        self.sessions = Path(sessions)  # this model's sessions directory (what a rebuild reads)
        self.said = said or Said()  # an index that cannot be used, said once a run

    def read(self) -> dict:
        """{NAME: {"codec", "points"}}: the file's, or rebuilt from the sessions when there is none or it
        cannot be used (written by the next `record`: looking up writes nothing)."""
        found, problem = read_hint(self.path, _sessions, LIMIT)
        if found is not None:
            return found
        if problem:
            self.said(self.path, f"the prefix index {self.path} cannot be used ({problem}): it is rebuilt from "
                                 "the saved conversations")
        return self.rebuild()

    def record(self, name: str, codec: str, tokens: np.ndarray, ends: list[int]) -> None:
        """Session NAME now holds `tokens` (turns ending at `ends`), kept in `codec`."""
        entries = self.read()
        entries[name] = {"codec": codec, "points": points(tokens, ends)}
        self._write(entries)

    def drop(self, name: str) -> None:
        """Session NAME is gone (deleted): its entry too, where there is one."""
        entries = self.read()
        if entries.pop(name, None) is not None:
            self._write(entries)

    def candidates(self, codec: str, ids: list[int]) -> list[tuple[int, str]]:
        """(tokens shared, NAME) of the conversations kept in `codec` whose indexed points match a prefix of
        `ids`, the longest first (at most one entry a conversation)."""
        ids_arr = np.asarray(ids, dtype="<i4")
        listed = {name: [p for p in e["points"] if isinstance(p, list) and len(p) == 2 and type(p[0]) is int]
                  for name, e in self.read().items()
                  if isinstance(e, dict) and e.get("codec") == codec and isinstance(e.get("points"), list)}
        mine = dict(points(ids_arr, [p[0] for pts in listed.values() for p in pts]))  # {n: hash of ids[:n]}
        found = {name: max((p[0] for p in pts if mine.get(p[0]) == p[1]), default=0) for name, pts in listed.items()}
        return sorted(((n, name) for name, n in found.items() if n), reverse=True)

    def rebuild(self) -> dict:
        """Every session's points, from its sidecar's turns and its KV file's token ids."""
        entries = {}
        try:
            names = sorted(p.stem for p in self.sessions.glob("*" + KV_EXT))
        except OSError:
            return entries
        for name in names:
            entry = _entry_of(self.sessions / (name + KV_EXT), self.sessions / (name + SIDECAR_EXT))
            if entry:
                entries[name] = entry
        return entries

    def _write(self, entries: dict) -> None:
        """Whole or not at all; where it cannot be written, nothing is said (it is a hint)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
            try:
                os.write(fd, json.dumps({"format": FORMAT, "sessions": entries}, separators=(",", ":")).encode())
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _entry_of(kv: Path, side: Path) -> dict | None:
    """A session's index entry from its files (the token ids of the records its turns cover), or None
    where they cannot give one (read as hints are: a FIFO or a device there is not waited on)."""
    doc = read_hint(side, document, MAX_SIDECAR_BYTES).value
    turns = parse_turns(doc)[0] if isinstance(doc, dict) else []
    if not turns:
        return None
    try:
        fd = os.open(kv, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            raw, size = f.read(HEADER_SIZE), st.st_size
            if header_damage(size, raw):
                return None
            header = Header(*HEADER.unpack(raw))
            layout = CacheLayout.from_header(header)
            if mode_damage(header.magic, header.mode) or layout.codec_problem():
                return None
            rb = layout.record_bytes
            n = min(header.nrec, turns[-1].last, (size - HEADER_SIZE) // rb)
            if n <= 0:
                return None
            records = np.memmap(f, dtype=np.uint8, mode="r", offset=HEADER_SIZE, shape=(n, rb))  # (N, record)
            tokens = np.array(records[:, :4]).view("<i4")[:, 0]  # (reads one page a record)
            del records
        except OSError:
            return None
    return {"codec": CODEC_OF_MAGIC[header.magic], "points": points(tokens, [t.last for t in turns if t.last <= n])}
