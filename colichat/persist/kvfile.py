"""The .coli_kv file: a 40-byte header, then fixed-size per-token records (see FORMAT.md).

    magic (8 bytes)  MLA: b"COLIKV1\\0" (f32), b"COLIKV2\\0" (fp8), b"COLIKV3\\0" (int4): colibri's;
                     GQA: b"COLIGQA\\0", b"COLIGQ2\\0", b"COLIGQ3\\0": colichat's own, the same codecs
    8 x int32 LE     n_layers, A width, B width, index_hd, n_index_layers, vocab, nrec, mode
                     (mode: 0 f32, 1 fp8, codec<<8 | bits = 0x104 int4; a compact GQA file has no
                     indexer and holds its row width, head_dim, where index_hd is)
    nrec records     the engine's record, in the file's codec: colichat/engine/cache.py describes it

A record is byte-for-byte what `colichat.engine.cache.KVCache.raw` holds (the f32 record, or the
stored codes of a compact cache), so records move between the file and the cache with one write
(`cache.raw(first, last)`) or a few large reads straight into the cache buffer. Everything here
works on raw file descriptors with positioned I/O; no function modifies a file unless its name says
so (write, create, cut, copy).
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import threading
from dataclasses import dataclass

import numpy as np

from ..engine.cache import stored_record_bytes
from ..engine.kvcodec import width_problem
from ..errors import SessionError

MAGIC = {("mla", "f32"): b"COLIKV1\0", ("mla", "fp8"): b"COLIKV2\0", ("mla", "int4"): b"COLIKV3\0",
         ("gqa", "f32"): b"COLIGQA\0", ("gqa", "fp8"): b"COLIGQ2\0", ("gqa", "int4"): b"COLIGQ3\0"}
KIND_OF_MAGIC = {m: k for (k, _), m in MAGIC.items()}
CODEC_OF_MAGIC = {m: c for (_, c), m in MAGIC.items()}
MODE = {"f32": 0, "fp8": 1, "int4": 1 << 8 | 4}  # header h[7]: colibri's KV8 flag, or codec << 8 | bits
HEADER = struct.Struct("<8s8i")
HEADER_SIZE = HEADER.size  # 40
NREC_OFFSET = 8 + 6 * 4  # byte offset of the nrec field
INT32_MAX = 2**31 - 1
PARALLEL_READ = 8 << 20  # bytes past which a load reads with two threads
CHUNK = 1 << 28  # largest single read/write (Linux caps one call near 2 GiB)
COPY_CHUNK = 8 << 20  # a fork's records copied by reads and writes: this many bytes at a time
# copy_file_range errors that mean "not here" (an old kernel, another file system, a special file): copy by hand
NO_COPY_RANGE = {errno.ENOSYS, errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EBADF}


def oserror_text(e: OSError) -> str:
    return e.strerror or str(e) or type(e).__name__


@dataclass(frozen=True)
class CacheLayout:
    """What the header describes: the cache kind, its widths, the model's vocabulary size, and how
    rows are stored (`codec`; a compact GQA file's rows are `head_dim` wide, one per head)."""

    kind: str  # "mla" or "gqa"
    n_layer: int
    a_width: int  # MLA: kv_lora (c); GQA: K width
    b_width: int  # MLA: qk_rope (k_pe); GQA: V width
    vocab: int
    index_hd: int = 0  # DSA indexer key width (0: no indexer)
    n_index_layers: int = 0
    codec: str = "f32"  # f32, fp8 or int4 (engine/kvcodec.py)
    head_dim: int = 0  # compact GQA only: the width of one stored row

    @classmethod
    def from_cache(cls, cache, vocab: int) -> CacheLayout:
        head = cache.row_width if cache.kind == "gqa" and cache.codec != "f32" else 0
        return cls(cache.kind, cache.n_layer, cache.a_width, cache.b_width, int(vocab),
                   cache.index_hd, cache.n_index_layers, cache.codec, head)

    @classmethod
    def from_header(cls, h: Header) -> CacheLayout:
        kind, codec = KIND_OF_MAGIC[h.magic], CODEC_OF_MAGIC[h.magic]
        if kind == "gqa" and codec != "f32":
            return cls(kind, h.n_layer, h.a_width, h.b_width, h.vocab, 0, h.n_index_layers, codec, h.index_hd)
        return cls(kind, h.n_layer, h.a_width, h.b_width, h.vocab, h.index_hd, h.n_index_layers, codec)

    def with_codec(self, codec: str, head_dim: int) -> CacheLayout:
        """The same model's layout, its rows stored in `codec` (`head_dim`: the GQA row width)."""
        head = (head_dim or self.head_dim) if self.kind == "gqa" and codec != "f32" else 0
        return CacheLayout(self.kind, self.n_layer, self.a_width, self.b_width, self.vocab, self.index_hd,
                           self.n_index_layers, codec, head)

    def codec_problem(self) -> str | None:
        """Why rows of these widths cannot be in this codec (a file's int4 rows not a power of two wide), or None."""
        widths = (self.head_dim,) if self.head_dim else (self.a_width, self.b_width)
        return next(filter(None, (width_problem(w, self.codec) for w in widths)), None)

    @property
    def magic(self) -> bytes:
        return MAGIC[self.kind, self.codec]

    @property
    def record_bytes(self) -> int:
        return stored_record_bytes(self.n_layer, self.a_width, self.b_width, self.codec, self.head_dim,
                                   self.index_hd, self.n_index_layers)

    def header(self, nrec: int) -> Header:
        fourth = self.head_dim if self.head_dim else self.index_hd
        return Header(self.magic, self.n_layer, self.a_width, self.b_width,
                      fourth, self.n_index_layers, self.vocab, nrec, MODE[self.codec])

    def check_cache(self, cache) -> None:
        """A programming error, not a user one: the cache handed in must have this layout."""
        got = (cache.kind, cache.n_layer, cache.a_width, cache.b_width, cache.codec, cache.stored_bytes)
        want = (self.kind, self.n_layer, self.a_width, self.b_width, self.codec, self.record_bytes)
        if got != want:
            raise ValueError(f"cache layout {got} does not match the session layout {want}")

    def to_json(self) -> dict:
        """The sidecar's "layout" (an f32 one as colichat wrote it before compact codecs: no codec key)."""
        d = dict(self.__dict__)
        if self.codec == "f32":
            del d["codec"], d["head_dim"]
        return d

    def describe(self) -> str:
        """'fp8 (COLIKV2, 1,160 bytes a token)'."""
        return f"{self.codec} ({self.magic.rstrip(bytes(1)).decode()}, {self.record_bytes:,} bytes a token)"


@dataclass(frozen=True)
class Header:
    magic: bytes
    n_layer: int
    a_width: int
    b_width: int
    index_hd: int
    n_index_layers: int
    vocab: int
    nrec: int
    mode: int

    def pack(self) -> bytes:
        return HEADER.pack(self.magic, self.n_layer, self.a_width, self.b_width, self.index_hd,
                           self.n_index_layers, self.vocab, self.nrec, self.mode)

    def mismatches(self, layout: CacheLayout) -> list[str]:
        """Fields that differ from what this model needs, as `name file/model` phrases (the codec is
        the file's own: a model reads every codec)."""
        a, b = ("kv_lora", "qk_rope") if layout.kind == "mla" else ("K width", "V width")
        mine = CacheLayout.from_header(self)
        pairs = [("n_layers", mine.n_layer, layout.n_layer), (a, mine.a_width, layout.a_width),
                 (b, mine.b_width, layout.b_width), ("index_hd", mine.index_hd, layout.index_hd),
                 ("indexed layers", mine.n_index_layers, layout.n_index_layers),
                 ("vocab", mine.vocab, layout.vocab)]
        return [f"{n} {f} (model: {m})" for n, f, m in pairs if f != m]


def mode_damage(magic: bytes, mode: int) -> str | None:
    """Why a header's mode is not the one its magic stores rows with (another codec or bit width,
    which colichat does not read), or None."""
    codec = CODEC_OF_MAGIC[magic]
    if mode == MODE[codec]:
        return None
    name = magic.rstrip(bytes(1)).decode(errors="replace")
    if codec == "int4":
        what = "PolarQuant (codec 0)" if mode >> 8 == 0 else f"codec {mode >> 8}"
        return f"{name} {what} at {mode & 255} bits, which colichat does not read (it reads codec 1 at 4 bits)"
    return f"{name} with mode {mode}, which colichat does not read (expected {MODE[codec]})"


def lstat_regular(path: str, what: str) -> os.stat_result | None:
    """lstat a session file: None if absent; SessionError if it is a symlink or not a regular file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SessionError(f"cannot access {what} {path}: {oserror_text(e)}") from None
    if stat.S_ISLNK(st.st_mode):
        raise SessionError(f"{what} {path} is a symbolic link; colichat does not follow symlinked "
                           "session files (replace the link with the file itself)")
    if not stat.S_ISREG(st.st_mode):
        raise SessionError(f"{what} {path} is not a regular file")
    return st


def open_file(path: str, what: str, flags: int, mode: int = 0o600) -> int:
    """os.open without following a final symlink (nor waiting on a FIFO); errors become one-line
    SessionErrors."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), mode)
    except FileExistsError:
        raise
    except PermissionError:
        raise SessionError(f"cannot open {what} {path}: permission denied "
                           "(check the file's owner and mode)") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SessionError(f"{what} {path} is a symbolic link; colichat does not follow "
                               "symlinked session files") from None
        raise SessionError(f"cannot open {what} {path}: {oserror_text(e)}") from None


def check_writable(fd: int, path: str, what: str, fix: str = "") -> os.stat_result:
    """Refuse to write through `fd` unless it is a regular file with one name: a write through a hard
    link (or to a device, a FIFO) would change a file that is not this session's. `fix` is the
    command to offer (default: make the file a copy of its own). Closes `fd` on refusal."""
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise SessionError(f"cannot access {what} {path}: {oserror_text(e)}") from None
    if stat.S_ISREG(st.st_mode) and st.st_nlink <= 1:
        return st
    os.close(fd)
    if not stat.S_ISREG(st.st_mode):
        raise SessionError(f"{what} {path} is not a regular file; colichat does not write to it "
                           f"(remove it: rm '{path}')")
    fix = fix or f"cp '{path}' '{path}.copy' && mv '{path}.copy' '{path}'"
    raise SessionError(f"{what} {path} has {st.st_nlink} hard links; colichat does not write through a "
                       f"hard link (another file would change): {fix}")


HEADER_FIELDS = ("n_layers", "A width", "B width", "index_hd", "indexed layers", "vocab", "nrec")


def header_damage(size: int, raw: bytes) -> str | None:
    """Why a KV file of `size` bytes starting with `raw` has no header a load can use, or None."""
    if size == 0:
        return "empty KV file"
    if len(raw) < HEADER_SIZE:
        return f"truncated header: {len(raw)} bytes, a header needs {HEADER_SIZE}"
    if raw[:8] not in KIND_OF_MAGIC:
        return f"not a KV file: magic {raw[:8]!r}"
    fields = dict(zip(HEADER_FIELDS, HEADER.unpack(raw)[1:8], strict=True))
    negative = [f"{k} {v}" for k, v in fields.items() if v < 0]
    if negative:
        return f"a negative field in its header: {', '.join(negative)}"
    return None


def unusable_header(path: str) -> str | None:
    """`header_damage` of the regular file at `path`; None for a file it cannot judge (missing, a link,
    a special file, one it may not read: those have refusals of their own)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        raw = os.pread(fd, HEADER_SIZE, 0) if stat.S_ISREG(st.st_mode) else None
    except OSError:
        return None
    finally:
        os.close(fd)
    return None if raw is None else header_damage(st.st_size, raw)


def read_header(fd: int, path: str) -> tuple[Header, int]:
    """The header and the file size. Refuses files too short or with a magic colichat does not know."""
    size = os.fstat(fd).st_size
    if size < HEADER_SIZE:
        detail = "empty" if size == 0 else f"{size} bytes, a header needs {HEADER_SIZE}"
        raise SessionError(f"{path} is not a usable KV file (truncated header: {detail})")
    raw = os.pread(fd, HEADER_SIZE, 0)
    if len(raw) < HEADER_SIZE:
        raise SessionError(f"{path}: short read of the header")
    h = Header(*HEADER.unpack(raw))
    if h.magic not in KIND_OF_MAGIC:
        raise SessionError(f"{path} is not a colichat/COLIKV KV file (magic {h.magic!r})")
    why = mode_damage(h.magic, h.mode)
    if why:
        raise SessionError(f"{path} is {why}; it was left as it is")
    if min(h.n_layer, h.a_width, h.b_width, h.index_hd, h.n_index_layers, h.vocab, h.nrec) < 0:
        raise SessionError(f"{path}: damaged header (negative field)")
    return h, size


def read_records(fd: int, dest: memoryview, record_bytes: int, at: int = 0) -> None:
    """Fill `dest` (whole records, a byte view of the cache) from record `at` on, in large reads.

    Past PARALLEL_READ bytes two threads each read one half: the cost of a resume is copying the
    file out of the page cache, and os.preadv releases the GIL, so both cores copy at once.
    """
    start = at * record_bytes
    if len(dest) < PARALLEL_READ:
        _pread_all(fd, dest, start, record_bytes)
        return
    half = len(dest) // 2 // record_bytes * record_bytes
    failed: list[BaseException] = []

    def second_half() -> None:
        try:
            _pread_all(fd, dest[half:], start + half, record_bytes)
        except BaseException as e:  # re-raised in the caller's thread
            failed.append(e)

    worker = threading.Thread(target=second_half)
    worker.start()
    try:
        _pread_all(fd, dest[:half], start, record_bytes)
    finally:
        worker.join()
    if failed:
        raise failed[0]


def _pread_all(fd: int, dest: memoryview, start: int, record_bytes: int) -> None:
    """Fill `dest` with the file's record bytes from byte `start` of the records on."""
    done = 0
    while done < len(dest):
        n = os.preadv(fd, [dest[done : done + CHUNK]], HEADER_SIZE + start + done)
        if n <= 0:
            raise SessionError(f"the KV file ended while reading record {(start + done) // record_bytes}")
        done += n


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done : done + CHUNK], offset + done)
        if n <= 0:  # a short write with nothing written: report it as the disk being full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += n


