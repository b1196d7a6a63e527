"""Files colichat reads only as hints: what they say saves work, and without them it is only slower.

    hint = read_hint(path, parse, limit)   # Hint(value, problem): parse(bytes) -> value
    said = Said(on_note)                   # each problem said once a run: said(path, "what; what now")

A hint is the prefix index (persist/prefixes.py), the experts' use counts and the weights cache's meta
(engine/gguf/prepared.py), the last-used mark (persist/store.py), the Hugging Face cache's refs and its
list of agent harnesses (models/hub.py); an interrupted rename's mark (persist/renaming.py) is read here too.
Whatever lies at such a path, reading it never hangs, never reads without end, never raises: it is opened
without blocking and without following a last link (a FIFO or a device is refused before a byte is read,
by fstat on the open descriptor), read up to `limit` bytes (more: refused), and parsed here, where any error
(ValueError, UnicodeDecodeError, RecursionError of deep nesting, MemoryError, OSError, a wrong shape:
KeyError, TypeError, IndexError) becomes a problem of one line. The caller ignores it, rebuilds the hint
where it can (it writes a new one whole, over whatever was there) and says it once (Said). A missing file
is no problem: there is no hint yet.

A leaf beside errors.py and paths.py: the engine reads its hints through it too.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any, NamedTuple

LIMIT = 1 << 20  # bytes a hint holds at most, unless its reader says otherwise
CHUNK = 1 << 20  # bytes read at a time


class Hint(NamedTuple):
    value: Any  # what parse returned; None: nothing to use
    problem: str | None  # why the file there cannot be used (one line); None: it could, or there is none


def read_hint(path, parse, limit: int = LIMIT) -> Hint:
    """The hint at `path`, parsed by `parse(bytes)`; Hint(None, None) where there is no file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return Hint(None, None)
    except OSError as e:
        return Hint(None, "a link" if e.errno == errno.ELOOP else (e.strerror or str(e)))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            return Hint(None, f"{_kind(mode)}, not a file")
        parts, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(CHUNK, limit + 1 - size))
            if not chunk:
                break
            parts.append(chunk)
            size += len(chunk)
        data = b"".join(parts)
        if size > limit:
            return Hint(None, f"larger than {limit:,} bytes")
    except OSError as e:
        return Hint(None, e.strerror or str(e))
    finally:
        os.close(fd)
    try:
        return Hint(parse(data), None)
    except (ValueError, RecursionError, MemoryError, OSError, EOFError, KeyError, TypeError, IndexError,
            AttributeError) as e:  # (UnicodeDecodeError and json's JSONDecodeError are ValueErrors)
        return Hint(None, _why(e))


def _kind(mode: int) -> str:
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "not a regular file")


def _why(e: BaseException) -> str:
    """What was wrong in the file's contents, in a few words."""
    if isinstance(e, RecursionError):
        return "nested too deep"
    if isinstance(e, MemoryError):
        return "too large to read"
    if isinstance(e, UnicodeDecodeError):
        return "not UTF-8"
    text = str(e).splitlines()[0][:120] if str(e) else ""
    if isinstance(e, (KeyError, TypeError, IndexError, AttributeError)):
        return "not in the expected shape"
    return text or type(e).__name__


class Said:
    """The hints found unusable in this run, each said once through `on_note(line)`."""

    def __init__(self, on_note=None):
        self.on_note = on_note
        self.said: set[str] = set()

    def __call__(self, path, line: str) -> None:
        if str(path) not in self.said:
            self.said.add(str(path))
            if self.on_note is not None:
                self.on_note(line)
