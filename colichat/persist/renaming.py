"""A /rename that a crash interrupted, finished: NEW.renaming names the old name while a rename is under
way (Store.rename links both files under the new name, then unlinks the old names). A crash between
the two leaves every file under both names (two hard links each, which colichat refuses to write
through); the next listing or opening of that directory sees the mark and finishes the rename, under
both names' locks, so that a rename under way in a running colichat is never touched.
"""

from __future__ import annotations

import contextlib
import os

from ..hints import read_hint
from .kvfile import SessionError, fsync_dir
from .locks import release_lock, take_lock

MARK_EXT = ".renaming"
SESSION_EXTS = (".coli_kv", ".json")


def mark(directory: str, new: str, old: str) -> None:
    """Before the links: NEW.renaming holds OLD (written whole, then the directory synced)."""
    path = os.path.join(directory, new + MARK_EXT)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, old.encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(directory)


def unmark(directory: str, new: str) -> None:
    """After the old names are gone (or the rename was undone): the mark goes; an error leaves it, and
    the next finish_renames removes it (its old name no longer shares the files)."""
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(directory, new + MARK_EXT))
        fsync_dir(directory)


def _same_file(a: str, b: str) -> bool:
    try:
        sa, sb = os.lstat(a), os.lstat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def finish_renames(directory: str) -> None:
    """Finish every rename a crash left in `directory`: the old names of files that are still linked
    under the new name go, then the mark. Never raises: what cannot be finished now (a name another
    colichat holds, a read-only file system) stays as it is, and is refused as before."""
    try:
        marks = [n[: -len(MARK_EXT)] for n in os.listdir(directory) if n.endswith(MARK_EXT)]
    except OSError:
        return
    for new in marks:
        old = read_hint(os.path.join(directory, new + MARK_EXT), lambda data: data.decode("utf-8"), 256).value
        if not old or "/" in old or old.startswith(".") or old == new:  # (not a name a rename writes)
            continue
        locks = []
        try:
            for name in (old, new):
                locks.append(take_lock(os.path.join(directory, name + ".lock"), name))
            for ext in SESSION_EXTS:
                base_old, base_new = os.path.join(directory, old + ext), os.path.join(directory, new + ext)
                if _same_file(base_old, base_new):
                    os.unlink(base_old)
            fsync_dir(directory)
            os.unlink(os.path.join(directory, new + MARK_EXT))
            fsync_dir(directory)
        except (OSError, SessionError):
            continue  # (SessionBusy: the rename is under way, or the session is open elsewhere)
        finally:
            for fd in locks:
                release_lock(fd)
