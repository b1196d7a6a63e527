"""A conversation: the one object a message or a slash command reaches. It changes the turns in memory
and the session on disk together, and is the only part of the app that writes a session
(persist.Session); each of its verbs (ask, rewind, reset, forget, fork, save_as, rename, new,
resume, close) is defined here once.

Each exchange is two turns over consecutive cache records:
  user turn      [first, last): the template text between the previous answer and this answer
                 (end-of-turn markers, the user's message, the assistant header: prompt.Prompt);
  assistant turn [first, last): the tokens the model generated (the end-of-generation token is
                 not fed back; the next user turn's template text starts with it).
The cache only ever grows by appending (or shrinks by truncating), so what is on disk is a prefix of
what is in memory. An answer is kept as the model wrote it, thinking and all: the template decides
what of it the model reads again, and thinking.py what the user sees of it.

Beside it, each with one job: transcript.py (the turns over the cache, where they part from the disk,
the mark-and-restore of an edit that may fail), prompt.py (the template's tokens for a new message),
shelf.py (this model's saved conversations: where a session comes from), reading.py (exchanges read
again from their text), answer.py (the forward passes), chat_settings.py (the settings it runs
with), report.py (the footer, /stats, what frees context).
"""

from __future__ import annotations

from ..engine import Model
from ..engine.cancel import Cancel
from ..errors import ChatError, ModelError
from ..persist import CacheLayout, SaveFailed, Session, SessionError, Store, Turn, check_name, model_identity, slug
from ..persist.loading import REOPEN_ROOM
from ..units import count
from ..wrap import displayable
from .answer import generate, prefill
from .chat_settings import ChatSettings
from .prompt import Prompt
from .reading import one_count, read_again
from .report import TurnStats, full_note, no_room, reopened, ways_out
from .settings import Settings, damaged_settings
from .shelf import Shelf
from .stopwatch import Stopwatch
from .system_prompt import problem_for_set
from .transcript import Transcript

FULL_BELOW = REOPEN_ROOM  # a resumed conversation with fewer tokens of context left is said to be full

__all__ = ["FULL_BELOW", "ChatError", "Conversation", "Settings", "TurnStats"]


def takes(n: int) -> str:
    """'1 to N' exchanges, or '1' when there is one."""
    return "1" if n == 1 else f"1 to {n}"


def nothing_written(e: SaveFailed, again: str) -> ChatError:
    """A copy (/save NAME, /fork) that could not be written: it is not retried (the next save is the
    conversation's own); `again` is the command to give once there is room."""
    return ChatError(f"{e.what}; nothing was written (free some space, then {again} again)")


def take_rope_factors(model: Model, sess: Session, shelf: Shelf) -> None:
    """Rotate with the rope factors the session's rows were made with (LongRoPE: a conversation
    made with the long factors goes on with them at a smaller context; the short ones serve no
    context above the original one, so such a resume is refused), before its rows are read."""
    saved = sess.saved_rope_factors()
    if saved is None or saved == model.rope_factors:
        return
    try:
        model.use_rope_factors(saved)
    except ModelError as e:
        raise ChatError(f"session {sess.name} cannot be resumed: {e}") from None
    sess.ident = shelf.ident


