"""Conversation-level behaviour that the pipe-mode tests cannot time reliably."""

from __future__ import annotations

import codecs
import contextlib

import pytest
from conftest import TINY

from colichat.conversation.chat import ChatError, Conversation, Settings
from colichat.engine import load
from colichat.engine.cancel import Cancel


@pytest.fixture(scope="module")
def model():
    return load(str(TINY / "llama.gguf"), n_ctx=2048)


def test_stop_during_a_long_prompt_drops_the_message(model):
    model.reset()
    conv = Conversation(model, Settings(temperature=0, max_tokens=4), save=False)
    conv.ask("hello")
    before = (model.cache.length, list(conv.transcript.turns))
    cancel = Cancel()

    def stop_in_the_second_step(done, total):
        if done > 300:
            cancel.set()  # what Ctrl-C does

    with pytest.raises(ChatError, match="not sent"):
        conv.ask("x y " * 500, on_progress=stop_in_the_second_step, cancel=cancel)
    assert (model.cache.length, conv.transcript.turns) == before
    answer, _ = conv.ask("hello again")  # and the conversation goes on
    assert len(conv.transcript.starts()) == 2


def test_stop_during_the_answer_keeps_what_was_said(model):
    model.reset()
    conv = Conversation(model, Settings(temperature=0, max_tokens=50), save=False)
    pieces, cancel = [], Cancel()

    def on_text(piece):
        pieces.append(piece)
        if len(pieces) == 3:
            cancel.set()

    answer, stats = conv.ask("tell me", on_text=on_text, cancel=cancel)
    assert stats.stopped == "interrupt" and answer == "".join(pieces)
    assert conv.transcript.turns[-1].last == model.cache.length and stats.generated >= 3


@pytest.mark.parametrize("draft", [0, 8])
def test_a_token_computed_when_the_stop_came_is_neither_shown_nor_kept(model, draft):
    """Ctrl-C while a decode step (or a verify pass) runs: the terminal shows nothing after the ^C, so
    that step's tokens are dropped and the conversation goes on from the text that was shown."""
    model.reset()
    conv = Conversation(model, Settings(temperature=0, max_tokens=40, draft=draft), save=False)
    message = "copy: one two three one two three one two three"
    full, _ = conv.ask(message)
    full_ids = model.cache.token_ids()[conv.transcript.turns[-1].first:]
    conv.new()
    pieces, passes, cancel = [], [], Cancel()
    decode, prefill = model.decode, model.prefill

    def stop_inside(step):
        def run(*args, **kwargs):
            passes.append(1)
            if len(passes) == 5:
                cancel.set()  # what Ctrl-C does, arriving while the step computes
            return step(*args, **kwargs)
        return run

    model.decode, model.prefill = stop_inside(decode), stop_inside(prefill)
    try:
        # shown as the REPL shows it: after the ^C, nothing (App.hushed)
        answer, stats = conv.ask(message, on_text=lambda piece: cancel.requested or pieces.append(piece), cancel=cancel)
    finally:
        model.decode, model.prefill = decode, prefill
    assert stats.stopped == "interrupt" and answer == "".join(pieces) and full.startswith(answer)
    assert conv.transcript.turns[-1].last == model.cache.length == conv.transcript.turns[-1].first + stats.generated
    shown = model.cache.token_ids()[conv.transcript.turns[-1].first:]  # the rows of what was shown
    assert shown == full_ids[:stats.generated]


@contextlib.contextmanager
def ctrl_c_at_first_decode(model):
    """Inside: model.decode's first call gets a stop request (what Ctrl-C does) while it computes, after
    the engine's last safe point. Yields the Cancel."""
    decode, cancel = model.decode, Cancel()

    def run(*args, **kwargs):
        logits = decode(*args, **kwargs)
        cancel.set()
        return logits

    model.decode = run
    try:
        yield cancel
    finally:
        del model.decode


def test_a_stop_inside_a_character_keeps_only_whole_characters(model):
    """Bytes of a character split over tokens show once it is whole: a stop after the first of its
    tokens drops them (they were not shown), so the answer's text is exactly its tokens' text."""
    model.reset()
    conv = Conversation(model, Settings(temperature=0, max_tokens=40, draft=0), save=False)
    conv.ask("hello")
    ids = model.cache.token_ids()[conv.transcript.turns[-1].first:]
    utf8 = codecs.getincrementaldecoder("utf-8")("replace")
    split = next(i for i, t in enumerate(ids)  # a token that begins a character and ends none
                 if utf8.decode(conv.prompt.tok.piece(t)) == "" and utf8.getstate()[0])
    conv.new()
    decode, calls, cancel = model.decode, [], Cancel()

    def run(*args, **kwargs):  # decode call k + 1 makes token k: Ctrl-C while the one after `split` computes
        calls.append(1)
        logits = decode(*args, **kwargs)
        if len(calls) == split + 2:
            cancel.set()
        return logits

    model.decode, shown = run, []
    try:
        answer, stats = conv.ask("hello", on_text=lambda piece: cancel.requested or shown.append(piece), cancel=cancel)
    finally:
        del model.decode
    kept = model.cache.token_ids()[conv.transcript.turns[-1].first:]
    assert stats.stopped == "interrupt" and len(kept) < split + 1 and kept == ids[:len(kept)]
    assert answer == "".join(shown) == conv.prompt.tok.decode(kept)


