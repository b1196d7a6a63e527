"""The generation loop: from the logits after the prompt to a stream of token ids.

    gen = Generation(model, logits, sampler, stop_ids, max_tokens)
    for tok in gen:           # each token is in the cache before it is yielded
        ...                   # breaking out early leaves exactly the yielded tokens in the cache
    gen.stopped               # "eog" | "length" | "context" (None if the caller stopped first)

With draft sources (speculative.py: prompt lookup; mtp.py: an MTP block) and draft > 0, each step
feeds the chosen token and up to `draft` guessed continuations in one batched pass, keeps the
longest prefix the sampler accepts (speculative.accept: the same tokens as plain decoding when
greedy, the same distribution when sampling) and cuts the cache back past it. Each source keeps
its own acceptance rate; a step checks the proposal with the best expected gain (speculative.gain:
tokens kept per unit of time, the proposal's own cost included, with a verify pass's measured cost
per draft), asking a costly source only when it could beat the free ones already asked.
A source paused for a while whose drafts would pay if kept has a few checked anyway (speculative.EXPLORE_*).
Knows no text and no turns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cancel import Cancel
from .speculative import EXPLORE_EVERY, EXPLORE_MAX, EXPLORE_SIZE, MAX_DRAFT, AcceptanceRate, accept, draft_size, gain


@dataclass(frozen=True)
class Token:
    id: int
    drafted: int = 0   # drafts checked in the pass that put this token in the cache
    accepted: int = 0  # how many of them were kept


class Generation:
    """Iterating runs the model; the counters and `stopped` are read after (or during) the loop."""

    def __init__(self, model, logits: np.ndarray, sampler, stop_ids, max_tokens: int,
                 drafts=None, draft: int = 0, recent: int | None = None, cancel: Cancel | None = None):
        """logits: (V,) after the last cached token; stop_ids: tokens that end the answer (never fed);
        drafts: a speculative.DraftSource, a list of them (asked in order: free ones first), or None;
        draft: at most this many drafts per pass, up to speculative.MAX_DRAFT (fewer while drafts are
        being rejected: speculative.draft_size); recent: how many cached tokens the sampler's repeat
        penalty sees (default: the sampler's repeat_last_n); cancel: checked inside every pass (Model.prefill),
        a stop raises cancel.Cancelled from the loop with only the tokens yielded in the cache."""
        if not 0 <= draft <= MAX_DRAFT:  # a longer pass would not give decode's rows: the answer would change
            raise ValueError(f"draft must be 0..{MAX_DRAFT}, not {draft}")
        self.model, self.logits, self.sampler, self.cancel = model, logits, sampler, cancel
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        self.max_tokens, self.draft = max_tokens, draft
        self.recent = sampler.settings.repeat_last_n if recent is None else recent
        self.sources = [] if drafts is None else list(drafts) if isinstance(drafts, (list, tuple)) else [drafts]
        self.stopped: str | None = None
        self.generated = 0
        self.n_drafted = 0   # drafts checked by verify passes
        self.n_accepted = 0  # drafts kept
        self.by_source = {s.name: [0, 0] for s in self.sources}  # name -> [drafts checked, kept]
        self.rates = [AcceptanceRate() for _ in self.sources]
        self.idle = [0] * len(self.sources)  # plain steps since each source's drafts were last checked
        self.explore_wait = [EXPLORE_EVERY] * len(self.sources)  # idle steps before a paused source is tried
        self.exploring = False  # the drafts being checked were asked of a paused source

    def _window(self, end: int) -> np.ndarray:
        return self.model.cache.tokens[max(0, end - self.recent) : end]

    def __iter__(self):
        model, cache, sampler = self.model, self.model.cache, self.sampler
        logits, forced = self.logits, None  # forced: a token already chosen by a rejected draft's check
        shown = cache.length  # the cache holds exactly the yielded tokens up to here
        try:
            while self.generated < self.max_tokens:
                n = cache.length
                tid = forced if forced is not None else sampler(logits, self._window(n))
                forced = None
                if tid in self.stop_ids:
                    self.stopped = "eog"
                    return
                if cache.room() < 1:  # (the last slot holds the last token shown)
                    self.stopped = "context"
                    return
                k = min(self.draft, self.max_tokens - self.generated - 1, cache.room() - 1)
                guess, src = self._propose(n, tid, k) if k > 0 else ([], None)
                for i, rate in enumerate(self.rates):
                    if i != src:  # not checked this step: drift back toward the prior
                        rate.plain_step()
                        self.idle[i] += 1
                    else:
                        self.idle[i] = 0
                if not guess:
                    logits = model.decode(tid, self.cancel)
                    self.generated += 1
                    shown = cache.length
                    yield Token(tid)
                    continue
                rows = model.prefill([tid] + guess, all_logits=True, cancel=self.cancel)  # (1+k, V)
                kept = 0
                for i, d in enumerate(guess):
                    ok, tok = accept(sampler, rows[i], self._window(n + 1 + i), d)
                    if not ok:
                        forced = tok
                        break
                    kept += 1
                cache.truncate(n + 1 + kept)  # rejected drafts' rows are dead
                self.rates[src].checked(kept, kept < len(guess))
                if self.exploring:  # kept whole: try again soon if paused again; else wait twice as long
                    wait = self.explore_wait[src]
                    self.explore_wait[src] = EXPLORE_EVERY if kept == len(guess) else min(2 * wait, EXPLORE_MAX)
                logits = rows[kept]
                self.n_drafted += len(guess)
                self.n_accepted += kept
                counts = self.by_source[self.sources[src].name]
                counts[0], counts[1] = counts[0] + len(guess), counts[1] + kept
                for t in [tid] + guess[:kept]:
                    self.generated += 1
                    shown += 1
                    yield Token(t, len(guess), kept)
            self.stopped = "length"
        finally:
            if cache.length > shown:  # the caller stopped inside a pass: keep only what it saw
                cache.truncate(shown)

    def _propose(self, n: int, tid: int, k: int) -> tuple[list[int], int | None]:
        """The drafts to check after `tid` (at most k) and the index of their source (None: none)."""
        history = np.append(self.model.cache.tokens[:n], np.int32(tid))  # (n+1,)
        best, best_gain, best_src = [], 1.0, None  # plain decoding gains 1
        row_cost = self.model.threads.row_cost()
        for i, src in enumerate(self.sources):
            rate, most = self.rates[i].value, k if src.most is None else min(k, src.most)

            def g(r: float, size: int, cost: float = src.cost) -> float:
                return gain(r, size, cost, row_cost)

            size = draft_size(rate, most, row_cost, cost=src.cost)
            # paused for long, but its drafts would pay if kept: check a few, or it stays paused for good
            explore = size == 0 and best_src is None and self.idle[i] >= self.explore_wait[i] and g(1.0, most) > 1
            if explore:
                size = min(most, EXPLORE_SIZE)
            elif size == 0 or g(rate, size) <= best_gain:
                continue  # paused, or it cannot beat what an earlier source offers
            out = []
            for d in src.propose(history, size)[:size]:
                if d in self.stop_ids:  # a stop token is never fed to the cache
                    break
                out.append(int(d))
            if out and (explore or g(rate, len(out)) > best_gain):
                best, best_gain, best_src, self.exploring = out, g(rate, len(out)), i, explore
        return best, best_src
