"""What the user is told about a conversation: one exchange's numbers (TurnStats) and the footer
after the answer, whether a message fits, the /stats lines, the ways out of a full context, a
prefill's progress, and where a resumed one stands."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..units import count, format_size
from ..wrap import dimmed, displayable
from .thinking import CLOSE, OPEN, head, shown_as, split


@dataclass
class TurnStats:
    prompt_tokens: int = 0
    prefill_s: float = 0.0
    generated: int = 0
    decode_s: float = 0.0
    stopped: str = "eog"  # eog | length | interrupt | context
    saved: bool | None = None  # None: saving is off
    save_error: str | None = None
    save_note: str | None = None  # something the save did that the user should hear of
    drafted: int = 0  # speculative decoding: drafts checked, and kept
    accepted: int = 0
    by_source: dict = field(default_factory=dict)  # with several sources: name -> (checked, kept) of those used
    reused: int = 0  # prompt tokens whose records were read from a saved conversation, not prefilled
    thinking: int = 0  # of the tokens generated, those of a thinking model's thinking (<think>...</think>)
    still_thinking: bool = False  # the answer ended inside the thinking (cut short)

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.generated / self.decode_s if self.decode_s > 0 else 0.0


SLOW_READ_S = 2.0  # a prompt read this long is said in the footer: the user waited for it


def footer(conv, stats: TurnStats, keep: str = "/save NAME") -> str:
    """The line after an answer, short enough for one line of 80 columns on the usual answer: its tokens
    and speed, the context left, and whether it was saved (if not, and it could be, what keeps it:
    `keep`). What matters only now and then shows only then: a prompt read from a saved conversation
    (`reused N tokens`), a prompt whose reading took a while, why the answer stopped; the rest
    (drafts, the prompt's speed) is in /stats."""
    shelf = conv.shelf
    unsaved = ("not saved (--no-save)" if shelf.no_save else "not saved (read-only)" if shelf.read_only
               else f"not saved ({keep} keeps it)")
    saved = {None: unsaved, True: f"saved to {conv.name}",
             False: f"NOT saved: {stats.save_error}"}[stats.saved]
    stop = {"interrupt": ", interrupted", "length": ", max_tokens reached",
            "context": ", context full"}.get(stats.stopped, "")
    note = f"\nnote: {stats.save_note}" if stats.save_note else ""
    n_ctx = conv.model.n_ctx
    thought = f", {stats.thinking} thinking" if stats.thinking else ""  # (of those tokens)
    prompt = f", reused {stats.reused:,} tokens" if stats.reused else ""  # (shelf.MIN_REUSE at least)
    if stats.prefill_s >= SLOW_READ_S:
        prompt += f", prompt {stats.prompt_tokens:,} at {rate(stats.prefill_tps)} tok/s"
    return (f"[{count(stats.generated, 'token')}{thought}, {rate(stats.decode_tps)} tok/s{prompt}, "
            f"{n_ctx - conv.model.cache.length} of {n_ctx} context left{stop}; {saved}]{note}")


def exchanges(conv) -> int:
    return len(conv.transcript.starts())


def fits(conv, user_text: str) -> bool:
    """Whether a message fits in the context left with room for its answer (at least
    min(max_tokens, 256) tokens, under which Conversation.ask's note says the answer may be cut)."""
    ids, start = conv.prompt.ids(user_text)
    return conv.model.n_ctx - start - len(ids) >= min(conv.prefs.settings.max_tokens, 256)


def disk_bytes(session) -> int:
    """The bytes of a session's files (persist.Session) on disk."""
    total = 0
    for path in (session.kv_path, session.json_path):
        try:
            total += os.path.getsize(path)
        except OSError:
            pass
    return total


def rate(tps: float) -> str:
    """Tokens per second as the footer and /stats say it: one decimal below 100."""
    return f"{tps:.1f}" if tps < 100 else f"{tps:.0f}"


def stats_lines(conv) -> list[str]:
    """/stats: the context used, the cache's size in memory and on disk, the last answer's speeds, how its
    prompt was read (reused from a saved conversation, prefilled) and its drafts."""
    cache, session = conv.model.cache, conv.session
    lines = [f"context: {cache.length} of {conv.model.n_ctx} tokens, {count(exchanges(conv), 'exchange')}",
             f"KV cache: {format_size(cache.kv_bytes_per_token)}/token, "
             f"{format_size(cache.length * cache.record_bytes)} in use; saved as {conv.shelf.layout.describe()}"]
    if session:
        lines.append(f"session {session.name}: {format_size(disk_bytes(session))} on disk")
    else:
        lines.append("session: saving is off (--no-save)" if conv.shelf.no_save else "session: not saved yet")
    s = conv.transcript.last_stats
    if s:
        lines.append(f"last answer: {count(s.generated, 'token')} at {rate(s.decode_tps)} tok/s; prompt: "
                     + (f"{count(s.reused, 'token')} reused, " if s.reused else "")
                     + f"{count(s.prompt_tokens, 'token')} read"
                     + (f" at {rate(s.prefill_tps)} tok/s" if s.prompt_tokens > 1 else ""))
        if s.drafted:
            each = "".join(f"; {name} {kept} of {checked}" for name, (checked, kept) in s.by_source.items())
            lines.append(f"drafts (tokens guessed ahead, then checked in one pass): {s.accepted} of {s.drafted} "
                         f"kept ({100 * s.accepted / s.drafted:.0f}%{each})")
    return lines


def ways_out(conv) -> str:
    """What goes on from a full context, the one advice every note and refusal about it gives, each way
    only where it applies: /forget (more than one exchange: it keeps the later ones), /rewind and /new
    (an exchange to drop), a larger --ctx (where the model takes one)."""
    n, ways = exchanges(conv), []
    if n > 1:
        ways.append("/forget goes on in a new conversation without the oldest exchanges (--auto-forget does so "
                    "by itself)")
    if n:
        ways += [f"/rewind {'N' if n > 1 else 1} drops the last {'N exchanges' if n > 1 else 'exchange'}",
                 "/new starts a new conversation"]
    if conv.model.n_ctx < conv.model.cfg.n_ctx_train:
        ways.append(f"a larger --ctx at the next start (this model takes up to {conv.model.cfg.n_ctx_train})")
    return "; ".join(ways)


def full_note(conv, below: int) -> list[str]:
    """A reopened conversation with fewer than `below` tokens of context left: that it is (nearly) full,
    and the ways on."""
    left, n_ctx = conv.model.n_ctx - conv.model.cache.length, conv.model.n_ctx
    if left >= below:
        return []
    return [f"note: the context is {'full' if left < 2 else 'nearly full'} ({n_ctx - left} of {n_ctx} tokens): "
            f"{ways_out(conv)}"]


def reopened(res) -> str:
    """The line a reopened conversation starts with (a persist LoadResult): its tokens read from disk, or,
    where its KV file was pruned (or removed) and all its text is read again, one plain line that says so."""
    if not res.kv_gone:
        return res.summary()
    return (f"{res.name}: its KV file {res.kv_gone}; reading its {count(len(res.unread) // 2, 'exchange')} again "
            f"({count(res.unread[-1].last, 'token')}) ...")


def no_room(conv, needs: int, room: int) -> str:
    """Why a message of `needs` tokens is not sent when `room` tokens of context are left."""
    n_ctx, most = conv.model.n_ctx, conv.model.cfg.n_ctx_train
    if needs + 1 >= n_ctx:  # not even a new conversation would hold it
        more = f" or restart with a larger --ctx (this model takes up to {most})" if n_ctx < most else ""
        system = system_tokens(conv) if room == n_ctx else 0  # a first message's tokens hold the system prompt
        if system + 1 >= n_ctx:
            return (f"the system prompt needs {system} tokens, more than the whole context of {n_ctx}: "
                    f"set a shorter one (--system, /set system TEXT; /set system none removes it){more}")
        if system * 2 > needs:
            return (f"the message needs {needs} tokens, {system} of them the system prompt's, more than the whole "
                    f"context of {n_ctx}: shorten it or the system prompt (--system, /set system TEXT){more}")
        return f"the message needs {needs} tokens, more than the whole context of {n_ctx}: shorten it{more}"
    return (f"the message needs {needs} tokens but only {room} of the context of {n_ctx} are left; "
            f"it was not sent: {ways_out(conv)}")


def system_tokens(conv) -> int:
    """How many tokens the system prompt's text is (0 without one): what it takes of every conversation."""
    system = conv.prefs.settings.system
    return len(conv.prompt.tok.encode(system)) if system else 0


def progress(done: float, total: int, seconds: float) -> str:
    """How far a prefill is after `seconds`: '57/105 tokens, 2.6 tok/s, about 18 s left' (the time left
    once a token has been read, at the rate so far)."""
    line = f"{int(done):,}/{total:,} tokens"
    if done <= 0 or seconds <= 0:
        return line
    rate = done / seconds
    left = (total - done) / rate
    return line + f", {rate:,.1f} tok/s" + (f", about {duration(left)} left" if left >= 1 else "")


def duration(seconds: float) -> str:
    """'8 s', '2 min 05 s', '1 h 02 min'."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


RECAP_LINES = 8  # a turn of the recap longer than this many lines (a long paste) shows its first ones


def recap(turns, conv=None, dim: bool = False) -> list[str]:
    """Where a resumed conversation stands, on the terminal: its last exchange as /history shows it,
    after a line counting the exchanges before it; a turn of more than RECAP_LINES lines is folded to its
    first ones and a line counting the rest (a long paste would fill the window)."""
    users = [i for i, t in enumerate(turns) if t.role == "user"]
    if not users:
        return []
    earlier = len(users) - 1
    head = [f"({count(earlier, 'earlier exchange')}; /history shows the whole conversation)"] if earlier else []
    shown = []
    for t in turns[users[-1]:]:
        lines = turn_line(t, conv, dim).split("\n")
        if len(lines) > RECAP_LINES:
            lines = lines[:RECAP_LINES - 1] + [f"(... {count(len(lines) - RECAP_LINES + 1, 'more line')}; "
                                               "/history shows them)"]
        shown.append("\n".join(lines))
    return head + shown


def forked_line(conv) -> str | None:
    """/history's first line for a fork (Session.parent, .branch): where it branched from its parent."""
    s = conv.session
    return f"forked from {displayable(s.parent)} after exchange {s.branch}" if s is not None and s.parent else None


def turn_line(turn, conv=None, dim: bool = False) -> str:
    """A turn as /history shows it: 'user> TEXT', its control characters shown (wrap.displayable).
    With `conv`, an answer's thinking shows as its `think` setting says: one line counting its
    tokens (fold), its text between <think> and </think> lines (show), or not at all (hide); `dim`
    on a terminal with styles."""
    if conv is None or turn.role != "assistant":
        return f"{turn.role}> {displayable(turn.text)}"
    thought, answer = split(turn.text, conv.prefs.opens_thinking)
    mode = shown_as(conv.prefs.settings.think)
    if thought is None or mode == "hide":
        return f"assistant> {displayable(answer)}"
    shown = head(len(conv.prompt.tok.encode(thought))) if mode == "fold" else f"{OPEN}\n{displayable(thought)}\n{CLOSE}"
    return f"assistant> {dimmed(shown) if dim else shown}" + (f"\n{displayable(answer)}" if answer else "")
