"""Where sessions live, and what is done to them as a whole: create, claim, open, delete, rename.

    store = Store()                            # sessions under paths().data / "sessions"
    sess = store.create(ident, layout, name=None, sampler=None)   # new empty session, locked
    sess = store.claim(ident, name, layout, sampler=None)   # the same, its files made by the first save
    sess = store.open(ident, name, layout)     # existing session, locked (then sess.load(...))
    store.list(ident=None) -> [SessionInfo]    # newest first; all models when ident is None (listing.py)
    store.latest(ident) -> SessionInfo | None
    store.is_empty(ident, name)                # an empty session left on disk: no conversation
    store.rename(sess, new)                    # an open session under another name
    store.delete(ident, name) -> bytes freed
    store.dirs_for(fingerprint) -> [Path]      # a model's session directories, before it loads
    store.refuse_elsewhere(name, hint=...)     # SessionError if another model has session NAME

Layout on disk: <data>/sessions/<model dir>/NAME.{coli_kv,json,lock}, where the model dir is the
sanitized model name plus 12 hex digits of the weights fingerprint (identity.py), so two fine-tunes
of one base model never share sessions. Directories are created 0700, session files 0600.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import stat
import time
from pathlib import Path
from typing import Callable

from ..hints import Said, read_hint
from ..paths import paths, private_dir
from . import renaming
from .identity import dir_suffix, model_dirname
from .kvfile import CacheLayout, SessionError, fsync_dir, oserror_text
from .listing import SessionInfo, damaged_text, dir_layout, holds_or_damaged, model_file_now, session_info
from .locks import SessionBusy, flock_for_save, release_lock, remove_lock, take_lock
from .names import KV_EXT, NAME_RE, SIDECAR_EXT, auto_name, check_name, holds_conversation, remove_leftovers
from .prefixes import PrefixIndex
from .session import Session


class SessionExists(SessionError):
    """A new session was asked for under a name that holds a conversation."""


PREFIXES = "prefixes"  # beside the sessions directory: per model, the prefix index (prefixes.py)
LAST_USED = "last-used"  # beside the sessions directory: per model, the conversation last reopened (Store.used)


def _marked(data: bytes) -> str:
    """The name a last-used mark holds (ValueError: not a conversation's name)."""
    name = data.decode("utf-8").strip()
    if not NAME_RE.fullmatch(name):
        raise ValueError("not a conversation's name")
    return name


def _open_to_remove(path: str) -> int | None:
    """A regular KV file opened and flocked exclusively before its removal (a reader without the
    session's lock holds it shared while it reads: locks.reading); None if there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    flock_for_save(fd)
    return fd


class Store:
    def __init__(self, root: str | os.PathLike | None = None, on_note=None, clock: Callable[[], float] = time.time):
        self.root = Path(root) if root is not None else paths().data / "sessions"
        self.said = Said(on_note)  # the hints beside the sessions (prefix index, last-used mark) found unusable
        self.clock = clock  # epoch seconds: when a conversation was saved or reopened (tests inject one)

    def model_dir(self, ident: dict) -> Path:
        """The model's session directory: the one named after it, else the one its weights already have
        under another name (a GGUF without general.name is named after its file, which may have been
        renamed or reached through another path since: its conversations stay its own)."""
        named = self.root / model_dirname(ident)
        if os.path.lexists(named):
            return named
        return next(iter(sorted(self.dirs_for(ident["fingerprint"]))), named)

    def create(self, ident: dict, layout: CacheLayout, name: str | None = None,
               sampler: dict | None = None, stem: str | None = None, files: bool = True) -> Session:
        """A new empty session (locked); `name=None` picks a fresh name from `stem` (a slug of the
        first message), else from the time. `files=False`: its files are made by its first save,
        whole (a conversation saved there at once never shows as an empty session)."""
        directory = self._make_dir(self.model_dir(ident))
        make = Session.create if files else Session.claim
        if name is not None:
            try:
                return make(directory, check_name(name), ident, layout, sampler, self.clock)
            except FileExistsError:
                raise self._exists(directory, name) from None
        busy: set[str] = set()
        while True:
            taken = {p.stem for p in directory.iterdir() if p.suffix in (KV_EXT, SIDECAR_EXT)} | busy
            name = auto_name(taken, stem)
            try:
                return make(directory, name, ident, layout, sampler, self.clock)
            except (FileExistsError, SessionBusy):
                busy.add(name)  # another colichat took the same name just now

    def claim(self, ident: dict, name: str, layout: CacheLayout, sampler: dict | None = None) -> Session | None:
        """A new session NAME, locked now, whose files the first save creates. SessionExists if the
        name holds a conversation, SessionBusy if another colichat has it; None if the session
        directory cannot be made (nothing can be saved there: the first save says why)."""
        check_name(name)
        try:
            directory = self._make_dir(self.model_dir(ident))
        except SessionError:
            return None
        renaming.finish_renames(str(directory))
        try:
            return Session.claim(directory, check_name(name), ident, layout, sampler, self.clock)
        except FileExistsError:
            raise self._exists(directory, name) from None

    def _exists(self, directory: Path, name: str) -> SessionExists:
        """NAME holds something: the damage line /sessions shows (SessionError), else SessionExists."""
        self._refuse_damaged(directory, name)
        return SessionExists(f"session {name} already exists; resume it with /resume {name} "
                             "or choose another name")

    def open(self, ident: dict, name: str, layout: CacheLayout, read_only: bool = False) -> Session:
        """An existing session of this model, locked for writing (or `read_only`); load it next."""
        directory = self.model_dir(ident)
        check_name(name)
        renaming.finish_renames(str(directory))
        if not any(os.path.lexists(directory / (name + ext)) for ext in (KV_EXT, SIDECAR_EXT)):
            self.refuse_elsewhere(name)
        self._refuse_damaged(directory, name, layout)
        return Session.open(directory, name, ident, layout, read_only, self.clock)

    def is_empty(self, ident: dict, name: str) -> bool:
        """Whether NAME of this model is an empty session left on disk (no records, no turns): no
        conversation, though `open` opens it (the chat program refuses it as it lists it: not at all)."""
        base = self.model_dir(ident) / check_name(name)
        return os.path.lexists(str(base) + KV_EXT) and not holds_or_damaged(base)

    def refuse_elsewhere(self, name: str, hint: str | None = None) -> None:
        """SessionError 'session NAME belongs to another model (MODEL, last run from PATH); HINT' if
        another model has a loadable session NAME (asked where the model in use has none of that name).
        The hint by default: the command that reopens it, where its model's file is still there."""
        found = [i for i in self.list() if i.name == name]  # newest first
        infos = [i for i in found if not i.damage]
        if not infos:
            if found:  # (a damaged one: not a new conversation of that name beside it, unsaid)
                raise SessionError(f"session {name} of another model ({found[0].model_dir}) is damaged "
                                   f"({found[0].damage}); start colichat with that model's --model PATH to "
                                   "see it in /sessions, or choose another name")
            return
        there = [p for p in map(model_file_now, infos) if p]
        if hint is None:
            hint = (f"colichat --model {shlex.quote(there[0])} --session {name} reopens it" if there
                    else "start colichat with that model to resume it")
        raise SessionError(f"session {name} belongs to another model ({self.whose(infos)}); {hint}")

    @staticmethod
    def whose(infos: list[SessionInfo]) -> str:
        """'MODEL, last run from PATH[, not there now]; ...': the models that saved these sessions."""
        return "; ".join(model if not path else f"{model}, last run from {path}" if os.path.isfile(path)
                         else f"{model}, last run from {path}, not there now"
                         for model, path in sorted({(i.model, i.model_path) for i in infos}))

    @staticmethod
    def _refuse_damaged(directory: Path, name: str, layout: CacheLayout | None = None) -> None:
        """SessionError with the line /sessions shows, if NAME is there but cannot be a session
        (a link, a special file, a file we may not read, a sidecar or a header opening cannot use
        keep the refusals that name the cause and what to do)."""
        info = session_info(directory, name, layout or dir_layout(directory))
        if info and info.damage and not info.damage.startswith(
                ("cannot read", "the KV file is", "the sidecar is", "a cache of another")):
            raise SessionError(f"session {damaged_text(name, info.damage)}")

    def delete(self, ident: dict, name: str) -> int:
        """Remove a saved session of this model and return the bytes freed. Its lock is taken first,
        so a session open in another colichat is refused. The sidecar goes first: a crash in between
        leaves a bare KV file, which still loads (as one imported turn) and can be deleted again."""
        directory = self.model_dir(ident)
        check_name(name)
        base = os.path.join(str(directory), name)
        if not any(os.path.lexists(base + ext) for ext in (KV_EXT, ".json")):
            raise SessionError(f"no session named {name} for this model (/sessions lists them)")
        paths = (base + SIDECAR_EXT, base + KV_EXT, base + SIDECAR_EXT + ".tmp", base + KV_EXT + ".tmp")
        for path in paths:  # checked before anything goes: a directory there is not colichat's to remove
            if os.path.isdir(path) and not os.path.islink(path):
                raise SessionError(f"cannot delete session {name}: {path} is a directory, which colichat did not "
                                   f"make; nothing was deleted (remove it yourself: rm -r '{path}')")
        fd = take_lock(base + ".lock", name)
        freed, gone = 0, False
        kv = _open_to_remove(base + KV_EXT)  # a reader without the lock (--export) ends its read first
        try:  # links are removed, never followed; the temporary files of an interrupted save go too
            for path in paths:
                try:
                    freed += os.lstat(path).st_size
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    raise SessionError(f"cannot delete session {name}: {oserror_text(e)}") from None
            fsync_dir(str(directory))
            gone = True
        finally:
            if kv is not None:
                os.close(kv)
            if gone:  # its lock file too
                remove_lock(fd, base + ".lock")
            else:
                release_lock(fd)
        self.prefix_index(ident).drop(name)
        return freed

    def rename(self, sess: Session, new: str) -> None:
        """Give an open session another name. Both files are linked under the new name before the
        old names go, so a crash in between leaves the conversation under both names, never none.
        A reader without the lock (--no-save, --export) ends its read first (Session._saving)."""
        with sess._saving():
            self._rename(sess, new)

    def _rename(self, sess: Session, new: str) -> None:
        check_name(new)
        base, old = os.path.join(sess.directory, new), os.path.join(sess.directory, sess.name)
        fd = take_lock(base + ".lock", new)
        try:
            if holds_conversation(base):  # (a link or a special file there is a SessionError naming it)
                raise SessionError(f"session {new} already exists: choose another name")
            try:
                remove_leftovers(base)  # an empty session or an interrupted create: no conversation
            except OSError as e:
                raise SessionError(f"cannot rename session {sess.name} to {new}: {oserror_text(e)}") from None
            exts: list[str] = []
            done: list[str] = []
            try:
                renaming.mark(sess.directory, new, sess.name)
                for ext in (KV_EXT, SIDECAR_EXT):  # (an error here must not read as "no such file")
                    try:
                        os.lstat(old + ext)
                        exts.append(ext)
                    except FileNotFoundError:
                        pass
                for ext in exts:
                    os.link(old + ext, base + ext)
                    done.append(base + ext)
                fsync_dir(sess.directory)
            except OSError as e:
                for path in done:
                    os.unlink(path)
                renaming.unmark(sess.directory, new)
                raise SessionError(f"cannot rename session {sess.name}: {oserror_text(e)}") from None
            try:
                for ext in reversed(exts):
                    os.unlink(old + ext)
                fsync_dir(sess.directory)
                copy = False
            except OSError:
                copy = True  # the old name stays as a second copy; /delete removes it
            renaming.unmark(sess.directory, new)
        except BaseException:
            release_lock(fd)
            raise
        if copy:  # the old name keeps its files: its lock file may serve them
            release_lock(sess._lock_fd)
        else:
            remove_lock(sess._lock_fd, old + ".lock")
        sess._lock_fd, sess.name = fd, new
        sess.kv_path, sess.json_path = base + KV_EXT, base + SIDECAR_EXT
        if copy and sess.on_disk:  # a copy, not a second link to the files this session writes
            try:
                sess._check_files(sess.turns, sess._crcs)
                sess._write_sidecar(sess.turns, sess._crcs)
                sess.notes.clear()
            except (OSError, SessionError):
                pass  # the next save writes the file again (it sees the second link)

    def dirs_for(self, fingerprint: str) -> list[Path]:
        """The session directories of the model with this weights fingerprint (found before it loads)."""
        try:
            return [p for p in self.root.iterdir() if p.name.endswith(dir_suffix(fingerprint)) and p.is_dir()
                    and not p.is_symlink()]
        except OSError:
            return []

    def list(self, ident: dict | None = None) -> list[SessionInfo]:
        """Sessions of one model (or all), newest first. Never raises on damaged entries; a directory
        that cannot be read (an I/O error) is a SessionError naming it."""
        if ident is not None:
            dirs = [self.model_dir(ident)]
        else:
            try:
                dirs = [p for p in self.root.iterdir() if p.is_dir() and not p.is_symlink()]
            except OSError:
                dirs = []
        infos = []
        for d in dirs:
            renaming.finish_renames(str(d))
            try:
                names = [p.name[: -len(ext)] for p in d.iterdir() for ext in (KV_EXT, ".json")
                         if p.name.endswith(ext)]
            except (FileNotFoundError, NotADirectoryError):
                continue  # (no conversation of that model yet)
            except OSError as e:  # said as what failed: not "no such session", then "already exists"
                raise SessionError(f"cannot list the conversations in {d}: {oserror_text(e)}") from None
            layout = dir_layout(d)
            infos += [i for i in (session_info(d, n, layout) for n in sorted(set(names)) if NAME_RE.fullmatch(n))
                      if i]
        return sorted(infos, key=lambda i: (i.last_used, i.name), reverse=True)

    def latest(self, ident: dict) -> SessionInfo | None:
        """The conversation of this model last used: the one last reopened (`used`) if that was after
        the newest save, else the newest saved."""
        found = [i for i in self.list(ident) if not i.damage]
        mark = self.root.parent / LAST_USED / self.model_dir(ident).name
        name, problem = read_hint(mark, _marked, 4096)
        if problem:
            self.said(mark, f"the last-used mark {mark} cannot be used ({problem}): ignored until a conversation "
                            "is reopened")
        try:
            when = mark.stat().st_mtime  # (when it was reopened)
        except OSError:
            name = None
        if name is None:
            return found[0] if found else None
        used = next((i for i in found if i.name == name), None)
        return used if used is not None and when > found[0].last_used else (found[0] if found else None)

    def prefix_index(self, ident: dict) -> PrefixIndex:
        """This model's prefix index (prefixes.py): a small file in PREFIXES beside the sessions directory."""
        directory = self.model_dir(ident)
        return PrefixIndex(self.root.parent / PREFIXES / (directory.name + ".json"), directory, self.said)

    def used(self, ident: dict, name: str) -> None:
        """Conversation NAME was reopened now: `latest` names it until another is saved or reopened. A
        small file per model in LAST_USED beside the sessions directory, written whole (nothing under the
        sessions directory is touched: reopening a conversation writes nothing of it); where it cannot be
        written, nothing is said."""
        mark = self.root.parent / LAST_USED / self.model_dir(ident).name
        tmp = mark.with_name(mark.name + ".tmp")
        try:
            private_dir(mark.parent)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
            try:
                os.write(fd, name.encode("utf-8"))
            finally:
                os.close(fd)
            now = self.clock()
            os.utime(tmp, (now, now))  # (its time is when, compared with the saves' times)
            os.replace(tmp, mark)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    @staticmethod
    def _make_dir(directory: Path) -> Path:
        """Create missing directories down to `directory`, each 0700."""
        try:
            private_dir(directory)
        except OSError as e:
            raise SessionError(f"cannot create session directory {e.filename or directory}: "
                               f"{oserror_text(e)}") from None
        if not directory.is_dir():
            raise SessionError(f"session directory {directory} is not a directory")
        return directory
