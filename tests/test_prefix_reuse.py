"""Prefix reuse: a new conversation whose prompt begins with the tokens of a saved conversation of the
same model reads those records instead of prefilling them, says so once, and is the answer a full
prefill gives. The prefix index is a hint: stale, damaged or lost, it costs a prefill, never a wrong
cache; --no-reuse turns reuse off."""

from __future__ import annotations

import json

import pytest
from cli_helpers import GREEDY, TINY_LLAMA, chat

from colichat.conversation.chat import Conversation, Settings
from colichat.engine import load
from colichat.persist import Store
from colichat.persist.kvfile import HEADER_SIZE

DOC = " ".join(f"Paragraph {i} is about the weather in town number {i}, which is mild." for i in range(15))
Q1, Q2 = DOC + "\nQuestion: what is in paragraph 3?", DOC + "\nQuestion: what about paragraph 7?"


@pytest.fixture(scope="module")
def model():
    return load(TINY_LLAMA, n_ctx=1024)


def conversation(model, store: Store, name: str, **kw) -> Conversation:
    model.reset()
    model.cache.set_codec("f32")
    return Conversation(model, Settings(temperature=0, max_tokens=6, draft=0), store=store, session_name=name, **kw)


def ask(model, store: Store, name: str, text: str, **kw):
    """(answer, stats, notes) of a new conversation NAME that sends `text`, saved and closed."""
    conv, notes = conversation(model, store, name, **kw), []
    answer, stats = conv.ask(text, on_note=notes.append)
    conv.close()
    return answer, stats, notes


def kv_bytes(store: Store, name: str) -> bytes:
    [p] = store.root.glob(f"*/{name}.coli_kv")
    return p.read_bytes()


def index_file(store: Store):
    [p] = (store.root.parent / "prefixes").glob("*.json")
    return p


def test_a_new_conversation_reads_the_shared_prefix_and_answers_as_a_full_prefill(model, tmp_path):
    store = Store(tmp_path / "sessions")
    ask(model, store, "first", Q1)
    answer, stats, notes = ask(model, store, "second", Q2)
    assert stats.reused > 250 and notes == [f"reused {stats.reused:,} tokens from first"]
    full, full_stats, full_notes = ask(model, Store(tmp_path / "other" / "sessions"), "second", Q2)
    assert full_notes == [] and full_stats.reused == 0
    assert stats.prompt_tokens == full_stats.prompt_tokens - stats.reused  # only the question is prefilled
    assert answer == full
    reused = slice(HEADER_SIZE, HEADER_SIZE + stats.reused * model.cache.record_bytes)
    mine, source = kv_bytes(store, "second"), kv_bytes(store, "first")
    assert mine[reused] == source[reused]
    assert mine[reused] == kv_bytes(Store(tmp_path / "other" / "sessions"), "second")[reused]  # = a full prefill's


def test_no_reuse_prefills_it_all(model, tmp_path):
    store = Store(tmp_path / "sessions")
    ask(model, store, "first", Q1)
    _, stats, notes = ask(model, store, "second", Q2, reuse=False)
    assert stats.reused == 0 and notes == []


def test_a_stale_index_costs_a_prefill_never_a_wrong_cache(model, tmp_path):
    """The index says `first` begins like the prompt, but `first` was rewound and now holds another text:
    its tokens are checked, and the answer is the one a full prefill gives."""
    store = Store(tmp_path / "sessions")
    ask(model, store, "first", Q1)
    stale = index_file(store).read_bytes()
    conv = conversation(model, store, "first")
    conv.resume("first")
    conv.rewind(1)
    conv.ask("Something else entirely, and long enough to be more than a few tokens of text.")
    conv.close()
    index_file(store).write_bytes(stale)  # (as if the rewind's index write had been lost)
    answer, stats, _ = ask(model, store, "second", Q2)
    full, _, _ = ask(model, Store(tmp_path / "other" / "sessions"), "second", Q2)
    assert stats.reused == 0 and answer == full


@pytest.mark.parametrize("damage", ["garbage", "missing"])
def test_a_damaged_or_lost_index_is_rebuilt_from_the_sessions(model, tmp_path, damage):
    store = Store(tmp_path / "sessions")
    ask(model, store, "first", Q1)
    kept = json.loads(index_file(store).read_bytes())
    if damage == "garbage":
        index_file(store).write_bytes(b"\x00not json")
    else:
        index_file(store).unlink()
    _, stats, notes = ask(model, store, "second", Q2)
    assert stats.reused > 250 and notes == [f"reused {stats.reused:,} tokens from first"]
    rebuilt = json.loads(index_file(store).read_bytes())  # (written whole again with the save of `second`)
    assert rebuilt["sessions"]["first"] == kept["sessions"]["first"]


def test_only_a_conversation_kept_in_the_same_codec_is_reused(model, tmp_path):
    store = Store(tmp_path / "sessions")
    ask(model, store, "first", Q1)
    _, stats, _ = ask(model, store, "second", Q2, kv="fp8")
    assert stats.reused == 0
    _, stats, _ = ask(model, store, "third", Q2 + " And 9?", kv="fp8")
    assert stats.reused > 250  # from `second`, the fp8 one


@pytest.mark.process
def test_a_p_run_reuses_a_saved_conversation_and_says_so(colichat_home):
    args = ["--model", TINY_LLAMA, *GREEDY, "--max-tokens", "4"]
    chat(colichat_home, [*args, "--session", "doc", "-p", Q1]).ok()
    r = chat(colichat_home, [*args, "-p", Q2]).ok()
    [line] = [x for x in r.err.splitlines() if x.startswith("reused ")]
    n = int(line.split()[1].replace(",", ""))
    assert line == f"reused {n:,} tokens from doc" and n > 250
    assert f", reused {n:,} tokens, " in r.footers()[0] and " 0 tok/s" not in r.footers()[0]
    r = chat(colichat_home, [*args, "--no-reuse", "-p", Q2]).ok()
    assert "reused" not in r.err


def test_forget_reads_its_first_kept_exchange_from_a_saved_conversation_that_began_with_it(model, tmp_path):
    """/forget twice from the same conversation: the second reading again starts from the first one's
    records (the kept exchange's message), and is the conversation the first one made."""
    store = Store(tmp_path / "sessions")
    conv = conversation(model, store, "long")
    for q in ("A short first question?", Q1, "And then?"):
        conv.ask(q)
    said = conv.forget(1)
    assert "reused" not in said and conv.name == "long-cont"
    first = kv_bytes(store, "long-cont")
    conv.resume("long")
    said = conv.forget(1)
    n = int(said.split("(reused ")[1].split()[0].replace(",", ""))
    assert n > 250 and said.endswith(f"read again (reused {n:,} tokens from long-cont); saved as long-cont-2")
    conv.close()
    assert kv_bytes(store, "long-cont-2")[:HEADER_SIZE + n * model.cache.record_bytes] == \
        first[:HEADER_SIZE + n * model.cache.record_bytes]