class Conversation:
    """One conversation over the model's cache, and the session it is saved into (`session`, with
    saving on: created at the first answer, claimed by --session NAME or /rename before it, or resumed).

    `transcript` holds its turns (transcript.Transcript), `prefs` the settings it runs with
    (chat_settings.ChatSettings), `prompt` renders a new message (prompt.Prompt), `shelf` is this
    model's saved conversations (shelf.Shelf); report.py says what happened.
    """

    def __init__(self, model: Model, settings: Settings, save: bool = True, session_name: str | None = None,
                 store: Store | None = None, pinned=frozenset(), save_new: bool = True, read_only: bool = False,
                 no_save: bool = False, kv: str | None = None, reuse: bool = True, claim: bool = False):
        self.model = model
        self.reuse = reuse  # a new conversation starts from a saved one's records where its prompt begins alike
        self.reused_from: str | None = None  # what the last /forget's reading again took from a saved conversation
        self.prefs = ChatSettings(settings, pinned, kv)
        model.cache.set_codec(self.prefs.kv)  # (ValueError: a codec this model's rows cannot take)
        self.transcript = Transcript(model.cache)
        self.prompt = Prompt(model.tokenizer, self.transcript, self.prefs)
        self.prefs.opens = {on: self.prompt.opens_thinking(on) for on in (True, False)}
        self.clock = Stopwatch()  # the prefill or answer under way; continued() after a stop (app.App)
        cfg = model.cfg
        ident = model_identity(cfg.path, cfg.arch, cfg.name) if save else None
        self.shelf = Shelf((store or Store()) if save else None, ident,
                           lambda: CacheLayout.from_cache(model.cache, cfg.n_vocab), save_new, read_only,
                           rope_factors=lambda: model.rope_factors, no_save=no_save, n_ctx=model.n_ctx)
        self.session: Session | None = None  # once created, claimed or resumed
        self.name = session_name  # the session's: claimed, saved, or to be taken by the first save
        self.stem: str | None = None  # the name a new conversation's first save takes (else its first message's)
        if claim:  # --session NAME at start: ours from now on (a second colichat with it is refused)
            self.session = self.shelf.claim(session_name, settings.to_dict())

    @property
    def saved_name(self) -> str | None:
        """The session's name if it has files on disk (not one claimed only, or cut to no exchange)."""
        s = self.session
        return s.name if s and s.on_disk else None

    def set_option(self, key: str, value) -> str:
        """Change one setting: a name of settings.TABLE (SettingError for a value it cannot take), or "kv",
        how new conversations keep their cache (an empty one takes it now). A system prompt the chat
        template refuses, or that leaves no room for a message, is refused now (ChatError), not at the
        next message; the one in use (or waiting) stays."""
        turns = self.transcript.turns
        if key == "kv":
            return self.prefs.set_kv(value, self.model.cache, fresh=not turns and not self.saved_name)
        problem = problem_for_set(self.model, value) if key == "system" and value is not None else None
        if problem:
            raise ChatError(problem)
        said, changed = self.prefs.set(key, value, started=bool(turns))
        self._settings_changed(changed)
        if key == "draft" and value and self.model.mtp_left_out:
            said += (" (prompt lookup only: the model's MTP block was not loaded, as with --draft 0 at start; "
                     "start colichat with --draft N to draft with it too)")
        return said

    # --- one exchange -----------------------------------------------------------------------------

    def ask(self, user_text: str | None, on_text=None, on_progress=None, on_note=None, on_think=None,
            cancel: Cancel | None = None) -> tuple[str, TurnStats]:
        """Append the user's message, generate the answer (streamed through on_text), save both turns.
        With `on_think`, a thinking model's thinking goes there instead, `on_think(text, tokens so
        far)` for each of its tokens (thinking.Splitter sorts it out), and on_text gets the answer.
        `user_text` None (/regen): the last message again; the answer it replaces stays until the new
        one exists (Transcript.replacing_last).

        `cancel` (set by a signal handler) drops a message still being read, or ends the answer: what was
        shown stays in the transcript and the cache; a token being computed when the stop came is dropped
        (a terminal shows nothing after the ^C: the conversation goes on from what the user read)."""
        t, cache = self.transcript, self.model.cache
        if user_text is None:
            if not t.starts():
                raise ChatError("nothing to regenerate: the conversation is empty")
            with t.replacing_last() as user:
                return self.ask(user.text, on_text, on_progress, on_note, on_think, cancel)
        if not user_text.strip():
            raise ChatError("empty message")
        cancel = cancel or Cancel()
        stats = TurnStats()
        ids, start = self.prompt.ids(user_text)
        room = self.model.n_ctx - start
        if len(ids) + 1 >= room:
            raise ChatError(no_room(self, len(ids), room))
        settings = self.prefs.settings
        if on_note and room - len(ids) < min(settings.max_tokens, 256):
            ways = ways_out(self)
            on_note(f"note: {room - len(ids)} tokens of context are left for the answer, which may be cut"
                    + (f" ({ways})" if ways else ""))
        if start < cache.length:
            t.defer_cut(t.rebase(start))  # (cut on disk as the answer is saved: one commit)
        first, sampler = cache.length, self.prefs.sampler
        random = sampler.rng.bit_generator.state
        self.clock.start()
        try:
            if self.reuse and not t.turns and first == 0:
                stats.reused, source = self.shelf.reuse(cache, ids)
                if stats.reused and on_note:
                    on_note(f"reused {stats.reused:,} tokens from {source}")
            ids = ids[stats.reused :]
            logits = prefill(self.model, ids, self.clock, cancel, on_progress)
            stats.prompt_tokens, stats.prefill_s = len(ids), self.clock.elapsed()
            user = Turn("user", user_text, first, cache.length)
            answer, stats = generate(self.model, logits, sampler, self.clock, cancel, stats, settings.max_tokens,
                                     settings.draft, self.prefs.opens_thinking, on_text, on_think)
        except BaseException:
            # an exchange that failed midway leaves no rows without turns, and draws nothing
            cache.truncate(first)
            sampler.rng.bit_generator.state = random
            raise
        t.turns.extend([user, Turn("assistant", answer, user.last, cache.length)])
        self._save(stats)
        t.last_stats = stats
        return answer, stats

    # --- history edits ----------------------------------------------------------------------------

    def rewind(self, n: int = 1) -> list[Turn]:
        """Drop the last n exchanges (the cache truncated to the start of the first dropped one), on
        disk too: now, or, if the disk refuses (`cut_failed`) or a stopped read left exchanges on
        disk (they and these go together), at the next save. Rewound to no exchange, the
        conversation starts anew. -> the turns dropped"""
        t = self.transcript
        starts = t.starts()
        if not starts:
            raise ChatError("nothing to rewind: the conversation is empty")
        if not 1 <= n <= len(starts):  # said as /forget says it
            raise ChatError(f"/rewind takes {takes(len(starts))}: the conversation has {count(len(starts), 'exchange')}"
                            + (" (/reset empties it)" if n > len(starts) else ""))
        dropped = t.turns[starts[-n]:]
        t.cut_failed, t.last_stats = None, None  # (/stats: the last answer is gone)
        if t.unread_left:  # a stopped read left exchanges on disk: they and these go with the next save
            t.defer_cut(t.rebase(dropped[0].first))
            t.turns = t.turns[: starts[-n]]
        else:
            t.turns = [x for x in t.turns if x.last <= dropped[0].first]
            self.model.cache.truncate(dropped[0].first)
            t.cut_failed = self._cut(len(t.turns))
        if not t.turns:
            self._settings_changed(self.prefs.next_conversation())
        return dropped

    def reset(self) -> str:
        """/reset (the format's kv_disk_reset): this conversation emptied in place. Same name, its KV file
        cut to its header and its sidecar listing no turn (Session.truncate with keep_files), its
        settings kept; the next message starts it again, as a new conversation of that name would."""
        t = self.transcript
        if not t.turns:
            raise ChatError("nothing to reset: the conversation is empty")
        n, tokens, first = len(t.starts()), self.model.cache.length, t.turns[0]
        self.model.reset()
        t.begin()
        failed = self._cut(0, keep_files=True)
        self._settings_changed(self.prefs.next_conversation())
        preview = displayable(first.text.strip().replace("\n", " "))
        said = (f"removed {count(n, 'exchange')} ({count(tokens, 'token')}), from \"{preview[:60]}"
                f"{'...' if len(preview) > 60 else ''}\"")
        if failed:
            return f"{said}; {failed}"
        where = self.saved_name
        return said + (f"; session {where} is empty, its settings kept" if where else "")

    def forget(self, n: int | None = None, on_progress=None, cancel: Cancel | None = None) -> str:
        """/forget [N]: continue in a new conversation without the n oldest exchanges (default: enough
        that what remains fills at most half the context): the rest is read again (prefilled) from
        its text; the current conversation stays saved as it is. Ctrl-C (`cancel`) goes back to it."""
        t, cache, cancel = self.transcript, self.model.cache, cancel or Cancel()
        starts = t.starts()
        if any(x.role not in ("user", "assistant") for x in t.turns):
            raise ChatError("this conversation began as an imported cache, which cannot be read again: /new")
        if not starts:
            raise ChatError("nothing to forget: the conversation is empty")
        if n is None:
            half, length = self.model.n_ctx // 2, cache.length
            n = next(k for k in range(1, len(starts) + 1)
                     if k == len(starts) or length - t.turns[starts[k]].first <= half)
        if not 1 <= n <= len(starts):
            has = count(len(starts), 'exchange')
            raise ChatError(f"/forget takes {takes(len(starts))}: the conversation has {has}")
        kept = t.turns[starts[n]:] if n < len(starts) else []
        self._keep_saved("/forget")
        old = self.saved_name
        stopped, self.reused_from = False, None
        self.new(stem=f"{old[:54]}-cont" if old and kept else None)  # named after where it came from
        try:
            for i, turn in enumerate(kept):
                if cancel.requested and old:  # Ctrl-C: back to the conversation as it was, below
                    stopped = True
                    break
                try:
                    self._read_turn(turn, one_count(on_progress, cache, kept[i + 1:]),
                                    "what remains does not fit in the context: /forget more exchanges", cancel=cancel)
                except ChatError:
                    if not (cancel.requested and old):
                        raise
                    stopped = True  # inside a turn's reading (what it read goes with the rest, below)
                    break
        except BaseException:
            if t.turns and t.turns[-1].role == "user":
                t.turns.pop()  # an exchange is kept whole or not at all
            cache.truncate(t.end)
            raise
        finally:
            stats = TurnStats()
            if t.turns and not stopped:
                self._save(stats)
        if stopped:
            self.model.reset()
            t.begin()
            self.resume(old)  # from disk, as it was saved: no reading again
            raise ChatError(f"/forget stopped: back in {old}, as it was")
        if not kept:
            return (f"new empty conversation: {'its one exchange' if n == 1 else f'all {n} exchanges'} forgotten"
                    + (f" ({old} is still saved as it was)" if old else ""))
        where = {None: "not saved", True: f"saved as {self.name}", False: f"NOT saved: {stats.save_error}"}[stats.saved]
        reused = f" ({self.reused_from})" if self.reused_from else ""
        return (f"new conversation without the {'oldest exchange' if n == 1 else f'{n} oldest exchanges'}"
                + (f" of {old} (still saved as it was)" if old else "")
                + f": {count(len(t.starts()), 'exchange')}, {count(cache.length, 'token')} read again"
                + f"{reused}; {where}")

    # --- the session: another one, a copy, a name --------------------------------------------------

    def new(self, stem: str | None = None) -> str:
        """/new: a new empty conversation (its first save named from `stem`, else from its first
        message); the current session stays on disk. Refused if leaving would lose unsaved turns."""
        self._keep_saved("/new")
        old = self.saved_name
        if self.session:
            self.session.close()
        self.session, self.name, self.stem = None, None, stem
        self.model.reset()
        self.transcript.begin()
        self.model.cache.set_codec(self.prefs.kv)
        self._settings_changed(self.prefs.next_conversation())  # (no session yet: the first save writes them)
        return f"new conversation (session {old} is saved; /resume {old} reopens it)" if old else "new conversation"

    def resume(self, name: str | None = None, on_progress=None, cancel: Cancel | None = None, on_note=None) -> str:
        """Go on in saved session NAME (the latest by default): the cache filled from its file, no
        forward pass, except for exchanges without records (pruned, damaged) whose text is intact:
        those are read again from their text (reading.read_again, with `on_progress`, after what was
        found is said to `on_note`; `cancel` stops it), so that going on never loses them. If the
        session cannot be read, the conversation in memory goes on as it was (or, if the failed read
        touched the cache, starts clean: the old session is on disk)."""
        t, model = self.transcript, self.model
        new, name = self.shelf.open(name, self.session.name if self.session else None)
        try:
            self._keep_saved(f"/resume {name}")
        except ChatError:
            new.close()
            raise
        rope = model.rope_factors
        try:
            take_rope_factors(model, new, self.shelf)
            res = new.load(model.cache, model.n_ctx, self.prompt.tok.decode, exchanges=True,
                           ctx_most=model.cfg.n_ctx_train)
        except BaseException:
            new.close()
            model.use_rope_factors(rope)
            if model.cache.length != t.end:
                model.reset()
                t.begin()
            raise
        if self.session:
            self.session.close()
        self.session, self.name, self.stem = new, name, None
        self.shelf.used(name)
        t.begin(res.turns)
        # Options given at start are the settings from now on, written with the next save: opening a
        # conversation to read it changes nothing on disk (FORMAT.md, "Loading reads only").
        self.prefs.apply_saved(res.sampler, started=bool(t.turns))
        lines = [reopened(res)] + [f"warning: {w}" for w in res.warnings + damaged_settings(res.sampler)]
        lines += self.prefs.check_saved_system(self.prompt.tok)
        codec, kv, given = model.cache.codec, self.prefs.kv, self.prefs.kv_from
        if codec != kv and given:  # (without --kv or /set kv there is no choice to set apart)
            lines.append(f"note: {name} is kept as {codec}, as it was saved; {given} {kv} is for new conversations")
        if res.unread and on_note:  # what was found is said before the reading, which takes a while
            on_note("\n".join(lines))
            lines = []
        if res.unread:
            cancel = cancel or Cancel()
            lines += read_again(t, res.unread, lambda turn, progress, why: self._read_turn(
                turn, progress, why, defer_cut=True, cancel=cancel), lambda text: self.prompt.ids(text)[1],
                on_progress, cancel, writes=not self.shelf.read_only, plain=bool(res.kv_gone))
        if self.prefs.pending_system is not False:  # --system given: this conversation was read with its own
            lines.append("note: the system prompt given waits for the next conversation (/new starts one); this "
                         "one goes on with the one it was saved with")
        return "\n".join(lines + full_note(self, FULL_BELOW))  # reopened as it was: what makes room

    def fork(self, n: int | None = None) -> str:
        """/fork [N]: continue in a new conversation made of this one's first n exchanges (default: all),
        saved at once into a new session PARENT-fork (-2, -3, ...: the first free name), from the
        session's KV file where it holds them as saved, else from the cache (Session.fork): no
        forward pass. This one stays saved as it is; the cache keeps the fork's records."""
        t = self.transcript
        starts = t.starts()
        if not starts:
            raise ChatError("nothing to fork: the conversation is empty")
        n = len(starts) if n is None else n
        if not 1 <= n <= len(starts):
            raise ChatError(f"/fork takes {takes(len(starts))}: the conversation has {count(len(starts), 'exchange')}")
        self._keep_saved("/fork")
        self.shelf.refuse_unless_writable("nothing can be forked")
        parent = self.session
        if parent is None or not parent.on_disk:
            raise ChatError("this conversation is not saved: /save NAME saves it, then /fork forks it")
        kept = t.turns[: starts[n] if n < len(starts) else len(t.turns)]
        new = self.shelf.create(None, self.prefs.saved(), stem=f"{parent.name[:54]}-fork")
        try:
            copied = parent.fork(new, self.model.cache, kept, n)
        except BaseException as e:
            new.close()  # (no file of it is left: Session.fork)
            if isinstance(e, SaveFailed):
                raise nothing_written(e, "/fork") from None
            raise
        parent.close()
        self.session, self.name = new, new.name
        t.turns, t.unsaved_cut, t.unread_left, t.cut_failed = kept, None, 0, None
        self.model.cache.truncate(kept[-1].last)
        how = f"copied from {parent.name}'s file" if copied else "written from memory"
        return (f"forked {parent.name} after exchange {n}: the conversation goes on in {new.name} "
                f"({count(kept[-1].last, 'token')} {how}, no re-prefill); {parent.name} stays saved as it was "
                f"(/rename NEW names the fork)")

    def save_as(self, name: str) -> str:
        """/save NAME: the conversation, from the cache, into a new session NAME (no forward pass). An
        unsaved conversation goes on in it; a saved one goes on in its own, NAME is a copy."""
        self.shelf.refuse_unless_writable("nothing can be saved")
        turns = self.transcript.turns
        if not turns:
            raise ChatError("nothing to save yet: the conversation is empty")
        if self.session and self.session.name == name:
            saved = "" if self.shelf.read_only else ", saved after every answer"
            raise ChatError(f"session {name} is this conversation{saved} (/save NAME keeps a copy under another name)")
        try:
            copy = self.shelf.create(check_name(name), self.prefs.saved())
        except SaveFailed as e:
            raise nothing_written(e, f"/save {name}") from None
        try:
            copy.append(self.model.cache, turns)  # the copy's files appear whole or not at all
        except SaveFailed as e:
            raise nothing_written(e, f"/save {name}") from None
        finally:
            if not copy.on_disk:
                copy.close()
        if self.session is None:
            self.session, self.name = copy, name
            return f"saved to session {name}; the conversation goes on in it"
        copy.close()
        return f"saved a copy as session {name} (the conversation goes on in {self.session.name})"

    def rename(self, new: str) -> str:
        """/rename NEW: the session's files renamed (nothing is rewritten). Before the first answer
        (nothing to save yet, nor to rename) the name is taken now, as --session NAME takes it, and the
        first answer saves the conversation under it."""
        shelf = self.shelf
        if shelf.store and not shelf.read_only and self.session is None and not self.transcript.turns:
            if new in shelf.names():
                raise ChatError(f"session {new} already exists: choose another name")
            self.session, self.name = shelf.claim(new, self.prefs.saved()), new
            return f"this conversation is named {new}: its first answer saves it"
        shelf.refuse_unless_writable("nothing is renamed")
        if not self.session:
            raise ChatError("this conversation is not saved yet: /save NAME saves it under that name")
        old = self.session.name
        if new == old:  # (its own lock would call it "open in another colichat")
            raise ChatError(f"this conversation is already called {new}")
        shelf.store.rename(self.session, new)
        self.name = new
        return f"renamed session {old} to {new}"

    def close(self) -> None:
        """Quitting: a cut or turns a failed save left unwritten get one more try, then the session is closed."""
        t = self.transcript
        if t.save_failed and not t.unread_left:
            self._save(TurnStats())
        if self.session:
            self.session.close()
            self.session = None

    # --- writing the session ----------------------------------------------------------------------

    def _save(self, stats: TurnStats) -> None:
        """Append the unsaved turns, with the settings in use (options given at start and a /set whose own
        save failed are written here) and the cut that waits, in one commit (the answer /regen replaces
        goes from the disk only as the new one is saved: Session.append's `keep`). The first save of a
        new conversation creates its session (named --session NAME, else from its first message; with
        `save_new` off, only a resumed or named conversation is saved). A failure is said in `stats`,
        and the conversation goes on in memory."""
        self.model.keep_expert_usage()  # (MoE: which experts this run used, for the next start's warm start)
        t, shelf, cache = self.transcript, self.shelf, self.model.cache
        if shelf.store and not shelf.read_only and (self.session is not None or shelf.save_new):
            settings = self.prefs.saved()
            try:
                if self.session is None:
                    first = next((x.text for x in t.turns if x.role == "user"), "")
                    self.session = shelf.create(self.name, settings, stem=self.stem or slug(first))
                    self.name, self.stem = self.session.name, None
                self.session.append(cache, t.turns, settings, t.unsaved_cut)
                shelf.index(self.session, cache)
                stats.saved = True
                stats.save_note = "; ".join(self.session.notes) or None
                self.session.notes.clear()
            except (SessionError, OSError) as e:
                stats.saved = False
                stats.save_error = str(e).splitlines()[0] if str(e) else type(e).__name__
        if stats.saved is not False:
            t.unsaved_cut = None
        if stats.saved is not None:
            t.save_failed = not stats.saved
        if stats.saved:
            t.unread_left = 0

    def _cut(self, kept_turns: int, keep_files: bool = False) -> str | None:
        """Cut the saved session to its first kept_turns turns now (the cache was cut to match); if the
        disk refuses, the cut waits for the next save (unsaved_cut: an append never runs before it),
        and the reason is returned. `keep_files`: see Session.truncate."""
        if not self.session or self.shelf.read_only:
            return None
        try:
            self.session.truncate(kept_turns, self.prefs.saved(), keep_files)
        except SessionError as e:
            self.transcript.defer_cut(kept_turns)
            self.transcript.save_failed = True
            return (f"{e}: the saved conversation keeps them until the next answer saves it "
                    "(or quitting, which tries again)")
        self.shelf.index(self.session, self.model.cache)
        return None

    def _settings_changed(self, changed: bool) -> None:
        """The settings in use changed (a /set; a new start taking a system prompt that waited for it):
        into the session now; if that fails, the next answer's save writes them."""
        if changed and self.session and not self.shelf.read_only:
            try:
                self.session.save_sampler(self.prefs.saved())
            except (SessionError, OSError):
                pass

    def _keep_saved(self, doing: str) -> None:
        """Before this conversation is left (/new, /resume, /forget, /fork): turns a failed save left
        unwritten are saved now, or `doing` is refused, saying why: leaving would lose them. (With
        exchanges a stopped read left unread, the disk holds more than memory: nothing to save.)"""
        t = self.transcript
        if not t.save_failed or t.unread_left:
            return
        stats = TurnStats()
        self._save(stats)
        if stats.saved is False:
            raise ChatError(f"this conversation is not saved ({stats.save_error}), and {doing} would lose it: "
                            "free some space and try again (/export FILE writes it elsewhere)")

    def _read_turn(self, turn: Turn, on_progress, too_long: str, defer_cut: bool = False, cancel=None) -> None:
        """Append `turn` with records made again from its text (a prefill of it as the template renders
        it after the turns so far): /forget, and a resume's damaged exchanges. ChatError(too_long) if it
        does not fit in the context. `defer_cut`: a re-render that cuts turns loaded from disk cuts
        the saved session only at the next save (a resume writes nothing)."""
        t, cache = self.transcript, self.model.cache
        if turn.role == "user":
            ids, start = self.prompt.ids(turn.text)
            if start < cache.length:
                kept = t.rebase(start)
                if defer_cut:
                    t.defer_cut(kept)
                else:
                    t.cut_failed = self._cut(kept)
        else:
            ids = self.prompt.tok.encode(turn.text, special=True)
        first = cache.length
        if first + len(ids) + 1 >= self.model.n_ctx:
            raise ChatError(too_long)
        reused = 0
        if self.reuse and turn.role == "user" and first == 0 and len(ids) > 1:  # a new conversation's first turn
            reused, source = self.shelf.reuse(cache, ids)
            self.reused_from = f"reused {reused:,} tokens from {source}" if reused else None
        if ids[reused:]:
            prefill(self.model, ids[reused:], self.clock, cancel or Cancel(), on_progress)
        t.turns.append(Turn(turn.role, turn.text, first, cache.length))
