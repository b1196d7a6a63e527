"""A conversation's transcript: its turns over the model's cache, and where they part from what is saved.

The cache only grows by appending (or shrinks by truncating), and the saved session is a prefix of
it. Where the two part for a while, the transcript says how, and the conversation's next save (or
quitting) joins them:
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

It touches no file: the conversation (chat.Conversation) writes the session.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from ..persist import Turn
from .report import TurnStats


@dataclass
class Mark:
    """What Transcript.restore puts back: the cache rows [first, end), the turns, the deferred cut."""
    first: int
    end: int
    rows: np.ndarray  # (end - first,) records
    turns: list[Turn]
    unsaved_cut: int | None


class Transcript:
    """The turns of one conversation over `cache` (engine.KVCache), and where they part from its saved session."""

    def __init__(self, cache):
        self.cache = cache
        self.turns: list[Turn] = []
        self.unsaved_cut: int | None = None
        self.unread_left = 0
        self.cut_failed: str | None = None
        self.save_failed = False
        self.last_stats: TurnStats | None = None  # the last answer's (/stats), none in a new conversation

    @property
    def end(self) -> int:
        """The cache row the turns end at."""
        return self.turns[-1].last if self.turns else 0

    def starts(self) -> list[int]:
        """The index of each exchange's user turn."""
        return [i for i, t in enumerate(self.turns) if t.role == "user"]

    def begin(self, turns: list[Turn] = ()) -> None:
        """The turns of a conversation as saved (a resumed one, or none: a new one): nothing apart from the disk."""
        self.turns, self.unsaved_cut, self.unread_left, self.save_failed = list(turns), None, 0, False
        self.last_stats = None

    # --- the edit that may fail midway ------------------------------------------------------------

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
        """The body edits the transcript from cache row `first` on; if it raises (a ChatError, Ctrl-C),
        the transcript is as before it."""
        m = self.mark(first)
        try:
            yield m
        except BaseException:
            self.restore(m)
            raise

    # --- cutting it short, in memory ----------------------------------------------------------------

    def rebase(self, n: int) -> int:
        """The template renders the turns differently now: the cache keeps its first n rows (up to the
        first token that differs). Later turns keep their text (the template still renders them) but
        lose their records (the turn n falls in keeps those before n), which the new user turn's
        records re-create. -> how many turns end by n (what the saved session keeps)."""
        kept = sum(1 for t in self.turns if t.last <= n)
        self.turns = [t if t.last <= n else Turn(t.role, t.text, min(t.first, n), n) for t in self.turns]
        self.cache.truncate(n)
        return kept

    def defer_cut(self, kept_turns: int) -> None:
        """The saved session keeps at most kept_turns turns from the next save on."""
        self.unsaved_cut = kept_turns if self.unsaved_cut is None else min(self.unsaved_cut, kept_turns)

    @contextlib.contextmanager
    def replacing_last(self):
        """/regen: the body answers the last message (yielded, its user turn) again. The exchange it
        replaces stays, in memory and on disk, until the new one exists: the next save replaces it in
        one commit (a crash leaves the old exchange or the new one), and a body that fails (or is
        stopped before its first token) leaves the transcript as it was."""
        starts = self.starts()
        user = self.turns[starts[-1]]
        with self.restored_unless_done(user.first):
            self.turns = self.turns[: starts[-1]]
            self.cache.truncate(user.first)
            self.defer_cut(starts[-1])
            yield user
