"""A system prompt that would make every message fail is refused when it is given (--system at start,
/set system), not at the next message: one its model's chat template refuses (Gemma's raises 'System
role not supported'), one that leaves no room in the context; a saved one the template refuses is
dropped when the conversation reopens."""

from __future__ import annotations

import json

import pytest
from cli_helpers import TINY_ARGS, TINY_LLAMA, chat_here, copy_gguf, lines, saved_turns, session_files
from test_commands import Recorder, run

from colichat.conversation.chat import ChatError, Conversation, Settings
from colichat.engine import load
from colichat.persist import Store
from colichat.persist.sidecar import doc_check

# Gemma's way: ChatML, but a system message is refused
NO_SYSTEM = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
             "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
             "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
REFUSED = "this model's chat template takes no system prompt (System role not supported)"
LONG = "You are helpful. " * 30  # 449 tokens of the tiny llama's vocabulary
TOO_LONG = ("system prompt not set: it needs 449 tokens, more than the whole context of 64; shorten it or restart "
            "with a larger --ctx (this model takes up to 2048)")


@pytest.fixture(scope="module")
def no_system_model(tmp_path_factory):
    return copy_gguf(TINY_LLAMA, tmp_path_factory.mktemp("gemma") / "gemma.gguf",
                     set_keys={"tokenizer.chat_template": NO_SYSTEM})


@pytest.fixture(scope="module")
def small_model():
    return load(TINY_LLAMA, n_ctx=64)


@pytest.fixture
def small_app(small_model, tmp_path):
    small_model.reset()
    conv = Conversation(small_model, Settings(temperature=0, max_tokens=4), store=Store(tmp_path / "s"))
    yield Recorder(conv)
    conv.close()


# ---- a chat template that takes no system prompt --------------------------------------------------


def test_system_given_at_start_to_a_template_that_takes_none_is_refused_at_load(no_system_model, colichat_home):
    args = ["--model", no_system_model, *TINY_ARGS[2:]]
    run_ = chat_here(colichat_home, [*args, "--system", "Be brief."], lines("Hello there.")).failed()
    assert run_.out == b""
    assert run_.err.splitlines() == [  # one line, before the model's banner: as a bad model file is refused
        f"colichat: {no_system_model}: its chat template (tokenizer.chat_template) takes no system prompt "
        "(System role not supported); run without --system"]
    assert session_files(colichat_home) == []
    # without a system prompt the model loads and chats
    ok = chat_here(colichat_home, [*args, "--session", "s"], lines("Hello there.")).ok()
    assert ok.out != b"" and len(ok.footers()) == 1 and saved_turns(colichat_home, "s")[0] == ("user", "Hello there.")


def test_set_system_refuses_a_prompt_the_template_takes_none_of(no_system_model):
    model = load(no_system_model, n_ctx=256)
    conv = Conversation(model, Settings(temperature=0, max_tokens=4), save=False)
    app = Recorder(conv)
    with pytest.raises(ChatError) as refused:
        conv.set_option("system", "Be brief.")
    assert str(refused.value) == f"system prompt not set: {REFUSED}"
    assert conv.prefs.settings.system is None
    conv.ask("Hello there.")  # the conversation goes on without one
    assert run(app, "/set system Be brief.") == [f"colichat: system prompt not set: {REFUSED}"]
    assert conv.prefs.options()["system"] is None and "system (next)" not in conv.prefs.options()
    assert run(app, "/set system none") != [] and conv.prefs.settings.system is None  # none is always taken


def test_a_saved_system_prompt_the_template_refuses_is_dropped_on_reopening(no_system_model, colichat_home):
    """A session whose saved settings hold a system prompt the template refuses (written by an older
    colichat, whose /set system took one after a /rewind to nothing): its cache cannot hold it (the
    template is part of the model's fingerprint), so it reopens without it and goes on."""
    args = ["--model", no_system_model, *TINY_ARGS[2:], "--session", "g"]
    chat_here(colichat_home, args, lines("Hello there.")).ok()
    [sidecar] = [p for p in session_files(colichat_home) if p.name == "g.json"]
    doc = json.loads(sidecar.read_text())
    doc["sampler"]["system"] = "Be brief."
    doc["check"] = doc_check(doc)
    sidecar.write_text(json.dumps(doc))
    run_ = chat_here(colichat_home, [*args, "--resume"], lines("/set system", "And again?")).ok()
    assert f"warning: the saved system prompt is not used: {REFUSED}" in run_.err.splitlines()
    assert "system = none" in run_.err.splitlines() and len(run_.footers()) == 1
    assert [t for t, _ in saved_turns(colichat_home, "g")] == ["user", "assistant"] * 2
    assert json.loads(sidecar.read_text())["sampler"]["system"] is None  # saved with the answer


