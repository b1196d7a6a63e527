"""Where colichat keeps things: sessions (data), input history (state), re-creatable caches (cache).

COLICHAT_HOME, when set, holds all three as data/, state/ and cache/ (tests use it; a relative one is
taken from the current directory at start, and `~` is expanded); otherwise the
XDG directories from platformdirs (~/.local/share/colichat, ~/.local/state/colichat, ~/.cache/colichat);
without a home directory (no absolute HOME, none in passwd either), a SessionError says to set one.
Every directory colichat creates is 0700 and every file 0600, whatever the umask: conversations are
private (`private_dir`, `private_file`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import SessionError


@dataclass(frozen=True)
class Paths:
    data: Path  # sessions (what a user keeps)
    state: Path  # history
    cache: Path  # dequantized weights and other re-creatable files


NO_HOME = ("HOME is not set (or not an absolute path) and this user has no home directory")


def _home() -> str | None:
    """The home directory `~` stands for: HOME when it is an absolute path, else the user database's
    (as platformdirs takes it); None if there is neither."""
    home = os.environ.get("HOME", "")
    if os.path.isabs(home):
        return home
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_dir or None
    except (ImportError, KeyError):
        return None


def expand_home(path: str, error: type[Exception], given: str = "") -> str:
    """`path` with a leading `~` or `~user` expanded (the shell leaves one after `=`, or quoted, as it is);
    `error` (the caller's kind of user error) where `~` has no home directory to stand for, its
    message naming the path as `given` it (an option or variable before it)."""
    if not path.startswith("~"):
        return path
    user, _, rest = path[1:].partition(os.sep)
    if user:
        expanded = os.path.expanduser(path)
        if expanded.startswith("~"):
            raise error(f"{given}{path}: there is no user {user} whose home directory ~{user} would be; "
                        "give the full path")
        return expanded
    home = _home()
    if home is None:
        raise error(f"{given}{path}: ~ cannot be expanded: {NO_HOME}; give the full path, or set HOME")
    return os.path.join(home, rest) if rest else home


def paths() -> Paths:
    home = os.environ.get("COLICHAT_HOME")
    if home:
        h = Path(os.path.abspath(expand_home(home, SessionError, "COLICHAT_HOME=")))  # (colichat never chdirs)
        return Paths(h / "data", h / "state", h / "cache")
    import platformdirs

    try:
        return Paths(Path(platformdirs.user_data_dir("colichat")), Path(platformdirs.user_state_dir("colichat")),
                     Path(platformdirs.user_cache_dir("colichat")))
    except RuntimeError:  # platformdirs: no absolute HOME, and the user has no home directory in passwd
        raise SessionError(f"cannot tell where to keep conversations: {NO_HOME}; set HOME, or COLICHAT_HOME "
                           "to a directory for colichat's files") from None


def private_dir(directory) -> Path:
    """Create the missing directories down to `directory`, each mode 0700 (an existing one is left
    as it is). OSError if one cannot be made."""
    directory = Path(directory)
    missing = []
    d = directory
    while not os.path.lexists(d):
        missing.append(d)
        d = d.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            continue
        os.chmod(d, 0o700)  # mkdir's mode is masked by the umask
    return directory


def private_file(path, flags: int) -> int:
    """The `opener` for open(): files created mode 0600 whatever the umask."""
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)
    except OSError:
        os.close(fd)
        raise
    return fd
