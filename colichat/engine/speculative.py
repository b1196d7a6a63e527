"""Speculative decoding: where drafts come from, and the rule that keeps or rejects them.

A draft source guesses the next few tokens cheaply; Generation (generate.py) checks all of them in
one batched pass and keeps the longest prefix `accept` allows. Decode is memory-bound, so the pass
over 1 + k tokens reads the weights once, as one decode step does.

Two sources: PromptLookup here (free; up to k tokens where the answer repeats the conversation)
and mtp.MTPDrafts (one token per step from the model's MTP block, at a cost: its layer and output
head). Generation asks the free one first and the MTP block only when its expected gain (`gain`,
with each source's own running acceptance rate and cost) beats the lookup's match: a lookup match
of several tokens wins where text is being copied, MTP elsewhere (BENCHMARKS.md has the numbers).

accept() is the standard speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023) for a
deterministic draft (q is a point mass on d): keep d with probability p(d); otherwise draw from
normalize(max(p - q, 0)), i.e. p without d. It draws that way by drawing the token from p exactly
as plain decoding does (the sampler, the same random numbers) and keeping d when the token drawn is
d: kept with probability p(d), and a rejection's token is p conditioned on not d. Every token is
then distributed exactly as p, and more: each token uses one draw of the sampler, as in plain
decoding, so with a seed (or temperature 0) the tokens are those of plain decoding, whatever was
drafted and however many drafts each pass checked (which depends on measured timings).
"""

from __future__ import annotations

import numpy as np

from .ops import SMALL_BATCH
from .threads import ROW_COST, pass_units

MAX_DRAFT = SMALL_BATCH - 1  # the most drafts one pass checks: the chosen token and its drafts give decode's rows
NGRAM_MAX = 4  # prompt lookup: the longest suffix looked for in the history
NGRAM_MIN = 2  # and the shortest (single tokens match too often to be worth a check)
RATE_PRIOR = 0.6  # the acceptance rate assumed at the start of an answer
RATE_STEP = 0.25  # weight of each checked draft in the running acceptance rate
RATE_RECOVER = 0.05  # per plain decode step, the rate drifts back toward the prior (to try again)
EXPLORE_EVERY = 16  # plain steps after which a paused source that could pay is checked anyway ...
EXPLORE_SIZE = 4  # ... with this many drafts; twice as long a wait after each such check that fails,
EXPLORE_MAX = 512  # up to this many steps


def gain(rate: float, k: int, cost: float = 0.0, row_cost: float = ROW_COST) -> float:
    """Expected tokens per decode step's time of checking k drafts kept at rate r that took `cost`
    decode steps to make, in a verify pass of k + 1 tokens (threads.pass_units with `row_cost`, as
    measured by threads.RowCost): (1 + r + ... + r^k) / (pass_units(k + 1) + cost); plain decoding is 1."""
    return sum(rate**i for i in range(k + 1)) / (pass_units(k + 1, row_cost) + cost)


def draft_size(rate: float, k_max: int, row_cost: float = ROW_COST, cost: float = 0.0) -> int:
    """How many drafts to check: the k <= k_max that maximizes `gain`; 0 if no k beats plain decoding."""
    best, best_k = 1.0, 0
    for k in range(1, k_max + 1):
        g = gain(rate, k, cost, row_cost)
        if g > best:
            best, best_k = g, k
    return best_k


class DraftSource:
    """What Generation asks for drafts: `propose(history, k)` -> up to k guessed token ids to follow
    `history` (N,) (the cached tokens and the token just chosen). `cost`: what one proposal costs, in
    decode steps; `most`: the most drafts one proposal gives (None: any number)."""

    name = "drafts"
    cost = 0.0
    most: int | None = None

    def propose(self, history: np.ndarray, k: int) -> list[int]:
        raise NotImplementedError


class AcceptanceRate:
    """A running estimate of how often drafts are kept: each checked draft moves it by RATE_STEP;
    every plain step moves it back toward RATE_PRIOR, so that a stretch of rejected drafts pauses
    drafting (an answer with nothing to copy pays only a few checks: a few percent, BENCHMARKS.md
    "Ordinary chat, ten questions") and later text that repeats is still caught."""

    def __init__(self):
        self.value = RATE_PRIOR

    def checked(self, kept: int, rejected: bool) -> None:
        for ok in [True] * kept + [False] * rejected:
            self.value += RATE_STEP * (float(ok) - self.value)

    def plain_step(self) -> None:
        self.value += RATE_RECOVER * (RATE_PRIOR - self.value)


def accept(sampler, logits: np.ndarray, recent, draft: int) -> tuple[bool, int]:
    """(True, draft) if the draft is kept, else (False, the token to use instead): the token plain
    decoding would draw here (the module's docstring says why that is the speculative-sampling rule).

    logits: (V,) the model's output before the draft's position; recent: the tokens the repeat
    penalty sees there."""
    token = sampler(logits, recent)
    return token == draft, token


class PromptLookup(DraftSource):
    """Drafts by prompt lookup (n-gram matching, as llama.cpp's lookup decoding): find the latest
    earlier occurrence of the history's last n tokens (n from NGRAM_MAX down to NGRAM_MIN, longest
    first) and propose the tokens that followed it. Costs no model pass; pays off when the answer
    repeats text from the conversation (rewriting, code edits, quoting)."""

    name = "lookup"

    def __init__(self, ngram_max: int = NGRAM_MAX, ngram_min: int = NGRAM_MIN):
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def propose(self, history: np.ndarray, k: int) -> list[int]:
        """Up to k tokens to follow `history` (N,) int token ids."""
        h = np.asarray(history)
        n_hist = h.size
        for n in range(min(self.ngram_max, n_hist - 1), self.ngram_min - 1, -1):
            tail = h[n_hist - n :]
            # candidate starts s (s + n < n_hist, so at least one token follows the match)
            starts = np.flatnonzero(h[: n_hist - n] == tail[0])
            for j in range(1, n):
                if not starts.size:
                    break
                starts = starts[h[starts + j] == tail[j]]
            if starts.size:
                s = int(starts[-1]) + n  # the latest match: its continuation
                return h[s : s + k].tolist()
        return []
