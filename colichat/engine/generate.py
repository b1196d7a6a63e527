"""The generation loop: from the logits after the prompt to a stream of token ids.

    gen = Generation(model, logits, sampler, stop_ids, max_tokens)
    for tok in gen:           # each token is in the cache before it is yielded
        ...                   # breaking out early leaves exactly the yielded tokens in the cache
    gen.stopped               # "eog" | "length" | "context" (None if the caller stopped first)

With a draft source (speculative.py) and draft > 0, each step feeds the chosen token and up to
`draft` guessed continuations in one batched pass, keeps the longest prefix the sampler accepts
(speculative.accept: the same tokens as plain decoding when greedy, the same distribution when
sampling) and cuts the cache back past it. Knows no text and no turns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .speculative import AcceptanceRate, accept, draft_size


@dataclass(frozen=True)
class Token:
    id: int
    drafted: int = 0   # drafts checked in the pass that put this token in the cache
    accepted: int = 0  # how many of them were kept


class Generation:
    """Iterating runs the model; the counters and `stopped` are read after (or during) the loop."""

    def __init__(self, model, logits: np.ndarray, sampler, stop_ids, max_tokens: int,
                 drafts=None, draft: int = 0, recent: int = 64):
        """logits: (V,) after the last cached token; stop_ids: tokens that end the answer (never fed);
        drafts: a draft source (`propose(history, k) -> list[int]`) or None; draft: at most this many
        drafts per pass (fewer while drafts are being rejected: speculative.draft_size); recent: how
        many cached tokens the sampler's repeat penalty sees."""
        self.model, self.logits, self.sampler = model, logits, sampler
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        self.max_tokens, self.drafts, self.draft, self.recent = max_tokens, drafts, draft, recent
        self.stopped: str | None = None
        self.generated = 0
        self.n_drafted = 0   # drafts checked by verify passes
        self.n_accepted = 0  # drafts kept
        self.rate = AcceptanceRate()

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
                if cache.room() < 2:
                    self.stopped = "context"
                    return
                k = min(self.draft, self.max_tokens - self.generated - 1, cache.room() - 2)
                k = draft_size(self.rate.value, k) if k > 0 and self.drafts is not None else 0
                guess = self._propose(n, tid, k) if k > 0 else []
                if not guess:
                    self.rate.plain_step()
                    logits = model.decode(tid)
                    self.generated += 1
                    shown = cache.length
                    yield Token(tid)
                    continue
                rows = model.prefill([tid] + guess, all_logits=True)  # (1+k, V)
                kept = 0
                for i, d in enumerate(guess):
                    ok, tok = accept(sampler, rows[i], self._window(n + 1 + i), d)
                    if not ok:
                        forced = tok
                        break
                    kept += 1
                cache.truncate(n + 1 + kept)  # rejected drafts' rows are dead
                self.rate.checked(kept, kept < len(guess))
                logits = rows[kept]
                self.n_drafted += len(guess)
                self.n_accepted += kept
                for t in [tid] + guess[:kept]:
                    self.generated += 1
                    shown += 1
                    yield Token(t, len(guess), kept)
            self.stopped = "length"
        finally:
            if cache.length > shown:  # the caller stopped inside a pass: keep only what it saw
                cache.truncate(shown)

    def _propose(self, n: int, tid: int, k: int) -> list[int]:
        history = np.append(self.model.cache.tokens[:n], np.int32(tid))  # (n+1,)
        out = []
        for d in self.drafts.propose(history, k)[:k]:
            if d in self.stop_ids:  # a stop token is never fed to the cache
                break
            out.append(int(d))
        return out
