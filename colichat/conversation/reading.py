"""Reading exchanges again from their text: the progress of one turn among several, and a resume's
exchanges whose records were dropped. The turn itself is read by a function the caller passes
(Conversation._read_turn: a prefill of the turn as the template renders it after the turns so far)."""

from __future__ import annotations

import time

from ..errors import ChatError
from ..persist import Turn
from ..units import count
from .transcript import Transcript


def one_count(on_progress, cache, later: list[Turn]):
    """The progress of one turn read again, said as part of reading several (/forget, a resume's
    exchanges): the cache's rows so far, of those plus the turn's rest plus the `later` turns' tokens
    (as they were saved): exact once the last turn is read, which the result counts."""
    if on_progress is None:
        return None
    rest = sum(t.last - t.first for t in later)
    return lambda done, total, *more: on_progress(cache.length, cache.length - done + total + rest, *more)


def read_again(transcript: Transcript, unread: list[Turn], read_turn, start_of, on_progress, cancel,
               writes: bool, plain: bool = False) -> list[str]:
    """A resume's exchanges whose records were dropped (damaged, cut short, pruned) but whose text is
    intact (LoadResult.unread): read again from their text, an exchange at a time, so that the
    conversation goes on whole. `read_turn(turn, on_progress, too_long)` appends one turn read again;
    `start_of(text)` is the cache row a user message's prompt starts at (below the cache's end when the
    template re-renders). Nothing is written now: the next answer's save replaces their records
    (`writes`: the conversation is saved at all). A stop (`cancel`, Ctrl-C's), or an exchange that no
    longer fits, keeps the exchanges read so far (as /regen does, the rows a re-render replaced are put
    back); the others stay on disk until that save (`unread_left`), as the warnings above this line
    say. -> the lines that say how it went (`plain`: none where all went well, a pruned conversation's
    line having said it all)."""
    cache = transcript.cache
    n0, t0 = cache.length, time.perf_counter()
    starts = [i for i, t in enumerate(unread) if t.role == "user"]
    done, why = 0, None
    for a, b in zip(starts, starts[1:] + [len(unread)], strict=True):
        try:
            with transcript.restored_unless_done(start_of(unread[a].text)):  # else as before this exchange
                if cancel.requested:
                    raise ChatError("stopped")
                for i in range(a, b):
                    read_turn(unread[i], one_count(on_progress, cache, unread[i + 1:]),
                              "it no longer fits in the context")
        except ChatError as e:
            why = "stopped" if cancel.requested else str(e)
            break
        done += 1
    said = (f"read {count(done, 'exchange')} again from {'its' if done == 1 else 'their'} saved text "
            f"({count(cache.length - n0, 'token')} in {time.perf_counter() - t0:.1f} s)")
    transcript.unread_left = len(starts) - done if writes else 0
    if why is None:
        return [] if plain else [f"note: {said}: the conversation is whole again" + (
            f"; the next answer saves {'its' if done == 1 else 'their'} records anew" if writes else "")]
    return [f"warning: {said}, then {why}: {count(len(starts) - done, 'more exchange')} not read"
            + ("; they stay on disk until the next answer saves the conversation without them" if writes else "")]