def write_records(fd: int, first: int, data: memoryview, record_bytes: int) -> None:
    """Write records starting at record `first` (over any dead space), then fsync."""
    _pwrite_all(fd, data, HEADER_SIZE + first * record_bytes)
    os.fsync(fd)


def write_nrec(fd: int, nrec: int) -> None:
    """Rewrite the header's record count, then fsync: this is what commits appended records."""
    if not 0 <= nrec <= INT32_MAX:
        raise ValueError(f"nrec {nrec} does not fit the header")
    _pwrite_all(fd, memoryview(struct.pack("<i", nrec)), NREC_OFFSET)
    os.fsync(fd)


def cut_to(fd: int, n: int, record_bytes: int) -> None:
    """Once nrec n is durable: the KV file holds its header and n records, no dead space after them."""
    size = HEADER_SIZE + n * record_bytes
    if os.fstat(fd).st_size > size:
        os.ftruncate(fd, size)
        os.fsync(fd)


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


def create_kv(path: str, layout: CacheLayout) -> int:
    """Create a new KV file (mode 0600, never over an existing one) holding just the header.
    On failure the descriptor is closed; the file (if it was made) is the caller's to remove."""
    fd = open_file(path, "session file", os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        os.fchmod(fd, 0o600)
        _pwrite_all(fd, memoryview(layout.header(0).pack()), 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def changed_since_open(fd: int, path: str, records_bytes: int) -> str | None:
    """How another program changed the KV file open as `fd` since then ("removed", "given another name
    (a hard link)", "cut short" below its header and `records_bytes` (truncate -s, in place), or
    "replaced" at `path`), or None: the writer's next save is not to go through such a file."""
    st = os.fstat(fd)
    try:
        cur = os.lstat(path)
    except FileNotFoundError:
        return "removed"
    same = (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino)
    if same and st.st_nlink == 1 and st.st_size >= HEADER_SIZE + records_bytes:
        return None
    return "given another name (a hard link)" if same and st.st_nlink != 1 else "cut short" if same else "replaced"


def create_kv_in_place(directory: str, path: str, layout: CacheLayout) -> int:
    """An empty KV file at `path` in `directory`, made whole under PATH.tmp, then renamed over whatever
    is there (a session opened from its sidecar alone: its broken file, or none); its descriptor.
    OSError with no PATH.tmp left (an error after the rename leaves the new file)."""
    tmp, fd = path + ".tmp", None
    try:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        fd = create_kv(tmp, layout)
        os.rename(tmp, path)
        fsync_dir(directory)
    except OSError:
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return fd


def read_nrec_if_empty(path: str) -> bool:
    """True if `path` is a KV file of a session that holds nothing: a whole header, nrec 0."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_SIZE)
    except OSError:
        return False
    return len(raw) == HEADER_SIZE and raw[:8] in KIND_OF_MAGIC and HEADER.unpack(raw)[7] == 0


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SavedRecords:
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
