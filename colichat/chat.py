"""A conversation: its turns over the model's cache, the chat template, and one exchange at a time.

Each exchange is two turns over consecutive cache records:
  user turn      [first, last): the template text between the previous answer and this answer
                 (end-of-turn markers, the user's message, the assistant header);
  assistant turn [first, last): the tokens the model generated (the end-of-generation token is
                 not fed back; the next user turn's template text starts with it).
The cache only ever grows by appending (or shrinks by truncating), so what is on disk is a
prefix of what is in memory. The template text of a new user turn is computed from the messages
alone (`render(messages + [user]) minus (render(messages before the last answer) + answer)`), so a
resumed conversation continues with exactly the tokens an uninterrupted one would have. A template
that renders earlier turns otherwise than they were read (R1's and GLM's drop a past answer's
thinking, which the model read as it wrote it) makes the new prompt differ from the cache: the
cache keeps the rows before the first token that differs, and the rest is read again (`_rebase`).
An answer is kept as the model wrote it, thinking and all: the template decides what of it the
model reads again, and thinking.py what the user sees of it.

Beside it: saving.py (the session it is saved into), chat_settings.py (the settings it runs with),
report.py (the footer, /stats, what frees context).
"""

from __future__ import annotations

import time

from .chat_settings import ChatSettings
from .engine import Model, ModelError
from .engine.generate import Generation
from .engine.speculative import PromptLookup
from .engine.text.template import TemplateError, chat_template_for
from .errors import ChatError
from .persist import CacheLayout, Store, Turn, model_identity
from .persist.loading import REOPEN_ROOM
from .report import TurnStats, no_room, ways_out
from .saving import Saving
from .settings import Settings, damaged_settings
from .stopwatch import Stopwatch
from .system_prompt import problem_for_set, refusal
from .thinking import Splitter, opens_thinking
from .units import count
from .wrap import displayable

FULL_BELOW = REOPEN_ROOM  # a resumed conversation with fewer tokens of context left is said to be full
# A prompt longer than PROMPT_STEPPED is read PROMPT_STEP tokens at a time: progress is shown and a
# stop request is honoured between steps. (The engine cuts each step again by its PREFILL_CHUNK, a
# bound on memory; SmolLM2 reads a 1024-token prompt as fast in steps of 256 as of 512, within 2%.)
PROMPT_STEP, PROMPT_STEPPED = 256, 512

__all__ = ["FULL_BELOW", "ChatError", "Conversation", "Settings", "TurnStats"]


def takes(n: int) -> str:
    """'1 to N' exchanges, or '1' when there is one."""
    return "1" if n == 1 else f"1 to {n}"