def test_a_stop_before_the_first_token_drops_the_message(model):
    model.reset()
    conv = Conversation(model, Settings(temperature=0, max_tokens=8, draft=0), save=False)
    conv.ask("hello")
    before = (model.cache.token_ids(), list(conv.transcript.turns))
    dropped = "^interrupted before the answer began; the message was not sent$"
    with ctrl_c_at_first_decode(model) as cancel, pytest.raises(ChatError, match=dropped):
        conv.ask("and now?", cancel=cancel)
    assert (model.cache.token_ids(), conv.transcript.turns) == before  # no empty answer kept
    conv.ask("and now?")
    assert len(conv.transcript.starts()) == 2


def test_regen_keeps_the_old_answer_until_a_new_one_exists(model, tmp_path):
    from colichat.persist import Store

    model.reset()
    store = Store(tmp_path)
    conv = Conversation(model, Settings(temperature=0.9, seed=1, max_tokens=12, draft=0), store=store,
                        session_name="r")
    try:
        conv.ask("hello")
        first, _ = conv.ask("tell me more")
        files = {p.name: p.read_bytes() for p in tmp_path.rglob("r.*") if p.suffix != ".lock"}
        rows = bytes(model.cache.raw(0, model.cache.length))
        turns = list(conv.transcript.turns)
        with ctrl_c_at_first_decode(model) as cancel, pytest.raises(ChatError, match="not sent"):
            conv.ask(None, cancel=cancel)
        assert conv.transcript.turns == turns and bytes(model.cache.raw(0, model.cache.length)) == rows
        assert {p.name: p.read_bytes() for p in tmp_path.rglob("r.*") if p.suffix != ".lock"} == files
        second, stats = conv.ask(None)  # a new answer replaces it, on disk too
        assert stats.saved and second != first and [t.text for t in conv.transcript.turns][-1] == second
        rows = bytes(model.cache.raw(0, model.cache.length))
    finally:
        conv.close()
    model.reset()
    again = Conversation(model, Settings(), store=store)
    try:
        again.resume("r")
        assert again.transcript.turns == conv.transcript.turns and bytes(model.cache.raw(0, model.cache.length)) == rows
    finally:
        again.close()


def test_set_of_another_setting_and_a_dropped_message_leave_the_random_numbers_where_they_are(model):
    """A seeded conversation draws the same answers whether or not a setting other than the seed was set,
    or a message was stopped before its answer began, in between."""
    settings = Settings(temperature=1.0, seed=7, max_tokens=10, draft=0)
    model.reset()
    plain = Conversation(model, settings, save=False)
    ref = [plain.ask("first")[0], plain.ask("second")[0]]
    model.reset()
    conv = Conversation(model, settings, save=False)
    got = [conv.ask("first")[0]]
    conv.set_option("max_tokens", 10)
    with ctrl_c_at_first_decode(model) as cancel, pytest.raises(ChatError, match="not sent"):
        conv.ask("dropped", cancel=cancel)
    got.append(conv.ask("second")[0])
    assert got == ref
    conv.set_option("seed", 8)  # a new seed starts its own numbers
    model.reset()
    fresh = Conversation(model, settings.with_(seed=8), save=False)
    assert conv.prefs.sampler.state["pcg64"] == fresh.prefs.sampler.state["pcg64"]


def test_ctrl_c_during_forget_goes_back_to_the_conversation_as_it_was(model, tmp_path):
    from colichat.persist import Store

    model.reset()
    conv = Conversation(model, Settings(temperature=0, max_tokens=6, draft=0), store=Store(tmp_path),
                        session_name="f")
    try:
        for question in ("one", "two", "three"):
            conv.ask(question)
        turns, rows = list(conv.transcript.turns), bytes(model.cache.raw(0, model.cache.length))
        files = {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.suffix != ".lock"}
        reads, cancel = [], Cancel()

        def progress(done, total):  # each kept turn read again; Ctrl-C during the second
            if done == 0:
                reads.append(total)
            if len(reads) == 2:
                cancel.set()

        with pytest.raises(ChatError, match="^/forget stopped: back in f, as it was$"):
            conv.forget(1, on_progress=progress, cancel=cancel)
        assert len(reads) == 2 and conv.transcript.turns == turns
        assert bytes(model.cache.raw(0, model.cache.length)) == rows
        assert {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.suffix != ".lock"} == files
        assert "new conversation without the oldest exchange" in conv.forget(1)  # and it can be done again
    finally:
        conv.close()


