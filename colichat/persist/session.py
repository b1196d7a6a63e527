"""A session: NAME.coli_kv (the records) + NAME.json (the sidecar, sidecar.py) + NAME.lock (the
writer's lock, locks.py), open for writing.

    sess = Session.create(directory, name, ident, layout, sampler=None)   # new, empty, locked
    sess = Session.open(directory, name, ident, layout)                   # existing, locked
    res = sess.load(cache, ctx_limit=None, detokenize=None)               # -> LoadResult (loading.py)
    sess.append(cache, turns, keep=None)  # save the turns not yet on disk; keep=k: in place of those after k
    sess.truncate(n_turns)        # keep the first n_turns turns (rewind)
    sess.fork(new, cache, turns, branch)   # its first exchanges into `new` (claimed), copied from its file
    sess.close()                  # or use the session as a context manager

Turns tile the records (turn 0 from record 0, each from the previous one's end); a turn handed in is
any object with role, text, first, last. Saving follows FORMAT.md: records, nrec, then an atomic
sidecar replace (a replace stages its records first: pending.py). `load` writes only what a commit
promised (pending.py); what it drops stays on disk until the next `append` or `truncate` (loading.py
holds those rules). A user-facing failure is a SessionError of one line; ValueError is a caller bug.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from typing import Callable

from ..units import count
from .kvfile import (
    HEADER_SIZE,
    CacheLayout,
    SessionError,
    changed_since_open,
    check_writable,
    copy_bytes,
    create_kv,
    create_kv_in_place,
    cut_to,
    fsync_dir,
    open_file,
    oserror_text,
    write_nrec,
    write_records,
)
from .loading import LoadResult, Source, load, load_text_only, saved_rope_factors, what_opens
from .locks import flock_for_save, flock_quietly, reading, release_lock, relocked, remove_lock, take_lock
from .names import (
    KV_EXT,
    SIDECAR_EXT,
    holds_conversation,
    remove_files,
    remove_leftovers,
    unlink_quietly,
)
from .pending import Pending
from .sidecar import Turn, iso_time, session_document, turn_crc, write_document


class SaveFailed(SessionError):
    """Writing a session failed (a full disk, an I/O error): `what` says what could not be written and
    why; the message adds what becomes of it (a conversation's own saves retry, a /save copy does not)."""

    def __init__(self, what: str, then: str):
        super().__init__(f"{what}; {then}")
        self.what = what


class Session:
    """One open session, holding its writer lock until `close`."""

    def __init__(self, directory: str, name: str, ident: dict, layout: CacheLayout, lock_fd: int | None,
                 clock: Callable[[], float] = time.time):
        self.clock = clock  # epoch seconds: the sidecar's times (the store's, injectable)
        self.directory, self.name, self.ident, self.layout = str(directory), name, dict(ident), layout
        self.kv_path = os.path.join(self.directory, name + KV_EXT)
        self.json_path = os.path.join(self.directory, name + SIDECAR_EXT)
        self._lock_fd, self._kv_fd = lock_fd, None  # (the KV file's, once open: int)
        self.turns: list[Turn] = []  # what is on disk and valid
        self._crcs: list[int] = []
        self.nrec = 0  # records covered by self.turns
        self.sampler: dict = {}  # saved with every sidecar write
        self.created = iso_time(clock())
        self.parent: str | None = None  # a fork's: the conversation it was forked from (saved in the sidecar)
        self.branch: int | None = None  # and the exchanges of it it began with
        self.emptied = False  # /reset emptied it in place: a conversation still, with no exchange (FORMAT.md)
        self._has_sidecar = False
        self._loaded = False  # state known (created, or loaded): needed before saving
        self._cache = None  # the cache last loaded or saved from: what a rewrite copies
        self._unread_entries: list[dict] = []  # LoadResult.unread's: listed on until an append saves them again
        self._pending: Pending | None = None  # what the sidecar committed and the file does not show yet
        self._text_only, self._kv_damage = False, None  # opened from its sidecar alone (no KV file it can read): why
        self.notes: list[str] = []  # things a save did that the user should hear of (caller drains)

    # ---- opening ---------------------------------------------------------------------------

    @classmethod
    def claim(cls, directory, name: str, ident: dict, layout: CacheLayout,
              sampler: dict | None = None, clock: Callable[[], float] = time.time) -> Session:
        """A new empty session that holds its lock but has no files yet: the first save creates them
        (so a name given at start is ours before the first answer, and quitting leaves no session).

        FileExistsError if NAME holds a conversation. What an interrupted create leaves (a session
        with no records and no turns) is not a conversation: it is replaced."""
        base = os.path.join(str(directory), name)
        if holds_conversation(base):  # before locking: the holder of an existing session may have the lock
            raise FileExistsError(errno.EEXIST, "session exists", name)
        s = cls(directory, name, ident, layout, take_lock(base + ".lock", name), clock)
        try:
            if holds_conversation(base):  # again, under the lock
                raise FileExistsError(errno.EEXIST, "session exists", name)
            with contextlib.suppress(OSError):  # (what no conversation leaves: no token id of it lingers)
                remove_leftovers(base)
        except BaseException:
            s.close()
            raise
        s.sampler = dict(sampler or {})
        s._loaded = True
        return s

    @classmethod
    def create(cls, directory, name: str, ident: dict, layout: CacheLayout,
               sampler: dict | None = None, clock: Callable[[], float] = time.time) -> Session:
        """A new empty session: all its files, or (on any error) none of them and the lock released."""
        s = cls.claim(directory, name, ident, layout, sampler, clock)
        try:
            s._create_files()
        except BaseException:
            s.close()
            raise
        return s

    @classmethod
    def open(cls, directory, name: str, ident: dict, layout: CacheLayout, read_only: bool = False,
             clock: Callable[[], float] = time.time) -> Session:
        """An existing session, locked for writing; `load` it before saving to it. `read_only`
        (--no-save, a read-only file system): not locked (another colichat may have it open), the
        file opened for reading, and `load` reads it between two saves of that colichat
        (locks.reading); saving to it fails."""
        base = os.path.join(str(directory), name)
        text_only, damage = what_opens(base, f"no session named {name} for this model (/sessions lists them)")
        s = cls(directory, name, ident, layout, None if read_only else take_lock(base + ".lock", name), clock)
        try:
            if text_only or damage:  # its KV file deleted (it is the large one), or broken: the text is read again
                s._text_only, s._kv_damage = True, damage
            elif read_only:
                s._kv_fd = open_file(s.kv_path, "session file", os.O_RDONLY)
            else:
                fd = open_file(s.kv_path, "session file", os.O_RDWR)
                check_writable(fd, s.kv_path, "session file")
                s._kv_fd = fd
        except BaseException:
            s.close()
            raise
        return s

    @property
    def on_disk(self) -> bool:
        """Whether the session's files exist (a claimed session has none until its first save)."""
        return self._kv_fd is not None

    def close(self) -> None:
        if self._kv_fd is not None:
            fd, self._kv_fd = self._kv_fd, None
            with contextlib.suppress(OSError):  # everything was fsynced: an error closing loses nothing
                os.close(fd)
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            if any(os.path.lexists(p) for p in (self.kv_path, self.json_path)):
                release_lock(fd)
            else:  # no conversation on disk (never saved, emptied): no lock file either
                remove_lock(fd, os.path.join(self.directory, self.name + ".lock"))

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- loading ---------------------------------------------------------------------------

    def load(self, cache, ctx_limit: int | None = None, detokenize=None, exchanges: bool = False,
             ctx_most: int | None = None) -> LoadResult:
        """Fill `cache` with what the files keep (loading.load: the arguments, and every rule of what
        a damaged session keeps) and go on from it: the next save writes after the turns kept. A
        session opened read-only is read between two saves of a colichat that has it open
        (locks.reading)."""
        src = Source(self.directory, self.name, self.ident, self.layout)
        if self._text_only:
            res = load_text_only(src, self._kv_damage, cache, ctx_limit, ctx_most)
        elif self._kv_fd is None:
            raise ValueError(f"session {self.name} is closed")
        else:
            with reading(self._kv_fd, self.kv_path, self.name) if self._lock_fd is None \
                    else contextlib.nullcontext():
                res = load(src, self._kv_fd, cache, ctx_limit, detokenize, exchanges, ctx_most)
        self.turns, self._crcs, self.nrec = list(res.turns), list(res.crcs), res.tokens
        self._cache, self.layout, self._has_sidecar = cache, res.layout, res.sidecar
        if res.sidecar:
            self.sampler, self.created = dict(res.sampler), res.created or iso_time(self.clock())
            self.parent, self.branch, self.emptied = res.parent, res.branch, res.emptied
        else:
            res.sampler = dict(self.sampler)
        if res.text_only:
            self._text_only, self._kv_damage = True, res.kv_damage
        self._unread_entries = list(res.unread_entries)
        self._loaded = True
        self._pending = res.pending if self._lock_fd is not None else None  # ours to finish (pending.py)
        if self._pending and not (res.warnings or res.unread):  # now (damage waits for the next save)
            with contextlib.suppress(OSError, SessionError), self._saving():  # (else before the next write)
                self._check_files(self.turns, self._crcs)
        return res

    def saved_rope_factors(self) -> str | None:
        """The rope factors the session's cache rows were rotated with (loading.saved_rope_factors)."""
        return saved_rope_factors(Source(self.directory, self.name, self.ident, self.layout))

    # ---- saving ----------------------------------------------------------------------------

    def append(self, cache, turns: list[Turn], sampler: dict | None = None, keep: int | None = None) -> None:
        """Save the turns not yet on disk: writes records [self.nrec, turns[-1].last) and the sidecar
        (with `sampler`, the settings from now on, when given).

        `turns` is either the whole conversation (starting at record 0, its head equal to
        `self.turns`) or just the new turns (starting at `self.nrec`). Passing the whole list is
        simplest: after a failed save (SessionError: disk full, I/O error) the next call retries the
        unsaved turns. A failed save leaves the cache untouched and the disk at the previous save.

        `keep` (with the whole conversation): the session keeps only its first `keep` saved turns, and
        the turns after them take the place of the others (/regen) in one commit (pending.py: a crash
        leaves the one or the other, never less). With no turn after them it is `truncate(keep)`.
        """
        self._require_loaded()
        self.layout.check_cache(cache)
        if sampler is not None:
            self.sampler = dict(sampler)
        turns = [Turn(t.role, t.text, t.first, t.last) for t in turns]  # any object with these fields
        keep = len(self.turns) if keep is None else min(keep, len(self.turns))
        replacing = keep < len(self.turns)
        if replacing or self.turns and turns and turns[0].first == 0:
            if turns[:keep] != self.turns[:keep] or turns and turns[0].first != 0:
                raise ValueError("the turn list does not start with the saved turns it keeps")
            if len(turns) <= keep:
                return self.truncate(keep) if replacing else None
            turns = turns[keep:]
        if not turns:
            return
        prev = start = (self.turns[keep - 1].last if keep else 0) if replacing else self.nrec
        for t in turns:
            if t.first != prev or not t.first <= t.last:
                raise ValueError(f"turn {t.role!r} [{t.first}, {t.last}) does not start at record {prev}")
            prev = t.last
        if prev > cache.length:
            raise ValueError(f"turns end at record {prev}, past the cache length {cache.length}")
        crcs = [turn_crc(cache, t) for t in turns]
        self._cache = cache
        if self._text_only:  # a new KV file first; the sidecar stays until replaced (a crash after the rename
            # leaves it listing turns past the file's records, which reopening reads again)
            try:
                _, self._lock_fd = relocked(self._lock_fd, self.directory, self.name)
                fd = create_kv_in_place(self.directory, self.kv_path, self.layout)
            except OSError as e:
                raise SaveFailed(f"could not save session {self.name}: {oserror_text(e)}",
                                 "the conversation is still in memory (free some space; the next save retries)") \
                    from None
            if self._kv_fd is not None:  # the broken file this one replaced
                with contextlib.suppress(OSError):
                    os.close(self._kv_fd)
            self._kv_fd, self._text_only, self._kv_damage = fd, False, None
        if not self.on_disk:  # the first save: the session appears whole or not at all
            _, self._lock_fd = relocked(self._lock_fd, self.directory, self.name)
            self._create_files(cache, turns, crcs)
            return
        staged = None
        try:
            with self._saving():
                self._check_files(self.turns[:keep], self._crcs[:keep])  # (written again: it holds those)
                if not self._has_sidecar:  # an imported cache: record its state before touching the file
                    self._write_sidecar(self.turns, self._crcs)
                if keep == len(self.turns):  # after the saved turns: records, nrec (the commit), sidecar
                    write_records(self._kv_fd, self.nrec, cache.raw(self.nrec, prev), self.layout.record_bytes)
                    write_nrec(self._kv_fd, prev)
                    self._write_sidecar(self.turns + turns, self._crcs + crcs)
                else:  # in place of saved turns: staged past both conversations, then the sidecar (the commit)
                    staged = Pending(max(self.nrec, prev), start)
                    write_records(self._kv_fd, staged.staged_at, cache.raw(start, prev), self.layout.record_bytes)
                    self._write_sidecar(self.turns[:keep] + turns, self._crcs[:keep] + crcs,
                                        staged=[staged.staged_at, start])
        except OSError as e:
            raise SaveFailed(f"could not save session {self.name}: {oserror_text(e)}",
                             "the conversation is still in memory but its last turn may not be on disk "
                             "(free some space; the next save retries)") from None
        self.turns, self._crcs = self.turns[:keep] + turns, self._crcs[:keep] + crcs
        self.nrec, self._unread_entries = prev, []  # (the conversation that read them again is saved now)
        self.emptied = False  # (it has exchanges again)
        if staged:  # saved: the records go in place now, or (after an error) before the next write
            self._pending = staged
            with contextlib.suppress(OSError, SessionError), self._saving():
                self._check_files(self.turns, self._crcs)

    def fork(self, new: Session, cache, turns: list[Turn], branch: int) -> bool:
        """Save `turns`, this conversation's first `branch` exchanges, into `new` (claimed, no files yet):
        its fork. Where this session's KV file holds them as saved (the bytes the cache holds), the new
        file's header and records are copied from it (`copy_bytes`), else written from `cache`; the
        sidecar names this session as the parent. True if copied. A failure leaves no file of `new`."""
        new.parent, new.branch = self.name, branch
        turns = [Turn(t.role, t.text, t.first, t.last) for t in turns]
        n, k = turns[-1].last, len(turns)
        try:
            saved = self.on_disk and not self._text_only and self._pending is None and self.turns[:k] == turns \
                and os.fstat(self._kv_fd).st_size >= HEADER_SIZE + n * self.layout.record_bytes
        except OSError:
            saved = False
        if not saved:
            new.append(cache, turns)
            return False
        new._create_files(cache, turns, self._crcs[:k], source=self._kv_fd)
        new._cache = cache
        return True

    def truncate(self, n_turns: int, sampler: dict | None = None, keep_files: bool = False) -> None:
        """Keep the first n_turns saved turns: the sidecar (with `sampler`, the settings from now on; its
        "cut" mark, pending.py), then nrec, then the KV file cut to its records. Once the sidecar is
        replaced the turns it no longer lists are gone for good. More turns than are saved (after a failed
        save) keeps them all. Cut to no turn, the files go (no exchange is no saved conversation), unless
        `keep_files` (/reset: emptied in place, its sidecar "emptied": listed, reopened with its codec)."""
        self._require_loaded()
        if sampler is not None:
            self.sampler = dict(sampler)
        if n_turns < 0:
            raise ValueError(f"cannot keep {n_turns} turns")
        unread = self._unread_entries[: max(0, n_turns - len(self.turns))]  # those still in the conversation
        n_turns = min(n_turns, len(self.turns))
        turns, crcs = self.turns[:n_turns], self._crcs[:n_turns]
        n = turns[-1].last if turns else 0
        self.emptied = (keep_files or self.emptied) and not (turns or unread)  # (a reset's retry keeps it)
        if self.branch:  # a fork cut below its branch point begins with fewer exchanges; cut to none, it is no fork
            self.branch = min(self.branch, sum(t.role == "user" for t in turns)
                              + sum(isinstance(e, dict) and e.get("role") == "user" for e in unread)) or None
            self.parent = self.parent if self.branch else None
        if self._text_only:  # no records: the sidecar lists what is still in the conversation
            self._unread_entries = unread
            try:
                if unread or self.emptied:
                    self._write_sidecar([], [], unread)
                else:
                    os.unlink(self.json_path)  # (a conversation rewound to nothing is no conversation)
            except OSError as e:
                raise SessionError(f"could not save session {self.name}: {oserror_text(e)}") from None
            return
        if self._kv_fd is None:  # claimed, nothing saved yet: nothing to cut
            return
        with self._saving():
            try:
                rewritten = self._check_files(turns, crcs)
                self._write_sidecar(turns, crcs, unread, **({"cut": self.nrec} if self.nrec > n else {}))
                # committed: an error now leaves records no turn covers (dropped by a load), and a retry
                # or the next append writes nrec again
                self.turns, self._crcs, self.nrec, self._unread_entries = turns, crcs, n, unread
                if not rewritten:
                    write_nrec(self._kv_fd, n)
                    cut_to(self._kv_fd, n, self.layout.record_bytes)
            except OSError as e:
                raise SessionError(f"could not save session {self.name}: {oserror_text(e)}") from None
            # cut to no turn, it is no conversation (holds_conversation): its files go, the lock stays, and
            # the next save creates them again, as after a claim (files that cannot be removed stay, empty)
            if not (turns or unread or self.emptied) and remove_files(self.directory, self.json_path, self.kv_path):
                fd, self._kv_fd = self._kv_fd, None
                with contextlib.suppress(OSError):
                    os.close(fd)
                self._has_sidecar, self.created = False, iso_time(self.clock())

    def save_sampler(self, sampler: dict) -> None:
        """Record new sampler settings now (they are also saved with every append)."""
        self._require_loaded()
        old, self.sampler = self.sampler, dict(sampler)
        if self._kv_fd is None and not self._text_only:  # claimed, nothing saved yet: the first save writes them
            return
        try:
            with self._saving():
                if not self._text_only:  # (else no records: the sidecar alone)
                    self._check_files(self.turns, self._crcs)
                self._write_sidecar(self.turns, self._crcs, self._unread_entries)
        except OSError as e:
            self.sampler = old
            raise SessionError(f"could not save session {self.name}: {oserror_text(e)}") from None

    def _require_loaded(self) -> None:
        if self._lock_fd is None:
            raise ValueError(f"session {self.name} is closed")
        if not self._loaded:
            raise ValueError(f"session {self.name}: load() it before saving to it")

    @contextlib.contextmanager
    def _saving(self):
        """While a save changes the files: the KV file's flock, exclusive, so that a reader without
        the session's lock (locks.reading) sees the session before or after the save, never halfway."""
        if self._kv_fd is not None:
            flock_for_save(self._kv_fd)
        try:
            yield
        finally:
            if self._kv_fd is not None:  # (a file written again meanwhile: the old one's lock went with it)
                flock_quietly(self._kv_fd, fcntl.LOCK_UN)

    def _create_files(self, cache=None, turns: list[Turn] = (), crcs: list[int] = (),
                      source: int | None = None) -> None:
        """Write the session whole (the header, the records of `turns` from `cache`, or copied from the
        KV file open as `source` (a fork's: `copy_bytes`), nrec) under
        NAME.coli_kv.tmp, then the sidecar, then rename the KV file into place: until that rename
        NAME is no session (a sidecar beside NAME.coli_kv.tmp with no NAME.coli_kv is what an
        interrupted create leaves, see `interrupted_create`), after it the session is whole.

        A crash leaves at most that (replaced by the next create); an error removes everything this
        call made (we hold the lock, and the names were free when we took it), so the next save
        starts again from nothing."""
        tmp = self.kv_path + ".tmp"
        fd = None
        n = turns[-1].last if turns else 0
        try:
            remove_leftovers(os.path.join(self.directory, self.name))
            fd = create_kv(tmp, self.layout)
            if n and source is not None:  # its header and first records: the header's nrec is set next
                copy_bytes(source, fd, HEADER_SIZE + n * self.layout.record_bytes)
            elif n:
                write_records(fd, 0, cache.raw(0, n), self.layout.record_bytes)
            if n:
                write_nrec(fd, n)
            self._write_sidecar(list(turns), list(crcs))
            os.rename(tmp, self.kv_path)
            fsync_dir(self.directory)
            self._kv_fd, fd = fd, None
        except (OSError, SessionError) as e:
            if fd is not None:
                os.close(fd)
            removed = [unlink_quietly(p) for p in (tmp, self.json_path + ".tmp", self.json_path, self.kv_path)]
            if any(removed):
                with contextlib.suppress(OSError):
                    fsync_dir(self.directory)
            why = oserror_text(e) if isinstance(e, OSError) else str(e)
            raise SaveFailed(f"could not create session {self.name}: {why}",
                             "nothing was written (free some space; the next save retries)") from None
        self.turns, self._crcs, self.nrec = list(turns), list(crcs), n

    def _check_files(self, turns: list[Turn], crcs: list[int]) -> bool:
        """Before a save: if another program removed, replaced, hard-linked or cut short this session's
        files since they were opened, write the KV file again, holding `turns`, from the cache (and take
        the lock again if its file went, and the directory if it went). True if it did (with a note
        saying so). Else what a commit promised the file and did not do yet is done first (pending.py)."""
        gone, self._lock_fd = relocked(self._lock_fd, self.directory, self.name)
        what = changed_since_open(self._kv_fd, self.kv_path, self.nrec * self.layout.record_bytes)
        if what is None:
            if self._pending is not None:
                self._pending.finish(self._kv_fd, self.nrec, self.layout.record_bytes,
                                     lambda cut: self._write_sidecar(self.turns, self._crcs, self._unread_entries,
                                                                     cut=cut))
                self._pending = None
            return False
        self._pending = None  # (the file is written again whole)
        what = "removed with its directory" if gone and what == "removed" else what
        n = turns[-1].last if turns else 0
        if n and (self._cache is None or self._cache.length < n
                  or any(turn_crc(self._cache, t) != c for t, c in zip(turns, crcs, strict=True))):
            raise SessionError(f"the KV file of session {self.name} was {what} by another program, and "
                               "the conversation in memory no longer holds what was saved")
        tmp = self.kv_path + ".tmp"
        if os.path.lexists(tmp):
            os.unlink(tmp)
        try:
            fd = create_kv(tmp, self.layout)
        except BaseException:
            unlink_quietly(tmp)
            raise
        try:
            flock_for_save(fd)  # a reader that opens it by its name waits for the save to end
            write_records(fd, 0, self._cache.raw(0, n) if n else memoryview(b""), self.layout.record_bytes)
            write_nrec(fd, n)
            os.replace(tmp, self.kv_path)
        except BaseException:
            os.close(fd)
            unlink_quietly(tmp)
            raise
        old, self._kv_fd = self._kv_fd, fd
        self.turns, self._crcs, self.nrec = list(turns), list(crcs), n
        with contextlib.suppress(OSError):  # the old file is gone from the directory; closing it is housekeeping
            os.close(old)
        self._has_sidecar = False  # the sidecar is written again before any new record
        fsync_dir(self.directory)
        self.notes.append(f"the KV file of session {self.name} was {what} by another program: "
                          f"wrote the session again from memory ({count(n, 'token')})")
        return True

    def _write_sidecar(self, turns: list[Turn], crcs: list[int], unread: list[dict] = (), **marks) -> None:
        """Atomically replace NAME.json (sidecar.write_document). `unread`: entries of turns whose
        records are lost, listed as they were after `turns`; `marks`: what the file does not show yet
        (pending.py: staged=[P, C], cut=R)."""
        fork = {"parent": self.parent, "branch": self.branch} if self.parent else {}  # (where it came from)
        emptied = {"emptied": True} if self.emptied and not (turns or unread) else {}
        write_document(self.json_path, session_document(
            {"model": self.ident, "layout": self.layout.to_json(), "created": self.created, "sampler": self.sampler,
             **fork, **emptied, **marks}, iso_time(self.clock()), turns, crcs, unread))
        self._has_sidecar = True