class Conversation:
    """The turns of one conversation over the model's cache: asking, forgetting, rewinding, resuming.

    `saving` keeps it on disk (saving.Saving), `prefs` holds the settings it runs with
    (chat_settings.ChatSettings); report.py says what happened.
    """

    def __init__(self, model: Model, settings: Settings, save: bool = True, session_name: str | None = None,
                 store: Store | None = None, pinned=frozenset(), save_new: bool = True, read_only: bool = False,
                 no_save: bool = False, kv: str = "f32", reuse: bool = True):
        self.model = model
        self.reuse = reuse  # a new conversation starts from a saved one's records where its prompt begins alike
        self.reused_from: str | None = None  # what the last /forget's reading again took from a saved conversation
        self.kv = kv  # how a new conversation's rows are stored (--kv); a saved one keeps its own
        model.cache.set_codec(kv)  # (ValueError: a codec this model's rows cannot take)
        self.tok = model.tokenizer
        self.template = chat_template_for(self.tok)
        self.prefs = ChatSettings(settings, pinned)
        self.prefs.opens_thinking = self._opens_thinking()
        self.turns: list[Turn] = []
        self.stop_requested = False
        self.unsaved_cut: int | None = None  # /regen: the saved session keeps this many turns from the next save on
        self.unread_left = 0  # exchanges a stopped read left on disk, unread: they go with the next answer's save
        self.cut_failed: str | None = None  # why the last /rewind could not cut the saved session (it waits)
        self.save_failed = False  # a save or a cut failed since the last save that worked: the disk is behind
        self.last_stats: TurnStats | None = None
        self.clock = Stopwatch()  # the prefill or answer under way; continued() after a stop (cli.App)
        cfg = model.cfg
        self.saving = Saving((store or Store()) if save else None,
                             model_identity(cfg.path, cfg.arch, cfg.name) if save else None,
                             lambda: CacheLayout.from_cache(model.cache, cfg.n_vocab), session_name, save_new,
                             read_only,
                             rope_factors=lambda: model.rope_factors, no_save=no_save,
                             n_ctx=model.n_ctx)

    # --- state ------------------------------------------------------------------------------------

    def _opens_thinking(self) -> bool:
        """Whether the template's generation prompt leaves the model inside its thinking (R1, GLM-4.7/5.x)."""
        try:
            return opens_thinking(self.template.render([{"role": "user", "content": "?"}], True))
        except TemplateError:  # (a template that needs more than one message to render says so when used)
            return False

    @property
    def settings(self) -> Settings:
        return self.prefs.settings

    @property
    def n_tokens(self) -> int:
        return self.model.cache.length

    def exchanges(self) -> int:
        return sum(1 for t in self.turns if t.role == "user")

    def messages(self, turns: list[Turn] | None = None) -> list[dict]:
        """The chat messages for the template (turns imported from a bare cache file are opaque)."""
        msgs = [{"role": "system", "content": self.settings.system}] if self.settings.system else []
        turns = self.turns if turns is None else turns
        return msgs + [{"role": t.role, "content": t.text} for t in turns if t.role in ("user", "assistant")]

    def set_option(self, key: str, value) -> str:
        """Change one setting (a name of settings.TABLE; SettingError for a value it cannot take). A
        system prompt the chat template refuses, or that leaves no room for a message, is refused now
        (ChatError), not at the next message; the one in use (or waiting) stays."""
        problem = problem_for_set(self.model, value) if key == "system" and value is not None else None
        if problem:
            raise ChatError(problem)
        said, changed = self.prefs.set(key, value, started=bool(self.turns))
        if changed:
            self._save_settings()
        if key == "draft" and value and self.model.mtp_left_out:
            said += (" (prompt lookup only: the model's MTP block was not loaded, as with --draft 0 at start; "
                     "start colichat with --draft N to draft with it too)")
        return said

    def set_kv(self, codec: str) -> str:
        """/set kv CODEC: how new conversations keep their cache (--kv); an empty one takes it now."""
        problem = self.model.cache.codec_problem(codec)
        if problem:
            raise ChatError(problem)
        self.kv = codec
        if not self.turns and not (self.saving.session and self.saving.session.on_disk):
            self.model.cache.set_codec(codec)
        if self.model.cache.codec == codec:
            return f"kv = {codec}"
        return f"kv = {codec} (for new conversations: this one stays {self.model.cache.codec}, as it was saved)"

    # --- the conversation and its session ---------------------------------------------------------

    def resume(self, name: str | None = None, on_progress=None) -> str:
        """Fill the cache from a saved session (the latest by default); no forward pass, except for
        exchanges whose records were damaged but whose text is intact: those are read again from
        their text (`_read_again`, with `on_progress`), so that going on never loses them."""
        new, name = self.saving.open(name)
        try:
            self._keep_saved(f"/resume {name}")
        except ChatError:
            new.close()
            raise
        rope = self.model.rope_factors
        try:
            self._take_rope_factors(new)
            res = new.load(self.model.cache, self.model.n_ctx, self.tok.decode, exchanges=True,
                           ctx_most=self.model.cfg.n_ctx_train)
        except BaseException:
            new.close()
            self.model.use_rope_factors(rope)  # the conversation in memory goes on as it was
            if self.model.cache.length != (self.turns[-1].last if self.turns else 0):
                self.clear()  # the failed read touched the cache: start clean (the old session is on disk)
            raise
        self.saving.adopt(new, name)
        self.turns, self.unsaved_cut, self.unread_left = list(res.turns), None, 0  # (of the conversation left)
        self.save_failed = False
        # Options given at start are the settings from now on, written with the next save: opening a
        # conversation to read it changes nothing on disk (FORMAT.md, "Loading reads only").
        self.prefs.apply_saved(res.sampler, started=bool(self.turns))
        damaged = damaged_settings(res.sampler)
        lines = [res.summary()] + [f"warning: {w}" for w in res.warnings + damaged] + self._check_saved_system()
        if self.model.cache.codec != self.kv:
            lines.append(f"note: {name} is kept as {self.model.cache.codec}, as it was saved; --kv {self.kv} is for "
                         "new conversations")
        if res.unread:
            lines.append(self._read_again(res.unread, on_progress))
        if self.prefs.pending_system is not False:  # --system given: this conversation was read with its own
            lines.append("note: the system prompt given waits for the next conversation (/new starts one); this "
                         "one goes on with the one it was saved with")
        left, n_ctx = self.model.n_ctx - self.n_tokens, self.model.n_ctx
        if left < FULL_BELOW:  # reopened as it was: what makes room
            full = "full" if left < 2 else "nearly full"
            lines.append(f"note: the context is {full} ({self.n_tokens} of {n_ctx} tokens): {ways_out(self)}")
        return "\n".join(lines)

    def _check_saved_system(self) -> list[str]:
        """A reopened conversation's system prompt that the chat template refuses cannot be what its
        cache was read with (the template is part of the model's fingerprint): it is dropped, saying
        so, else every message would fail. (One that leaves no room for a message cannot be reopened:
        a saved conversation has an exchange, and its tokens must fit the context.)"""
        system = self.settings.system
        why = None if system is None else refusal(self.tok, system)
        if why is None:
            return []
        self.prefs.drop_system()
        return [f"warning: the saved system prompt is not used: this model's chat template takes no system "
                f"prompt ({why})"]

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

    def save_as(self, name: str) -> str:
        """/save NAME: the conversation, from the cache, into a new session (saving.Saving.save_as)."""
        return self.saving.save_as(name, self.model.cache, self.turns, self.prefs.saved())

    def fork(self, n: int | None = None) -> str:
        """/fork [N]: continue in a new conversation made of this one's first n exchanges (default: all),
        saved at once (saving.Saving.fork: their records copied, no forward pass); this one stays
        saved as it is. The cache keeps the fork's records."""
        starts = [i for i, t in enumerate(self.turns) if t.role == "user"]
        if not starts:
            raise ChatError("nothing to fork: the conversation is empty")
        n = len(starts) if n is None else n
        if not 1 <= n <= len(starts):
            raise ChatError(f"/fork takes {takes(len(starts))}: the conversation has {count(len(starts), 'exchange')}")
        self._keep_saved("/fork")
        kept = self.turns[: starts[n] if n < len(starts) else len(self.turns)]
        said = self.saving.fork(self.model.cache, kept, n, self.prefs.saved())
        self.turns, self.unsaved_cut, self.unread_left, self.cut_failed = kept, None, 0, None
        self.model.cache.truncate(kept[-1].last)
        return said

    def new(self) -> str:
        """/new: a new empty conversation; the current session stays on disk."""
        self._keep_saved("/new")
        old = self.saving.leave()
        self.clear()
        self.model.cache.set_codec(self.kv)
        if self.prefs.next_conversation():
            self._save_settings()
        return f"new conversation (session {old} is saved; /resume {old} reopens it)" if old else "new conversation"

    def reset(self) -> str:
        """/reset (the format's kv_disk_reset): this conversation emptied in place. Same name, its KV file
        cut to its header and its sidecar listing no turn (Session.truncate with keep_files), its
        settings kept; the next message starts it again, as a new conversation of that name would."""
        if not self.turns:
            raise ChatError("nothing to reset: the conversation is empty")
        n, tokens, first = self.exchanges(), self.n_tokens, self.turns[0]
        self.clear()
        failed = self._cut_on_disk(0, keep_files=True)
        if self.prefs.next_conversation():
            self._save_settings()
        preview = displayable(first.text.strip().replace("\n", " "))
        said = (f"removed {count(n, 'exchange')} ({count(tokens, 'token')}), from \"{preview[:60]}"
                f"{'...' if len(preview) > 60 else ''}\"")
        where = self.saving.session.name if self.saving.session and self.saving.session.on_disk else None
        if failed:
            return f"{said}; {failed}"
        return said + (f"; session {where} is empty, its settings kept" if where else "")

    def clear(self) -> None:
        self.model.reset()
        self.last_stats = None  # (/stats of a new conversation shows no answer of the old one)
        self.turns, self.unsaved_cut, self.unread_left, self.save_failed = [], None, 0, False

    def close(self) -> None:
        """Quitting: a cut or turns a failed save left unwritten get one more try, then the session is closed."""
        if self.save_failed and not self.unread_left:
            self._save(TurnStats())
        self.saving.close()

    def _keep_saved(self, doing: str) -> None:
        """Before this conversation is left (/new, /resume, /forget): turns a failed save left unwritten
        are saved now, or `doing` is refused, saying why: leaving would lose them. (With exchanges a
        stopped read left unread, the disk holds more than memory: nothing to save.)"""
        if not self.save_failed or self.unread_left:
            return
        stats = TurnStats()
        self._save(stats)
        if stats.saved is False:
            raise ChatError(f"this conversation is not saved ({stats.save_error}), and {doing} would lose it: "
                            "free some space and try again (/export FILE writes it elsewhere)")

    def _save(self, stats: TurnStats) -> None:
        self.model.keep_expert_usage()  # (MoE: which experts this run used, for the next start's warm start)
        if self.unsaved_cut is not None:  # the answer /regen replaces goes from the disk only now
            try:
                self.saving.truncate(self.model.cache, self.unsaved_cut, self.prefs.saved())
            except ChatError as e:
                stats.saved, stats.save_error = False, str(e)
                self.save_failed = True
                return
            self.unsaved_cut = None
        self.saving.save(self.model.cache, self.turns, self.prefs.saved(), stats)
        if stats.saved is not None:
            self.save_failed = not stats.saved
        if stats.saved:
            self.unread_left = 0

    def _save_settings(self) -> None:
        self.saving.save_settings(self.prefs.saved())

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
        # Not prefix-stable (a template that rewrites past answers, as R1's drops their thinking):
        # the cache keeps the rows of the longest common token prefix (a row depends only on the
        # tokens up to it) and the rest is read again, from the first token that differs; at least
        # one token is read, for the logits of the answer.
        ids = self.tok.encode_prompt(full)
        cached = self.model.cache.token_ids()
        lcp = 0
        while lcp < min(len(ids), len(cached)) and ids[lcp] == cached[lcp]:
            lcp += 1
        keep = min(lcp, len(ids) - 1)
        return ids[keep:], keep

    def fits(self, user_text: str) -> bool:
        """Whether a message fits in the context left with room for its answer (at least
        min(max_tokens, 256) tokens, under which ask's note says the answer may be cut)."""
        ids, start = self._prompt_ids(user_text)
        return self.model.n_ctx - start - len(ids) >= min(self.settings.max_tokens, 256)

    # --- one exchange -----------------------------------------------------------------------------

    def ask(self, user_text: str, on_text=None, on_progress=None, on_note=None,
            on_think=None) -> tuple[str, TurnStats]:
        """Append the user's message, generate the answer (streamed through on_text), save both turns.
        With `on_think`, a thinking model's thinking goes there instead, `on_think(text, tokens so
        far)` for each of its tokens (thinking.Splitter sorts it out), and on_text gets the answer.

        `stop_requested` (set from a signal handler) ends the answer: what was shown stays in the
        transcript and the cache; a token that was being computed when the stop came is dropped (a
        terminal shows nothing after the ^C, so the conversation goes on from what the user read).
        """
        if not user_text.strip():
            raise ChatError("empty message")
        self.stop_requested = False
        stats = TurnStats()
        ids, start = self._prompt_ids(user_text)
        room = self.model.n_ctx - start
        if len(ids) + 1 >= room:
            raise ChatError(no_room(self, len(ids), room))
        if on_note and room - len(ids) < min(self.settings.max_tokens, 256):
            on_note(f"note: {room - len(ids)} tokens of context are left for the answer, which may be cut "
                    f"({ways_out(self)})")
        if start < self.n_tokens:
            self._rebase(start)
        first, sampler = self.n_tokens, self.prefs.sampler
        random = sampler.rng.bit_generator.state
        self.clock.start()
        try:
            if self.reuse and not self.turns and first == 0:
                stats.reused, source = self.saving.reuse(self.model.cache, ids)
                if stats.reused and on_note:
                    on_note(f"reused {stats.reused:,} tokens from {source}")
            ids = ids[stats.reused :]
            logits = self._prefill(ids, on_progress)
            stats.prompt_tokens, stats.prefill_s = len(ids), self.clock.elapsed()
            user = Turn("user", user_text, first, self.n_tokens)
            answer, stats = self._generate(logits, stats, self._sorted(on_text, on_think, stats))
        except BaseException:
            # an exchange that failed midway leaves no rows without turns, and draws nothing
            self.model.cache.truncate(first)
            sampler.rng.bit_generator.state = random
            raise
        self.turns += [user, Turn("assistant", answer, user.last, self.n_tokens)]
        self._save(stats)
        self.last_stats = stats
        return answer, stats

    def _prefill(self, ids: list[int], on_progress):
        """Long prompts go in steps (PROMPT_STEP): progress can be shown, and a stop request drops
        the message instead of waiting for the whole prompt."""
        step = PROMPT_STEP if len(ids) > PROMPT_STEPPED else len(ids)
        if on_progress:
            on_progress(0, len(ids))
        for i in range(0, len(ids), step):
            logits = self.model.prefill(ids[i : i + step], all_logits=False)[-1]
            self.clock.tick()
            if on_progress and step < len(ids):
                on_progress(min(i + step, len(ids)), len(ids))
            if self.stop_requested and i + step < len(ids):
                raise ChatError("interrupted while reading the message; it was not sent")
        return logits

    def _draft(self) -> int:
        """Drafts per pass. Speculation relies on a pass giving decode's exact rows; llama.cpp numerics
        compute a batch differently from single tokens (Model.exact_passes), so they decode one token
        at a time."""
        return self.settings.draft if self.model.exact_passes else 0

    def _sorted(self, on_text, on_think, stats: TurnStats):
        """The callback _generate gives each token's text to (and, `end`, the text left at the end of
        the answer): as it is without `on_think`, else thinking to on_think (its tokens counted in
        stats.thinking) and the answer to on_text."""
        if on_think is None:
            return on_text and (lambda piece, end=False: piece and on_text(piece))
        split = Splitter(self.prefs.opens_thinking)

        def sort(piece: str, end: bool = False) -> None:
            was = split.thinking
            parts = split.feed(piece) + (split.end() if end else [])
            if not end and (was or split.thinking):
                stats.thinking += 1
                parts = parts if any(thinking for thinking, _ in parts) else [(True, "")] + parts
            stats.still_thinking = split.thinking  # (an answer that ends so was cut short)
            for thinking, text in parts:
                if thinking:
                    on_think(text, stats.thinking)
                elif text and on_text:
                    on_text(text)

        return sort

    def _generate(self, logits, stats: TurnStats, on_text) -> tuple[str, TurnStats]:
        stream = self.tok.stream()
        pieces: list[str] = []
        self.clock.start()
        drafts = [PromptLookup()] + ([self.model.mtp] if self.model.mtp is not None else [])
        gen = Generation(self.model, logits, self.prefs.sampler, self.tok.eog_ids, self.settings.max_tokens,
                         drafts=drafts, draft=self._draft())  # (the penalty's window: the sampler's)
        stats.stopped = "interrupt"
        tokens, first = iter(gen), self.model.cache.length
        try:
            while not self.stop_requested or stats.generated == self.settings.max_tokens:
                tok = next(tokens, None)  # the token is in the cache before it is shown
                if tok is None:
                    stats.stopped = gen.stopped
                    break
                if self.stop_requested:  # asked to stop while it was computed: neither shown nor kept
                    break
                stats.generated += 1
                piece = stream.push(tok.id)
                pieces.append(piece)
                if on_text:
                    on_text(piece)
                self.clock.tick()
        finally:
            tokens.close()  # a stop inside a batched pass drops the tokens not shown
            cut = stream.pending_tokens if stats.stopped == "interrupt" else 0  # nor those of a part of a character
            stats.generated -= cut
            stats.thinking = min(stats.thinking, stats.generated)
            if self.model.cache.length > first + stats.generated:  # and the one computed after a stop
                self.model.cache.truncate(first + stats.generated)
        if stats.stopped == "interrupt" and not stats.generated:  # nothing shown: as if it was never sent
            raise ChatError("interrupted before the answer began; the message was not sent")
        tail = stream.flush() if not cut else ""
        pieces.append(tail)
        if on_text:
            on_text(tail, end=True)
        stats.decode_s = self.clock.elapsed()
        stats.drafted, stats.accepted = gen.n_drafted, gen.n_accepted
        if len(drafts) > 1:  # which source the drafts came from
            stats.by_source = {name: tuple(c) for name, c in gen.by_source.items() if c[0]}
        return "".join(pieces), stats

    # --- a full context ---------------------------------------------------------------------------

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
            has = count(len(starts), 'exchange')
            raise ChatError(f"/forget takes {takes(len(starts))}: the conversation has {has}")
        kept = self.turns[starts[n]:] if n < len(starts) else []
        self._keep_saved("/forget")
        old = self.saving.session.name if self.saving.session and self.saving.session.on_disk else None
        self.stop_requested, stopped, self.reused_from = False, False, None
        self.new()
        self.saving.stem = f"{old[:54]}-cont" if old and kept else None  # named after where it came from
        try:
            for t in kept:
                if self.stop_requested and old:  # Ctrl-C: back to the conversation as it was, below
                    stopped = True
                    break
                self._read_turn(t, on_progress, "what remains does not fit in the context: /forget more exchanges")
        except BaseException:
            if self.turns and self.turns[-1].role == "user":
                self.turns.pop()  # an exchange is kept whole or not at all
            self.model.cache.truncate(self.turns[-1].last if self.turns else 0)
            raise
        finally:
            stats = TurnStats()
            if self.turns and not stopped:
                self._save(stats)
        if stopped:
            self.clear()
            self.resume(old)  # from disk, as it was saved: no reading again
            raise ChatError(f"/forget stopped: back in {old}, as it was")
        if not kept:
            return (f"new empty conversation: {'its one exchange' if n == 1 else f'all {n} exchanges'} forgotten"
                    + (f" ({old} is still saved as it was)" if old else ""))
        where = {None: "not saved", True: f"saved as {self.saving.name}",
                 False: f"NOT saved: {stats.save_error}"}[stats.saved]
        reused = f" ({self.reused_from})" if self.reused_from else ""
        return (f"new conversation without the {'oldest exchange' if n == 1 else f'{n} oldest exchanges'}"
                + (f" of {old} (still saved as it was)" if old else "")
                + f": {count(self.exchanges(), 'exchange')}, {count(self.n_tokens, 'token')} read again{reused}; "
                + where)

    def _read_turn(self, t: Turn, on_progress, too_long: str, defer_cut: bool = False) -> None:
        """Append turn t with records made again from its text (a prefill of it as the template renders
        it after the turns so far): /forget, and a resume's damaged exchanges. ChatError(too_long) if it
        does not fit in the context. `defer_cut`: a re-render that cuts turns loaded from disk cuts
        the saved session only at the next save (a resume writes nothing)."""
        if t.role == "user":
            ids, start = self._prompt_ids(t.text)
            if start < self.n_tokens:
                self._rebase(start, defer_cut)
        else:
            ids = self.tok.encode(t.text, special=True)
        first = self.n_tokens
        if first + len(ids) + 1 >= self.model.n_ctx:
            raise ChatError(too_long)
        reused = 0
        if self.reuse and t.role == "user" and first == 0 and len(ids) > 1:  # a new conversation's first turn
            reused, source = self.saving.reuse(self.model.cache, ids)
            self.reused_from = f"reused {reused:,} tokens from {source}" if reused else None
        if ids[reused:]:
            self._prefill(ids[reused:], on_progress)
        self.turns.append(Turn(t.role, t.text, first, self.n_tokens))

    def _read_again(self, unread: list[Turn], on_progress=None) -> str:
        """A resume's exchanges whose records were dropped (damaged, cut short) but whose text is intact
        (LoadResult.unread): read again from their text, an exchange at a time, so that the
        conversation goes on whole. Nothing is written now: the next answer's save replaces their
        records. A stop (Ctrl-C), or an exchange that no longer fits, keeps the exchanges read so far
        (as /regen does, the rows a re-render replaced are put back); the others stay on disk until
        that save, as the warnings above this line say."""
        cache, n0, t0 = self.model.cache, self.n_tokens, time.perf_counter()
        starts = [i for i, t in enumerate(unread) if t.role == "user"]
        done, why = 0, None
        self.stop_requested = False
        for a, b in zip(starts, starts[1:] + [len(unread)], strict=True):
            _, start = self._prompt_ids(unread[a].text)  # below the cache's end when the template re-renders
            end = cache.length
            rows, turns, cut = cache.records[start:end].copy(), list(self.turns), self.unsaved_cut  # (end-start,)
            read = False
            try:
                if self.stop_requested:
                    raise ChatError("stopped")
                for t in unread[a:b]:
                    self._read_turn(t, on_progress, "it no longer fits in the context", defer_cut=True)
                read = True
            except ChatError as e:
                why = "stopped" if self.stop_requested else str(e)
            finally:
                if not read:  # as before this exchange
                    cache.truncate(start)
                    cache.records[start:end] = rows
                    cache.set_length(end)
                    self.turns, self.unsaved_cut = turns, cut
            if not read:
                break
            done += 1
        said = (f"read {count(done, 'exchange')} again from {'its' if done == 1 else 'their'} saved text "
                f"({count(self.n_tokens - n0, 'token')} in {time.perf_counter() - t0:.1f} s)")
        saving = not self.saving.read_only  # (--no-save, a read-only file system: nothing is written)
        self.unread_left = len(starts) - done if saving else 0
        if why is None:
            return (f"note: {said}: the conversation is whole again"
                    + (f"; the next answer saves {'its' if done == 1 else 'their'} records anew" if saving else ""))
        return (f"warning: {said}, then {why}: {count(len(starts) - done, 'more exchange')} not read"
                + ("; they stay on disk until the next answer saves the conversation without them" if saving else ""))

    # --- history edits ----------------------------------------------------------------------------

    def regen(self, on_text=None, on_progress=None, on_note=None, on_think=None) -> tuple[str, TurnStats]:
        """Answer the last message again. The answer it replaces stays, in memory and on disk, until
        the new one exists: a regeneration stopped before its first token, or failing, leaves the
        conversation as it was."""
        starts = [i for i, t in enumerate(self.turns) if t.role == "user"]
        if not starts:
            raise ChatError("nothing to regenerate: the conversation is empty")
        cache, old_turns = self.model.cache, self.turns
        user, end = self.turns[starts[-1]], cache.length
        old_rows = cache.records[user.first:end].copy()  # (n,) records of the exchange replaced
        self.turns = self.turns[: starts[-1]]
        cache.truncate(user.first)
        cut = self.unsaved_cut
        self.unsaved_cut = starts[-1] if cut is None else min(cut, starts[-1])
        try:
            return self.ask(user.text, on_text, on_progress, on_note, on_think)
        except BaseException:
            cache.records[user.first:end] = old_rows
            cache.set_length(end)
            self.turns, self.unsaved_cut = old_turns, cut
            raise

    def rewind(self, n: int = 1) -> list[Turn]:
        """Drop the last n exchanges (cache truncated to the start of the first dropped one). Rewound
        to no exchange, the conversation starts anew: a system prompt that waited for the next
        conversation (/set system after the first answer) is the one in use now."""
        starts = [i for i, t in enumerate(self.turns) if t.role == "user"]
        if not starts:
            raise ChatError("nothing to rewind: the conversation is empty")
        if not 1 <= n <= len(starts):  # said as /forget says it
            raise ChatError(f"/rewind takes {takes(len(starts))}: the conversation has {count(len(starts), 'exchange')}"
                            + (" (/reset empties it)" if n > len(starts) else ""))
        dropped = self.turns[starts[-n]:]
        self.cut_failed = None
        if self.unread_left:  # a stopped read left exchanges on disk: they and these go with the next save
            self._rebase(dropped[0].first, defer_cut=True)
            self.turns = self.turns[: starts[-n]]
        else:
            self._truncate_records(dropped[0].first)
        if not self.turns and self.prefs.next_conversation():
            self._save_settings()
        return dropped

    def _rebase(self, n: int, defer_cut: bool = False) -> None:
        """The template renders the history differently now: keep the cache up to row n (the first
        token that differs). Later turns keep their text (the template still renders them) but lose
        their records (the turn n falls in keeps those before n), which the new user turn's records
        re-create. The saved session keeps the turns that end by n; `defer_cut`: it is cut at the
        next save (unsaved_cut), not now."""
        kept = sum(1 for t in self.turns if t.last <= n)
        self.turns = [t if t.last <= n else Turn(t.role, t.text, min(t.first, n), n) for t in self.turns]
        if defer_cut:
            self.model.cache.truncate(n)
            self.unsaved_cut = kept if self.unsaved_cut is None else min(self.unsaved_cut, kept)
        else:
            self._cut(n, kept)

    def _truncate_records(self, n: int) -> None:
        """Shrink the cache to n rows (a turn boundary), dropping later turns, on disk too."""
        self.turns = [t for t in self.turns if t.last <= n]
        self._cut(n, len(self.turns))

    def _cut(self, n: int, kept_turns: int) -> None:
        """Truncate the cache to n rows and the saved session to its first kept_turns turns; a cut the
        disk refused is said in `cut_failed` and made with the next save."""
        self.model.cache.truncate(n)
        self.cut_failed = self._cut_on_disk(kept_turns)

    def _cut_on_disk(self, kept_turns: int, keep_files: bool = False) -> str | None:
        """Cut the saved session to its first kept_turns turns now; if the disk refuses, the cut waits
        for the next save (unsaved_cut: an append never runs before it), and the reason is returned."""
        try:
            self.saving.truncate(self.model.cache, kept_turns, self.prefs.saved(), keep_files)
        except ChatError as e:
            self.unsaved_cut = kept_turns if self.unsaved_cut is None else min(self.unsaved_cut, kept_turns)
            self.save_failed = True
            return (f"{e}: the saved conversation keeps them until the next answer saves it "
                    "(or quitting, which tries again)")
        return None
