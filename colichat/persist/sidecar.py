"""The sidecar NAME.json's turns and checks: a Turn (role, text, its span of records), the CRC-32 of
a turn's records, the "check" CRCs that cover each turn's fields and the document's settings (a
fork's parent and branch among them: `lineage`), what a load keeps of a sidecar's turn list (its
longest sound prefix, exchanges whole), and which turns it drops can be read again from their text
(`readable_again`), and the document written whole (`write_document`). FORMAT.md describes it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone

try:  # the same CRC-32 as zlib.crc32, several times faster (resume checks every saved byte)
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives identical values
    from zlib import crc32

from .kvfile import INT32_MAX, fsync_dir, open_file

FORMAT_VERSION = 2  # 2: a "check" CRC over the sidecar's settings, and one over each turn's fields
MAX_SIDECAR_BYTES = 256 << 20


@dataclass(frozen=True)
class Turn:
    role: str  # "system", "user", "assistant"; "imported" for a cache loaded without a sidecar
    text: str
    first: int  # first record of the turn
    last: int  # one past its last record


def turn_crc(cache, t: Turn) -> int:
    """CRC-32 (zlib's polynomial) of the turn's record bytes; ISA-L computes the same value ~4x faster."""
    return crc32(cache.raw(t.first, t.last))


def document(data: bytes):
    """The JSON value of a sidecar file's bytes; None if they are not JSON. A byte that is not UTF-8
    (damage in a turn's text) reads as U+FFFD: that turn's check then fails, and only it and the
    turns after it are lost, as with any other changed byte of a text."""
    try:
        return json.loads(data.decode("utf-8", "replace"))
    except (ValueError, RecursionError):  # JSONDecodeError, an integer of over 4,300 digits; nesting too deep
        return None


def session_document(head: dict, updated: str, turns: list[Turn], crcs: list[int], unread: list[dict] = ()) -> dict:
    """The sidecar of a session: `head` (model, layout, created, sampler, a fork's parent and branch,
    pending.py's marks) and the time `updated` (iso_time), under the top-level check; the turns, each
    with its check, then `unread` (entries of turns whose records are lost, listed as they were)."""
    doc = {"format": FORMAT_VERSION, **head, "updated": updated, "nrec": turns[-1].last if turns else 0}
    doc["check"] = doc_check(doc)
    doc["turns"] = [{"role": t.role, "text": t.text, "first": t.first, "last": t.last, "crc32": c,
                     "check": turn_check(t.role, t.text, t.first, t.last, c)}
                    for t, c in zip(turns, crcs, strict=True)] + list(unread)
    return doc


def iso_time(t: float) -> str:
    """The sidecar's times ("created", "updated"), from epoch seconds (the store's clock): UTC, to the
    millisecond."""
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")


def write_document(path: str, doc: dict) -> None:
    """Atomically replace the sidecar at `path` by `doc`: write PATH.tmp, fsync, rename over, fsync the
    directory. On an error no PATH.tmp is left and the sidecar is as before."""
    try:
        data = json.dumps(doc, ensure_ascii=False, indent=1).encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates in a text: escape them instead
        data = json.dumps(doc, indent=1).encode("ascii")
    tmp = path + ".tmp"
    if os.path.lexists(tmp):  # a crash's leftover, or a file planted there: never written through
        os.unlink(tmp)
    fd = open_file(tmp, "sidecar", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        try:
            os.fchmod(fd, 0o600)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(os.path.dirname(path) or ".")


def _canonical_crc(value) -> int:
    """CRC-32 of the value as compact, key-sorted, ASCII JSON: the same whatever the file's layout."""
    return crc32(json.dumps(value, ensure_ascii=True, sort_keys=True, separators=(",", ":")).encode("ascii"))


def turn_check(role: str, text: str, first: int, last: int, crc: int) -> int:
    """The sidecar's "check" of one turn: covers its role, text, record span and record CRC."""
    return _canonical_crc([role, text, first, last, crc])


def doc_check(doc: dict) -> int:
    """The sidecar's top-level "check": covers everything but the turns (which carry their own)."""
    return _canonical_crc({k: v for k, v in doc.items() if k not in ("turns", "check")})


def lineage(doc: dict) -> tuple[str | None, int | None]:
    """(parent, branch) of a fork, as its sidecar records them: the conversation it was forked from and
    the exchanges of it that it began with; (None, None) for one that is no fork, or whose document
    check fails (its settings, these with them, are not believed)."""
    parent, branch = doc.get("parent"), doc.get("branch")
    if not isinstance(parent, str) or not 0 < len(parent) <= 64 or type(branch) is not int or branch < 1 \
            or doc.get("check") != doc_check(doc):
        return None, None
    return parent, branch


def parse_turns(doc: dict) -> tuple[list[Turn], list[int], str | None]:
    """The longest well-formed, contiguous, checked prefix of the sidecar's turns, and a warning if
    shorter. A format-1 sidecar (an older colichat) has no per-turn checks."""
    raw = doc.get("turns")
    if not isinstance(raw, list):
        return [], [], "the sidecar has no turn list: no turns kept"
    checked = doc.get("format") != 1
    turns: list[Turn] = []
    crcs: list[int] = []
    for i, t in enumerate(raw):
        ok = isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("text"), str)
        vals = [t.get(k) for k in ("first", "last", "crc32")] if ok else []
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in vals)
        prev = turns[-1].last if turns else 0
        if not ok or vals[0] != prev or not vals[0] <= vals[1] <= INT32_MAX or not 0 <= vals[2] < 2**32:
            return turns, crcs, f"sidecar turn {i + 1} is malformed: dropped it and {len(raw) - i - 1} later"
        if (checked or "check" in t) and t.get("check") != turn_check(t["role"], t["text"], *vals):
            return turns, crcs, (f"sidecar turn {i + 1} is damaged (its role, text or span does not match its "
                                 f"checksum): dropped it and {len(raw) - i - 1} later")
        turns.append(Turn(t["role"], t["text"], vals[0], vals[1]))
        crcs.append(vals[2])
    return turns, crcs, None