REWRITING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% else %}<｜Assistant｜>[{{ m['content'] }}]<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def test_a_template_that_rewrites_history_still_gives_the_model_the_right_prompt(model):
    """Past answers rendered differently (as templates that strip reasoning do): the cache is cut at
    the first token that differs from the new prompt, and the model reads exactly the new prompt."""
    from colichat.engine.text.template import ChatTemplate

    model.reset()
    conv = Conversation(model, Settings(temperature=0, max_tokens=6), save=False)
    conv.prompt.template = ChatTemplate(REWRITING_TEMPLATE, bos_token=model.tokenizer.bos_text)
    conv.ask("hello")
    conv.ask("and again")
    user2 = conv.transcript.turns[-2]
    prompt = conv.prompt.template.render(conv.prompt.messages(conv.transcript.turns[:-1]), True)
    assert model.cache.token_ids()[: user2.last] == model.tokenizer.encode_prompt(prompt)
    assert [t.role for t in conv.transcript.turns] == ["user", "assistant", "user", "assistant"]
    assert conv.transcript.turns[-1].last == model.cache.length


def test_system_prompt_change_waits_for_the_next_conversation(model):
    def run(system_midway: bool) -> tuple[Conversation, list[int]]:
        model.reset()
        conv = Conversation(model, Settings(temperature=0, max_tokens=4), save=False)
        conv.ask("hello")
        if system_midway:
            assert "next conversation" in conv.set_option("system", "Be brief.")
            assert conv.prefs.settings.system is None and conv.prefs.options()["system (next)"] == "Be brief."
        conv.ask("more")
        return conv, model.cache.token_ids()

    plain = run(False)[1]  # an independent run that never heard of the system prompt
    conv, ids = run(True)
    assert ids == plain and conv.transcript.turns[0].first == 0  # the prompt set midway changed no token
    conv.new()
    assert conv.prefs.settings.system == "Be brief." and "system (next)" not in conv.prefs.options()
    conv.ask("hello")  # the next conversation reads it
    prompt = model.tokenizer.decode(model.cache.token_ids()[: conv.transcript.turns[0].last])
    assert "Be brief." in prompt and "Be brief." not in model.tokenizer.decode(plain)


def test_rewritten_history_is_saved_and_resumes(model, colichat_home):
    from colichat.engine.text.template import ChatTemplate

    model.reset()
    conv = Conversation(model, Settings(temperature=0, max_tokens=6), session_name="rw")
    conv.prompt.template = ChatTemplate(REWRITING_TEMPLATE, bos_token=model.tokenizer.bos_text)
    conv.ask("hello")
    _, stats = conv.ask("and again")
    assert stats.saved
    records, turns = model.cache.records[: model.cache.length].copy(), list(conv.transcript.turns)
    conv.close()
    model.reset()
    again = Conversation(model, Settings(temperature=0))
    again.resume("rw")
    def rows(ts):
        return [(t.role, t.text, t.first, t.last) for t in ts]

    assert rows(again.transcript.turns) == rows(turns)
    assert model.cache.records[: model.cache.length].tobytes() == records.tobytes()
    again.close()


@pytest.mark.parametrize("name", ["plm", "minicpm3"])
def test_mla_models_rewind_new_and_resume(colichat_home, name):
    """The deepseek2-derived models in a conversation: /rewind then the same question gives the
    same answer and the same cache; /new then the first question answers as a fresh conversation;
    the saved session resumes with the cache to the byte."""
    m = load(str(TINY / f"{name}.gguf"), n_ctx=256)
    conv = Conversation(m, Settings(temperature=0, max_tokens=8), session_name="s")
    first, _ = conv.ask("hello")
    rows1 = m.cache.records[: m.cache.length].tobytes()
    second, _ = conv.ask("and again")
    rows2 = m.cache.records[: m.cache.length].tobytes()
    conv.rewind(1)
    assert m.cache.records[: m.cache.length].tobytes() == rows1 and len(conv.transcript.starts()) == 1
    assert conv.ask("and again")[0] == second
    assert m.cache.records[: m.cache.length].tobytes() == rows2
    conv.new()
    assert m.cache.length == 0 and conv.ask("hello")[0] == first
    assert m.cache.records[: m.cache.length].tobytes() == rows1
    conv.close()
    again = Conversation(m, Settings(temperature=0))
    again.resume("s")  # the session of the first two exchanges, kept by /new
    assert len(again.transcript.starts()) == 2 and m.cache.records[: m.cache.length].tobytes() == rows2
    again.close()
