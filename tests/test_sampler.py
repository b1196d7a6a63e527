"""The sampler: greedy, temperature, top-k, top-p, min-p, repetition penalty, seeded."""

from __future__ import annotations

import numpy as np
import pytest

from colichat.engine import Sampler, SamplerSettings

LOGITS = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05], dtype=np.float32))  # probabilities at temperature 1


def draws(settings: SamplerSettings, n: int = 3000, logits=LOGITS, recent=()) -> np.ndarray:
    s = Sampler(settings)
    return np.array([s(logits, recent) for _ in range(n)])


def freq(ids: np.ndarray, k: int = 5) -> np.ndarray:
    return np.bincount(ids, minlength=k) / len(ids)


def test_greedy_takes_the_argmax():
    assert set(draws(SamplerSettings(temperature=0), 20)) == {0}


def test_temperature_one_follows_the_distribution():
    f = freq(draws(SamplerSettings(temperature=1, top_k=0, top_p=1, min_p=0, seed=1)))
    assert np.allclose(f, [0.5, 0.2, 0.15, 0.1, 0.05], atol=0.03)


def test_low_temperature_sharpens():
    f = freq(draws(SamplerSettings(temperature=0.3, top_k=0, top_p=1, min_p=0, seed=2)))
    assert f[0] > 0.85


def test_top_k_keeps_k_candidates():
    assert set(draws(SamplerSettings(temperature=1, top_k=2, top_p=1, min_p=0, seed=3))) == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p():
    # 0.5 + 0.2 = 0.7 < 0.8 <= 0.85: the first three tokens
    assert set(draws(SamplerSettings(temperature=1, top_k=0, top_p=0.8, min_p=0, seed=4))) == {0, 1, 2}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    # 0.25 * 0.5 = 0.125: tokens with p >= 0.125 are 0, 1, 2
    assert set(draws(SamplerSettings(temperature=1, top_k=0, top_p=1, min_p=0.25, seed=5))) == {0, 1, 2}


def test_repeat_penalty_lowers_recent_tokens():
    logits = np.array([2.0, 1.9, -1.0, -3.0], dtype=np.float32)
    greedy = SamplerSettings(temperature=0, repeat_penalty=1.5)
    assert Sampler(greedy)(logits, recent=[0]) == 1  # 2.0 / 1.5 < 1.9
    assert Sampler(greedy)(logits, recent=[]) == 0
    neg = np.array([-1.0, -1.2], dtype=np.float32)
    assert Sampler(greedy)(neg, recent=[0]) == 1  # negative logits are multiplied: -1.5 < -1.2


def test_same_seed_same_tokens_other_seed_other_tokens():
    s = SamplerSettings(temperature=1, top_k=0, top_p=1, min_p=0)
    a, b = draws(s.with_(seed=7), 200), draws(s.with_(seed=7), 200)
    c = draws(s.with_(seed=8), 200)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(temperature=float("nan")), dict(top_p=0),
                                 dict(top_p=1.5), dict(min_p=1), dict(top_k=-1), dict(repeat_penalty=0),
                                 dict(seed=-1)])
def test_bad_settings_are_refused_by_name(bad):
    key = next(iter(bad))
    with pytest.raises(ValueError, match=key):
        SamplerSettings(**bad).validate()


def test_a_tiny_temperature_takes_the_best_token_without_nan():
    # 1e-310 turns every logit / T into an overflow; the differences to the best are taken first.
    for t in (1e-310, 5e-324, 1e-30):
        cand, p = Sampler(SamplerSettings(temperature=t, seed=1)).distribution(LOGITS)
        assert cand[0] == 0 and p[0] == 1.0 and not np.isnan(p).any()
    assert set(draws(SamplerSettings(temperature=1e-310, seed=1), 20)) == {0}


@pytest.mark.parametrize("temperature", [0, 0.7])
def test_nan_scores_are_a_model_error_not_a_token(temperature):
    from colichat.engine import ModelError

    logits = LOGITS.copy()
    logits[3] = np.nan
    with pytest.raises(ModelError, match="^the model computed NaN for the next token's scores"):
        Sampler(SamplerSettings(temperature=temperature, seed=1))(logits)


def test_the_settings_take_their_sampling_defaults_from_the_sampler():
    """One source of sampling defaults: the settings table (what --help, /show and a new conversation
    give) and a SamplerSettings that leaves a value out agree, at the values users have had."""
    from colichat.conversation.settings import BY_NAME, Settings

    assert Settings().sampler() == SamplerSettings()
    names = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "seed")
    assert [BY_NAME[k].default for k in names] == [0.7, 40, 0.95, 0.05, 1.1, 256, None]
