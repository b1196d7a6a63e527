"""Sessions of a model whose rope depends on the context size (minicpm3's LongRoPE): the sidecar
records the factors the cache rows were rotated with (model.rope_factors). The tiny minicpm3's
original context is 256: --ctx 256 or less rotates with the short factors, more with the long ones.

A conversation made with the long factors goes on with them at any context size (bit-identical to
going on uninterrupted); one made with the short factors is refused, before any record is read,
at a context above 256 (the short factors serve no more, the long ones would mix with its rows)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import GREEDY, chat_here, lines, session_files
from conftest import TINY

from colichat.conversation.chat import ChatError, Conversation, Settings
from colichat.engine import ModelError, load, resume_problem
from colichat.persist import CacheLayout, SessionError, Store, Turn, model_identity
from colichat.persist.sidecar import doc_check

MINICPM3 = str(TINY / "minicpm3.gguf")
ORIG = 256  # the tiny minicpm3's rope.scaling.original_context_length
ARGS = ["--model", MINICPM3, *GREEDY, "--max-tokens", "8"]


@pytest.fixture(scope="module")
def models():
    """One model per context size: 200 and 256 rotate with the short factors, 1024 with the long."""
    return {n: load(MINICPM3, n_ctx=n) for n in (200, 256, 1024)}


def fresh(models, n_ctx):
    m = models[n_ctx]
    m.reset()
    return m


def sidecar(home, name: str) -> tuple[Path, dict]:
    [path] = Path(home).glob(f"data/sessions/*/{name}.json")
    return path, json.loads(path.read_text())


def rewrite_model_field(path: Path, **fields) -> None:
    """Set (value) or remove (None) fields of the sidecar's model section, with a matching check:
    what an older colichat or another program may have written, not damage."""
    doc = json.loads(path.read_text())
    doc["model"] = {k: v for k, v in {**doc["model"], **fields}.items() if v is not None}
    doc.pop("check")
    doc["check"] = doc_check({k: v for k, v in doc.items() if k != "turns"})
    path.write_text(json.dumps(doc))


# ---- the engine ----------------------------------------------------------------------------------


def test_the_model_rotates_with_the_context_sizes_factors_and_can_keep_a_conversations(models):
    ids = np.load(TINY / "minicpm3.ref.npz")["tokens_0"][:12]
    short, long = fresh(models, 256), fresh(models, 1024)
    assert (models[200].rope_factors, short.rope_factors, long.rope_factors) == ("short", "short", "long")
    want = long.prefill(ids)
    short.use_rope_factors("long")  # a conversation made with the long factors, at a smaller context
    assert short.rope_factors == "long" and np.array_equal(short.prefill(ids), want)
    short.reset()  # a new conversation: the factors this context size picks
    assert short.rope_factors == "short"
    with pytest.raises(ModelError, match="serve a context size of at most 256 \\(this one is 1,024\\)"):
        long.use_rope_factors("short")
    with pytest.raises(ModelError, match="rope factors 'medium', which minicpm3 does not have"):
        long.use_rope_factors("medium")
    assert long.rope_factors == "long"
    llama = load(str(TINY / "llama.gguf"), n_ctx=64)
    assert llama.rope_factors is None
    llama.use_rope_factors(None)
    with pytest.raises(ModelError, match="llama uses the same rope at every context size"):
        llama.use_rope_factors("long")


def test_the_same_answer_before_loading(tmp_path):
    """resume_problem reads the GGUF's metadata only (the CLI asks it before loading the model)."""
    assert resume_problem(MINICPM3, 256, "short") is None and resume_problem(MINICPM3, 200, "long") is None
    assert "at most 256 (this one is 4,096)" in resume_problem(MINICPM3, None, "short")  # the default context
    assert "llama uses the same rope" in resume_problem(str(TINY / "llama.gguf"), 64, "long")
    assert resume_problem(str(TINY / "llama.gguf"), 64, None) is None
    (tmp_path / "x.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ModelError, match="x.gguf"):  # what loading it would say
        resume_problem(str(tmp_path / "x.gguf"), 64, "long")


# ---- the library API (engine + persist) -----------------------------------------------------------


def save_exchange(model, name: str) -> list[Turn]:
    """One prompt and 4 greedy tokens, saved as session NAME (its ident from the model)."""
    ident = model_identity(MINICPM3, model.cfg.arch, model.cfg.name, model.rope_factors)
    ids = list(range(5, 25))
    last = model.prefill(ids)[-1]
    mid = model.cache.length
    for _ in range(4):
        last = model.decode(int(np.argmax(last)))
    turns = [Turn("user", "u", 0, mid), Turn("assistant", "a", mid, model.cache.length)]
    with Store().create(ident, CacheLayout.from_cache(model.cache, model.cfg.n_vocab), name=name) as s:
        s.append(model.cache, turns)
    return turns


def open_session(model, name: str):
    ident = model_identity(MINICPM3, model.cfg.arch, model.cfg.name, model.rope_factors)
    return Store().open(ident, name, CacheLayout.from_cache(model.cache, model.cfg.n_vocab))


def test_library_same_side_resumes_bit_identically_other_side_is_refused(colichat_home, models):
    src = fresh(models, 256)
    save_exchange(src, "s")
    rows = src.cache.records[: src.cache.length].copy()
    after = src.prefill([7, 8, 9])  # going on uninterrupted
    assert sidecar(colichat_home, "s")[1]["model"]["rope_factors"] == "short"

    same = fresh(models, 200)  # another context size, the same (short) factors
    with open_session(same, "s") as sess:
        res = sess.load(same.cache, same.n_ctx)
    assert res.warnings == [] and np.array_equal(same.cache.records[: same.cache.length], rows)
    assert np.array_equal(same.prefill([7, 8, 9]), after)

    other = fresh(models, 1024)
    kv = next(p for p in session_files(colichat_home) if p.suffix == ".coli_kv")
    before = kv.read_bytes()
    with open_session(other, "s") as sess:
        assert sess.saved_rope_factors() == "short"
        with pytest.raises(SessionError) as e:
            sess.load(other.cache, other.n_ctx)
    assert str(e.value).count("\n") == 0
    assert "rotated with the 'short' rope factors and this model's with 'long'" in str(e.value)
    assert other.cache.length == 0 and kv.read_bytes() == before


def test_library_a_long_session_goes_on_with_its_factors_at_a_smaller_context(colichat_home, models):
    src = fresh(models, 1024)
    save_exchange(src, "l")
    rows = src.cache.records[: src.cache.length].copy()
    after = src.prefill([7, 8, 9])
    small = fresh(models, 256)
    with open_session(small, "l") as sess, pytest.raises(SessionError, match="'long' rope factors"):
        sess.load(small.cache, small.n_ctx)
    small.use_rope_factors("long")  # what the chat program does on resume (below)
    with open_session(small, "l") as sess:
        sess.load(small.cache, small.n_ctx)
    assert np.array_equal(small.cache.records[: small.cache.length], rows)
    assert np.array_equal(small.prefill([7, 8, 9]), after)


def test_models_without_context_dependent_rope_record_nothing(colichat_home):
    m = load(str(TINY / "llama.gguf"), n_ctx=64)
    conv = Conversation(m, Settings(temperature=0, max_tokens=2), session_name="g")
    conv.ask("hello")
    conv.close()
    assert "rope_factors" not in sidecar(colichat_home, "g")[1]["model"]


# ---- the chat program's Conversation --------------------------------------------------------------


def test_conversation_long_session_resumes_at_a_smaller_context_as_if_uninterrupted(colichat_home, models):
    long = fresh(models, 1024)
    conv = Conversation(long, Settings(temperature=0, max_tokens=8), session_name="l")
    conv.ask("hello")
    second, _ = conv.ask("and again")
    rows = long.cache.records[: long.cache.length].copy()
    conv.rewind(1)
    conv.close()

    small = fresh(models, 256)
    again = Conversation(small, Settings(temperature=0, max_tokens=8))
    again.resume("l")
    assert small.rope_factors == "long"
    assert again.ask("and again")[0] == second
    assert np.array_equal(small.cache.records[: small.cache.length], rows)
    assert sidecar(colichat_home, "l")[1]["model"]["rope_factors"] == "long"
    again.reset()  # a new conversation: this context size's own factors, and so its sessions
    assert small.rope_factors == "short"
    again.ask("hello")
    again.save_as("n")
    again.close()
    assert sidecar(colichat_home, "n")[1]["model"]["rope_factors"] == "short"


def test_conversation_short_session_at_a_larger_context_is_refused_in_one_line(colichat_home, models):
    short = fresh(models, 256)
    conv = Conversation(short, Settings(temperature=0, max_tokens=4), session_name="s")
    conv.ask("hello")
    conv.close()
    long = fresh(models, 1024)
    other = Conversation(long, Settings(temperature=0, max_tokens=4), session_name="t")
    other.ask("hi")
    rows = long.cache.records[: long.cache.length].copy()
    with pytest.raises(ChatError) as e:
        other.resume("s")
    assert str(e.value) == ("session s cannot be resumed: it was made with the short rope factors, which serve "
                            "a context size of at most 256 (this one is 1,024): resume it with a context size "
                            "of at most 256, or start a new conversation")
    # the conversation in memory goes on, with its own factors and session
    assert long.rope_factors == "long" and other.session.name == "t"
    assert np.array_equal(long.cache.records[: long.cache.length], rows)
    other.ask("more")
    other.close()


@pytest.mark.parametrize("value, says", [
    ("medium", "rope factors 'medium', which minicpm3 does not have (it has short and long)"),
    (7, "is damaged (its model.rope_factors is 7, not a name)"),
    ("", "is damaged (its model.rope_factors is \"\", not a name)"),
])
def test_a_foreign_or_bad_value_is_refused_in_one_line(colichat_home, models, value, says):
    m = fresh(models, 256)
    conv = Conversation(m, Settings(temperature=0, max_tokens=4), session_name="s")
    conv.ask("hello")
    conv.close()
    path, _ = sidecar(colichat_home, "s")
    rewrite_model_field(path, rope_factors=value)
    m.reset()
    again = Conversation(m, Settings(temperature=0, max_tokens=4))
    with pytest.raises((ChatError, SessionError)) as e:
        again.resume("s")
    assert says in str(e.value) and "\n" not in str(e.value)
    assert m.cache.length == 0 and m.rope_factors == "short"


def test_an_old_sidecar_without_the_field_loads_as_before(colichat_home, models):
    m = fresh(models, 256)
    conv = Conversation(m, Settings(temperature=0, max_tokens=4), session_name="s")
    conv.ask("hello")
    rows = m.cache.records[: m.cache.length].copy()
    conv.close()
    path, _ = sidecar(colichat_home, "s")
    rewrite_model_field(path, rope_factors=None)
    m.reset()
    again = Conversation(m, Settings(temperature=0, max_tokens=4))
    assert "warning" not in again.resume("s")
    assert np.array_equal(m.cache.records[: m.cache.length], rows)
    again.ask("more")  # the next save records the factors
    again.close()
    assert sidecar(colichat_home, "s")[1]["model"]["rope_factors"] == "short"


# ---- the program, through pipes -------------------------------------------------------------------


def kv_bytes(home, name: str) -> bytes:
    [kv] = Path(home).glob(f"data/sessions/*/{name}.coli_kv")
    return kv.read_bytes()


def test_cli_resume_on_either_side(colichat_home):
    for ctx, name in ((1024, "long"), (256, "short")):
        whole = chat_here(colichat_home, [*ARGS, "--ctx", ctx, "--session", f"{name}-whole"],
                     lines("hello", "and again")).ok()
        chat_here(colichat_home, [*ARGS, "--ctx", ctx, "--session", name], lines("hello")).ok()
        assert sidecar(colichat_home, name)[1]["model"]["rope_factors"] == name
        # the same side (another context size): bit-identical to the uninterrupted conversation
        same = 200 if name == "short" else 2048
        again = chat_here(colichat_home, [*ARGS, "--ctx", same, "--resume", "--session", name], lines("and again")).ok()
        assert again.resumed()[1:] == (2, name)
        assert again.out == whole.out.split(b"\n", 1)[1]
        assert kv_bytes(colichat_home, name) == kv_bytes(colichat_home, f"{name}-whole")
        chat_here(colichat_home, [*ARGS, "--ctx", ctx, "--session", f"{name}-2"], lines("hello")).ok()
        if name == "long":  # goes on with the long factors at a context the short ones would serve
            again = chat_here(colichat_home, [*ARGS, "--ctx", 256, "--resume", "--session", "long-2"],
                         lines("and again")).ok()
            assert again.out == whole.out.split(b"\n", 1)[1]
            assert kv_bytes(colichat_home, "long-2") == kv_bytes(colichat_home, "long-whole")
        else:  # refused before the model loads, the files untouched
            files = {p: p.read_bytes() for p in session_files(colichat_home) if "short-2" in p.name}
            refused = chat_here(colichat_home, [*ARGS, "--ctx", 1024, "--resume", "--session", "short-2"],
                           lines("and again")).failed()
            assert refused.errors() == [
                "colichat: session short-2 cannot be resumed: it was made with the short rope factors, which "
                "serve a context size of at most 256 (this one is 1,024): resume it with a context size of at "
                "most 256, or start a new conversation"]
            assert refused.out == b"" and "loaded in" not in refused.err  # refused before the model loads
            assert {p: p.read_bytes() for p in files} == files


def test_cli_reopens_with_the_context_it_was_saved_with(colichat_home):
    """Without --ctx, --session NAME (and --resume) reopens a conversation with the context size it
    was saved with, so with the factors it was made with (the short ones at 256: the model's default
    context, 4096, would refuse them); a --ctx given wins and is saved with the next answer."""
    for ctx, name in ((256, "short"), (1024, "long")):
        chat_here(colichat_home, [*ARGS, "--ctx", ctx, "--session", name], lines("hello")).ok()
        assert sidecar(colichat_home, name)[1]["model"]["n_ctx"] == ctx
        again = chat_here(colichat_home, [*ARGS, "--session", name], lines("and again")).ok()
        assert again.resumed()[1:] == (2, name)
        assert [n for _, n in again.contexts()] == [ctx]
    chat_here(colichat_home, [*ARGS, "--ctx", 200, "--resume", "--session", "short"], lines("more")).ok()
    assert sidecar(colichat_home, "short")[1]["model"]["n_ctx"] == 200
    latest = chat_here(colichat_home, [*ARGS, "--resume"], lines("more")).ok()
    assert latest.resumed()[1:] == (6, "short")
    assert [n for _, n in latest.contexts()] == [200]


def test_cli_resume_command_refused_leaves_the_conversation_going_on(colichat_home):
    """/resume of a short-factor conversation at a larger context, inside a running conversation:
    one line, then the conversation in memory goes on, with its long factors, in its own session."""
    chat_here(colichat_home, [*ARGS, "--ctx", 256, "--session", "short"], lines("hello")).ok()
    whole = chat_here(colichat_home, [*ARGS, "--ctx", 1024, "--session", "whole"], lines("hi", "more")).ok()
    run = chat_here(colichat_home, [*ARGS, "--ctx", 1024, "--session", "cur"], lines("hi", "/resume short", "more"))
    assert run.failed().errors() == [  # (pipe mode exits 1 when a command failed)
        "colichat: session short cannot be resumed: it was made with the short rope factors, which serve a context "
        "size of at most 256 (this one is 1,024): resume it with a context size of at most 256, or start a "
        "new conversation"]
    assert run.out == whole.out and run.footers()[-1].endswith("; saved to cur]")
    assert kv_bytes(colichat_home, "cur") == kv_bytes(colichat_home, "whole")


def test_a_damaged_sidecar_without_the_field_says_the_factors_are_assumed(colichat_home, models):
    m = fresh(models, 256)
    conv = Conversation(m, Settings(temperature=0, max_tokens=4), session_name="s")
    conv.ask("hello")
    conv.close()
    path, doc = sidecar(colichat_home, "s")
    doc["model"]["rope_factorz"] = doc["model"].pop("rope_factors")  # a changed byte: the check fails
    path.write_text(json.dumps(doc))
    m.reset()
    again = Conversation(m, Settings(temperature=0, max_tokens=4))
    said = again.resume("s")
    assert ("warning: the sidecar does not say which rope factors the cache rows were rotated with: "
            "assumed 'short', this model's") in said.splitlines()
    again.close()
