"""MTP drafts: the answer and the saved session are the same with and without them (greedy, across
/rewind and /resume), the MTP block's state follows the trunk's cache and never reaches the disk,
sampling keeps its distribution, the memory check counts the block's rows, and the footer names them.

Three models: the reference ds-v3-mtp and glm-dsa (sparse attention; random weights: their MTP
blocks' drafts are almost never kept, so only rejections run) and `copying`, a tiny deepseek2 model
with an MTP block whose drafts are mostly right: attention and FFN outputs scaled down make the
trunk nearly a bigram model, and the block, given the next token's embedding and the trunk's own
output head, predicts the same bigram.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import TINY
from drafting_helpers import assert_drawn_from, load, three_token_distribution
from gguf_factory import DS2Spec, write_deepseek2

import colichat.engine as engine
from colichat.conversation.chat import Conversation
from colichat.conversation.report import footer, stats_lines
from colichat.conversation.settings import Settings
from colichat.engine import ModelError, Sampler, SamplerSettings
from colichat.engine.generate import Generation
from colichat.engine.model import working_bytes
from colichat.engine.mtp import MTPBlock, bytes_per_token
from colichat.engine.speculative import DraftSource
from colichat.persist import Store


@pytest.fixture(scope="module")
def copying_path(tmp_path_factory):
    return write_deepseek2(tmp_path_factory.mktemp("mtp") / "copying.gguf", DS2Spec(n_nextn=1))


def copying_model(path, n_ctx: int = 512):
    """The `copying` model (module docstring), its MTP drafts taken whatever they cost."""
    m = load(str(path), n_ctx=n_ctx)
    w, d, last = m.w, m.cfg.n_embd, m.cfg.n_layer
    for l in range(last + 1):
        for name in ("attn_output", "ffn_norm"):
            w[f"blk.{l}.{name}"] = w[f"blk.{l}.{name}"] * np.float32(0.3)
    b = f"blk.{last}.nextn."
    w[b + "eh_proj"] = np.concatenate([np.eye(d), np.zeros((d, d))], axis=1).astype(np.float32)  # u = enorm(e)
    w[b + "enorm"] = np.ones(d, dtype=np.float32)
    w[b + "shared_head_norm"], w[b + "shared_head_head"] = w["output_norm"], m.output
    m.mtp.cost = 0.0
    return m


def tiny_mtp_model(name: str = "ds-v3-mtp", n_ctx: int = 512):
    m = load(str(TINY / f"{name}.gguf"), n_ctx=n_ctx)
    m.mtp.cost = 0.0  # draft on a model this small, where the output head is most of a step
    return m


@pytest.fixture(scope="module")
def sparse_copying_path(tmp_path_factory):
    """The `copying` model with DeepSeek-V3.2's sparse attention (top_k 8: the answers run past it)."""
    spec = DS2Spec(arch="deepseek32", n_nextn=1, index_heads=4, index_dim=16, index_top_k=8)
    return write_deepseek2(tmp_path_factory.mktemp("mtp") / "copying-v32.gguf", spec)


@pytest.fixture(params=["copying", "copying-deepseek32", "ds-v3-mtp", "glm-dsa"])
def make_model(request, copying_path, sparse_copying_path):
    if request.param.startswith("copying"):
        path = copying_path if request.param == "copying" else sparse_copying_path
        return lambda: copying_model(path)
    return lambda: tiny_mtp_model(request.param)


def converse(make_model, home, draft: int):
    """Exchanges with a /rewind, a /new, a /resume in the same model, then a /resume in a fresh
    model (as a new process would):
    the answers, the saved cache file, the drafts (checked, kept) per source, and the resumed
    model's MTP state (its first position, and the tokens read from the file)."""
    store = Store(home)
    settings = Settings(temperature=0, max_tokens=40, draft=draft)
    model = make_model()
    conv = Conversation(model, settings, store=store, session_name="s")
    answers, counts = [], {}

    def ask(conv, text):
        answer, stats = conv.ask(text)
        assert stats.saved
        answers.append(answer)
        for name, (checked, kept) in stats.by_source.items():
            c = counts.setdefault(name, [0, 0])
            c[0], c[1] = c[0] + checked, c[1] + kept

    ask(conv, "copy this: one two three four five six seven eight nine ten")
    ask(conv, "again: " + answers[-1])
    conv.rewind(1)
    ask(conv, "and now this: " + answers[-1])
    conv.new()  # /new: another conversation in the same cache
    ask(conv, "something else: " + answers[-1])
    conv.resume("s")  # back to the first one, in the same model
    ask(conv, "and again: " + answers[-1])
    conv.close()
    model = make_model()
    conv = Conversation(model, settings, store=store)
    conv.resume("s")
    resumed = conv.model.cache.length
    ask(conv, "once more: " + answers[-1])
    kv = Path(conv.session.kv_path).read_bytes()
    conv.close()
    return answers, kv, counts, (model.mtp.base, resumed)


