"""A session: NAME.coli_kv (the records) + NAME.json (the sidecar, sidecar.py) + NAME.lock (the
writer's lock, locks.py).

    sess = Session.create(directory, name, ident, layout, sampler=None)   # new, empty, locked
    sess = Session.open(directory, name, ident, layout)                   # existing, locked
    res = sess.load(cache, ctx_limit=None, detokenize=None)               # -> LoadResult
    sess.append(cache, turns)     # save the turns not yet on disk (see `append`)
    sess.truncate(n_turns)        # keep the first n_turns turns (rewind)
    sess.fork(new, cache, turns, branch)   # its first exchanges into `new` (claimed), copied from its file
    sess.close()                  # or use the session as a context manager

Turns tile the records: turn 0 starts at record 0 and each turn starts where the previous one ends.
A turn handed in may be any object with role, text, first, last; the session keeps its own copies.
Saving follows design.md section 3: new records in one write + fsync, then nrec + fsync, then an
atomic sidecar replace. `load` reads only; what it drops from a damaged session stays on disk until
the next `append` or `truncate`, which rewrite nrec and the sidecar to the kept prefix (FORMAT.md).
Every user-facing failure is a SessionError with a one-line message; ValueError means a caller bug.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import numpy as np

from ..paths import private_dir
from ..units import count
from .kvfile import (
    CODEC_OF_MAGIC,
    HEADER_SIZE,
    KIND_OF_MAGIC,
    CacheLayout,
    SaveFailed,
    SessionError,
    check_writable,
    create_kv,
    fsync_dir,
    lstat_regular,
    open_file,
    oserror_text,
    read_header,
    read_nrec_if_empty,
    read_records,
    unusable_header,
    write_nrec,
    write_records,
)
from .locks import flock_for_save, flock_quietly, release_lock, take_lock
from .sidecar import (
    Turn,
    doc_check,
    document,
    drop_unanswered,
    parse_turns,
    readable_again,
    span,
    turn_check,
    turn_crc,
)

# Tokens of context a reopened conversation has left at least, to go on with a short exchange: the
# size a refusal of too small a context asks for (more_context), and below which the chat says the
# context is nearly full (chat.FULL_BELOW).
REOPEN_ROOM = 16
FORMAT_VERSION = 2  # 2: a "check" CRC over the sidecar's settings, and one over each turn's fields
KV_EXT, SIDECAR_EXT = ".coli_kv", ".json"  # NAME.coli_kv holds the records, NAME.json the turns
MAX_SIDECAR_BYTES = 256 << 20
COPY_CHUNK = 8 << 20  # a fork's records copied by reads and writes: this many bytes at a time
# copy_file_range errors that mean "not here" (an old kernel, another file system, a special file): copy by hand
NO_COPY_RANGE = {errno.ENOSYS, errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EBADF}


@dataclass
class LoadResult:
    name: str
    tokens: int
    turns: list[Turn]
    elapsed_ms: float
    warnings: list[str] = field(default_factory=list)  # one line per thing dropped, and why
    sampler: dict = field(default_factory=dict)
    # the dropped turns whose text is intact (sidecar.readable_again): whole exchanges, after `turns`
    unread: list[Turn] = field(default_factory=list)

    def summary(self) -> str:
        """The line the chat program prints to stderr after a resume."""
        return (f"resumed {count(self.tokens, 'token')}, {count(len(self.turns), 'turn')} from {self.name} "
                f"in {self.elapsed_ms:.0f} ms, no re-prefill")


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def more_context(name: str, n: int, ctx: int, most: int | None = None) -> str:
    """The refusal of session NAME's `n` tokens in a context of `ctx`, and what reopens it: the --ctx
    with room to go on (exactly `n` would reopen it full), where the model takes it (`most`: its
    trained context, when known), else the model's maximum, else nothing: --export reads it."""
    if most is None or n + REOPEN_ROOM <= most:
        return (f"session {name} holds {n} tokens, more than the context of {ctx}: start colichat with "
                f"--ctx {n + REOPEN_ROOM} or more to reopen it with room for an exchange")
    if n <= most:
        room = f"with room for {count(most - n, 'token')} more" if n < most else "full (/rewind makes room)"
        return (f"session {name} holds {n} tokens, more than the context of {ctx}: start colichat with "
                f"--ctx {most}, this model's maximum, to reopen it {room}")
    return (f"session {name} holds {n} tokens, more than this model's maximum context of {most}: it cannot "
            f"be reopened with this model; colichat --export {name} prints it, and a new conversation "
            "goes on without it")


def _unlink_quietly(path: str) -> bool:
    """Remove a file if it is there; True if something was removed. Errors are left to the caller's
    next step (a failed cleanup must not hide the error being reported)."""
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def copy_bytes(src: int, dst: int, size: int) -> None:
    """Bytes [0, size) of file `src` into `dst` at the same offsets: with copy_file_range where there
    is one (in the kernel; blocks shared where the file system can, as btrfs and XFS do), else, or for
    what it leaves, by reads and writes. OSError as any write's; EIO if `src` ends early."""
    done, copy_range = 0, getattr(os, "copy_file_range", None)
    while copy_range is not None and done < size:
        try:
            n = copy_range(src, dst, min(size - done, 1 << 30), done, done)
        except OSError as e:
            if e.errno not in NO_COPY_RANGE:
                raise
            n = 0
        if not n:
            break
        done += n
    while done < size:
        data = os.pread(src, min(size - done, COPY_CHUNK), done)
        if not data:
            raise OSError(errno.EIO, "the KV file it is copied from ended early")
        view = memoryview(data)
        while view:
            wrote = os.pwrite(dst, view, done)
            view, done = view[wrote:], done + wrote


