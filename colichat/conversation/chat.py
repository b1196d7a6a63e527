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
cache keeps the rows before the first token that differs, and the rest is read again (History.rebase).
An answer is kept as the model wrote it, thinking and all: the template decides what of it the
model reads again, and thinking.py what the user sees of it.

Beside it: turns.py (the turns against what is saved: rewind, regen, forget, reset, fork, their
deferred cuts), saving.py (the session it is saved into), chat_settings.py (the settings it runs
with), report.py (the footer, /stats, what frees context).
"""

from __future__ import annotations

from ..engine import Model
from ..engine.cancel import Cancel
from ..engine.text.template import TemplateError, chat_template_for
from ..errors import ChatError
from ..persist import CacheLayout, Store, Turn, model_identity
from ..persist.loading import REOPEN_ROOM
from .answer import generate, prefill
from .chat_settings import ChatSettings
from .report import TurnStats, full_note, no_room, reopened, ways_out
from .saving import Saving
from .settings import Settings, damaged_settings
from .stopwatch import Stopwatch
from .system_prompt import problem_for_set
from .thinking import opens_thinking
from .turns import History

FULL_BELOW = REOPEN_ROOM  # a resumed conversation with fewer tokens of context left is said to be full

__all__ = ["FULL_BELOW", "ChatError", "Conversation", "Settings", "TurnStats"]


class Conversation:
    """The turns of one conversation over the model's cache: asking, forgetting, rewinding, resuming.

    `history` holds its turns against what is saved (turns.History, the session in `saving`),
    `prefs` the settings it runs with (chat_settings.ChatSettings); report.py says what happened.
    """

    def __init__(self, model: Model, settings: Settings, save: bool = True, session_name: str | None = None,
                 store: Store | None = None, pinned=frozenset(), save_new: bool = True, read_only: bool = False,
                 no_save: bool = False, kv: str | None = None, reuse: bool = True):
        self.model = model
        self.reuse = reuse  # a new conversation starts from a saved one's records where its prompt begins alike
        self.reused_from: str | None = None  # what the last /forget's reading again took from a saved conversation
        self.tok = model.tokenizer
        self.template = chat_template_for(self.tok)
        self.prefs = ChatSettings(settings, pinned)
        self.prefs.opens = {on: self._opens_thinking(on) for on in (True, False)}
        self.clock = Stopwatch()  # the prefill or answer under way; continued() after a stop (app.App)
        cfg = model.cfg
        ident = model_identity(cfg.path, cfg.arch, cfg.name) if save else None
        saving = Saving((store or Store()) if save else None, ident,
                        lambda: CacheLayout.from_cache(model.cache, cfg.n_vocab), session_name, save_new, read_only,
                        rope_factors=lambda: model.rope_factors, no_save=no_save, n_ctx=model.n_ctx)
        self.history = History(model, saving, self.prefs, kv)

    # --- state ------------------------------------------------------------------------------------

    def _opens_thinking(self, on: bool) -> bool:
        """Whether the template's generation prompt leaves the model inside its thinking (R1, GLM-4.7/5.x;
        V3.1 asked to think), asked to think (`on`) or not."""
        try:
            return opens_thinking(self.template.render([{"role": "user", "content": "?"}], True, enable_thinking=on))
        except TemplateError:  # (a template that needs more than one message to render says so when used)
            return False

    @property
    def turns(self) -> list[Turn]:
        return self.history.turns

    @property
    def saving(self) -> Saving:
        return self.history.saving

    @property
    def cut_failed(self) -> str | None:
        return self.history.cut_failed

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
            self.history.save_settings()
        if key == "draft" and value and self.model.mtp_left_out:
            said += (" (prompt lookup only: the model's MTP block was not loaded, as with --draft 0 at start; "
                     "start colichat with --draft N to draft with it too)")
        return said

    def set_kv(self, codec: str) -> str:
        """/set kv CODEC: how new conversations keep their cache (History.set_kv)."""
        return self.history.set_kv(codec)

    # --- the conversation and its session ---------------------------------------------------------

    def resume(self, name: str | None = None, on_progress=None, cancel: Cancel | None = None, on_note=None) -> str:
        """Fill the cache from a saved session (the latest by default); no forward pass, except for
        exchanges without records (pruned, damaged) whose text is intact: those are read again from
        their text (History.read_again, with `on_progress`, after what was found is said to `on_note`;
        `cancel` stops it), so that going on never loses them."""
        res, name = self.history.resume(name, lambda sess: sess.load(
            self.model.cache, self.model.n_ctx, self.tok.decode, exchanges=True, ctx_most=self.model.cfg.n_ctx_train))
        # Options given at start are the settings from now on, written with the next save: opening a
        # conversation to read it changes nothing on disk (FORMAT.md, "Loading reads only").
        self.prefs.apply_saved(res.sampler, started=bool(self.turns))
        lines = [reopened(res)] + [f"warning: {w}" for w in res.warnings + damaged_settings(res.sampler)]
        lines += self.prefs.check_saved_system(self.tok)
        codec, kv, given = self.model.cache.codec, self.history.kv, self.history.kv_from
        if codec != kv and given:  # (without --kv or /set kv there is no choice to set apart)
            lines.append(f"note: {name} is kept as {codec}, as it was saved; {given} {kv} is for new conversations")
        if res.unread and on_note:  # what was found is said before the reading, which takes a while
            on_note("\n".join(lines))
            lines = []
        if res.unread:
            lines += self.history.read_again(self, res.unread, on_progress, cancel or Cancel(), plain=bool(res.kv_gone))
        if self.prefs.pending_system is not False:  # --system given: this conversation was read with its own
            lines.append("note: the system prompt given waits for the next conversation (/new starts one); this "
                         "one goes on with the one it was saved with")
        return "\n".join(lines + full_note(self, FULL_BELOW))  # reopened as it was: what makes room

    def save_as(self, name: str) -> str:
        """/save NAME: the conversation, from the cache, into a new session (saving.Saving.save_as)."""
        return self.history.save_as(name)

    def fork(self, n: int | None = None) -> str:
        """/fork [N]: go on in a new saved conversation of this one's first n exchanges (History.fork)."""
        return self.history.fork(n)

    def new(self, stem: str | None = None) -> str:
        """/new: a new empty conversation; the current session stays on disk (History.new)."""
        return self.history.new(stem)

    def reset(self) -> str:
        """/reset: this conversation emptied in place, its settings kept (History.reset)."""
        return self.history.reset()

    def close(self) -> None:
        """Quitting: what a failed save or cut left unwritten gets one more try (History.close)."""
        self.history.close()

    # --- the prompt for a new user message ---------------------------------------------------------

    def _prompt_ids(self, user_text: str) -> tuple[list[int], int]:
        """Token ids to append for a new user message, and the cache row they start at
        (below the cache length only when the template re-renders history differently)."""
        on = self.prefs.thinks  # (asked of templates with the switch: V3.1, GLM, Qwen3)
        full = self.template.render(self.messages() + [{"role": "user", "content": user_text}], True,
                                    enable_thinking=on)
        users = [i for i, t in enumerate(self.turns) if t.role == "user"]
        if not self.turns:
            return self.tok.encode_prompt(full), 0
        if not users:  # only turns imported from a bare cache: continue after them, no second BOS
            bos = self.tok.bos_text
            return self.tok.encode(full[len(bos):] if bos and full.startswith(bos) else full,
                                   special=True), self.n_tokens
        last_user = users[-1]
        base = self.template.render(self.messages(self.turns[: last_user + 1]), True, enable_thinking=on)
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

    def ask(self, user_text: str, on_text=None, on_progress=None, on_note=None, on_think=None,
            cancel: Cancel | None = None) -> tuple[str, TurnStats]:
        """Append the user's message, generate the answer (streamed through on_text), save both turns.
        With `on_think`, a thinking model's thinking goes there instead, `on_think(text, tokens so
        far)` for each of its tokens (thinking.Splitter sorts it out), and on_text gets the answer.

        `cancel` (set by a signal handler) drops a message still being read, or ends the answer: what was
        shown stays in the transcript and the cache; a token being computed when the stop came is dropped
        (a terminal shows nothing after the ^C: the conversation goes on from what the user read)."""
        if not user_text.strip():
            raise ChatError("empty message")
        cancel = cancel or Cancel()
        stats = TurnStats()
        ids, start = self._prompt_ids(user_text)
        room = self.model.n_ctx - start
        if len(ids) + 1 >= room:
            raise ChatError(no_room(self, len(ids), room))
        if on_note and room - len(ids) < min(self.settings.max_tokens, 256):
            ways = ways_out(self)
            on_note(f"note: {room - len(ids)} tokens of context are left for the answer, which may be cut"
                    + (f" ({ways})" if ways else ""))
        if start < self.n_tokens:
            self.history.rebase(start, defer_cut=True)  # (cut on disk as the answer is saved: one commit)
        first, sampler = self.n_tokens, self.prefs.sampler
        random = sampler.rng.bit_generator.state
        self.clock.start()
        try:
            if self.reuse and not self.turns and first == 0:
                stats.reused, source = self.saving.reuse(self.model.cache, ids)
                if stats.reused and on_note:
                    on_note(f"reused {stats.reused:,} tokens from {source}")
            ids = ids[stats.reused :]
            logits = prefill(self.model, ids, self.clock, cancel, on_progress)
            stats.prompt_tokens, stats.prefill_s = len(ids), self.clock.elapsed()
            user = Turn("user", user_text, first, self.n_tokens)
            answer, stats = generate(self.model, logits, sampler, self.clock, cancel, stats, self.settings.max_tokens,
                                     self.settings.draft, self.prefs.opens_thinking, on_text, on_think)
        except BaseException:
            # an exchange that failed midway leaves no rows without turns, and draws nothing
            self.model.cache.truncate(first)
            sampler.rng.bit_generator.state = random
            raise
        self.turns.extend([user, Turn("assistant", answer, user.last, self.n_tokens)])
        self.history.save(stats)
        self.history.last_stats = stats
        return answer, stats

    # --- a full context, history edits -------------------------------------------------------------

    def forget(self, n: int | None = None, on_progress=None, cancel: Cancel | None = None) -> str:
        """/forget [N]: go on in a new conversation without the n oldest exchanges, the rest read again
        from its text (History.forget; `cancel` goes back to this one)."""
        return self.history.forget(self, n, on_progress, cancel or Cancel())

    def _read_turn(self, t: Turn, on_progress, too_long: str, defer_cut: bool = False, cancel=None) -> None:
        """Append turn t with records made again from its text (a prefill of it as the template renders
        it after the turns so far): /forget, and a resume's damaged exchanges. ChatError(too_long) if it
        does not fit in the context. `defer_cut`: a re-render that cuts turns loaded from disk cuts
        the saved session only at the next save (a resume writes nothing)."""
        if t.role == "user":
            ids, start = self._prompt_ids(t.text)
            if start < self.n_tokens:
                self.history.rebase(start, defer_cut)
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
            prefill(self.model, ids[reused:], self.clock, cancel or Cancel(), on_progress)
        self.turns.append(Turn(t.role, t.text, first, self.n_tokens))

    def regen(self, on_text=None, on_progress=None, on_note=None, on_think=None, cancel=None) -> tuple[str, TurnStats]:
        """Answer the last message again; the answer it replaces stays until the new one exists
        (History.replacing_last)."""
        with self.history.replacing_last() as user:
            return self.ask(user.text, on_text, on_progress, on_note, on_think, cancel)

    def rewind(self, n: int = 1) -> list[Turn]:
        """Drop the last n exchanges (History.rewind); -> the turns dropped."""
        return self.history.rewind(n)
