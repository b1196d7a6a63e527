"""Speculative decoding: a verify pass computes decode's exact rows, greedy answers and saved sessions
are the same with and without drafts, and with sampling every token keeps its distribution."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import TINY
from drafting_helpers import assert_drawn_from, load, pinned, three_token_distribution

from colichat.conversation.chat import Conversation
from colichat.conversation.settings import BY_NAME, SettingError, Settings
from colichat.engine import Sampler, SamplerSettings
from colichat.engine.generate import Generation
from colichat.engine.ops import SMALL_BATCH
from colichat.engine.speculative import EXPLORE_EVERY, MAX_DRAFT, DraftSource, PromptLookup, accept, draft_size
from colichat.engine.threads import ROW_COST, ROW_COST_MAX, RowCost, ThreadPolicy, pass_units
from colichat.persist import Store

TINY_MODELS = ["llama", "ds-v2-lite", "ds-dense", "ds-v3", "plm", "minicpm3", "glm-dsa"]


@pytest.fixture(scope="module", params=TINY_MODELS)
def tiny(request):
    return load(str(TINY / f"{request.param}.gguf"), n_ctx=1024)


@pytest.fixture(scope="module", params=TINY_MODELS + ["ds-v32"])  # ds-v32's answers repeat nothing to draft
def any_tiny(request):
    return load(str(TINY / f"{request.param}.gguf"), n_ctx=1024)


def test_prompt_lookup_continues_the_latest_longest_match():
    look = PromptLookup(ngram_max=3, ngram_min=2)
    #                  0  1  2  3  4  5  6  7  8  9 10 11
    hist = np.array([5, 6, 7, 8, 1, 6, 7, 9, 4, 2, 6, 7])
    assert look.propose(hist, 3) == [9, 4, 2]  # "6 7" last seen at 5: what followed it
    hist = np.array([1, 6, 7, 8, 3, 6, 7, 9, 1, 6, 7])
    assert look.propose(hist, 2) == [8, 3]  # "1 6 7" (longest) beats the later "6 7"
    assert look.propose(np.array([1, 2, 3, 4]), 4) == []  # nothing repeats
    assert look.propose(np.array([3, 4, 3, 4]), 5) == [3, 4]  # the continuation runs up to the end


def decoded_one_by_one(tiny, rng, n: int):
    """A 30-token random prompt and n random tokens decoded one at a time after it: (prompt, tokens, their
    logits (n, V), the cache bytes); the model is left with only the prompt prefilled again."""
    prompt, toks = rng.integers(0, tiny.cfg.n_vocab, 30).tolist(), rng.integers(0, tiny.cfg.n_vocab, n).tolist()
    tiny.reset()
    tiny.prefill(prompt, all_logits=False)
    ref = np.stack([tiny.decode(t) for t in toks])
    ref_rows = bytes(tiny.cache.raw(0, tiny.cache.length))
    tiny.reset()
    tiny.prefill(prompt, all_logits=False)
    return prompt, toks, ref, ref_rows


def test_a_verify_pass_writes_the_rows_and_logits_decoding_would(any_tiny):
    """Tokens fed in passes of 2..9 give the bits of feeding them one at a time (cache and logits;
    for sparse attention past its top_k, the Ic rows and each query's own selection of keys)."""
    tiny = any_tiny
    rng = np.random.default_rng(1)
    prompt, toks, ref, ref_rows = decoded_one_by_one(tiny, rng, 40)
    got, i = [], 0
    while i < len(toks):
        c = int(rng.integers(2, 10))
        got.append(tiny.prefill(toks[i : i + c]))
        i += c
    assert np.array_equal(np.concatenate(got), ref)
    assert bytes(tiny.cache.raw(0, tiny.cache.length)) == ref_rows


def converse(model, home, draft: int, max_tokens: int = 40, **sampling) -> tuple[list[str], bytes, int]:
    """Four exchanges with a /rewind and a /resume in between: the answers, the saved cache file and
    the drafts accepted. Messages repeat text so that prompt lookup finds something to draft.
    Greedy, unless `sampling` gives other settings (temperature, seed, ...)."""
    store = Store(home)
    settings = Settings(**{"temperature": 0, **sampling}, max_tokens=max_tokens, draft=draft)
    model.reset()
    conv = Conversation(model, settings, store=store, session_name="s")
    answers, accepted = [], 0

    def ask(text):
        nonlocal accepted
        answer, stats = conv.ask(text)
        assert stats.saved
        answers.append(answer)
        accepted += stats.accepted

    ask("copy this: one two three four five six seven eight nine ten one two three four")
    ask("again: " + answers[-1] + answers[-1])
    conv.rewind(1)
    ask("and now this: " + answers[-1] + " " + answers[-1])
    conv.close()
    model.reset()
    conv = Conversation(model, settings, store=store)
    conv.resume("s")
    ask("once more: " + answers[-1] + answers[-1])
    kv = Path(conv.session.kv_path).read_bytes()
    conv.close()
    return answers, kv, accepted


def test_greedy_answers_and_saved_sessions_are_the_same_with_drafts(tiny, tmp_path):
    tiny.threads = pinned(row_cost=0.1)  # drafts checked even where a random model keeps few: exactness is tested
    plain, kv_plain, none = converse(tiny, tmp_path / "plain", draft=0)
    fast, kv_fast, accepted = converse(tiny, tmp_path / "draft", draft=5)
    assert none == 0 and accepted > 0  # the drafts were used...
    assert fast == plain  # ...and changed no token
    assert kv_fast == kv_plain  # rejected drafts never reached the file


def test_seeded_sampled_answers_and_saved_sessions_are_the_same_with_drafts(tiny, tmp_path):
    """Each token takes one draw of the sampler with drafts as without (speculative.accept), so a seeded
    answer does not depend on drafting nor on how many drafts a pass checks (which follows timings)."""
    sampling = {"temperature": 0.2, "repeat_penalty": 1.0, "seed": 11}
    tiny.threads = pinned(row_cost=0.1)
    greedy = converse(tiny, tmp_path / "greedy", draft=0)[0]
    plain, kv_plain, _ = converse(tiny, tmp_path / "plain", draft=0, **sampling)
    assert plain != greedy  # the draws chose tokens
    for draft, row_cost in ((5, 0.1), (15, 0.02)):
        tiny.threads = pinned(row_cost=row_cost)
        fast, kv_fast, accepted = converse(tiny, tmp_path / f"draft{draft}", draft=draft, **sampling)
        assert accepted > 0 and fast == plain and kv_fast == kv_plain


@pytest.mark.default_model
def test_smollm2_echo_answer_is_the_same_with_drafts(default_model, tmp_path):
    paragraph = ("The quick brown fox jumps over the lazy dog. The dog does not move, and the fox runs "
                 "into the forest where it finds a small river and drinks from it before the night comes.")
    runs, saved = {}, default_model.threads
    default_model.threads = pinned()  # draft counts independent of timing
    try:
        for draft in (0, 6):
            store = Store(tmp_path / str(draft))
            settings = Settings(temperature=0, max_tokens=60, draft=draft)
            default_model.reset()
            conv = Conversation(default_model, settings, store=store, session_name="s")
            a1, s1 = conv.ask(f"Repeat this text exactly: {paragraph}")
            conv.rewind(1)
            a2, s2 = conv.ask(f"Copy this paragraph word for word: {paragraph}")
            runs[draft] = (a1, a2, Path(conv.session.kv_path).read_bytes(), s1.accepted + s2.accepted,
                           s2.drafted)
            conv.close()
    finally:
        default_model.threads = saved
    assert runs[6][:3] == runs[0][:3]
    assert runs[6][3] > 20  # most of the echoed paragraph came from drafts


class FixedDrafts(DraftSource):
    """Always the same guesses (a point-mass draft distribution, whatever the history)."""

    def __init__(self, tokens):
        self.tokens = list(tokens)

    def propose(self, history, k):
        return self.tokens[:k]


def test_sampling_with_drafts_keeps_the_distribution():
    """Three sampled tokens with two fixed drafts checked by `accept`: their joint frequencies over
    many seeds match the sampler's exact distribution (penalty, temperature, top-k/p, min-p)."""
    model = load(str(TINY / "llama.gguf"), n_ctx=64)
    settings = SamplerSettings(temperature=1.3, top_k=3, top_p=0.97, min_p=0.02, repeat_penalty=1.5)
    prompt = [1, 5, 9, 5, 12]
    model.reset()
    first = model.prefill(prompt, all_logits=False)[-1]
    probe = Sampler(settings)
    cand, _ = probe.distribution(first, prompt)
    drafts = FixedDrafts([int(cand[0]), int(cand[1])])  # guesses the sampler often makes

    want = three_token_distribution(model, prompt, first, probe)

    n_runs, counts, drafted, kept = 1500, {}, 0, 0
    for seed in range(n_runs):
        model.cache.truncate(len(prompt))
        gen = Generation(model, first, Sampler(settings.with_(seed=seed)), (), 3, drafts=drafts, draft=2)
        key = tuple(t.id for t in gen)
        counts[key] = counts.get(key, 0) + 1
        drafted, kept = drafted + gen.n_drafted, kept + gen.n_accepted
        assert model.cache.length == len(prompt) + 3
    assert 0 < kept < drafted  # both branches of the rule ran
    assert_drawn_from(counts, want, n_runs)


def test_accept_greedy_keeps_only_the_argmax():
    s = Sampler(SamplerSettings(temperature=0))
    logits = np.array([0.1, 2.0, 0.5], dtype=np.float32)
    assert accept(s, logits, [], 1) == (True, 1)
    assert accept(s, logits, [], 2) == (False, 1)


def test_stopping_inside_a_pass_keeps_only_the_tokens_shown(tmp_path):
    model = load(str(TINY / "llama.gguf"), n_ctx=128)
    model.reset()
    prompt = [1, 5, 9, 5, 12]
    first = model.prefill(prompt, all_logits=False)[-1]
    greedy = Sampler(SamplerSettings(temperature=0))
    ref = [t.id for t in Generation(model, first, greedy, (), 12)]
    model.cache.truncate(len(prompt))
    gen = iter(Generation(model, first, greedy, (), 12, drafts=FixedDrafts(ref[1:]), draft=8))
    shown = [next(gen).id, next(gen).id]
    gen.close()
    assert shown == ref[:2] and model.cache.token_ids() == prompt + ref[:2]


def test_draft_setting_is_checked():
    model = load(str(TINY / "llama.gguf"), n_ctx=64)
    conv = Conversation(model, Settings(), save=False)
    conv.set_option("draft", 3)
    assert conv.prefs.options()["draft"] == 3
    with pytest.raises(SettingError, match="draft must be between 0"):
        conv.set_option("draft", 99)


def test_the_longest_pass_the_draft_limit_allows_writes_the_rows_decoding_would(any_tiny):
    """The draft limit comes from the batch limit: the chosen token and MAX_DRAFT drafts, one pass of
    ops.SMALL_BATCH tokens, give the cache rows and logits of decoding them one by one."""
    tiny, n = any_tiny, MAX_DRAFT + 1
    assert n == SMALL_BATCH
    prompt, toks, ref, ref_rows = decoded_one_by_one(tiny, np.random.default_rng(2), n)
    assert np.array_equal(tiny.prefill(toks), ref)
    assert bytes(tiny.cache.raw(0, tiny.cache.length)) == ref_rows


def test_the_draft_setting_and_generation_refuse_more_drafts_than_a_pass_checks():
    """The setting's default and its limit are MAX_DRAFT (15); one more is refused in one line, and a
    Generation asked for it (a caller's bug: the answer would change) raises."""
    row = BY_NAME["draft"]
    assert row.default == MAX_DRAFT == 15 and row.parse(str(MAX_DRAFT)) == MAX_DRAFT
    with pytest.raises(SettingError, match=r"^draft must be between 0 \(off\) and 15$"):
        row.parse(str(MAX_DRAFT + 1))
    model = load(str(TINY / "llama.gguf"), n_ctx=64)
    first = model.prefill([1, 5, 9], all_logits=False)[-1]
    with pytest.raises(ValueError, match="draft must be 0..15, not 16"):
        Generation(model, first, Sampler(SamplerSettings(temperature=0)), (), 4, draft=MAX_DRAFT + 1)


def test_drafts_that_keep_failing_are_paused():
    """Drafts that are always rejected cost a verify row each: after a few, drafting pauses (plain
    decoding), and it is tried again now and then; the tokens are those of plain decoding."""
    model = load(str(TINY / "llama.gguf"), n_ctx=256)
    prompt = [1, 5, 9, 5, 12]
    ref = [t.id for t in greedy_run(model, prompt, 100)[0]]
    never = next(i for i in range(model.cfg.n_vocab) if i not in ref)  # a token greedy never picks here
    toks, gen = greedy_run(model, prompt, 100, drafts=FixedDrafts([never] * 8), draft=8)
    assert [t.id for t in toks] == ref
    assert gen.n_accepted == 0 and 3 <= gen.n_drafted <= 20


@pytest.mark.parametrize("name", ["ds-v32", "glm-dsa"])
def test_sparse_attention_answers_and_cache_are_the_same_with_drafts(name):
    """Sparse attention past its top_k (each query's own selection of keys) with drafts kept and
    rejected: the tokens and every cache row (Ic included) are plain decoding's."""
    model = load(str(TINY / f"{name}.gguf"), n_ctx=256)
    model.threads = pinned(row_cost=0.1)
    assert model.exact_passes and model.cfg.index_top_k < 30
    prompt = np.random.default_rng(3).integers(0, model.cfg.n_vocab, 30).tolist()
    ref = [t.id for t in greedy_run(model, prompt, 60)[0]]
    ref_rows = bytes(model.cache.raw(0, model.cache.length))
    wrong = [t if i % 5 != 4 else (t + 1) % model.cfg.n_vocab for i, t in enumerate(ref)]  # every fifth guess wrong
    toks, gen = greedy_run(model, prompt, 60, drafts=Oracle(prompt + wrong), draft=6)
    assert [t.id for t in toks] == ref
    assert bytes(model.cache.raw(0, model.cache.length)) == ref_rows
    assert 20 < gen.n_accepted < gen.n_drafted  # drafts kept and rejected


def test_a_verify_pass_is_weighed_by_its_cost_per_draft():
    """Drafts kept 73% of the time pay when each adds 0.3 decode steps to the verify pass, not when
    each adds 0.8 (long contexts: each query's attention is its own); drafts nearly always kept still
    do, fewer of them."""
    assert draft_size(0.73, 4, row_cost=0.3) == 3
    assert draft_size(0.73, 4, row_cost=0.8) == 0
    assert draft_size(0.97, 8, row_cost=0.3) == 8
    assert draft_size(0.97, 8, row_cost=0.8) == 6


def test_the_cost_per_draft_is_measured_from_the_passes():
    """RowCost: from ROW_COST, toward what verify passes take over the one-token passes' running
    average on the same thread count; a pass that was descheduled counts at most ROW_COST_MAX."""
    rows = RowCost()
    assert rows.value == ROW_COST
    rows.record(2, 5, 0.100)  # no one-token pass measured on two threads yet: nothing to compare with
    assert rows.value == ROW_COST
    for _ in range(30):
        rows.record(2, 1, 0.020)
        rows.record(2, 5, 0.020 * pass_units(5, 0.5))
    assert rows.value == pytest.approx(0.5, abs=1e-3)
    rows.record(2, 3, 10.0)
    assert rows.value == pytest.approx(0.8 * 0.5 + 0.2 * ROW_COST_MAX, abs=1e-3)
    model = load(str(TINY / "llama.gguf"), n_ctx=256)
    model.threads = ThreadPolicy(one_token=(1,))
    toks, gen = greedy_run(model, [1, 5, 9, 5, 12], 60, drafts=FixedDrafts([7] * 8), draft=4)
    assert gen.n_drafted and model.threads.row_cost() != ROW_COST  # measured on this model's passes


def greedy_run(model, prompt, n, **kwargs):
    """The Tokens of a greedy answer of n tokens to `prompt`, and its Generation."""
    model.cache.truncate(0)
    first = model.prefill(prompt, all_logits=False)[-1]
    gen = Generation(model, first, Sampler(SamplerSettings(temperature=0)), (), n, **kwargs)
    return list(gen), gen


class Oracle(DraftSource):
    """Drafts the tokens that follow in a known token stream (greedy's own answer): always kept."""

    name = "oracle"

    def __init__(self, stream):
        self.stream = list(stream)

    def propose(self, history, k):
        return self.stream[len(history) : len(history) + k]


def test_a_paused_source_is_tried_again_and_drafts_resume_when_they_are_kept():
    """With drafts costing 0.6 decode steps each, the prior acceptance rate does not pay: the source is
    paused, tried after EXPLORE_EVERY plain steps and, its drafts kept, drafts again."""
    model = load(str(TINY / "llama.gguf"), n_ctx=256)
    prompt = [1, 5, 9, 5, 12]
    ref = [t.id for t in greedy_run(model, prompt, 120)[0]]
    model.threads = ThreadPolicy(one_token=(1,), row_cost=0.6)
    toks, gen = greedy_run(model, prompt, 120, drafts=Oracle(prompt + ref), draft=8)
    assert [t.id for t in toks] == ref
    assert next(i for i, t in enumerate(toks) if t.drafted) == EXPLORE_EVERY  # plain steps until then
    assert gen.n_accepted > 80  # then most tokens came from drafts


def test_a_paused_source_whose_drafts_fail_is_tried_ever_less_often():
    model = load(str(TINY / "llama.gguf"), n_ctx=512)
    prompt = [1, 5, 9, 5, 12]
    ref = [t.id for t in greedy_run(model, prompt, 400)[0]]
    never = next(i for i in range(model.cfg.n_vocab) if i not in ref)
    model.threads = ThreadPolicy(one_token=(1,), row_cost=0.6)
    toks, gen = greedy_run(model, prompt, 400, drafts=FixedDrafts([never] * 8), draft=8)
    assert [t.id for t in toks] == ref
    assert gen.n_accepted == 0 and gen.n_drafted == 4 * 4  # tried after 16, 32, 64 and 128 more plain steps
