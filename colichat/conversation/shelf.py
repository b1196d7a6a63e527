"""A model's shelf: its saved conversations in the Store, as the conversation and the commands see them.

The conversation (chat.Conversation) takes its session from here (claimed, created, opened) and
writes it itself; /sessions, /delete and Tab completion ask the shelf. `store` None means no
sessions at all; `read_only` that sessions can be read, not saved (a read-only file system), and
`no_save` the same by choice (--no-save: nothing is written, and what would write, /save, /rename,
/delete, is refused). With `save_new` off (one-shot runs and messages from a pipe, without
--session), a new conversation is saved only by /save NAME; a resumed one is still saved after
every answer.
"""

from __future__ import annotations

import numpy as np

from ..errors import ChatError
from ..persist import CacheLayout, Session, SessionError, SessionExists, Store
from ..persist.listing import total_line, under_parents
from ..units import format_size
from ..wrap import displayable

MIN_REUSE = 32  # tokens: a shorter shared prefix is prefilled (reading a file for it would cost as much)
CURRENT_MARK = "* "  # in /sessions, the row of the conversation in use (the others start with two spaces)


class Shelf:
    """The saved conversations of one model (`ident`, persist.model_identity) in `store`."""

    def __init__(self, store: Store | None, ident: dict | None, layout, save_new: bool = True,
                 read_only: bool = False, rope_factors=lambda: None, no_save: bool = False, n_ctx: int | None = None):
        # () -> CacheLayout: the cache's layout now (its codec is the conversation's), or a fixed one
        self._layout = layout if callable(layout) else lambda: layout
        self.store, self.weights_ident = store, ident
        self.n_ctx = n_ctx  # the context size the conversation runs with: reopening it takes it again
        self.rope_factors = rope_factors  # () -> the rope factors the cache rows are rotated with now
        self.save_new = save_new
        self.read_only = read_only or no_save
        self.no_save = no_save or store is None

    @property
    def layout(self) -> CacheLayout:
        return self._layout()

    @property
    def ident(self) -> dict | None:
        """What a session records about the model: its weights, the context size it runs with
        ("n_ctx": --session NAME and --resume reopen it with that one, reopen.resume_context), and
        the rope factors the cache rows are rotated with now (where they depend on the context size:
        Model.rope_factors)."""
        if self.weights_ident is None:
            return None
        rope = self.rope_factors()
        ident = self.weights_ident if self.n_ctx is None else {**self.weights_ident, "n_ctx": self.n_ctx}
        return ident if rope is None else {**ident, "rope_factors": rope}

    def refuse_unless_writable(self, nothing: str) -> None:
        """With --no-save, or on a read-only file system: say so, rather than try (and fail with the OS's error)."""
        if self.no_save:
            raise ChatError(f"saving is off (--no-save): {nothing}")
        if self.read_only:
            raise ChatError(f"the conversations are on a read-only file system: {nothing}")

    # --- a session to go on in --------------------------------------------------------------------

    def claim(self, name: str, settings: dict) -> Session:
        """NAME for a conversation before its first answer (--session NAME, /rename): it is ours from now
        on, so a second colichat started with the same name is refused. The first save creates the files."""
        try:
            return self.store.claim(self.ident, name, self.layout, settings)
        except SessionExists:
            raise ChatError(f"session {name} already exists: add --resume to continue it, "
                            "or choose another name") from None

    def create(self, name: str | None, settings: dict, stem: str | None = None) -> Session:
        """A new session (named NAME, else the first free name from `stem`), its files written by its first append."""
        return self.store.create(self.ident, self.layout, name, settings, stem=stem, files=False)

    def open(self, name: str | None, current: str | None) -> tuple[Session, str]:
        """Open saved session NAME (the latest by default; not `current`, the one in use) to load."""
        if not self.store:
            raise ChatError("saving is off (--no-save): nothing to resume")
        if name is None:
            info = self.store.latest(self.ident)
            if info is None:
                raise ChatError("no saved conversation for this model yet")
            name = info.name
        if current == name:
            raise ChatError(f"already in session {name}")
        if self.store.is_empty(self.ident, name):  # as /sessions shows it: not at all
            self.store.refuse_elsewhere(name)
            raise ChatError(f"no session named {name} for this model (/sessions lists them)")
        return self.store.open(self.ident, name, self.layout, read_only=self.read_only), name

    def used(self, name: str) -> None:
        """NAME is the conversation in use: the latest used from now on."""
        if not self.read_only:
            self.store.used(self.ident, name)

    # --- the prefix index -------------------------------------------------------------------------

    def index(self, session: Session, cache) -> None:
        """The prefix index learns what `session` holds now (what it has on disk)."""
        index = self.store.prefix_index(self.ident)
        if not session.turns:  # (rewound to nothing, or reset)
            index.drop(session.name)
        elif session.nrec <= cache.length:
            index.record(session.name, cache.codec, cache.tokens[: session.nrec], [t.last for t in session.turns])

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

    # --- what the commands ask ----------------------------------------------------------------------

    def latest_hint(self) -> str | None:
        """The line at start that says which conversation /resume would continue."""
        if not self.store:
            return None
        info = self.store.latest(self.ident)
        if info is None:
            return None
        return f"latest saved conversation: {displayable(info.describe())} (/resume to continue it)"

    def names(self) -> list[str]:
        """This model's saved conversations, newest first (for Tab completion)."""
        return [i.name for i in self.store.list(self.ident)] if self.store else []

    def listing(self, current: str | None) -> list[str]:
        """/sessions: a row for each of this model's conversations, under its parent; `current` marked."""
        if not self.store:
            raise ChatError("saving is off (--no-save): no sessions")
        return [(CURRENT_MARK if i.name == current else "  ") + "  " * depth + displayable(i.describe())
                for i, depth in under_parents(self.store.list(self.ident))]

    def total(self) -> str:
        """The foot of /sessions: how many conversations this model has, and their bytes on disk."""
        return total_line(self.store.list(self.ident))

    def delete(self, name: str, current: str | None) -> str:
        """/delete NAME: a saved conversation of this model, not `current` (the one in use)."""
        self.refuse_unless_writable("no session is deleted")
        if current == name:
            raise ChatError(f"session {name} is the current conversation: /new first, then /delete {name}")
        freed = self.store.delete(self.ident, name)
        return f"deleted session {name} ({format_size(freed)})"
