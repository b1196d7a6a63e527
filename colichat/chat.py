"""A conversation: turns, the chat template, the generate loop, and the persistence calls.

Each exchange is two turns over consecutive cache records:
  user turn      [first, last): the template text between the previous answer and this answer
                 (end-of-turn markers, the user's message, the assistant header);
  assistant turn [first, last): the tokens the model generated (the end-of-generation token is
                 not fed back; the next user turn's template text starts with it).
The cache only ever grows by appending (or shrinks by truncating), so what is on disk is a
prefix of what is in memory. The template text of a new user turn is computed from the messages
alone (`render(messages + [user]) minus (render(messages before the last answer) + answer)`), so a
resumed conversation continues with exactly the tokens an uninterrupted one would have.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from .engine import Model, Sampler
from .engine.generate import Generation
from .engine.speculative import PromptLookup
from .engine.template import chat_template_for
from .persist import CacheLayout, SessionError, SessionExists, Store, Turn, check_name, model_identity, slug
from .settings import BY_NAME, Settings, damaged_settings, saved_values
from .units import format_size

RESUME_MARGIN = 16  # a resumed conversation must leave at least this many tokens of context


class ChatError(Exception):
    """Something the user asked that cannot be done; the message is one line."""


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

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.generated / self.decode_s if self.decode_s > 0 else 0.0


class Conversation:
    """Owns the model's cache, the turns and the session they are saved into.

    With saving on, the session file is created at the first answer (named --session NAME, else
    from the first message), so starting colichat and quitting leaves nothing behind. With
    `save_new` off (one-shot and piped runs without --session), a new conversation is saved only
    by /save NAME; a resumed one is still saved after every answer.
    """

    def __init__(self, model: Model, settings: Settings, save: bool = True, session_name: str | None = None,
                 store: Store | None = None, pinned=frozenset(), save_new: bool = True, read_only: bool = False):
        self.model = model
        self.tok = model.tokenizer
        self.template = chat_template_for(self.tok)
        self.settings = settings
        self.pinned = frozenset(pinned)  # settings given on the command line: a resumed session keeps them
        self.sampler = Sampler(settings.sampler())
        self.turns: list[Turn] = []
        self.stop_requested = False
        self.last_stats: TurnStats | None = None
        cfg = model.cfg
        self.store = (store or Store()) if save else None
        self.ident = model_identity(cfg.path, cfg.arch, cfg.name) if save else None
        self.layout = CacheLayout.from_cache(model.cache, cfg.n_vocab)
        self.session = None  # persist.Session once created or resumed
        self.session_name = session_name
        self.save_new = save_new
        self.pending_system: str | None | bool = False  # a /set system waiting for the next conversation
        self.read_only = read_only  # sessions can be read, not saved (a read-only file system)

    # --- state ------------------------------------------------------------------------------------

    @property
    def n_tokens(self) -> int:
        return self.model.cache.length

    def messages(self, turns: list[Turn] | None = None) -> list[dict]:
        """The chat messages for the template (turns imported from a bare cache file are opaque)."""
        msgs = [{"role": "system", "content": self.settings.system}] if self.settings.system else []
        turns = self.turns if turns is None else turns
        return msgs + [{"role": t.role, "content": t.text} for t in turns if t.role in ("user", "assistant")]

    def options(self) -> dict:
        """Every setting's value (and the system prompt waiting for the next conversation)."""
        return {**self.settings.to_dict(),
                **({"system (next)": self.pending_system} if self.pending_system is not False else {})}

    def set_option(self, key: str, value) -> str:
        """Change one setting (a name of settings.TABLE; SettingError for a value it cannot take)."""
        row = BY_NAME[key]
        row.validate(value)
        if key == "system" and self.turns:  # the conversation so far was read with the old one
            self.pending_system = value
            return "system prompt set for the next conversation (/new starts one)"
        self.settings = self.settings.with_(**{key: value})
        self.sampler = Sampler(self.settings.sampler())
        self._save_settings()
        return f"{key} = {row.show(value)}"

    def _apply_saved_settings(self, d) -> None:
        """Take a resumed session's saved settings, except those given on the command line."""
        saved = saved_values(d)
        if "system" in self.pinned and self.turns and saved.get("system") != self.settings.system:
            # --system on a resumed conversation: it was read with the saved one; the new one waits
            self.pending_system = self.settings.system
            self.settings = self.settings.with_(system=saved.get("system"))
        self.settings = self.settings.with_(**{k: v for k, v in saved.items() if k not in self.pinned})
        self.sampler = Sampler(self.settings.sampler())

    # --- sessions ---------------------------------------------------------------------------------

    def latest_hint(self) -> str | None:
        if not self.store:
            return None
        info = self.store.latest(self.ident)
        if info is None:
            return None
        return f"latest saved conversation: {info.describe()} (/resume to continue it)"

    def claim_session(self, name: str) -> None:
        """Take --session NAME at start (saving is on): it is ours from now on, so a second colichat
        started with the same name is refused before its first answer. The first answer's save
        creates the files."""
        try:
            self.session = self.store.claim(self.ident, name, self.layout, self.settings.to_dict())
        except SessionExists:
            raise ChatError(f"session {name} already exists: add --resume to continue it, "
                            "or choose another name") from None
        self.session_name = name

    def session_names(self) -> list[str]:
        """This model's saved conversations, newest first (for Tab completion)."""
        return [i.name for i in self.store.list(self.ident)] if self.store else []

    def rename(self, new: str) -> str:
        """Give the current conversation another name (its files are renamed, nothing is rewritten)."""
        if not self.store:
            raise ChatError("saving is off (--no-save): nothing to rename")
        if not self.session:
            raise ChatError("this conversation is not saved yet: /save NAME saves it under that name")
        old = self.session.name
        self.store.rename(self.session, new)
        self.session_name = new
        return f"renamed session {old} to {new}"

    def save_as(self, name: str) -> str:
        """Write the conversation from the cache into a new session NAME (no forward pass). An
        unsaved conversation goes on in it; a saved one goes on in its own, NAME is a copy."""
        if not self.store:
            raise ChatError("saving is off (--no-save): nothing can be saved")
        if not self.turns:
            raise ChatError("nothing to save yet: the conversation is empty")
        copy = self.store.create(self.ident, self.layout, check_name(name), self.settings.to_dict())
        try:
            copy.append(self.model.cache, self.turns)
        except BaseException:
            copy.close()
            try:
                self.store.delete(self.ident, name)  # a partial copy: the conversation is still in memory
            except SessionError:
                pass
            raise
        if self.session is None:
            self.session, self.session_name = copy, name
            return f"saved to session {name}; the conversation goes on in it"
        copy.close()
        return f"saved a copy as session {name} (the conversation goes on in {self.session.name})"

    def list_sessions(self) -> list[str]:
        if not self.store:
            raise ChatError("saving is off (--no-save): no sessions")
        current = self.session.name if self.session else None
        return [("* " if i.name == current else "  ") + i.describe() for i in self.store.list(self.ident)]

    def resume(self, name: str | None = None) -> str:
        """Fill the cache from a saved session (the latest by default); no forward pass."""
        if not self.store:
            raise ChatError("saving is off (--no-save): nothing to resume")
        if name is None:
            info = self.store.latest(self.ident)
            if info is None:
                raise ChatError("no saved conversation for this model yet")
            name = info.name
        if self.session and self.session.name == name:
            raise ChatError(f"already in session {name}")
        new = self.store.open(self.ident, name, self.layout, read_only=self.read_only)
        try:
            res = new.load(self.model.cache, self.model.n_ctx, self.tok.decode, RESUME_MARGIN)
        except BaseException:
            new.close()
            if self.model.cache.length != (self.turns[-1].last if self.turns else 0):
                self.clear()  # the failed read touched the cache: start clean (the old session is on disk)
            raise
        if self.session:
            self.session.close()
        self.session, self.session_name = new, name
        self.turns = list(res.turns)
        self._apply_saved_settings(res.sampler)
        if self.pinned:
            self._save_settings()  # the options given now are the session's settings from now on
        damaged = damaged_settings(res.sampler)
        lines = [res.summary()] + [f"warning: {w}" for w in res.warnings + damaged]
        return "\n".join(lines)

    def delete_session(self, name: str) -> str:
        """Delete a saved conversation of this model (not the one in use)."""
        if not self.store:
            raise ChatError("saving is off (--no-save): no sessions")
        if self.session and self.session.name == name:
            raise ChatError(f"session {name} is the current conversation: /new first, then /delete {name}")
        freed = self.store.delete(self.ident, name)
        return f"deleted session {name} ({format_size(freed)})"

    def reset(self) -> str:
        """A new empty conversation; the current session stays on disk."""
        old = self.session.name if self.session and self.session.on_disk else None
        if self.session:
            self.session.close()
        self.session, self.session_name = None, None
        self.clear()
        if self.pending_system is not False:
            self.settings, self.pending_system = self.settings.with_(system=self.pending_system), False
            self._save_settings()
        return f"new conversation (session {old} is saved; /resume {old} reopens it)" if old else "new conversation"

    def clear(self) -> None:
        self.model.reset()
        self.turns = []

    def close(self) -> None:
        if self.session:
            self.session.close()
            self.session = None

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

    def _save(self, stats: TurnStats) -> None:
        """Append the unsaved turns; a failure is reported and the conversation goes on in memory."""
        if not self.store or self.read_only:
            return
        if self.session is None and not self.save_new:
            return
        try:
            if self.session is None:
                first = next((t.text for t in self.turns if t.role == "user"), "")
                self.session = self.store.create(self.ident, self.layout, self.session_name,
                                                 self.settings.to_dict(), stem=slug(first))
                self.session_name = self.session.name
            self.session.append(self.model.cache, self.turns)
            stats.saved = True
            stats.save_note = "; ".join(self.session.notes) or None
            self.session.notes.clear()
        except (SessionError, OSError, ValueError) as e:
            stats.saved = False
            stats.save_error = str(e).splitlines()[0] if str(e) else type(e).__name__

    def _save_settings(self) -> None:
        if self.session and not self.read_only:
            try:
                self.session.save_sampler(self.settings.to_dict())
            except (SessionError, OSError):
                pass  # saved again with the next answer

    # --- the prompt for a new user message ---------------------------------------------------------

    def _prompt_ids(self, user_text: str) -> tuple[list[int], int]:
        """Token ids to append for a new user message, and the cache row they start at
        (below the cache length only when the template re-renders history differently)."""
        full = self.template.render(self.messages() + [{"role": "user", "content": user_text}], True)
        users = [i for i, t in enumerate(self.turns) if t.role == "user"]
        if not self.turns:
            return self.tok.encode_prompt(full), 0
        if not users:  # only turns imported from a bare cache: continue after them, no second BOS
            bos = self.tok.bos_text
            return self.tok.encode(full[len(bos):] if bos and full.startswith(bos) else full,
                                   special=True), self.n_tokens
        last_user = users[-1]
        base = self.template.render(self.messages(self.turns[: last_user + 1]), True)
        base += "".join(t.text for t in self.turns[last_user + 1 :])
        if full.startswith(base):
            return self.tok.encode(full[len(base) :], special=True), self.n_tokens
        # Not prefix-stable (e.g. a template that rewrites past answers): keep the cache up to the
        # last turn boundary inside the longest common token prefix, and re-run the rest.
        ids = self.tok.encode_prompt(full)
        cached = self.model.cache.token_ids()
        lcp = 0
        while lcp < min(len(ids), len(cached)) and ids[lcp] == cached[lcp]:
            lcp += 1
        keep = max([0] + [t.last for t in self.turns if t.last <= lcp])
        return ids[keep:], keep

    # --- one exchange -----------------------------------------------------------------------------

    def ask(self, user_text: str, on_text=None, on_progress=None, on_note=None) -> tuple[str, TurnStats]:
        """Append the user's message, generate the answer (streamed through on_text), save both turns.

        `stop_requested` (set from a signal handler) ends the answer after the current token;
        what was generated stays in the transcript and the cache.
        """
        if not user_text.strip():
            raise ChatError("empty message")
        self.stop_requested = False
        stats = TurnStats()
        ids, start = self._prompt_ids(user_text)
        room = self.model.n_ctx - start
        if len(ids) + 1 >= room:
            raise ChatError(self._no_room(len(ids), room))
        if on_note and room - len(ids) < min(self.settings.max_tokens, 256):
            on_note(f"note: {room - len(ids)} tokens of context are left for the answer, which may be cut "
                    f"({self._ways_out()})")
        if start < self.n_tokens:
            self._rebase(start)
        first = self.n_tokens
        t0 = time.perf_counter()
        try:
            logits = self._prefill(ids, on_progress)
            stats.prompt_tokens, stats.prefill_s = len(ids), time.perf_counter() - t0
            user = Turn("user", user_text, first, self.n_tokens)
            answer, stats = self._generate(logits, stats, on_text)
        except BaseException:
            self.model.cache.truncate(first)  # an exchange that failed midway leaves no rows without turns
            raise
        self.turns += [user, Turn("assistant", answer, user.last, self.n_tokens)]
        self._save(stats)
        self.last_stats = stats
        return answer, stats

    def _prefill(self, ids: list[int], on_progress):
        """Long prompts (past 512 tokens) go in steps of 256: progress can be shown, and a stop
        request drops the message instead of waiting for the whole prompt."""
        step = 256 if len(ids) > 512 else len(ids)
        if on_progress:
            on_progress(0, len(ids))
        for i in range(0, len(ids), step):
            logits = self.model.prefill(ids[i : i + step], all_logits=False)[-1]
            if on_progress and step < len(ids):
                on_progress(min(i + step, len(ids)), len(ids))
            if self.stop_requested and i + step < len(ids):
                raise ChatError("interrupted while reading the message; it was not sent")
        return logits

    def _draft(self) -> int:
        """Drafts per pass. Speculation relies on a pass giving decode's exact rows; llama.cpp numerics
        and sparse attention compute a batch differently from single tokens (Model.exact_passes), so
        they decode one token at a time."""
        return self.settings.draft if self.model.exact_passes else 0

    def _generate(self, logits, stats: TurnStats, on_text) -> tuple[str, TurnStats]:
        stream = self.tok.stream()
        pieces: list[str] = []
        t0 = time.perf_counter()
        drafts = [PromptLookup()] + ([self.model.mtp] if self.model.mtp is not None else [])
        gen = Generation(self.model, logits, self.sampler, self.tok.eog_ids, self.settings.max_tokens,
                         drafts=drafts, draft=self._draft(), recent=self.settings.repeat_last_n)
        stats.stopped = "interrupt"
        tokens = iter(gen)
        try:
            while not self.stop_requested or stats.generated == self.settings.max_tokens:
                tok = next(tokens, None)  # the token is in the cache before it is shown
                if tok is None:
                    stats.stopped = gen.stopped
                    break
                stats.generated += 1
                piece = stream.push(tok.id)
                if piece:
                    pieces.append(piece)
                    if on_text:
                        on_text(piece)
        finally:
            tokens.close()  # a stop inside a batched pass drops the tokens not shown
        tail = stream.flush()
        if tail:
            pieces.append(tail)
            if on_text:
                on_text(tail)
        stats.decode_s = time.perf_counter() - t0
        stats.drafted, stats.accepted = gen.n_drafted, gen.n_accepted
        if len(drafts) > 1:  # which source the drafts came from
            stats.by_source = {name: tuple(c) for name, c in gen.by_source.items() if c[0]}
        return "".join(pieces), stats

    # --- a full context ---------------------------------------------------------------------------

    def _ways_out(self) -> str:
        """What frees context: the commands, and a larger --ctx only when the model allows one."""
        ways = ["/rewind N drops the last exchanges", "/new starts a new conversation"]
        if self.exchanges() > 1:
            ways.append("/forget N continues in a new one without the N oldest exchanges")
        if self.model.n_ctx < self.model.cfg.n_ctx_train:
            ways.append(f"or restart with a larger --ctx (this model takes up to {self.model.cfg.n_ctx_train})")
        return "; ".join(ways)

    def _no_room(self, needs: int, room: int) -> str:
        n_ctx, most = self.model.n_ctx, self.model.cfg.n_ctx_train
        if needs + 1 >= n_ctx:  # not even a new conversation would hold it
            more = f" or restart with a larger --ctx (this model takes up to {most})" if n_ctx < most else ""
            return f"the message needs {needs} tokens, more than the whole context of {n_ctx}: shorten it{more}"
        return (f"the message needs {needs} tokens but only {room} of the context of {n_ctx} are left; "
                f"it was not sent: {self._ways_out()}")

    def forget(self, n: int | None = None, on_progress=None) -> str:
        """Continue in a new conversation without the n oldest exchanges (default: enough that what
        remains fills at most half the context): the rest is read again (prefilled) from its text;
        the current conversation stays saved as it is."""
        starts = [i for i, t in enumerate(self.turns) if t.role == "user"]
        if any(t.role not in ("user", "assistant") for t in self.turns):
            raise ChatError("this conversation began as an imported cache, which cannot be read again: /new")
        if not starts:
            raise ChatError("nothing to forget: the conversation is empty")
        if n is None:
            half = self.model.n_ctx // 2
            n = next(k for k in range(1, len(starts) + 1)
                     if k == len(starts) or self.n_tokens - self.turns[starts[k]].first <= half)
        if not 1 <= n <= len(starts):
            raise ChatError(f"/forget takes 1 to {len(starts)} exchange(s)")
        kept = self.turns[starts[n]:] if n < len(starts) else []
        old = self.session.name if self.session else None
        self.reset()
        try:
            for t in kept:
                if t.role == "user":
                    ids, start = self._prompt_ids(t.text)
                    if start < self.n_tokens:
                        self._rebase(start)
                else:
                    ids = self.tok.encode(t.text, special=True)
                first = self.n_tokens
                if first + len(ids) + 1 >= self.model.n_ctx:
                    raise ChatError("what remains does not fit in the context: /forget more exchanges")
                if ids:
                    self._prefill(ids, on_progress)
                self.turns.append(Turn(t.role, t.text, first, self.n_tokens))
        except BaseException:
            if self.turns and self.turns[-1].role == "user":
                self.turns.pop()  # an exchange is kept whole or not at all
            self.model.cache.truncate(self.turns[-1].last if self.turns else 0)
            raise
        finally:
            stats = TurnStats()
            if self.turns:
                self._save(stats)
        where = {None: "not saved", True: f"saved as {self.session_name}",
                 False: f"NOT saved: {stats.save_error}"}[stats.saved]
        return (f"new conversation without the {n} oldest exchange(s)"
                + (f" of {old} (still saved as it was)" if old else "")
                + f": {self.exchanges()} exchange(s), {self.n_tokens} tokens read again; {where}")

    # --- history edits ----------------------------------------------------------------------------

    def rewind(self, n: int = 1) -> list[Turn]:
        """Drop the last n exchanges (cache truncated to the start of the first dropped one)."""
        if n < 1:
            raise ChatError("/rewind takes a positive number of exchanges")
        starts = [i for i, t in enumerate(self.turns) if t.role == "user"]
        if n > len(starts):
            raise ChatError(f"cannot rewind {n} exchange(s): the conversation has {len(starts)}")
        dropped = self.turns[starts[-n]:]
        self._truncate_records(dropped[0].first)
        return dropped

    def _rebase(self, n: int) -> None:
        """The template renders the history differently now: keep the cache up to row n (a turn
        boundary). Later turns keep their text (the template still renders them) but lose their
        records, which the new user turn's records re-create."""
        kept = sum(1 for t in self.turns if t.last <= n)
        self.turns = self.turns[:kept] + [Turn(t.role, t.text, n, n) for t in self.turns[kept:]]
        self._cut(n, kept)

    def _truncate_records(self, n: int) -> None:
        """Shrink the cache to n rows (a turn boundary), dropping later turns, on disk too."""
        self.turns = [t for t in self.turns if t.last <= n]
        self._cut(n, len(self.turns))

    def _cut(self, n: int, kept_turns: int) -> None:
        """Truncate the cache to n rows and the saved session to its first kept_turns turns."""
        self.model.cache.truncate(n)
        if self.session and not self.read_only:
            try:
                self.session.truncate(kept_turns)
            except SessionError as e:
                raise ChatError(f"{e} (the conversation goes on in memory)") from None

    # --- reporting --------------------------------------------------------------------------------

    def footer(self, stats: TurnStats) -> str:
        unsaved = ("not saved (--no-save)" if not self.store else "not saved (read-only)" if self.read_only
                   else "not saved (/save NAME keeps it)")
        saved = {None: unsaved, True: f"saved to {self.session_name}",
                 False: f"NOT saved: {stats.save_error}"}[stats.saved]
        stop = {"interrupt": ", interrupted", "length": ", max_tokens reached",
                "context": ", context full"}.get(stats.stopped, "")
        drafts = ""
        if stats.drafted:
            each = "".join(f"; {name} {kept}/{checked}" for name, (checked, kept) in stats.by_source.items())
            share = 100 * stats.accepted / stats.drafted
            drafts = f", drafts {stats.accepted}/{stats.drafted} accepted ({share:.0f}%{each})"
        note = f"\nnote: {stats.save_note}" if stats.save_note else ""
        return (f"[{stats.generated} tokens, {stats.decode_tps:.1f} tok/s, prefill {stats.prompt_tokens} "
                f"at {stats.prefill_tps:.0f} tok/s, context {self.n_tokens}/{self.model.n_ctx}, "
                f"{self.model.n_ctx - self.n_tokens} left{drafts}{stop}; {saved}]{note}")

    def stats_lines(self) -> list[str]:
        cache = self.model.cache
        lines = [f"context: {self.n_tokens} of {self.model.n_ctx} tokens, {self.exchanges()} exchange(s)",
                 f"KV cache: {format_size(cache.kv_bytes_per_token)}/token, "
                 f"{format_size(self.n_tokens * cache.record_bytes)} in use"]
        if self.session:
            lines.append(f"session {self.session.name}: {format_size(self.disk_bytes())} on disk")
        else:
            lines.append("session: not saved yet" if self.store else "session: saving is off (--no-save)")
        s = self.last_stats
        if s:
            lines.append(f"last answer: {s.generated} tokens at {s.decode_tps:.1f} tok/s; "
                         f"prefill {s.prompt_tokens} tokens at {s.prefill_tps:.0f} tok/s")
        return lines

    def exchanges(self) -> int:
        return sum(1 for t in self.turns if t.role == "user")