def test_greedy_answers_and_saved_sessions_are_the_same_with_mtp_drafts(make_model, tmp_path):
    plain, kv_plain, none, _ = converse(make_model, tmp_path / "plain", draft=0)
    fast, kv_fast, counts, (base, resumed) = converse(make_model, tmp_path / "mtp", draft=4)
    assert none == {} and counts["MTP"][0] > 0  # MTP drafts were checked...
    assert fast == plain  # ...and changed no token
    assert kv_fast == kv_plain  # the saved session is the same byte for byte
    assert base == resumed + 1  # after the resume the block started afresh (no hidden state before it)


@pytest.mark.parametrize("sparse", [False, True])
def test_copying_model_keeps_and_rejects_mtp_drafts(copying_path, sparse_copying_path, sparse, tmp_path):
    """The models above exercise both outcomes of a check (kept drafts and rejected ones), with dense
    and with sparse attention."""
    path = sparse_copying_path if sparse else copying_path
    _, _, counts, _ = converse(lambda: copying_model(path), tmp_path, draft=4)
    checked, kept = counts["MTP"]
    assert 0 < kept < checked


def test_mtp_state_follows_the_trunk(copying_path):
    """After answers with rejected drafts and a rewind into the middle of an answer, the block's rows
    are those a fresh block computes from the trunk's hidden states of the tokens now cached."""
    m = copying_model(copying_path)
    greedy = Sampler(SamplerSettings(temperature=0))
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 256, 30).tolist()
    first = m.prefill(prompt, all_logits=False)[-1]
    gen = Generation(m, first, greedy, (), 40, drafts=[m.mtp], draft=1)
    toks = [t.id for t in gen]
    assert 0 < gen.n_accepted < gen.n_drafted
    m.cache.truncate(len(prompt) + 17)  # as /rewind does
    more = rng.integers(0, 256, 5).tolist()
    first = m.prefill(more, all_logits=False)[-1]
    gen = Generation(m, first, greedy, (), 20, drafts=[m.mtp], draft=1)
    toks = [t.id for t in gen]
    assert gen.n_drafted > 0
    mtp, n = m.mtp, m.cache.length
    assert mtp.base == 0 and 0 < mtp.block.cache.length <= n
    rows = mtp.block.cache.length
    ids = np.array(m.cache.token_ids())
    assert np.array_equal(mtp.block.cache.tokens[:rows], ids[:rows])
    assert toks  # the trunk moved on after the rewind
    m.reset()
    _, h = m.prefill(ids, hidden=True)  # (n, D) the trunk's hidden states, recomputed
    ref = MTPBlock(m)
    ref.forward(np.concatenate([np.zeros_like(h[:1]), h[: rows - 1]]), ids[:rows])
    got, want = mtp.block.cache.records["kv"][:rows], ref.cache.records["kv"][:rows]
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()


def test_mtp_rows_never_reach_the_disk(copying_path, tmp_path):
    m = copying_model(copying_path)
    conv = Conversation(m, Settings(temperature=0, max_tokens=30, draft=4), store=Store(tmp_path), session_name="s")
    _, stats = conv.ask("copy this: one two three four five six")
    assert stats.by_source["MTP"][0] > 0
    data = Path(conv.session.kv_path).read_bytes()
    rows = m.mtp.block.cache.records["kv"][: m.mtp.block.cache.length, 0]  # (rows, C+R)
    assert rows.shape[0] > 10
    assert not any(r.tobytes() in data for r in rows)
    assert len(data) < m.cache.record_bytes * (m.cache.length + 64)  # the trunk's records, not twice them
    conv.close()