def lineage(doc: dict) -> tuple[str | None, int | None]:
    """(parent, branch) of a fork, as its sidecar records them: the conversation it was forked from and
    the exchanges of it that it began with; (None, None) for one that is no fork, or whose document
    check fails (its settings, these with them, are not believed)."""
    parent, branch = doc.get("parent"), doc.get("branch")
    if not isinstance(parent, str) or not 0 < len(parent) <= 64 or type(branch) is not int or branch < 1 \
            or doc.get("check") != doc_check(doc):
        return None, None
    return parent, branch


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
    create (see `interrupted_create`) or an empty session: a KV file with no records, and no sidecar
    or one that lists no turns (what a rewind of every exchange leaves when its files cannot be
    removed, and older versions left). Such a name is no conversation: not listed, not reopened, and
    the next claim of it replaces the files. SessionError for a file that is a link or not regular."""
    if interrupted_create(base):
        return False
    kv = lstat_regular(base + ".coli_kv", "session file")
    side = lstat_regular(base + ".json", "sidecar")
    if kv is None:
        return side is not None
    if not read_nrec_if_empty(base + ".coli_kv"):
        return True
    if side is None:
        return False
    try:
        with open(base + ".json", "rb") as f:
            doc = document(f.read(MAX_SIDECAR_BYTES))
    except OSError:
        return True
    return not (isinstance(doc, dict) and doc.get("turns") == [])


class _SavedRecords:
    """A KV file's records in memory, as `load` reads them into a cache: enough for its checks (the
    CRCs and token ids are over the file's bytes), so a session's turns are checked without its model."""

    def __init__(self, layout: CacheLayout, capacity: int):
        self.kind, self.n_layer, self.codec = layout.kind, layout.n_layer, layout.codec
        self.a_width, self.b_width = layout.a_width, layout.b_width
        self.record_bytes, self.capacity, self.length = layout.record_bytes, capacity, 0
        self.stored_bytes = self.record_bytes
        self._buf = bytearray(capacity * self.record_bytes)
        self.tokens = np.ndarray((capacity,), "<i4", self._buf, strides=(self.record_bytes,))  # (N,) token ids

    def raw(self, start: int, stop: int) -> memoryview:
        return memoryview(self._buf)[start * self.record_bytes : stop * self.record_bytes]

    def set_length(self, n: int) -> None:
        self.length = n

    def set_codec(self, codec: str) -> None:
        assert codec == self.codec, "a saved-records buffer is made in its file's codec"

    def loaded(self, n: int) -> None:
        """(The checks are over the file's bytes: nothing to decode.)"""


def _saved_model(path: str) -> dict:
    """The sidecar's model entry (what it says it was saved with), {} if it cannot say: reading it
    for real refuses what is wrong with it."""
    try:
        with open(path, "rb") as f:
            doc = document(f.read(MAX_SIDECAR_BYTES))
    except OSError:
        return {}
    return doc["model"] if isinstance(doc, dict) and isinstance(doc.get("model"), dict) else {}


class Session:
    """One open session, holding its writer lock until `close`."""

    def __init__(self, directory: str, name: str, ident: dict, layout: CacheLayout, lock_fd: int | None):
        self.directory = str(directory)
        self.name = name
        self.ident = dict(ident)
        self.layout = layout
        self.kv_path = os.path.join(self.directory, name + KV_EXT)
        self.json_path = os.path.join(self.directory, name + SIDECAR_EXT)
        self._lock_fd = lock_fd
        self._kv_fd: int | None = None
        self._shared = False  # reading under the KV file's shared flock (`_reading`)
        self.turns: list[Turn] = []  # what is on disk and valid
        self._crcs: list[int] = []
        self.nrec = 0  # records covered by self.turns
        self.sampler: dict = {}  # saved with every sidecar write
        self.created = now_iso()
        self.parent: str | None = None  # a fork's: the conversation it was forked from (saved in the sidecar)
        self.branch: int | None = None  # and the exchanges of it it began with
        self._has_sidecar = False
        self._loaded = False  # state known (created, or loaded): needed before saving
        self._cache = None  # the cache last loaded or saved from: what a rewrite copies
        # the sidecar's entries of the turns a load dropped whose text is intact (LoadResult.unread): listed
        # on in every sidecar written until an append saves the conversation that read them again
        self._unread_entries: list[dict] = []
        self._text_only = False  # opened from its sidecar alone: no KV file, or none it can read (`_load_text_only`)
        self._kv_damage: str | None = None  # why not, when there is one
        self.notes: list[str] = []  # things a save did that the user should hear of (caller drains)

    # ---- opening ---------------------------------------------------------------------------

    @classmethod
    def claim(cls, directory, name: str, ident: dict, layout: CacheLayout,
              sampler: dict | None = None) -> Session:
        """A new empty session that holds its lock but has no files yet: the first save creates them
        (so a name given at start is ours before the first answer, and quitting leaves no session).

        FileExistsError if NAME holds a conversation. What an interrupted create leaves (a session
        with no records and no turns) is not a conversation: it is replaced."""
        base = os.path.join(str(directory), name)
        if holds_conversation(base):  # before locking: the holder of an existing session may have the lock
            raise FileExistsError(errno.EEXIST, "session exists", name)
        s = cls(directory, name, ident, layout, take_lock(base + ".lock", name))
        try:
            if holds_conversation(base):  # again, under the lock
                raise FileExistsError(errno.EEXIST, "session exists", name)
        except BaseException:
            s.close()
            raise
        s.sampler = dict(sampler or {})
        s._loaded = True
        return s

    @classmethod
    def create(cls, directory, name: str, ident: dict, layout: CacheLayout,
               sampler: dict | None = None) -> Session:
        """A new empty session: all its files, or (on any error) none of them and the lock released."""
        s = cls.claim(directory, name, ident, layout, sampler)
        try:
            s._create_files()
        except BaseException:
            s.close()
            raise
        return s

    @property
    def on_disk(self) -> bool:
        """Whether the session's files exist (a claimed session has none until its first save)."""
        return self._kv_fd is not None

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
            removed = [_unlink_quietly(p) for p in (tmp, self.json_path + ".tmp", self.json_path, self.kv_path)]
            if any(removed):
                try:
                    fsync_dir(self.directory)
                except OSError:
                    pass
            why = oserror_text(e) if isinstance(e, OSError) else str(e)
            raise SaveFailed(f"could not create session {self.name}: {why}",
                             "nothing was written (free some space; the next save retries)") from None
        self.turns, self._crcs, self.nrec = list(turns), list(crcs), n

    @classmethod
    def open(cls, directory, name: str, ident: dict, layout: CacheLayout, read_only: bool = False) -> Session:
        """An existing session, locked for writing; `load` it before saving to it. `read_only`
        (--no-save, a read-only file system): not locked (another colichat may have it open), the
        file opened for reading, and `load` reads it between two saves of that colichat (`_reading`);
        saving to it fails."""
        base = os.path.join(str(directory), name)
        text_only = lstat_regular(base + KV_EXT, "session file") is None
        side = lstat_regular(base + SIDECAR_EXT, "sidecar")
        if text_only and (side is None or interrupted_create(base)):
            raise SessionError(f"no session named {name} for this model (/sessions lists them)")
        damage = None if text_only or side is None else unusable_header(base + KV_EXT)
        s = cls(directory, name, ident, layout, None if read_only else take_lock(base + ".lock", name))
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

    @classmethod
    def read_saved(cls, directory, name: str) -> LoadResult:
        """What opening session NAME would keep, without its model (for an export): the same checks
        over its files, the same warnings, the same refusals (its model is the one its sidecar
        names; that the sidecar belongs in this directory is the caller's to check). Takes no writer's
        lock, modifies nothing: it reads between two saves of a colichat that has it open (`_reading`).
        A session without a sidecar has no text: refused."""
        base = os.path.join(str(directory), name)
        text_only = lstat_regular(base + KV_EXT, "session file") is None
        side = lstat_regular(base + SIDECAR_EXT, "sidecar")
        if text_only and (side is None or interrupted_create(base)):
            raise SessionError(f"no session named {name} (colichat --sessions lists them)")
        damage = None if text_only or side is None else unusable_header(base + KV_EXT)
        s = cls(directory, name, _saved_model(base + SIDECAR_EXT), None, None)
        try:
            if text_only or damage:
                s._text_only, s._kv_damage = True, damage
                return s._load_text_only()
            s._kv_fd = open_file(s.kv_path, "session file", os.O_RDONLY)
            with s._reading():
                return s._read_saved()
        finally:
            s.close()

    @classmethod
    def tokens_to_load(cls, directory, name: str) -> int | None:
        """The tokens opening session NAME reads, the number `load` holds against its context, from the
        files alone (before the model loads); None where they cannot say (opening says why). Takes
        no lock: it reads between two saves of a colichat that has it open (`_reading`)."""
        s = cls(directory, name, {}, None, None)
        try:
            header = None
            if lstat_regular(s.kv_path, "session file") is not None and not unusable_header(s.kv_path):
                s._kv_fd = open_file(s.kv_path, "session file", os.O_RDONLY)
                with s._reading():
                    header, size = read_header(s._kv_fd, s.kv_path)
                    doc = s._sidecar_as_it_is()
            else:
                doc = s._sidecar_as_it_is()
            if header is None or isinstance(doc, dict) and isinstance(doc.get("layout"), dict) \
                    and s._header_disagreement(doc, header):
                turns = readable_again(doc, []) if doc is not None else []  # no records: all read again
                return turns[-1].last if turns else None
            s.layout = CacheLayout.from_header(header)
            return s._listed_prefix(doc, header.nrec, size, [])[2]
        except (SessionError, OSError, ZeroDivisionError):  # (a header of records of no bytes)
            return None
        finally:
            s.close()

    def _sidecar_as_it_is(self) -> dict | None:
        """The sidecar document as `_listed_prefix` takes it, unchecked (None: no sidecar, or one that is
        not a document; SessionError if it cannot be read)."""
        if lstat_regular(self.json_path, "sidecar") is None:
            return None
        fd = open_file(self.json_path, "sidecar", os.O_RDONLY)
        try:
            data = os.read(fd, MAX_SIDECAR_BYTES + 1)
        finally:
            os.close(fd)
        doc = document(data)
        if not isinstance(doc, dict):
            raise SessionError("damaged sidecar")
        return doc

    def _read_saved(self) -> LoadResult:
        """read_saved's checks and load, over the open KV file (under `_reading`)."""
        header, size = read_header(self._kv_fd, self.kv_path)
        doc = self._read_sidecar()
        if doc is None:
            raise SessionError(f"session {self.name} has no sidecar, so no text to export: colichat --session "
                               f"{self.name} with its model loads its cache as one imported turn, which /export "
                               "writes")
        why = self._header_disagreement(doc, header)
        if why:
            return self._read_text_instead(why)
        self.layout = CacheLayout.from_header(header)
        records = min(header.nrec, (size - HEADER_SIZE) // max(1, self.layout.record_bytes))
        self._loaded = True
        return self.load(_SavedRecords(self.layout, records), exchanges=True)

    def close(self) -> None:
        if self._kv_fd is not None:
            fd, self._kv_fd = self._kv_fd, None
            try:
                os.close(fd)
            except OSError:
                pass  # everything was fsynced: an error closing loses nothing
        if self._lock_fd is not None:
            release_lock(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- loading ---------------------------------------------------------------------------

    def load(self, cache, ctx_limit: int | None = None, detokenize=None, exchanges: bool = False,
             ctx_most: int | None = None) -> LoadResult:
        """Fill `cache` (see `_load`): a session opened read-only is read between two saves of a
        colichat that has it open (`_reading`)."""
        if self._text_only:
            self.layout.check_cache(cache)
            return self._load_text_only(cache, ctx_limit, ctx_most)
        if self._kv_fd is None:
            raise ValueError(f"session {self.name} is closed")
        with self._reading():
            return self._load(cache, ctx_limit, detokenize, exchanges, ctx_most)

    def _read_text_instead(self, why: str, cache=None, ctx_limit: int | None = None,
                           ctx_most: int | None = None) -> LoadResult:
        """The KV file has records, but not this conversation's (`why`): load as `_load_text_only`."""
        self._text_only, self._kv_damage = True, why
        return self._load_text_only(cache, ctx_limit, ctx_most)

    def _load_text_only(self, cache=None, ctx_limit: int | None = None, ctx_most: int | None = None) -> LoadResult:
        """A session whose KV file is not there (deleted to free its space, say) or has no header a load
        can use (`_kv_damage`): no records to read, so no turn is kept; its exchanges whose text is
        intact are returned to be read again (LoadResult.unread), and the next save writes a new KV
        file first (in place of the broken one), then the sidecar. `cache` (emptied) may be None (an
        export). Refuses a sidecar opening refuses, and (as `_load`) text that reads again into more
        tokens than ctx_limit."""
        t0 = time.perf_counter()
        doc = self._read_sidecar()
        if doc is None:
            raise SessionError(f"no session named {self.name} for this model (/sessions lists them)")
        listed, _, warn = parse_turns(doc)
        state = f"is damaged ({self._kv_damage})" if self._kv_damage else "is not there"
        warnings = [f"the KV file {self.name}{KV_EXT} {state}: none of the {count(len(listed), 'turn')} "
                    "listed has its records"] + ([warn] if warn else [])
        unread = readable_again(doc, [])
        n = unread[-1].last if unread else 0
        ctx = None if cache is None else cache.capacity if ctx_limit is None else min(ctx_limit, cache.capacity)
        if ctx is not None and n > ctx:
            raise SessionError(more_context(self.name, n, ctx, ctx_most))
        if cache is not None:
            cache.set_length(0)
        self.turns, self._crcs, self.nrec, self._cache, self._has_sidecar = [], [], 0, cache, True
        self.sampler = doc.get("sampler") if isinstance(doc.get("sampler"), dict) else {}
        self.created = doc.get("created") if isinstance(doc.get("created"), str) else now_iso()
        self.parent, self.branch = lineage(doc)
        self._loaded = True
        self._unread_entries = doc["turns"][: len(unread)]
        return LoadResult(self.name, 0, [], (time.perf_counter() - t0) * 1000, warnings, dict(self.sampler), unread)

    @contextlib.contextmanager
    def _reading(self):
        """Without the session's lock (read-only: --no-save, --export, a read-only file system), hold
        the KV file's flock shared while reading: a save under way in a colichat that has the session
        open (`_saving`) ends first, and saves wait for the read. A file replaced meanwhile is opened
        again by its name; one removed or renamed meanwhile is refused."""
        if self._lock_fd is not None or self._shared:  # the writer itself, or already held
            yield
            return
        for _ in range(8):
            flock_quietly(self._kv_fd, fcntl.LOCK_SH)
            st = os.fstat(self._kv_fd)
            try:
                cur = os.lstat(self.kv_path)
            except FileNotFoundError:
                raise SessionError(f"session {self.name} was removed or renamed while it was read") from None
            if (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino):
                break
            fd = open_file(self.kv_path, "session file", os.O_RDONLY)  # written again by its colichat
            old, self._kv_fd = self._kv_fd, fd
            os.close(old)
        else:
            raise SessionError(f"session {self.name} was replaced again and again while it was read")
        self._shared = True
        try:
            yield
        finally:
            self._shared = False
            if self._kv_fd is not None:
                flock_quietly(self._kv_fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def _saving(self):
        """While a save changes the files: the KV file's flock, exclusive, so that a reader without
        the session's lock (`_reading`) sees the session before or after the save, never halfway."""
        if self._kv_fd is not None:
            flock_for_save(self._kv_fd)
        try:
            yield
        finally:
            if self._kv_fd is not None:  # (a file written again meanwhile: the old one's lock went with it)
                flock_quietly(self._kv_fd, fcntl.LOCK_UN)

    def _load(self, cache, ctx_limit: int | None = None, detokenize=None, exchanges: bool = False,
              ctx_most: int | None = None) -> LoadResult:
        """Fill `cache` with the longest valid prefix of whole turns; modifies no file.

        Refuses (SessionError, cache untouched) a file of another model, kind or shape, other
        weights (sidecar fingerprint), rows rotated with other rope factors than the ident's
        ("rope_factors", where the model has them), or more saved tokens than ctx_limit (the cache
        capacity by default): a conversation that fills its context reopens, full. Damage drops
        turns from the first bad one on, with a warning each.
        `detokenize(ids) -> str` names the text of a cache saved without a sidecar (one turn).
        `exchanges`: keep whole exchanges (the chat program's unit): a last user turn, whose answer
        was dropped, is dropped too. `ctx_most`: the model's largest context (its trained one), which
        the refusal of too many tokens holds its suggestion to.
        """
        t0 = time.perf_counter()
        self.layout.check_cache(cache)
        header, size = read_header(self._kv_fd, self.kv_path)
        doc = self._read_sidecar()  # first: the model that saved it tells damage from another model's file
        kind = KIND_OF_MAGIC[header.magic]
        if doc is not None and (kind != self.layout.kind or header.mismatches(self.layout)):
            why = self._header_disagreement(doc, header)
            if why:  # not this conversation's records: its text is read again
                return self._read_text_instead(why, cache, ctx_limit, ctx_most)
        if kind != self.layout.kind:
            raise SessionError(f"session {self.name} holds a cache of another kind of model "
                               f"(magic {header.magic!r}, this model needs {self.layout.magic!r}); "
                               "start a new session with /reset")
        bad = header.mismatches(self.layout)
        if bad:
            raise SessionError(f"session {self.name} was saved by another model ({', '.join(bad)}); "
                               "start a new session with /reset")
        if doc is not None:
            self._check_rope_factors(doc)
        warnings: list[str] = []
        if doc is not None and doc.get("settings damaged"):
            warnings.append("the sidecar's settings do not match their checksum: the saved sampler "
                            "settings were not restored")
            if self.ident.get("rope_factors") and "rope_factors" not in doc["model"]:
                warnings.append("the sidecar does not say which rope factors the cache rows were rotated "
                                f"with: assumed {self.ident['rope_factors']!r}, this model's")
        elif doc is not None and doc["format"] == 1:
            warnings.append("the sidecar was written by an older colichat: its turn texts carry no "
                            "checksum (the next save adds them)")
        # a conversation keeps the codec it was saved in: the cache takes the file's
        layout = self.layout.with_codec(CODEC_OF_MAGIC[header.magic], getattr(cache, "row_width", 0))
        turns, crcs, n = self._listed_prefix(doc, header.nrec, size, warnings, layout.record_bytes)
        ctx = cache.capacity if ctx_limit is None else min(ctx_limit, cache.capacity)
        if n > ctx:
            raise SessionError(more_context(self.name, n, ctx, ctx_most))
        codec = cache.codec
        try:
            cache.set_codec(layout.codec)
            read_records(self._kv_fd, cache.raw(0, n), layout.record_bytes)
            cache.loaded(n)
        except (OSError, SessionError) as e:
            cache.set_length(0)
            cache.set_codec(codec)
            why = oserror_text(e) if isinstance(e, OSError) else str(e)
            raise SessionError(f"could not read session {self.name} ({why}); the cache was cleared") from None
        if doc is not None:
            n = self._verify(cache, turns, crcs, warnings)
            if exchanges:
                n = drop_unanswered(turns, crcs, warnings)
        else:
            n = self._check_tokens(cache, n, warnings)
            warnings.append(f"no sidecar {self.name}{SIDECAR_EXT}: loaded the {n} records as one imported turn "
                            "(no weights fingerprint to check)" if n else f"no sidecar {self.name}{SIDECAR_EXT}")
            if n:
                text = "" if detokenize is None else str(detokenize(cache.tokens[:n].tolist()))
                turns, crcs = [Turn("imported", text, 0, n)], [turn_crc(cache, Turn('imported', '', 0, n))]
        cache.set_length(n)

        self.turns, self._crcs, self.nrec = turns, crcs, n
        self._cache, self.layout = cache, layout
        self._has_sidecar = doc is not None
        if doc is not None:
            self.sampler = doc.get("sampler") if isinstance(doc.get("sampler"), dict) else {}
            self.created = doc.get("created") if isinstance(doc.get("created"), str) else now_iso()
            self.parent, self.branch = lineage(doc)
        self._loaded = True
        ms = (time.perf_counter() - t0) * 1000
        unread = readable_again(doc, turns) if doc is not None else []
        self._unread_entries = doc["turns"][len(turns): len(turns) + len(unread)] if unread else []
        return LoadResult(self.name, n, list(turns), ms, warnings, dict(self.sampler), unread)

    def saved_rope_factors(self) -> str | None:
        """The rope factors the session's cache rows were rotated with (the sidecar's
        model.rope_factors), None if it records none (a model whose rope does not depend on the
        context size, an older colichat, no sidecar). SessionError for a damaged sidecar or value."""
        doc = self._read_sidecar()
        return None if doc is None else self._rope_factors_of(doc)

    def _rope_factors_of(self, doc: dict) -> str | None:
        saved = doc["model"].get("rope_factors")
        if saved is not None and not (isinstance(saved, str) and saved.isascii() and saved.isprintable()
                                      and 0 < len(saved) <= 40):
            raise SessionError(f"sidecar {self.json_path} is damaged (its model.rope_factors is "
                               f"{json.dumps(saved)[:40]}, not a name); the session cannot be resumed safely")
        return saved

    def _check_rope_factors(self, doc: dict) -> None:
        """Refuse (before any record is read) rows rotated with other rope factors than the model
        uses now: mixed in one cache they give wrong answers. A sidecar without the field (an older
        colichat, or a model whose rope does not depend on the context size) is not checked."""
        saved, mine = self._rope_factors_of(doc), self.ident.get("rope_factors")
        if saved is None or saved == mine:
            return
        head = f"session {self.name}'s cache rows were rotated with the {saved!r} rope factors"
        if mine is None:
            raise SessionError(f"{head}, which this model does not have (its rope is the same at every "
                               "context size): it cannot be resumed; start a new session with /reset")
        raise SessionError(f"{head} and this model's with {mine!r}: rotate with {saved!r} to resume it, "
                           "or start a new session with /reset")

    def _header_disagreement(self, doc: dict, header) -> str | None:
        """How a header disagrees with the layout its own sidecar recorded (damage, or another
        session's KV file put in its place), or None."""
        saved = doc.get("layout") if isinstance(doc.get("layout"), dict) else {}
        saved = {"codec": "f32", "head_dim": 0, **saved}  # (an f32 sidecar names no codec)
        got = CacheLayout.from_header(header).__dict__
        bad = [f"{k} {v} (sidecar: {saved.get(k)})" for k, v in got.items() if saved.get(k) != v]
        return f"its header disagrees with the sidecar: {', '.join(bad)}" if bad else None

    def _listed_prefix(self, doc, nrec: int, size: int, warnings: list[str], record_bytes: int | None = None):
        """(turns, crcs, records to read): the sidecar's turns that lie within the whole records
        present (all records present when there is no sidecar), of `record_bytes` (the layout's)."""
        whole = (size - HEADER_SIZE) // (record_bytes or self.layout.record_bytes)
        avail = min(nrec, whole)
        if whole < nrec:
            warnings.append(f"the KV file is cut short: its header lists {nrec} records, "
                            f"it holds {whole} whole ones")
        if doc is None:
            return [], [], avail
        turns, crcs, warn = parse_turns(doc)
        warnings += [warn] if warn else []
        kept = sum(1 for t in turns if t.last <= avail)
        if kept < len(turns):
            warnings.append(f"dropped {span(turns, kept)}: past the {avail} records in the KV file")
            del turns[kept:], crcs[kept:]
        n = turns[-1].last if turns else 0
        if avail > n and not warn:  # (after a dropped sidecar turn the records are that turn's)
            warnings.append(f"dropped {avail - n} records after the last turn (an interrupted save)")
        return turns, crcs, n

    def _verify(self, cache, turns: list[Turn], crcs: list[int], warnings: list[str]) -> int:
        """Drop (in place) the first turn whose CRC or token ids are wrong, and all later ones."""
        for i, t in enumerate(turns):
            if turn_crc(cache, t) != crcs[i]:
                warnings.append(f"dropped {span(turns, i)}: checksum mismatch (damaged records)")
                del turns[i:], crcs[i:]
                break
        n = turns[-1].last if turns else 0
        k = self._check_tokens(cache, n, [])
        if k < n:
            i = next(i for i, t in enumerate(turns) if t.last > k)
            warnings.append(f"dropped {span(turns, i)}: token id {int(cache.tokens[k])} is outside "
                            "the vocabulary")
            del turns[i:], crcs[i:]
            n = turns[-1].last if turns else 0
        return n

    def _check_tokens(self, cache, n: int, warnings: list[str]) -> int:
        """The number of leading records whose token id is inside the vocabulary."""
        ids = cache.tokens[:n]
        out = np.flatnonzero((ids < 0) | (ids >= self.layout.vocab))
        if not out.size:
            return n
        k = int(out[0])
        warnings.append(f"dropped records {k}-{n}: token id {int(ids[k])} is outside the vocabulary")
        return k

    def _read_sidecar(self) -> dict | None:
        """The sidecar document, None if there is none; refuses a damaged one or another model's."""
        st = lstat_regular(self.json_path, "sidecar")
        if st is None:
            return None
        aside = f"move {self.json_path} aside to load the cache as one imported turn"
        if st.st_size > MAX_SIDECAR_BYTES:
            raise SessionError(f"sidecar {self.json_path} is implausibly large; {aside}")
        fd = open_file(self.json_path, "sidecar", os.O_RDONLY)
        try:
            data = os.read(fd, st.st_size + 1)
        except OSError as e:
            raise SessionError(f"cannot read sidecar {self.json_path}: {oserror_text(e)}") from None
        finally:
            os.close(fd)
        doc = document(data)
        if not isinstance(doc, dict) or not isinstance(doc.get("format"), int) \
                or not isinstance(doc.get("model"), dict) or doc["format"] < 1:
            raise SessionError(f"sidecar {self.json_path} is damaged (not a colichat sidecar); {aside}")
        intact = doc.get("check") == doc_check(doc) or (doc["format"] == 1 and "check" not in doc)
        if doc["format"] > FORMAT_VERSION:  # its checks may be computed otherwise: they cannot tell
            raise SessionError(f"session {self.name} was written by a newer colichat "
                               f"(sidecar format {doc['format']}); upgrade colichat to resume it")
        saved, me = doc["model"], self.ident
        other = saved.get("arch") != me.get("arch") or saved.get("fingerprint") != me.get("fingerprint")
        if not intact and other:
            raise SessionError(f"sidecar {self.json_path} is damaged (its model does not match its "
                               f"checksum); {aside}")
        if not intact:  # the turns carry their own checks; only the settings are in doubt
            doc = {**doc, "sampler": {}, "created": None, "settings damaged": True}
        if other:
            raise SessionError(
                f"session {self.name} was saved with other weights ({saved.get('name')}, fingerprint "
                f"{str(saved.get('fingerprint'))[:12]}; this model: {me.get('name')}, "
                f"{str(me.get('fingerprint'))[:12]}); load that model or start a new session with /reset")
        return doc

    # ---- saving ----------------------------------------------------------------------------

    def append(self, cache, turns: list[Turn], sampler: dict | None = None) -> None:
        """Save the turns not yet on disk: writes records [self.nrec, turns[-1].last) and the sidecar
        (with `sampler`, the settings from now on, when given).

        `turns` is either the whole conversation (starting at record 0, its head equal to
        `self.turns`) or just the new turns (starting at `self.nrec`). Passing the whole list is
        simplest: after a failed save (SessionError: disk full, I/O error) the next call retries the
        unsaved turns. A failed save leaves the cache untouched and the disk at the previous save.
        """
        self._require_loaded()
        self.layout.check_cache(cache)
        if sampler is not None:
            self.sampler = dict(sampler)
        turns = [Turn(t.role, t.text, t.first, t.last) for t in turns]  # any object with these fields
        if self.turns and turns and turns[0].first == 0:
            if turns[: len(self.turns)] != self.turns:
                raise ValueError("the turn list does not start with the saved turns; truncate first")
            turns = turns[len(self.turns):]
        if not turns:
            return
        prev = self.nrec
        for t in turns:
            if t.first != prev or not t.first <= t.last:
                raise ValueError(f"turn {t.role!r} [{t.first}, {t.last}) does not start at record {prev}")
            prev = t.last
        if prev > cache.length:
            raise ValueError(f"turns end at record {prev}, past the cache length {cache.length}")
        crcs = [turn_crc(cache, t) for t in turns]
        self._cache = cache
        if self._text_only:  # a new KV file first (the sidecar, listing the text, stays until it is replaced)
            self._new_kv_file()
        if not self.on_disk:  # the first save: the session appears whole or not at all
            self._remake_directory()
            self._check_lock()  # (a directory removed took the lock file with it)
            self._create_files(cache, turns, crcs)
            return
        try:
            with self._saving():
                self._check_files(self.turns, self._crcs)
                if not self._has_sidecar:  # an imported cache: record its state before touching the file
                    self._write_sidecar(self.turns, self._crcs)
                write_records(self._kv_fd, self.nrec, cache.raw(self.nrec, prev), self.layout.record_bytes)
                write_nrec(self._kv_fd, prev)
                self._write_sidecar(self.turns + turns, self._crcs + crcs)
        except OSError as e:
            raise SaveFailed(f"could not save session {self.name}: {oserror_text(e)}",
                             "the conversation is still in memory but its last turn may not be on disk "
                             "(free some space; the next save retries)") from None
        self.turns += turns
        self._crcs += crcs
        self.nrec = prev
        self._unread_entries = []  # the conversation that read them again is saved now

    def fork(self, new: Session, cache, turns: list[Turn], branch: int) -> bool:
        """Save `turns`, this conversation's first `branch` exchanges, into `new` (claimed, no files yet):
        its fork. Where this session's KV file holds them as saved (the bytes the cache holds), the new
        file's header and records are copied from it (`copy_bytes`), else written from `cache`; the
        sidecar names this session as the parent. True if copied. A failure leaves no file of `new`."""
        new.parent, new.branch = self.name, branch
        turns = [Turn(t.role, t.text, t.first, t.last) for t in turns]
        n, k = turns[-1].last, len(turns)
        try:
            saved = self.on_disk and not self._text_only and self.turns[:k] == turns \
                and os.fstat(self._kv_fd).st_size >= HEADER_SIZE + n * self.layout.record_bytes
        except OSError:
            saved = False
        if not saved:
            new.append(cache, turns)
            return False
        new._create_files(cache, turns, self._crcs[:k], source=self._kv_fd)
        new._cache = cache
        return True

    def _new_kv_file(self) -> None:
        """For a session opened from its sidecar alone: an empty KV file under its name (written whole
        under NAME.coli_kv.tmp, then renamed), so that saves go on as for any session. A crash or an
        error after the rename leaves the sidecar listing turns past the KV file's records: reopening
        reads them again; the next save retries."""
        tmp, fd = self.kv_path + ".tmp", None
        try:
            self._remake_directory()
            self._check_lock()
            if os.path.lexists(tmp):
                os.unlink(tmp)
            fd = create_kv(tmp, self.layout)
            os.rename(tmp, self.kv_path)
            fsync_dir(self.directory)
        except OSError as e:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
            _unlink_quietly(tmp)
            raise SaveFailed(f"could not save session {self.name}: {oserror_text(e)}",
                             "the conversation is still in memory (free some space; the next save retries)") from None
        if self._kv_fd is not None:  # the broken file this one replaced
            with contextlib.suppress(OSError):
                os.close(self._kv_fd)
        self._kv_fd, self._text_only, self._kv_damage = fd, False, None

    def truncate(self, n_turns: int, sampler: dict | None = None, keep_files: bool = False) -> None:
        """Keep the first n_turns saved turns: rewrite the sidecar (with `sampler`, the settings from
        now on, when given), then nrec, then cut the KV file to its records. The sidecar goes first:
        once it is replaced, the turns it no longer lists are gone for good (a crash before nrec is
        written leaves records no turn covers, dropped at the next load, never text read again).
        Keeping more turns than are saved (after a failed save) keeps them all. Cut to no turn, the
        files are removed (no exchange is no saved conversation), unless `keep_files` (/reset: the
        conversation emptied in place, its KV file cut to its header and its sidecar listing no turn)."""
        self._require_loaded()
        if sampler is not None:
            self.sampler = dict(sampler)
        if n_turns < 0:
            raise ValueError(f"cannot keep {n_turns} turns")
        unread = self._unread_entries[: max(0, n_turns - len(self.turns))]  # those still in the conversation
        n_turns = min(n_turns, len(self.turns))
        turns, crcs = self.turns[:n_turns], self._crcs[:n_turns]
        n = turns[-1].last if turns else 0
        if self.branch:  # a fork cut below its branch point begins with fewer exchanges; cut to none, it is no fork
            self.branch = min(self.branch, sum(t.role == "user" for t in turns)
                              + sum(isinstance(e, dict) and e.get("role") == "user" for e in unread)) or None
            self.parent = self.parent if self.branch else None
        if self._text_only:  # no records: the sidecar lists what is still in the conversation
            self._unread_entries = unread
            try:
                if unread or keep_files:
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
                self._write_sidecar(turns, crcs, unread)
                # committed: an error now leaves records no turn covers (dropped by a load), and a retry
                # or the next append writes nrec again
                self.turns, self._crcs, self.nrec, self._unread_entries = turns, crcs, n, unread
                if not rewritten:
                    write_nrec(self._kv_fd, n)
                    self._cut_file(n)
            except OSError as e:
                raise SessionError(f"could not save session {self.name}: {oserror_text(e)}") from None
            if not turns and not unread and not keep_files:
                self._remove_files()

    def _cut_file(self, n: int) -> None:
        """Once nrec n is durable: the KV file holds its header and n records, no dead space after them."""
        size = HEADER_SIZE + n * self.layout.record_bytes
        if os.fstat(self._kv_fd).st_size > size:
            os.ftruncate(self._kv_fd, size)
            os.fsync(self._kv_fd)

    def _remove_files(self) -> None:
        """A session cut to no turns is no conversation (holds_conversation): its files go (the
        sidecar first), the lock stays, and the next save creates them again, as after a claim. Files
        that cannot be removed stay, empty: no listing shows them and the next claim replaces them."""
        try:
            for path in (self.json_path, self.kv_path):
                os.unlink(path)
            fsync_dir(self.directory)
        except OSError:
            return
        fd, self._kv_fd = self._kv_fd, None
        try:
            os.close(fd)
        except OSError:
            pass
        self._has_sidecar, self.created = False, now_iso()

    def save_sampler(self, sampler: dict) -> None:
        """Record new sampler settings now (they are also saved with every append)."""
        self._require_loaded()
        old, self.sampler = self.sampler, dict(sampler)
        if self._text_only:
            try:
                self._write_sidecar([], [], self._unread_entries)
            except OSError as e:
                self.sampler = old
                raise SessionError(f"could not save session {self.name}: {oserror_text(e)}") from None
            return
        if self._kv_fd is None:  # claimed, nothing saved yet: the first save writes them
            return
        try:
            with self._saving():
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

    def _remake_directory(self) -> bool:
        """If the session's directory was removed (a clean-up while colichat ran), make it again (the
        files follow: the lock, then the session from memory). True if it did; SessionError if it cannot."""
        if os.path.isdir(self.directory):
            return False
        try:
            private_dir(self.directory)
        except OSError as e:
            raise SessionError(f"could not save session {self.name}: its directory {self.directory} was "
                               f"removed and cannot be made again: {oserror_text(e)}") from None
        return True

    def _check_files(self, turns: list[Turn], crcs: list[int]) -> bool:
        """Before a save: if another program removed, replaced, hard-linked or cut short this session's
        files since they were opened, write the KV file again, holding `turns`, from the cache (and take
        the lock again if its file went, and the directory if it went). True if it did (with a note
        saying so)."""
        gone = self._remake_directory()
        self._check_lock()
        st = os.fstat(self._kv_fd)
        try:
            cur = os.lstat(self.kv_path)
        except FileNotFoundError:
            cur = None
        same = cur is not None and (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino)
        short = st.st_size < HEADER_SIZE + self.nrec * self.layout.record_bytes  # (truncate -s, in place)
        if same and st.st_nlink == 1 and not short:
            return False
        what = ("removed with its directory" if gone else "removed") if cur is None else \
            "given another name (a hard link)" if same and st.st_nlink != 1 else "cut short" if same else "replaced"
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
            _unlink_quietly(tmp)
            raise
        try:
            flock_for_save(fd)  # a reader that opens it by its name waits for the save to end
            write_records(fd, 0, self._cache.raw(0, n) if n else memoryview(b""), self.layout.record_bytes)
            write_nrec(fd, n)
            os.replace(tmp, self.kv_path)
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        old, self._kv_fd = self._kv_fd, fd
        self.turns, self._crcs, self.nrec = list(turns), list(crcs), n
        try:
            os.close(old)
        except OSError:
            pass  # the old file is gone from the directory; closing it is housekeeping
        self._has_sidecar = False  # the sidecar is written again before any new record
        fsync_dir(self.directory)
        self.notes.append(f"the KV file of session {self.name} was {what} by another program: "
                          f"wrote the session again from memory ({count(n, 'token')})")
        return True

    def _check_lock(self) -> None:
        """If NAME.lock was removed or replaced, our flock guards nothing: take the new file's."""
        path = os.path.join(self.directory, self.name + ".lock")
        st = os.fstat(self._lock_fd)
        try:
            cur = os.lstat(path)
            if (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino):
                return
        except FileNotFoundError:
            pass
        fd = take_lock(path, self.name)
        release_lock(self._lock_fd)
        self._lock_fd = fd

    def _write_sidecar(self, turns: list[Turn], crcs: list[int], unread: list[dict] = ()) -> None:
        """Atomically replace NAME.json: write NAME.json.tmp, fsync, rename over, fsync the directory.
        `unread`: entries of turns whose records are lost, listed as they were after `turns`."""
        doc = {
            "format": FORMAT_VERSION,
            "model": self.ident,
            "layout": self.layout.to_json(),
            "created": self.created,
            "updated": now_iso(),
            "sampler": self.sampler,
            "nrec": turns[-1].last if turns else 0,
        }
        if self.parent:  # a fork: where it came from (covered by the check, as the settings are)
            doc["parent"], doc["branch"] = self.parent, self.branch
        doc["check"] = doc_check(doc)
        doc["turns"] = [{"role": t.role, "text": t.text, "first": t.first, "last": t.last, "crc32": c,
                         "check": turn_check(t.role, t.text, t.first, t.last, c)}
                        for t, c in zip(turns, crcs, strict=True)] + list(unread)
        try:
            data = json.dumps(doc, ensure_ascii=False, indent=1).encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates in a text: escape them instead
            data = json.dumps(doc, indent=1).encode("ascii")
        tmp = self.json_path + ".tmp"
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
            os.replace(tmp, self.json_path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        fsync_dir(self.directory)
        self._has_sidecar = True
