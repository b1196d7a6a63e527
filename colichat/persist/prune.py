"""`colichat --prune-kv DAYS`: the disk space of conversations not used for DAYS days, reclaimed without
losing a word. The KV file (the large one) of each goes; its sidecar, which holds every turn's text
with checksums, stays, and reopening the conversation reads its exchanges again from that text (a
prefill, said in one plain line), after which its next answer writes the KV file anew (FORMAT.md).

It lists what it will free and asks first (terminal/one_shot.py), unless --yes or stdin is not a terminal; DAYS 0
keeps the last hour's conversations unless --all. Only a conversation whose every turn can be read
again is pruned: a sidecar whose turns all pass their checks, messages and answers in turn (not an
imported cache, not an older colichat's sidecar without text checksums). One open in a running
colichat is left as it is. The sidecar is marked "pruned" before the KV file goes, so that reopening
tells a pruned conversation from a damaged one.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass

from ..units import count, format_size
from .kvfile import SessionError, fsync_dir
from .listing import SessionInfo
from .locks import release_lock, take_lock
from .sidecar import document, mark_pruned, parse_turns
from .store import Store


def readable_again_whole(sidecar: str) -> bool:
    """Whether every turn the sidecar lists can be read again from its text: all pass their checks, and
    they are whole exchanges (a message, then its answer)."""
    try:
        with open(sidecar, "rb") as f:
            doc = document(f.read())
    except OSError:
        return False
    if not isinstance(doc, dict) or doc.get("format") == 1 or not isinstance(doc.get("turns"), list):
        return False
    turns, _, warning = parse_turns(doc)
    roles = [t.role for t in turns]
    return (warning is None and bool(turns) and len(turns) == len(doc["turns"])
            and roles == ["user", "assistant"] * (len(roles) // 2) and len(roles) % 2 == 0)


RECENT_S = 3600  # --prune-kv 0 keeps the conversations used this long ago or less, unless --all


@dataclass(frozen=True)
class Choice:
    """What --prune-kv would free: one conversation's KV file, or why it is kept."""

    info: SessionInfo
    size: int  # the KV file's bytes
    kept: str | None = None  # why it is not pruned (then it is said, not freed)


def choose(store: Store, days: float, now: float | None = None, everything: bool = False) -> list[Choice]:
    """The conversations (of every model) last used more than `days` ago, each with its KV file's size, or
    why it is kept. DAYS 0 keeps the last hour's (`RECENT_S`: a conversation just used is likely to be used
    again) unless `everything` (--all)."""
    now = store.clock() if now is None else now
    cutoff = now - max(days * 86400, 0 if everything or days else RECENT_S)
    found = []
    for info in store.list():
        try:
            st = os.lstat(info.path)
        except OSError:  # already pruned, or never written
            continue
        if info.damage or info.last_used > cutoff or not stat.S_ISREG(st.st_mode):
            continue
        readable = readable_again_whole(str(info.path.with_suffix(".json")))
        found.append(Choice(info, st.st_size, None if readable else "its saved text cannot all be read again"))
    return found


def listed(choices: list[Choice], now: float | None = None) -> list[str]:
    """What --prune-kv will free, one line a conversation, before it asks."""
    return [f"  {c.info.model}: {c.info.describe(now)}" + (f" (kept: {c.kept})" if c.kept else "")
            for c in choices]


def prune_kv(choices: list[Choice], days: float) -> list[str]:
    """Remove the KV files chosen (those not `kept`): the sidecar is marked pruned first (sidecar.mark_pruned),
    then the KV file goes, under the writer's lock; the lines that say what was done."""
    freed, pruned, lines = 0, 0, []
    for c in choices:
        info = c.info
        kv, sidecar = str(info.path), str(info.path.with_suffix(".json"))
        if c.kept:
            lines.append(f"kept {info.name}'s KV file: {c.kept}")
            continue
        try:
            lock = take_lock(os.path.join(os.path.dirname(kv), info.name + ".lock"), info.name)
        except SessionError as e:  # (SessionBusy: open in a running colichat)
            lines.append(f"kept {info.name}'s KV file: {e}")
            continue
        try:
            with open(sidecar, "rb") as f:
                mark_pruned(sidecar, document(f.read()), time.time())
            os.unlink(kv)
            fsync_dir(os.path.dirname(kv))
        except OSError as e:
            lines.append(f"kept {info.name}'s KV file: {e.strerror or e}")
            continue
        finally:
            release_lock(lock)
        freed, pruned = freed + c.size, pruned + 1
    lines.append(f"freed {format_size(freed)}: the KV files of {count(pruned, 'conversation')} not used for "
                 f"{days:g} days (their text stays; reopening one reads it again)")
    return lines