# ---- a system prompt too long for the context -----------------------------------------------------


def test_system_given_at_start_too_long_for_the_context_is_refused_before_anything_is_read(colichat_home):
    run_ = chat_here(colichat_home, [*TINY_ARGS, "--ctx", "64", "--system", LONG],
                lines("/set system none", "Hello there.")).failed()
    assert run_.out == b"" and run_.err.splitlines() == [
        "colichat: the system prompt needs 449 tokens, more than the whole context of 64: give a shorter --system "
        "or a larger --ctx (this model takes up to 2048)"]
    assert session_files(colichat_home) == []


def test_set_system_too_long_for_the_context_is_refused_and_the_current_one_stays(small_app):
    conv = small_app.conv
    assert run(small_app, "/set system Be kind.") == ["system = Be kind."]
    assert run(small_app, f"/set system {LONG}") == [f"colichat: {TOO_LONG}"]
    assert conv.prefs.settings.system == "Be kind."
    conv.ask("Hello there.")
    assert run(small_app, "/set system Be brief.") == ["system prompt set for the next conversation (/new starts one)"]
    # for the next conversation: checked now too, and the one waiting stays
    assert run(small_app, f"/set system {LONG}") == [f"colichat: {TOO_LONG}"]
    assert run(small_app, "/set system") == ["system = Be kind. (next conversation: Be brief.)"]


def test_a_system_prompt_refused_for_room_leaves_no_room_for_any_message(small_model):
    """The rule is the first message's (Conversation.ask): with the shortest system prompt refused,
    every one-letter message is refused as too long; one a few characters shorter is taken and answers."""
    from colichat.conversation.system_prompt import room_problem

    n = next(k for k in range(len(LONG)) if room_problem(small_model.tokenizer, LONG[:k], 64))
    assert room_problem(small_model.tokenizer, LONG[:n], 64) == (
        f"needs {len(small_model.tokenizer.encode(LONG[:n]))} tokens, which leave no room in the context of 64 "
        "for a message and its answer")
    refused = Conversation(small_model, Settings(temperature=0, max_tokens=2, system=LONG[:n]), save=False)
    for letter in "abcdefghijklmnopqrstuvwxyz?!.0":
        small_model.reset()
        with pytest.raises(ChatError, match="more than the whole context of 64"):
            refused.ask(letter)
    small_model.reset()
    assert room_problem(small_model.tokenizer, LONG[:n - 8], 64) is None
    taken = Conversation(small_model, Settings(temperature=0, max_tokens=2, system=LONG[:n - 8]), save=False)
    taken.ask("a")
    assert len(taken.transcript.starts()) == 1


def test_set_system_to_the_one_in_use_midway_leaves_nothing_waiting(small_app):
    """After the first answer, /set system of the prompt in use (none, say) is no change for the next
    conversation: it says the value, and drops one set earlier to wait for the next conversation."""
    small_app.conv.ask("Hello there.")
    assert run(small_app, "/set system none") == ["system = none"]
    assert run(small_app, "/set system") == ["system = none"]
    assert run(small_app, "/set system Be brief.")[0].startswith("system prompt set for the next conversation")
    assert run(small_app, "/set system none") == [
        "system = none (the one that waited for the next conversation is dropped)"]
    assert "system (next)" not in small_app.conv.prefs.options()


def test_a_system_prompt_waiting_for_the_next_conversation_is_used_once_every_exchange_is_rewound(small_app):
    """/set system after the first answer waits for the next conversation; /rewind of every exchange
    makes the next message start one, so the waiting prompt is the one in use now (it went on
    waiting, and the next message was read with the old one)."""
    small_app.conv.ask("Hello there.")
    assert run(small_app, "/set system Be brief.")[0].startswith("system prompt set for the next conversation")
    said = run(small_app, "/rewind")
    assert said[-1] == "system = Be brief. (it waited for the next conversation)"
    assert run(small_app, "/set system") == ["system = Be brief."]
    small_app.conv.ask("Hello there.")
    conv = small_app.conv
    assert conv.prompt.messages(conv.transcript.turns)[0] == {"role": "system", "content": "Be brief."}