def test_sampling_with_mtp_drafts_keeps_the_distribution(copying_path):
    """Three sampled tokens with the MTP block's draft checked by the acceptance rule at each step:
    their joint frequencies over many seeds match the sampler's exact distribution."""
    model = copying_model(copying_path, n_ctx=64)
    settings = SamplerSettings(temperature=1.5, top_k=3, top_p=0.97, repeat_penalty=1.3)
    prompt = [1, 5, 9, 5, 12]
    first = model.prefill(prompt, all_logits=False)[-1]
    probe = Sampler(settings)

    want = three_token_distribution(model, prompt, first, probe)

    n_runs, counts, drafted, kept = 600, {}, 0, 0
    for seed in range(n_runs):
        model.cache.truncate(len(prompt))
        gen = Generation(model, first, Sampler(settings.with_(seed=seed)), (), 3, drafts=[model.mtp], draft=2)
        key = tuple(t.id for t in gen)
        counts[key] = counts.get(key, 0) + 1
        drafted, kept = drafted + gen.by_source["MTP"][0], kept + gen.by_source["MTP"][1]
    assert 0 < kept < drafted  # both branches of the rule ran on MTP drafts
    assert_drawn_from(counts, want, n_runs)


def test_a_full_context_ends_the_answer_with_mtp_drafts(copying_path):
    """Drafts never push a pass past the context: the answer stops at "context", as plain decoding's."""
    runs = []
    for draft in (0, 4):
        m = copying_model(copying_path, n_ctx=48)
        first = m.prefill(list(range(30)), all_logits=False)[-1]
        gen = Generation(m, first, Sampler(SamplerSettings(temperature=0)), (), 100,
                         drafts=[m.mtp], draft=draft)
        runs.append(([t.id for t in gen], gen.stopped, m.cache.length, gen.n_drafted))
    assert runs[1][:3] == runs[0][:3] and runs[0][1] == "context" and runs[1][3] > 0


