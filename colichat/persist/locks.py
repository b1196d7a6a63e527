"""The locks of a session's files.

NAME.lock is the writer's lock: one colichat has a session open for writing (`take_lock`, flock
LOCK_EX on the file, which holds its pid for the refusal another colichat prints; `release_lock`;
`remove_lock` when its conversation goes, so that no empty NAME.lock stays), and `lock_holder`
looks, before a long start, whether another has it. The KV file's own flock orders a save
(LOCK_EX, `flock_for_save`) and a read without the session's lock (LOCK_SH, `reading`): such a
read sees the session whole.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time

from .kvfile import SessionError, check_writable, open_file, oserror_text
from .names import remake_directory


class SessionBusy(SessionError):
    """The session's lock is held by another colichat (or another Session in this process)."""


def take_lock(path: str, name: str) -> int:
    """flock NAME.lock (made if missing) and write our pid in it.

    The holder removes the file when its conversation goes (`remove_lock`); a lock taken on a file
    removed meanwhile (opened before the removal, flocked after it) guards nothing, so it is taken
    again on the file now at that name. The descriptor is closed on every failure. The pid is
    informational (it names the holder in the refusal another colichat prints), so failing to write
    it, on a full disk say, keeps the lock."""
    for _ in range(8):
        fd = _flock(path, name)
        try:
            if _names(path, fd):
                break
        except OSError as e:
            os.close(fd)
            raise SessionError(f"cannot lock session {name}: {oserror_text(e)}") from None
        os.close(fd)
    else:
        raise SessionError(f"cannot lock session {name}: its lock file {path} is removed again and again")
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass
    return fd


def _names(path: str, fd: int) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        cur, st = os.lstat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino)


def remove_lock(fd: int, path: str) -> None:
    """Release the writer's lock held as `fd` and remove its file NAME.lock (`path`): the conversation
    is gone (deleted, renamed, never saved or emptied). Removed while held, so a colichat waiting for
    it finds the name free (take_lock takes a lock on a new file); a file not this lock's is left."""
    with contextlib.suppress(OSError):
        if _names(path, fd):
            os.unlink(path)
    release_lock(fd)


def _flock(path: str, name: str) -> int:
    """NAME.lock (`path`) open and flocked, exclusive, without waiting; SessionBusy where another holds it."""
    fd = open_file(path, "lock file", os.O_RDWR | os.O_CREAT)
    check_writable(fd, path, "lock file", f"remove it (rm '{path}'); colichat makes a new one")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        try:
            pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
        except OSError:
            pid = "?"
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise SessionBusy(f"session {name} is open in another colichat (pid {pid})") from None
        raise SessionError(f"cannot lock session {name}: {oserror_text(e)}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def relock(fd: int, path: str, name: str) -> int:
    """The writer's lock to hold from now on: `fd` while NAME.lock (`path`) is still its file; if that
    was removed or replaced, our flock guards nothing: the new file's, taken, and `fd` released."""
    st = os.fstat(fd)
    try:
        cur = os.lstat(path)
        if (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino):
            return fd
    except FileNotFoundError:
        pass
    new = take_lock(path, name)
    release_lock(fd)
    return new


def lock_holder(path: str) -> str | None:
    """The pid (as text, "?" if unknown) of the colichat holding the lock file `path`, or None if none
    does: a look before a long start (the model's load) that `take_lock` may well refuse afterwards. It is
    no lock: `take_lock` decides, and a session found free here can be taken before then. It takes nothing
    from a holder, nor keeps anyone from taking the lock: a file without a pid in it is free (`take_lock`
    writes its pid once it holds the lock, `release_lock` empties the file), and only one with a pid, which
    a holder killed outright leaves, is flocked, shared and without waiting, to tell which it is."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None  # no lock file (or none we can read: taking the lock says why)
    try:
        pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        if not pid:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            return pid if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) else None
        return None  # (closing the descriptor releases the flock)
    except OSError:
        return None
    finally:
        os.close(fd)


def release_lock(fd: int) -> None:
    try:
        os.ftruncate(fd, 0)
    except OSError:
        pass
    try:
        os.close(fd)  # closing the descriptor releases the flock (also when close reports an error)
    except OSError:
        pass


def flock_quietly(fd: int, op: int) -> None:
    """flock the KV file (a read without the session's lock: LOCK_SH, waiting for a save under way;
    LOCK_UN); where the file system has no locks, the read goes on unlocked."""
    try:
        fcntl.flock(fd, op)
    except OSError:
        pass


SAVE_WAITS_FOR_A_READ = 10.0  # seconds; then the save goes on (a reader stopped with Ctrl-Z must not stop it)


def flock_for_save(fd: int) -> None:
    """flock(LOCK_EX) on the KV file for a save, waiting for a read under way (`reading`)
    at most SAVE_WAITS_FOR_A_READ seconds: a save never hangs on a stopped reader, whose own checks
    then drop what it read halfway (the state before this lock existed)."""
    deadline = time.monotonic() + SAVE_WAITS_FOR_A_READ
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or time.monotonic() > deadline:
                return  # no locks on this file system, or a reader that does not finish: go on
        time.sleep(0.01)


@contextlib.contextmanager
def reading(fd: int, path: str, name: str):
    """A read of session NAME's KV file (open as `fd`, named `path`) without the session's lock
    (--no-save, --export, a read-only file system): the file's flock held shared while reading, so
    that a save under way in a colichat that has the session open (`flock_for_save`) ends first, and
    saves wait for the read. A file replaced meanwhile (written again by its colichat) is opened again
    by its name under the same descriptor `fd`; one removed or renamed meanwhile is refused."""
    for _ in range(8):
        flock_quietly(fd, fcntl.LOCK_SH)
        st = os.fstat(fd)
        try:
            cur = os.lstat(path)
        except FileNotFoundError:
            raise SessionError(f"session {name} was removed or renamed while it was read") from None
        if (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino):
            break
        new = open_file(path, "session file", os.O_RDONLY)  # written again by its colichat
        os.dup2(new, fd, inheritable=False)  # (the old file closed, and its flock with it)
        os.close(new)
    else:
        raise SessionError(f"session {name} was replaced again and again while it was read")
    try:
        yield
    finally:
        flock_quietly(fd, fcntl.LOCK_UN)


def relocked(fd: int, directory: str, name: str) -> tuple[bool, int]:
    """Session NAME's directory and lock file made again where they went (a removed directory took both):
    (whether the directory was made again, the lock's descriptor)."""
    gone = remake_directory(directory, name)
    return gone, relock(fd, os.path.join(directory, name + ".lock"), name)
