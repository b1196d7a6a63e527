"""Where a conversation is kept: the session (persist.Session) it is saved into, in the Store.

With saving on, the session file is created at the first answer (named --session NAME, else from
the first message), so starting colichat and quitting leaves nothing behind. With `save_new` off
(one-shot runs and messages from a pipe, without --session), a new conversation is saved only by
/save NAME; a resumed one is still saved after every answer. `store` None means no sessions at all;
`read_only` that sessions can be read, not saved (a read-only file system), and `no_save` the same
by choice (--no-save: nothing is written, and what would write, /save, /rename, /delete, is refused).
"""

from __future__ import annotations

import os

import numpy as np

from ..errors import ChatError
from ..persist import CacheLayout, SaveFailed, Session, SessionError, SessionExists, Store, check_name, slug
from ..persist.listing import total_line, under_parents
from ..units import count, format_size
from ..wrap import displayable

MIN_REUSE = 32  # tokens: a shorter shared prefix is prefilled (reading a file for it would cost as much)
CURRENT_MARK = "* "  # in /sessions, the row of the conversation in use (the others start with two spaces)


class Saving:
    def __init__(self, store: Store | None, ident: dict | None, layout, name: str | None = None,
                 save_new: bool = True, read_only: bool = False, rope_factors=lambda: None, no_save: bool = False,
                 n_ctx: int | None = None):
        # () -> CacheLayout: the cache's layout now (its codec is the conversation's), or a fixed one
        self._layout = layout if callable(layout) else lambda: layout
        self.store, self.weights_ident = store, ident
        self.n_ctx = n_ctx  # the context size the conversation runs with: reopening it takes it again
        self.rope_factors = rope_factors  # () -> the rope factors the cache rows are rotated with now
        self.session: Session | None = None  # once created, claimed or resumed
        self.name = name
        self.stem: str | None = None  # the name a new conversation's first save takes (else its first message's)
        self.save_new = save_new
        self.read_only = read_only or no_save
        self.no_save = no_save or store is None

    @property
    def layout(self) -> CacheLayout:
        return self._layout()

    @property
    def ident(self) -> dict | None:
        """What a session records about the model: its weights, the context size it runs with
        ("n_ctx": --session NAME and --resume reopen it with that one, sessions.resume_context), and
        the rope factors the cache rows are rotated with now (where they depend on the context size:
        Model.rope_factors)."""
        if self.weights_ident is None:
            return None
        rope = self.rope_factors()
        ident = self.weights_ident if self.n_ctx is None else {**self.weights_ident, "n_ctx": self.n_ctx}
        return ident if rope is None else {**ident, "rope_factors": rope}

    # --- the session in use -----------------------------------------------------------------------

    def claim(self, name: str, settings: dict) -> None:
        """Take --session NAME at start (saving is on): it is ours from now on, so a second colichat
        started with the same name is refused before its first answer. The first answer's save
        creates the files."""
        try:
            self.session = self.store.claim(self.ident, name, self.layout, settings)
        except SessionExists:
            raise ChatError(f"session {name} already exists: add --resume to continue it, "
                            "or choose another name") from None
        self.name = name

    def open(self, name: str | None) -> tuple[Session, str]:
        """Open saved session NAME (the latest by default) to load; it is not in use until `adopt`."""
        if not self.store:
            raise ChatError("saving is off (--no-save): nothing to resume")
        if name is None:
            info = self.store.latest(self.ident)
            if info is None:
                raise ChatError("no saved conversation for this model yet")
            name = info.name
        if self.session and self.session.name == name:
            raise ChatError(f"already in session {name}")
        if self.store.is_empty(self.ident, name):  # as /sessions shows it: not at all
            self.store.refuse_elsewhere(name)
            raise ChatError(f"no session named {name} for this model (/sessions lists them)")
        return self.store.open(self.ident, name, self.layout, read_only=self.read_only), name

    def adopt(self, session: Session, name: str) -> None:
        """Go on in `session` (loaded); the one in use is closed. It is the latest used from now on."""
        if self.session:
            self.session.close()
        self.session, self.name, self.stem = session, name, None
        if not self.read_only:
            self.store.used(self.ident, name)

    def leave(self) -> str | None:
        """The next conversation is a new one: close the session in use; its name if it is on disk."""
        old = self.session.name if self.session and self.session.on_disk else None
        self.close()
        self.name = self.stem = None
        return old

    def close(self) -> None:
        if self.session:
            self.session.close()
            self.session = None

    def _refuse_unless_writable(self, nothing: str) -> None:
        """With --no-save, or on a read-only file system: say so, rather than try (and fail with the OS's error)."""
        if self.no_save:
            raise ChatError(f"saving is off (--no-save): {nothing}")
        if self.read_only:
            raise ChatError(f"the conversations are on a read-only file system: {nothing}")

    def rename(self, new: str) -> str:
        """Give the current conversation another name (its files are renamed, nothing is rewritten)."""
        self._refuse_unless_writable("nothing is renamed")
        if not self.session:
            raise ChatError("this conversation is not saved yet: /save NAME saves it under that name")
        old = self.session.name
        if new == old:  # (its own lock would call it "open in another colichat")
            raise ChatError(f"this conversation is already called {new}")
        self.store.rename(self.session, new)
        self.name = new
        return f"renamed session {old} to {new}"

    def disk_bytes(self) -> int:
        if not self.session:
            return 0
        total = 0
        for path in (self.session.kv_path, self.session.json_path):
            try:
                total += os.path.getsize(path)
            except OSError:
                pass
        return total

    # --- writing ----------------------------------------------------------------------------------

    def save(self, cache, turns: list, settings: dict, stats, keep: int | None = None) -> None:
        """Append the unsaved turns, with the settings in use (options given at start and a /set whose
        own save failed are written here); a failure is reported in `stats` and the conversation goes
        on in memory. `keep`: the saved session keeps only its first `keep` turns, the others replaced
        by the turns after them in one commit (Session.append)."""
        if not self.store or self.read_only:
            return
        if self.session is None and not self.save_new:
            return
        try:
            if self.session is None:
                first = next((t.text for t in turns if t.role == "user"), "")
                self.session = self.store.create(self.ident, self.layout, self.name, settings,
                                                 stem=self.stem or slug(first), files=False)
                self.name, self.stem = self.session.name, None
            self.session.append(cache, turns, settings, keep)
            self._index(cache)
            stats.saved = True
            stats.save_note = "; ".join(self.session.notes) or None
            self.session.notes.clear()
        except (SessionError, OSError) as e:
            stats.saved = False
            stats.save_error = str(e).splitlines()[0] if str(e) else type(e).__name__

    def _index(self, cache) -> None:
        """The prefix index learns what the session in use holds now (what it has on disk)."""
        s, index = self.session, self.store.prefix_index(self.ident)
        if not s.turns:  # (rewound to nothing, or reset)
            index.drop(s.name)
        elif s.nrec <= cache.length:
            index.record(s.name, cache.codec, cache.tokens[: s.nrec], [t.last for t in s.turns])

    def reuse(self, cache, ids: list[int]) -> tuple[int, str | None]:
        """Fill the empty `cache` with the records of the longest prefix of `ids` (all but its last token,
        whose logits the prompt needs) that a saved conversation of this model holds in the cache's
        codec, found by the prefix index and read as /resume reads (header, fingerprint, checksums;
        the conversation's own files are not written): (tokens reused, NAME), or (0, None)."""
        if not self.store or self.ident is None or cache.length:
            return 0, None
        codec = cache.codec
        for shared, name in self.store.prefix_index(self.ident).candidates(codec, ids[:-1])[:3]:
            if shared < MIN_REUSE:
                break
            try:
                source = self.store.open(self.ident, name, self.layout, read_only=True)
            except (SessionError, OSError):
                continue
            try:
                res = source.load(cache, cache.capacity)
            except (SessionError, OSError):
                res = None
            finally:
                source.close()
            n = 0
            if res is not None and not res.unread and cache.codec == codec:  # (records, not text read again)
                have = cache.tokens[: min(cache.length, len(ids) - 1)]
                n = int(np.argmin(np.append(have == np.asarray(ids[: have.size]), False)))  # common prefix
            cache.set_codec(codec)
            if n >= MIN_REUSE:
                cache.truncate(n)
                return n, name
            cache.set_length(0)
        return 0, None

    def save_settings(self, settings: dict) -> None:
        if self.session and not self.read_only:
            try:
                self.session.save_sampler(settings)
            except (SessionError, OSError):
                pass  # saved again with the next answer

    def truncate(self, cache, kept_turns: int, settings: dict, keep_files: bool = False) -> None:
        """The saved session keeps its first kept_turns turns (`cache` was cut to match), and the
        settings in use (`keep_files`: see Session.truncate)."""
        if self.session and not self.read_only:
            try:
                self.session.truncate(kept_turns, settings, keep_files)
            except SessionError as e:
                raise ChatError(str(e)) from None
            self._index(cache)

    def save_as(self, name: str, cache, turns: list, settings: dict) -> str:
        """Write the conversation from the cache into a new session NAME (no forward pass). An
        unsaved conversation goes on in it; a saved one goes on in its own, NAME is a copy."""
        self._refuse_unless_writable("nothing can be saved")
        if not turns:
            raise ChatError("nothing to save yet: the conversation is empty")
        if self.session and self.session.name == name:
            saved = "" if self.read_only else ", saved after every answer"
            raise ChatError(f"session {name} is this conversation{saved} (/save NAME keeps a copy under another name)")
        try:
            copy = self.store.create(self.ident, self.layout, check_name(name), settings, files=False)
        except SaveFailed as e:
            raise self._copy_failed(e, name) from None
        try:
            copy.append(cache, turns)  # the copy's files appear whole or not at all
        except SaveFailed as e:
            raise self._copy_failed(e, name) from None
        finally:
            if not copy.on_disk:
                copy.close()
        if self.session is None:
            self.session, self.name = copy, name
            return f"saved to session {name}; the conversation goes on in it"
        copy.close()
        return f"saved a copy as session {name} (the conversation goes on in {self.session.name})"

    def fork(self, cache, turns: list, branch: int, settings: dict) -> str:
        """/fork: `turns`, this conversation's first `branch` exchanges, into a new session PARENT-fork
        (-2, -3, ...: the first free name), from the session's KV file where it holds them as saved,
        else from the cache (Session.fork): no forward pass. The conversation goes on in the fork; the
        session in use stays on disk as it is."""
        self._refuse_unless_writable("nothing can be forked")
        parent = self.session
        if parent is None or not parent.on_disk:
            raise ChatError("this conversation is not saved: /save NAME saves it, then /fork forks it")
        new = self.store.create(self.ident, self.layout, None, settings, stem=f"{parent.name[:54]}-fork", files=False)
        try:
            copied = parent.fork(new, cache, turns, branch)
        except BaseException as e:
            new.close()  # (no file of it is left: Session.fork)
            if isinstance(e, SaveFailed):
                raise ChatError(f"{e.what}; nothing was written (free some space, then /fork again)") from None
            raise
        parent.close()
        self.session, self.name = new, new.name
        how = f"copied from {parent.name}'s file" if copied else "written from memory"
        return (f"forked {parent.name} after exchange {branch}: the conversation goes on in {new.name} "
                f"({count(turns[-1].last, 'token')} {how}, no re-prefill); {parent.name} stays saved as it was "
                f"(/rename NEW names the fork)")

    def lineage(self) -> tuple[str, int] | None:
        """(parent, branch) if the conversation in use is a fork (Session.parent, .branch), else None."""
        s = self.session
        return (s.parent, s.branch) if s is not None and s.parent else None

    @staticmethod
    def _copy_failed(e: SaveFailed, name: str) -> ChatError:
        """A /save that could not be written: it is not retried (the next save is the conversation's own)."""
        return ChatError(f"{e.what}; nothing was written (free some space, then /save {name} again)")

    # --- the other saved conversations of this model ------------------------------------------------

    def latest_hint(self) -> str | None:
        if not self.store:
            return None
        info = self.store.latest(self.ident)
        if info is None:
            return None
        return f"latest saved conversation: {displayable(info.describe())} (/resume to continue it)"

    def names(self) -> list[str]:
        """This model's saved conversations, newest first (for Tab completion)."""
        return [i.name for i in self.store.list(self.ident)] if self.store else []

    def listing(self) -> list[str]:
        if not self.store:
            raise ChatError("saving is off (--no-save): no sessions")
        current = self.session.name if self.session else None
        return [(CURRENT_MARK if i.name == current else "  ") + "  " * depth + displayable(i.describe())
                for i, depth in under_parents(self.store.list(self.ident))]

    def total(self) -> str:
        """The foot of /sessions: how many conversations this model has, and their bytes on disk."""
        return total_line(self.store.list(self.ident))

    def delete(self, name: str) -> str:
        """Delete a saved conversation of this model (not the one in use)."""
        self._refuse_unless_writable("no session is deleted")
        if self.session and self.session.name == name:
            raise ChatError(f"session {name} is the current conversation: /new first, then /delete {name}")
        freed = self.store.delete(self.ident, name)
        return f"deleted session {name} ({format_size(freed)})"
