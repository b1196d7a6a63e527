"""`colichat --prune-kv DAYS`: the disk space of conversations not used for DAYS days, reclaimed without
losing a word. The KV file (the large one) of each goes; its sidecar, which holds every turn's text
with checksums, stays, and reopening the conversation reads its exchanges again from that text (a
prefill, said in a note), after which its next answer writes the KV file anew (FORMAT.md).

Only a conversation whose every turn can be read again is pruned: a sidecar whose turns all pass
their checks, messages and answers in turn (not an imported cache, not an older colichat's sidecar
without text checksums). One open in a running colichat is left as it is.
"""

from __future__ import annotations

import os

from .persist import SessionError, Store
from .persist.kvfile import fsync_dir
from .persist.locks import release_lock, take_lock
from .persist.sidecar import document, parse_turns
from .units import count, format_size


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


def prune_kv(store: Store, days: float, now: float | None = None) -> list[str]:
    """Remove the KV files of the conversations (of every model) last used more than `days` ago whose
    text can be read again; the lines that say what was done."""
    cutoff = (store.clock() if now is None else now) - days * 86400
    freed, pruned, lines = 0, 0, []
    for info in store.list():
        kv, sidecar = str(info.path), str(info.path.with_suffix(".json"))
        if info.damage or info.last_used > cutoff or not os.path.isfile(kv):
            continue
        if not readable_again_whole(sidecar):
            lines.append(f"kept {info.name}'s KV file: its saved text cannot all be read again")
            continue
        try:
            lock = take_lock(os.path.join(os.path.dirname(kv), info.name + ".lock"), info.name)
        except SessionError as e:  # (SessionBusy: open in a running colichat)
            lines.append(f"kept {info.name}'s KV file: {e}")
            continue
        try:
            size = os.lstat(kv).st_size
            os.unlink(kv)
            fsync_dir(os.path.dirname(kv))
        except OSError as e:
            lines.append(f"kept {info.name}'s KV file: {e.strerror or e}")
            continue
        finally:
            release_lock(lock)
        freed, pruned = freed + size, pruned + 1
    lines.append(f"freed {format_size(freed)}: the KV files of {count(pruned, 'conversation')} not used for "
                 f"{days:g} days (their text stays; reopening one reads it again)")
    return lines