def test_memory_check_counts_the_mtp_rows(monkeypatch):
    """The context's memory includes the block's rows and hidden states when MTP drafting is on."""
    path = str(TINY / "ds-v3-mtp.gguf")
    cfg = load(path, n_ctx=64).cfg
    plain = load(path, n_ctx=64, mtp=False)
    assert plain.mtp is None
    est = load(path, n_ctx=64).memory_estimate()
    assert est.mtp_per_token == bytes_per_token(cfg) == 4 + 4 * (cfg.kv_lora_rank + cfg.rope_dim) + 4 * cfg.n_embd
    assert est.total - plain.memory_estimate().total == 64 * est.mtp_per_token
    assert "MTP drafts" in str(est)
    n_ctx = 1024
    have = (engine.dense_f32_bytes(plain.tensors) + working_bytes(cfg) + plain.cache.record_bytes * n_ctx
            + est.mtp_per_token * n_ctx // 2)
    monkeypatch.setattr(engine, "available_memory", lambda: have)
    assert load(path, n_ctx=n_ctx, mtp=False).n_ctx == n_ctx  # fits without the MTP rows
    with pytest.raises(ModelError, match="use at most"):
        load(path, n_ctx=n_ctx)  # not with them


def test_no_mtp_drafts_where_passes_are_not_exact():
    """llama.cpp's numerics compute a pass of several tokens differently from decoding: no MTP state.
    Sparse attention's passes are exact (each query selects alone), so glm-dsa's block drafts."""
    assert load(str(TINY / "ds-v3-mtp.gguf"), n_ctx=64, numerics="llama.cpp").mtp is None
    assert load(str(TINY / "glm-dsa.gguf"), n_ctx=64).mtp is not None


def test_stats_count_mtp_drafts(copying_path):
    m = copying_model(copying_path)
    conv = Conversation(m, Settings(temperature=0, max_tokens=30, draft=4), save=False)
    _, stats = conv.ask("copy this: one two three four five six")
    checked, kept = stats.by_source["MTP"]
    assert f"MTP {kept} of {checked}" in stats_lines(conv)[-1] and "MTP" not in footer(conv, stats)
    assert stats.drafted == sum(c for c, _ in stats.by_source.values())


def test_mtp_step_cost_is_the_bytes_it_reads():
    """The draft's cost estimate: the block's weights and head against the trunk's layers and output
    matrix (routed experts: the ones a token uses), from the file's tensor shapes."""
    m = load(str(TINY / "ds-v3-mtp.gguf"), n_ctx=64)
    cfg, t = m.cfg, m.tensors

    def f32(name):
        return 4 * int(np.prod(t.shape(name)))

    per_token_experts = cfg.n_expert_used * 3 * cfg.n_ff_exp * cfg.n_embd * 4
    trunk = f32("output.weight") + (cfg.n_layer - cfg.n_dense) * per_token_experts
    block = per_token_experts + f32(f"blk.{cfg.n_layer}.nextn.shared_head_head.weight")
    for name in t.by_name:
        if not name.startswith("blk.") or "_exps." in name or name.endswith("shared_head_head.weight"):
            continue
        if int(name.split(".")[1]) < cfg.n_layer:
            trunk += f32(name)
        else:
            block += f32(name)
    assert abs(m.mtp.cost - block / trunk) < 1e-9


class Oracle(DraftSource):
    """Proposes the next tokens of a known answer (or nothing) and counts how often it was asked."""

    def __init__(self, name, answer, start, cost=0.0, most=None):
        self.name, self.answer, self.start, self.cost, self.most, self.asked = name, answer, start, cost, most, 0

    def propose(self, history, k):
        self.asked += 1
        j = len(history) - self.start  # history ends with answer[j - 1]
        return self.answer[j : j + k]


def test_a_costly_source_is_asked_only_when_it_can_beat_the_free_one():
    """Lookup first; the MTP block (a cost per proposal, one draft) only when its expected gain beats
    the lookup match's: never while free matches keep being right, always without one."""
    model = load(str(TINY / "llama.gguf"), n_ctx=128)
    prompt = [1, 5, 9, 5, 12]
    first = model.prefill(prompt, all_logits=False)[-1]
    greedy = Sampler(SamplerSettings(temperature=0))
    ref = [t.id for t in Generation(model, first, greedy, (), 12)]
    for free in (ref, []):
        model.cache.truncate(len(prompt))
        lookup, mtp = Oracle("lookup", free, len(prompt)), Oracle("MTP", ref, len(prompt), cost=0.1, most=1)
        gen = Generation(model, first, greedy, (), 12, drafts=[lookup, mtp], draft=4)
        assert [t.id for t in gen] == ref
        if free:  # right free matches of several tokens gain more than one costly token: MTP is never asked
            assert mtp.asked == 0 and gen.by_source["lookup"][1] > 0
        else:  # no free match: MTP drafts
            assert lookup.asked > 0 and mtp.asked > 0 and gen.by_source["MTP"][1] > 0


def test_set_draft_says_when_the_mtp_block_was_not_loaded():
    """Started with --draft 0, an MTP model has no MTP block loaded (its rows cost memory): /set draft N
    then drafts by prompt lookup alone, and says so with what brings the block in."""
    off = Conversation(load(str(TINY / "ds-v3-mtp.gguf"), n_ctx=64, mtp=False), Settings(draft=0), save=False)
    said = off.set_option("draft", 5)
    assert said.endswith("(prompt lookup only: the model's MTP block was not loaded, as with --draft 0 at start; "
                         "start colichat with --draft N to draft with it too)")
    on = Conversation(load(str(TINY / "ds-v3-mtp.gguf"), n_ctx=64), Settings(draft=0), save=False)
    assert "MTP" not in on.set_option("draft", 5) and "MTP" not in off.set_option("draft", 0)


def test_the_model_decides_at_load_whether_it_drafts_with_its_mtp_block(copying_path):
    """Whether a model keeps an MTP block's draft state is decided once, when it loads (the memory check
    counted its rows then): a file with a block has it unless loaded with mtp=False (--draft 0 at start),
    a file without one never, nor llama.cpp's numerics (no exact passes). The draft setting then only
    chooses whether answers ask that same block for drafts."""
    plain = load(str(TINY / "llama.gguf"), n_ctx=64)
    left_out = load(str(TINY / "ds-v3-mtp.gguf"), n_ctx=64, mtp=False)
    reference = load(str(TINY / "ds-v3-mtp.gguf"), n_ctx=64, numerics="llama.cpp")
    assert (plain.mtp, plain.mtp_left_out) == (None, False)
    assert (left_out.mtp, left_out.mtp_left_out) == (None, True)
    assert (reference.mtp, reference.mtp_left_out) == (None, False)

    m = copying_model(copying_path)
    block = m.mtp
    conv = Conversation(m, Settings(temperature=0, max_tokens=30, draft=0), save=False)
    asked = []
    for draft in (0, 4, 0):
        conv.set_option("draft", draft)
        _, stats = conv.ask("copy this: one two three four five six seven eight nine ten")
        asked.append(stats.by_source.get("MTP", (0, 0))[0])
        assert m.mtp is block and not m.mtp_left_out
    assert asked[0] == asked[2] == 0 < asked[1]
