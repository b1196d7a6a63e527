"""Helpers of the speculative-decoding tests (test_speculative.py, test_mtp_drafts.py)."""

from __future__ import annotations

import math

from colichat.engine import load as engine_load
from colichat.engine.threads import ROW_COST, ThreadPolicy


def pinned(row_cost: float = ROW_COST) -> ThreadPolicy:
    """A thread policy whose verify passes cost `row_cost` per draft: how many drafts a step checks weighs
    a verify pass's measured cost (threads.RowCost), so with the default policy the draft counts would
    follow the machine's load; pinned, they are the same on every run."""
    return ThreadPolicy(one_token=(1,), row_cost=row_cost)


def load(*args, **kwargs):
    """engine.load with the pinned() thread policy."""
    model = engine_load(*args, **kwargs)
    model.threads = pinned()
    return model


def chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - 0.001 (z = 3.09), Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def three_token_distribution(model, prompt, first, probe) -> dict[tuple, float]:
    """The exact probability of every 3-token continuation of `prompt` under the sampler `probe`
    (its final distribution at each step), from the logits `first` after the prompt; leaves the cache
    somewhere past the prompt."""

    def exact(prefix, logits):
        ids, p = probe.distribution(logits, prefix)
        return dict(zip(ids.tolist(), p.tolist(), strict=True))

    want: dict[tuple, float] = {}
    for t1, p1 in exact(prompt, first).items():
        model.cache.truncate(len(prompt))
        l2 = model.prefill([t1], all_logits=False)[-1]
        for t2, p2 in exact(prompt + [t1], l2).items():
            model.cache.truncate(len(prompt) + 1)
            l3 = model.prefill([t2], all_logits=False)[-1]
            for t3, p3 in exact(prompt + [t1, t2], l3).items():
                want[(t1, t2, t3)] = p1 * p2 * p3
    return want


def assert_drawn_from(counts: dict, want: dict, n_runs: int) -> None:
    """A chi-square test at 0.001 that `counts` of n_runs draws come from the distribution `want`
    (cells with fewer than 5 expected draws are pooled into one)."""
    assert set(counts) <= set(want)
    big = [k for k, p in want.items() if p * n_runs >= 5]
    obs = [counts.get(k, 0) for k in big] + [n_runs - sum(counts.get(k, 0) for k in big)]
    exp = [want[k] * n_runs for k in big] + [n_runs * (1 - sum(want[k] for k in big))]
    if exp[-1] < 5:
        obs, exp = obs[:-2] + [obs[-2] + obs[-1]], exp[:-2] + [exp[-2] + exp[-1]]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    assert stat < chi2_critical(len(obs) - 1), (stat, len(obs))