def span(turns: list[Turn], i: int) -> str:
    """'turns 3-5 (records 40-97)' for turns[i:]."""
    a, b = i + 1, len(turns)
    which = f"turn {a}" if a == b else f"turns {a}-{b}"
    return f"{which} (records {turns[i].first}-{turns[-1].last})"


def drop_unanswered(turns: list[Turn], crcs: list[int], warnings: list[str]) -> int:
    """Drop (in place) a last user turn: the chat saves a message and its answer together (an answer
    the model ends at once is an empty assistant turn; a message whose answer was stopped before its
    first token is not saved), so a message alone is what is left of an exchange whose answer was
    dropped. Returns the records kept."""
    if turns and turns[-1].role == "user":
        warnings.append(f"dropped {span(turns, len(turns) - 1)}: a message whose answer is not there "
                        "(an exchange is kept whole)")
        del turns[-1], crcs[-1]
    return turns[-1].last if turns else 0


def readable_again(doc: dict, kept: list[Turn]) -> list[Turn]:
    """The sidecar's turns after the `kept` ones (a load's valid prefix) whose own checks hold, so that
    their text is as it was saved although their records were dropped (damaged, cut short): whole
    exchanges of messages and answers, which the chat program reads again (prefills) from their text
    rather than lose them. None from a format-1 sidecar, whose texts carry no checksum."""
    if doc.get("format") == 1:
        return []
    listed, _, _ = parse_turns(doc)
    rest = listed[len(kept):]
    while rest and rest[-1].role != "assistant":  # a message alone is no exchange
        rest.pop()
    roles = [t.role for t in rest]
    if roles[0::2] != ["user"] * len(roles[0::2]) or roles[1::2] != ["assistant"] * len(roles[1::2]):
        return []
    return rest


# --prune-kv's mark: the time a sidecar's KV file was removed to free its space (all its turns can be read again)
PRUNED = "pruned"


def kv_gone(doc: dict, listed: list[Turn], unread: list[Turn]) -> str | None:
    """How a sidecar's KV file went, where it is not there and every turn listed is read again from its
    text, so nothing is lost: "was pruned" (marked so by --prune-kv), else "is not there"; None otherwise."""
    if not unread or len(unread) < len(listed):
        return None
    return "was pruned" if doc.get(PRUNED) else "is not there"


def mark_pruned(path: str, doc: dict, when: float) -> None:
    """Write the sidecar `doc` at `path` again with the mark of --prune-kv (before its KV file goes, at
    `when`: the store's clock); its "check" is computed anew only if it held (a damaged one is not made
    to look sound)."""
    intact = doc.get("check") == doc_check(doc)
    doc = {**doc, PRUNED: iso_time(when)}
    if intact:
        doc["check"] = doc_check(doc)
    write_document(path, doc)
