"""A conversation's history: its turns over the model's cache, against what its session holds on disk.

The cache only grows by appending (or shrinks by truncating), and the saved session is a prefix of
it. Where the two part for a while, History says how, and the next save (or quitting) joins them:
  unsaved_cut  the session keeps this many turns from the next save on (/regen, a re-render of
               turns loaded from disk, a cut the disk refused): that save drops the others and
               adds the new turns in one commit (Session.append's `keep`), so a crash leaves one or
               the other;
  unread_left  exchanges a stopped read left on disk, unread: they go with the next answer's save;
  save_failed  a save or a cut failed since the last save that worked: the disk is behind;
  cut_failed   why the last /rewind could not cut the session now (it waits for the next save).
An edit that may fail midway (/regen, reading an exchange again) takes a Mark of what it may touch
and puts it back if it does not complete (`restored_unless_done`): the cache rows, the turns and the
deferred cut together, so that nothing is lost and no text a user removed comes back.

Beside it: saving.py (the session, in the Store), chat.py (the forward passes that add turns: /forget
and a resume's damaged exchanges read again call its Conversation._read_turn).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np

from ..errors import ChatError, ModelError
from ..persist import Turn
from ..units import count
from ..wrap import displayable
from .report import TurnStats
from .saving import Saving


def takes(n: int) -> str:
    """'1 to N' exchanges, or '1' when there is one."""
    return "1" if n == 1 else f"1 to {n}"


def one_count(on_progress, cache, later: list[Turn]):
    """The progress of one turn read again, said as part of reading several (/forget, a resume's
    exchanges): the cache's rows so far, of those plus the turn's rest plus the `later` turns' tokens
    (as they were saved): exact once the last turn is read, which the result counts."""
    if on_progress is None:
        return None
    rest = sum(t.last - t.first for t in later)
    return lambda done, total, *more: on_progress(cache.length, cache.length - done + total + rest, *more)


@dataclass
class Mark:
    """What History.restore puts back: the cache rows [first, end), the turns, the deferred cut."""
    first: int
    end: int
    rows: np.ndarray  # (end - first,) records
    turns: list[Turn]
    unsaved_cut: int | None


class History:
    """The turns of one conversation over `model`'s cache, and the session they are saved into
    (`saving`, saving.Saving) with the settings in use (`prefs`, chat_settings.ChatSettings: a new
    start also takes the system prompt that waited for it)."""

    def __init__(self, model, saving: Saving, prefs, kv: str | None = None):
        self.model, self.saving, self.prefs = model, saving, prefs
        self.kv = kv or "f32"  # how a new conversation's rows are stored (--kv); a saved one keeps its own
        self.kv_from = "--kv" if kv else None  # who chose it (--kv, /set kv); None: the default, chosen by no one
        model.cache.set_codec(self.kv)  # (ValueError: a codec this model's rows cannot take)
        self.turns: list[Turn] = []
        self.unsaved_cut: int | None = None
        self.unread_left = 0
        self.cut_failed: str | None = None
        self.save_failed = False
        self.last_stats: TurnStats | None = None  # the last answer's (/stats), none in a new conversation

    # --- what it holds ----------------------------------------------------------------------------

    @property
    def cache(self):
        return self.model.cache

    @property
    def end(self) -> int:
        """The cache row the turns end at."""
        return self.turns[-1].last if self.turns else 0

    def starts(self) -> list[int]:
        """The index of each exchange's user turn."""
        return [i for i, t in enumerate(self.turns) if t.role == "user"]

    @property
    def saved_name(self) -> str | None:
        """The session's name if it has files on disk (not one claimed only, or cut to no exchange)."""
        s = self.saving.session
        return s.name if s and s.on_disk else None

    def mark(self, first: int) -> Mark:
        """What an edit from cache row `first` on may touch."""
        end = self.cache.length
        return Mark(first, end, self.cache.records[first:end].copy(), list(self.turns), self.unsaved_cut)

    def restore(self, m: Mark) -> None:
        """Back to `m`: its rows, turns and deferred cut (the disk was not written since)."""
        self.cache.records[m.first : m.end] = m.rows
        self.cache.set_length(m.end)
        self.turns, self.unsaved_cut = m.turns, m.unsaved_cut

    @contextlib.contextmanager
    def restored_unless_done(self, first: int):
        """The body edits the history from cache row `first` on; if it raises (a ChatError, Ctrl-C),
        the history is as before it."""
        m = self.mark(first)
        try:
            yield m
        except BaseException:
            self.restore(m)
            raise

    def clear(self) -> None:
        """No turn: an empty cache (the session, if any, is left as it is on disk)."""
        self.model.reset()
        self.turns, self.unsaved_cut, self.unread_left, self.save_failed = [], None, 0, False
        self.last_stats = None

    def set_kv(self, codec: str) -> str:
        """/set kv CODEC: how new conversations keep their cache (--kv); an empty one takes it now."""
        problem = self.cache.codec_problem(codec)
        if problem:
            raise ChatError(problem)
        self.kv, self.kv_from = codec, "/set kv"
        if not self.turns and not self.saved_name:
            self.cache.set_codec(codec)
        if self.cache.codec == codec:
            return f"kv = {codec}"
        return f"kv = {codec} (for new conversations: this one stays {self.cache.codec}, as it was saved)"

    # --- saving -----------------------------------------------------------------------------------

    def save(self, stats: TurnStats) -> None:
        """Append the unsaved turns, with the cut that waits in the same commit (the answer /regen
        replaces goes from the disk only as the new one is saved: Session.append's `keep`); how it
        went is in `stats`."""
        self.model.keep_expert_usage()  # (MoE: which experts this run used, for the next start's warm start)
        self.saving.save(self.cache, self.turns, self.prefs.saved(), stats, keep=self.unsaved_cut)
        if stats.saved is not False:
            self.unsaved_cut = None
        if stats.saved is not None:
            self.save_failed = not stats.saved
        if stats.saved:
            self.unread_left = 0

    def save_settings(self) -> None:
        self.saving.save_settings(self.prefs.saved())

    def keep_saved(self, doing: str) -> None:
        """Before this conversation is left (/new, /resume, /forget): turns a failed save left unwritten
        are saved now, or `doing` is refused, saying why: leaving would lose them. (With exchanges a
        stopped read left unread, the disk holds more than memory: nothing to save.)"""
        if not self.save_failed or self.unread_left:
            return
        stats = TurnStats()
        self.save(stats)
        if stats.saved is False:
            raise ChatError(f"this conversation is not saved ({stats.save_error}), and {doing} would lose it: "
                            "free some space and try again (/export FILE writes it elsewhere)")

    def close(self) -> None:
        """Quitting: a cut or turns a failed save left unwritten get one more try, then the session is closed."""
        if self.save_failed and not self.unread_left:
            self.save(TurnStats())
        self.saving.close()

    def save_as(self, name: str) -> str:
        """/save NAME: the conversation, from the cache, into a new session (saving.Saving.save_as)."""
        return self.saving.save_as(name, self.cache, self.turns, self.prefs.saved())

    def rename(self, new: str) -> str:
        """/rename NEW. Before the first answer (nothing to save yet, nor to rename) the name is taken
        now, as --session NAME takes it, and the first answer saves the conversation under it."""
        s = self.saving
        if not (s.store and not s.read_only and s.session is None and not self.turns):
            return s.rename(new)
        if new in s.names():
            raise ChatError(f"session {new} already exists: choose another name")
        s.claim(new, self.prefs.saved())
        return f"this conversation is named {new}: its first answer saves it"

    # --- the session, and this model's others (what the commands ask) -------------------------------

    @property
    def name(self) -> str | None:
        """The session's name (claimed, saved, or to be taken by the first save)."""
        return self.saving.name

    @property
    def no_save(self) -> bool:
        return self.saving.no_save

    def lineage(self) -> tuple[str, int] | None:
        """(parent, branch) if the conversation is a fork, else None (Saving.lineage)."""
        return self.saving.lineage()

    def names(self) -> list[str]:
        """This model's saved conversations, newest first (for Tab completion)."""
        return self.saving.names()

    def listing(self) -> list[str]:
        """/sessions: a row for each of this model's conversations, this one marked (saving.CURRENT_MARK)."""
        return self.saving.listing()

    def total(self) -> str:
        return self.saving.total()

    def delete(self, name: str) -> str:
        """/delete NAME: another saved conversation of this model."""
        return self.saving.delete(name)

    # --- leaving it for another -------------------------------------------------------------------

    def resume(self, name: str | None, load):
        """Go on in saved session NAME (the latest by default): `load(session)` fills the cache and
        gives its LoadResult, whose turns are this history's. If it fails, the conversation in memory
        goes on as it was (or, if the failed read touched the cache, starts clean: the old session is
        on disk). -> (LoadResult, NAME)"""
        new, name = self.saving.open(name)
        try:
            self.keep_saved(f"/resume {name}")
        except ChatError:
            new.close()
            raise
        rope = self.model.rope_factors
        try:
            self._take_rope_factors(new)
            res = load(new)
        except BaseException:
            new.close()
            self.model.use_rope_factors(rope)
            if self.cache.length != self.end:
                self.clear()
            raise
        self.saving.adopt(new, name)
        self.turns, self.unsaved_cut, self.unread_left = list(res.turns), None, 0  # (of the conversation left)
        self.save_failed = False
        return res, name

    def _take_rope_factors(self, sess) -> None:
        """Rotate with the rope factors the session's rows were made with (LongRoPE: a conversation
        made with the long factors goes on with them at a smaller context; the short ones serve no
        context above the original one, so such a resume is refused), before its rows are read."""
        saved = sess.saved_rope_factors()
        if saved is None or saved == self.model.rope_factors:
            return
        try:
            self.model.use_rope_factors(saved)
        except ModelError as e:
            raise ChatError(f"session {sess.name} cannot be resumed: {e}") from None
        sess.ident = self.saving.ident

    def new(self, stem: str | None = None) -> str:
        """/new: a new empty conversation (its first save named from `stem`, else from its first
        message); the current session stays on disk. Refused if leaving would lose unsaved turns."""
        self.keep_saved("/new")
        old = self.saving.leave()
        self.saving.stem = stem
        self.clear()
        self.cache.set_codec(self.kv)
        self._started()
        return f"new conversation (session {old} is saved; /resume {old} reopens it)" if old else "new conversation"

    def _started(self) -> None:
        """No exchange (new, reset, rewound to none): the conversation starts anew, and a system prompt
        that waited for the next conversation (/set system after the first answer) is the one in use."""
        if self.prefs.next_conversation():
            self.save_settings()

    def fork(self, n: int | None = None) -> str:
        """/fork [N]: continue in a new conversation made of this one's first n exchanges (default: all),
        saved at once (saving.Saving.fork: their records copied, no forward pass); this one stays
        saved as it is. The cache keeps the fork's records."""
        starts = self.starts()
        if not starts:
            raise ChatError("nothing to fork: the conversation is empty")
        n = len(starts) if n is None else n
        if not 1 <= n <= len(starts):
            raise ChatError(f"/fork takes {takes(len(starts))}: the conversation has {count(len(starts), 'exchange')}")
        self.keep_saved("/fork")
        kept = self.turns[: starts[n] if n < len(starts) else len(self.turns)]
        said = self.saving.fork(self.cache, kept, n, self.prefs.saved())
        self.turns, self.unsaved_cut, self.unread_left, self.cut_failed = kept, None, 0, None
        self.cache.truncate(kept[-1].last)
        return said

    # --- reading it again -------------------------------------------------------------------------
    # `conv` is the chat.Conversation that reads: its `_read_turn` prefills a turn from its text
    # (appending it here); `cancel` (engine.cancel.Cancel) is Ctrl-C's.

    def forget(self, conv, n: int | None = None, on_progress=None, cancel=None) -> str:
        """/forget [N]: continue in a new conversation without the n oldest exchanges (default: enough
        that what remains fills at most half the context): the rest is read again (prefilled) from
        its text; the current conversation stays saved as it is. Ctrl-C goes back to it."""
        starts = self.starts()
        if any(t.role not in ("user", "assistant") for t in self.turns):
            raise ChatError("this conversation began as an imported cache, which cannot be read again: /new")
        if not starts:
            raise ChatError("nothing to forget: the conversation is empty")
        if n is None:
            half, length = self.model.n_ctx // 2, self.cache.length
            n = next(k for k in range(1, len(starts) + 1)
                     if k == len(starts) or length - self.turns[starts[k]].first <= half)
        if not 1 <= n <= len(starts):
            has = count(len(starts), 'exchange')
            raise ChatError(f"/forget takes {takes(len(starts))}: the conversation has {has}")
        kept = self.turns[starts[n]:] if n < len(starts) else []
        self.keep_saved("/forget")
        old = self.saved_name
        stopped, conv.reused_from = False, None
        self.new(stem=f"{old[:54]}-cont" if old and kept else None)  # named after where it came from
        try:
            for i, t in enumerate(kept):
                if cancel.requested and old:  # Ctrl-C: back to the conversation as it was, below
                    stopped = True
                    break
                try:
                    conv._read_turn(t, one_count(on_progress, self.cache, kept[i + 1:]),
                                    "what remains does not fit in the context: /forget more exchanges", cancel=cancel)
                except ChatError:
                    if not (cancel.requested and old):
                        raise
                    stopped = True  # inside a turn's reading (what it read goes with the rest, below)
                    break
        except BaseException:
            if self.turns and self.turns[-1].role == "user":
                self.turns.pop()  # an exchange is kept whole or not at all
            self.cache.truncate(self.end)
            raise
        finally:
            stats = TurnStats()
            if self.turns and not stopped:
                self.save(stats)
        if stopped:
            self.clear()
            conv.resume(old)  # from disk, as it was saved: no reading again
            raise ChatError(f"/forget stopped: back in {old}, as it was")
        if not kept:
            return (f"new empty conversation: {'its one exchange' if n == 1 else f'all {n} exchanges'} forgotten"
                    + (f" ({old} is still saved as it was)" if old else ""))
        where = {None: "not saved", True: f"saved as {self.saving.name}",
                 False: f"NOT saved: {stats.save_error}"}[stats.saved]
        reused = f" ({conv.reused_from})" if conv.reused_from else ""
        return (f"new conversation without the {'oldest exchange' if n == 1 else f'{n} oldest exchanges'}"
                + (f" of {old} (still saved as it was)" if old else "")
                + f": {count(len(self.starts()), 'exchange')}, {count(self.cache.length, 'token')} read again"
                + f"{reused}; {where}")

    def read_again(self, conv, unread: list[Turn], on_progress=None, cancel=None, plain: bool = False) -> list[str]:
        """A resume's exchanges whose records were dropped (damaged, cut short, pruned) but whose text is
        intact (LoadResult.unread): read again from their text, an exchange at a time, so that the
        conversation goes on whole. Nothing is written now: the next answer's save replaces their
        records. A stop (Ctrl-C), or an exchange that no longer fits, keeps the exchanges read so far
        (as /regen does, the rows a re-render replaced are put back); the others stay on disk until
        that save (`unread_left`), as the warnings above this line say. -> the lines that say how it
        went (`plain`: none where all went well, a pruned conversation's line having said it all)."""
        n0, t0 = self.cache.length, time.perf_counter()
        starts = [i for i, t in enumerate(unread) if t.role == "user"]
        done, why = 0, None
        for a, b in zip(starts, starts[1:] + [len(unread)], strict=True):
            _, start = conv._prompt_ids(unread[a].text)  # below the cache's end when the template re-renders
            try:
                with self.restored_unless_done(start):  # else as before this exchange
                    if cancel.requested:
                        raise ChatError("stopped")
                    for i in range(a, b):
                        conv._read_turn(unread[i], one_count(on_progress, self.cache, unread[i + 1:]),
                                        "it no longer fits in the context", defer_cut=True, cancel=cancel)
            except ChatError as e:
                why = "stopped" if cancel.requested else str(e)
                break
            done += 1
        said = (f"read {count(done, 'exchange')} again from {'its' if done == 1 else 'their'} saved text "
                f"({count(self.cache.length - n0, 'token')} in {time.perf_counter() - t0:.1f} s)")
        saving = not self.saving.read_only  # (--no-save, a read-only file system: nothing is written)
        self.unread_left = len(starts) - done if saving else 0
        if why is None:
            return [] if plain else [f"note: {said}: the conversation is whole again" + (
                f"; the next answer saves {'its' if done == 1 else 'their'} records anew" if saving else "")]
        return [f"warning: {said}, then {why}: {count(len(starts) - done, 'more exchange')} not read"
                + ("; they stay on disk until the next answer saves the conversation without them" if saving else "")]

    # --- cutting it short -------------------------------------------------------------------------

    def reset(self) -> str:
        """/reset (the format's kv_disk_reset): this conversation emptied in place. Same name, its KV file
        cut to its header and its sidecar listing no turn (Session.truncate with keep_files), its
        settings kept; the next message starts it again, as a new conversation of that name would."""
        if not self.turns:
            raise ChatError("nothing to reset: the conversation is empty")
        n, tokens, first = len(self.starts()), self.cache.length, self.turns[0]
        self.clear()
        failed = self._cut_on_disk(0, keep_files=True)
        self._started()
        preview = displayable(first.text.strip().replace("\n", " "))
        said = (f"removed {count(n, 'exchange')} ({count(tokens, 'token')}), from \"{preview[:60]}"
                f"{'...' if len(preview) > 60 else ''}\"")
        if failed:
            return f"{said}; {failed}"
        where = self.saved_name
        return said + (f"; session {where} is empty, its settings kept" if where else "")

    @contextlib.contextmanager
    def replacing_last(self):
        """/regen: the body answers the last message (yielded, its user turn) again. The exchange it
        replaces stays, in memory and on disk, until the new one exists: the next save replaces it in
        one commit (a crash leaves the old exchange or the new one), and a body that fails (or is
        stopped before its first token) leaves the conversation as it was."""
        starts = self.starts()
        if not starts:
            raise ChatError("nothing to regenerate: the conversation is empty")
        user = self.turns[starts[-1]]
        with self.restored_unless_done(user.first):
            self.turns = self.turns[: starts[-1]]
            self.cache.truncate(user.first)
            self._defer_cut(starts[-1])
            yield user

    def rewind(self, n: int = 1) -> list[Turn]:
        """Drop the last n exchanges (the cache truncated to the start of the first dropped one), on
        disk too: now, or, if the disk refuses (`cut_failed`) or a stopped read left exchanges on
        disk (they and these go together), at the next save. Rewound to no exchange, the
        conversation starts anew (`_started`). -> the turns dropped"""
        starts = self.starts()
        if not starts:
            raise ChatError("nothing to rewind: the conversation is empty")
        if not 1 <= n <= len(starts):  # said as /forget says it
            raise ChatError(f"/rewind takes {takes(len(starts))}: the conversation has {count(len(starts), 'exchange')}"
                            + (" (/reset empties it)" if n > len(starts) else ""))
        dropped = self.turns[starts[-n]:]
        self.cut_failed, self.last_stats = None, None  # (/stats: the last answer is gone)
        if self.unread_left:  # a stopped read left exchanges on disk: they and these go with the next save
            self.rebase(dropped[0].first, defer_cut=True)
            self.turns = self.turns[: starts[-n]]
        else:
            self.turns = [t for t in self.turns if t.last <= dropped[0].first]
            self._cut(dropped[0].first, len(self.turns))
        if not self.turns:
            self._started()
        return dropped

    def rebase(self, n: int, defer_cut: bool = False) -> None:
        """The template renders the history differently now: keep the cache up to row n (the first
        token that differs). Later turns keep their text (the template still renders them) but lose
        their records (the turn n falls in keeps those before n), which the new user turn's records
        re-create. The saved session keeps the turns that end by n; `defer_cut`: it is cut at the
        next save (unsaved_cut), not now."""
        kept = sum(1 for t in self.turns if t.last <= n)
        self.turns = [t if t.last <= n else Turn(t.role, t.text, min(t.first, n), n) for t in self.turns]
        if defer_cut:
            self.cache.truncate(n)
            self._defer_cut(kept)
        else:
            self._cut(n, kept)

    def _defer_cut(self, kept_turns: int) -> None:
        """The saved session keeps at most kept_turns turns from the next save on."""
        self.unsaved_cut = kept_turns if self.unsaved_cut is None else min(self.unsaved_cut, kept_turns)

    def _cut(self, n: int, kept_turns: int) -> None:
        """Truncate the cache to n rows and the saved session to its first kept_turns turns; a cut the
        disk refused is said in `cut_failed` and made with the next save."""
        self.cache.truncate(n)
        self.cut_failed = self._cut_on_disk(kept_turns)

    def _cut_on_disk(self, kept_turns: int, keep_files: bool = False) -> str | None:
        """Cut the saved session to its first kept_turns turns now; if the disk refuses, the cut waits
        for the next save (unsaved_cut: an append never runs before it), and the reason is returned."""
        try:
            self.saving.truncate(self.cache, kept_turns, self.prefs.saved(), keep_files)
        except ChatError as e:
            self._defer_cut(kept_turns)
            self.save_failed = True
            return (f"{e}: the saved conversation keeps them until the next answer saves it "
                    "(or quitting, which tries again)")
        return None
