"""A reopened conversation whose records are damaged (a changed byte, a file cut short) but whose
saved text is intact is read again from that text, so going on never loses it: nothing is written
while it is read, the next answer saves the records anew, a stop keeps the exchanges read so far."""

from __future__ import annotations

import json
import os
import signal

import pytest
from cli_helpers import TINY, TINY_ARGS, TINY_LLAMA, copy_gguf
from persist_helpers import snapshot

from colichat.conversation.chat import Conversation, Settings
from colichat.engine import load
from colichat.engine.cancel import Cancel
from colichat.persist import Store
from colichat.persist.kvfile import HEADER_SIZE

QUESTIONS = ["Hello there", "And again", "Once more"]

# ChatML, with every answer but the last shortened to two characters: the history renders otherwise
# than it was cached, so each message re-creates the answer before it (turns.History.rebase)
REWRITING = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'][:2] "
             "if m['role'] == 'assistant' and not loop.last else m['content']) + '<|im_end|>\\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def model():
    return load(TINY_LLAMA, n_ctx=512)


@pytest.fixture(scope="module")
def rewriting_model(tmp_path_factory):
    path = copy_gguf(TINY_LLAMA, tmp_path_factory.mktemp("rewriting") / "rewriting.gguf",
                     set_keys={"tokenizer.chat_template": REWRITING})
    return load(path, n_ctx=512)


def conversation(model, store: Store, name: str | None = None) -> Conversation:
    model.reset()
    return Conversation(model, Settings(temperature=0, max_tokens=6), store=store, session_name=name)


def saved(store: Store, name: str) -> tuple[dict, object]:
    """(the sidecar document, the KV file's path) of session NAME."""
    [sidecar] = store.root.glob(f"*/{name}.json")
    return json.loads(sidecar.read_text("utf-8")), sidecar.with_suffix(".coli_kv")


def files(store: Store) -> dict:
    """Bytes and mtimes of the one model's session files."""
    [directory] = [p for p in store.root.iterdir() if p.is_dir()]
    return snapshot(directory)


def flip_a_byte_of_turn(store: Store, name: str, turn: int, record_bytes: int) -> None:
    doc, kv = saved(store, name)
    t = doc["turns"][turn]
    with open(kv, "r+b") as f:
        f.seek(HEADER_SIZE + t["first"] * record_bytes + 7)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))


def talk(model, store: Store, name: str, questions) -> list[tuple[str, str]]:
    conv = conversation(model, store, name)
    for q in questions:
        conv.ask(q)
    turns = [(t.role, t.text) for t in conv.transcript.turns]
    conv.close()
    return turns


def saved_then_damaged(model, store: Store, questions, turn: int) -> tuple[list[tuple[str, str]], dict]:
    """Session "d" of `questions`, a byte of turn `turn`'s records changed: (its turns, its files then)."""
    said = talk(model, store, "d", questions)
    flip_a_byte_of_turn(store, "d", turn, model.cache.record_bytes)
    return said, files(store)


def test_damaged_records_are_read_again_from_the_saved_text_and_saved_anew_with_the_next_answer(model, tmp_path):
    store = Store(tmp_path / "s")
    said, before = saved_then_damaged(model, store, QUESTIONS[:2], 1)  # the first answer: both exchanges dropped
    conv = conversation(model, store)
    report = conv.resume("d")
    assert "warning: dropped turns 2-4" in report and "checksum mismatch" in report
    assert "note: read 2 exchanges again from their saved text" in report
    assert "the conversation is whole again" in report
    assert [(t.role, t.text) for t in conv.transcript.turns] == said
    assert conv.model.cache.length == conv.transcript.turns[-1].last > 0
    assert files(store) == before  # reading again writes nothing
    conv.ask(QUESTIONS[2])
    conv.close()
    again = conversation(model, store)
    report = again.resume("d")
    assert "warning" not in report and "read" not in report.split("\n", 1)[-1]
    assert [(t.role, t.text) for t in again.transcript.turns][:4] == said and len(again.transcript.turns) == 6
    again.close()


def test_a_stop_while_reading_again_keeps_the_exchanges_read_and_writes_nothing(model, tmp_path):
    store = Store(tmp_path / "s")
    said, before = saved_then_damaged(model, store, QUESTIONS, 0)
    conv, cancel = conversation(model, store), Cancel()

    def stop_in_the_second(done, total):  # Ctrl-C while the second exchange is read: it is not kept
        if len(conv.transcript.turns) >= 2:
            cancel.set()

    report = conv.resume("d", on_progress=stop_in_the_second, cancel=cancel)
    assert "warning: read 1 exchange again from its saved text" in report
    assert "then stopped: 2 more exchanges not read; they stay on disk until the next answer" in report
    assert [(t.role, t.text) for t in conv.transcript.turns] == said[:2]
    assert conv.model.cache.length == conv.transcript.turns[-1].last
    assert files(store) == before
    conv.ask("Go on")
    conv.close()
    doc, _ = saved(store, "d")
    assert [t["text"] for t in doc["turns"] if t["role"] == "user"] == [QUESTIONS[0], "Go on"]


def test_reading_again_where_the_template_rewrites_past_answers(rewriting_model, tmp_path):
    """Each message re-creates the answer before it (the template shortens past answers): read again,
    the conversation is what it was, nothing is written, and the next answer saves it whole."""
    store = Store(tmp_path / "s")
    said = talk(rewriting_model, store, "r", QUESTIONS)
    doc, _ = saved(store, "r")
    assert doc["turns"][1]["first"] == doc["turns"][1]["last"]  # the first answer was re-created in the next message
    flip_a_byte_of_turn(store, "r", 2, rewriting_model.cache.record_bytes)  # the second message
    before = files(store)
    conv = conversation(rewriting_model, store)
    report = conv.resume("r")
    assert "note: read 2 exchanges again from their saved text" in report
    assert [(t.role, t.text) for t in conv.transcript.turns] == said
    assert files(store) == before
    conv.ask("Go on")
    conv.close()
    again = conversation(rewriting_model, store)
    report = again.resume("r")
    assert "warning" not in report and [(t.role, t.text) for t in again.transcript.turns][:6] == said
    again.close()


def test_a_setting_or_a_rewind_before_the_next_answer_keeps_the_text_of_what_was_read_again(model, tmp_path):
    """/set and /rewind write the sidecar at once, before any answer saves the exchanges read again:
    it lists them on (as they were saved, their records still lost), so quitting then loses nothing;
    a rewind drops from the list what it drops from the conversation."""
    store = Store(tmp_path / "s")
    said = talk(model, store, "d", QUESTIONS)
    flip_a_byte_of_turn(store, "d", 3, model.cache.record_bytes)  # the second answer: exchanges 2 and 3
    conv = conversation(model, store)
    assert "note: read 2 exchanges again" in conv.resume("d")
    conv.set_option("temperature", 0.5)
    conv.close()
    doc, _ = saved(store, "d")
    assert [(t["role"], t["text"]) for t in doc["turns"]] == said and doc["sampler"]["temperature"] == 0.5
    conv = conversation(model, store)
    assert "note: read 2 exchanges again" in conv.resume("d") and conv.prefs.settings.temperature == 0.5
    assert [(t.role, t.text) for t in conv.transcript.turns] == said
    conv.rewind(1)
    conv.close()
    conv = conversation(model, store)
    assert "note: read 1 exchange again" in conv.resume("d")
    assert [(t.role, t.text) for t in conv.transcript.turns] == said[:4]
    conv.ask("Go on")
    conv.close()
    doc, _ = saved(store, "d")
    assert [t["text"] for t in doc["turns"] if t["role"] == "user"] == [*QUESTIONS[:2], "Go on"]


def test_a_conversation_whose_kv_file_was_deleted_goes_on_from_its_text(model, tmp_path):
    """The KV file deleted (it is the large one): reopening reads every exchange again from the
    sidecar; /set and /rewind rewrite the sidecar alone, keeping what the conversation still holds;
    the next answer writes a new KV file and the conversation reopens from it, with no warning."""
    store = Store(tmp_path / "s")
    said = talk(model, store, "k", QUESTIONS)
    _, kv = saved(store, "k")
    kv.unlink()
    conv = conversation(model, store)
    report = conv.resume("k")
    assert report == "k: its KV file is not there; reading its 3 exchanges again (51 tokens) ..."  # nothing lost
    assert [(t.role, t.text) for t in conv.transcript.turns] == said
    conv.set_option("temperature", 0.5)
    doc, _ = saved(store, "k")
    assert [(t["role"], t["text"]) for t in doc["turns"]] == said and doc["sampler"]["temperature"] == 0.5
    conv.rewind(1)
    doc, _ = saved(store, "k")
    assert [(t["role"], t["text"]) for t in doc["turns"]] == said[:4] and not kv.exists()
    conv.close()
    conv = conversation(model, store)
    assert "reading its 2 exchanges again" in conv.resume("k") and conv.prefs.settings.temperature == 0.5
    conv.ask("Go on")
    conv.close()
    assert kv.exists()
    conv = conversation(model, store)
    report = conv.resume("k")
    assert "warning" not in report and "note" not in report
    assert [(t.role, t.text) for t in conv.transcript.turns][:4] == said[:4] and len(conv.transcript.turns) == 6
    conv.rewind(3)  # every exchange: the conversation leaves the disk
    conv.close()
    assert store.list() == []


def test_rewinding_every_exchange_of_a_conversation_read_from_its_text_leaves_no_conversation(model, tmp_path):
    store = Store(tmp_path / "s")
    talk(model, store, "k", QUESTIONS[:2])
    _, kv = saved(store, "k")
    kv.unlink()
    conv = conversation(model, store)
    conv.resume("k")
    conv.rewind(2)
    conv.close()
    assert store.list() == [] and [p.name for p in kv.parent.iterdir()] == []  # (its lock went with it)


def test_a_rewind_after_a_stopped_reading_leaves_the_saved_conversation_whole_until_the_next_answer(model, tmp_path):
    """A stop while reading again leaves exchanges unread, on disk only: a /rewind then cuts the
    conversation in memory and, on disk, nothing until the next answer (as the stop's warning says), so
    quitting after it loses none of them; the next answer saves the conversation as it is then."""
    store = Store(tmp_path / "s")
    said, before = saved_then_damaged(model, store, QUESTIONS, 0)
    conv, cancel = conversation(model, store), Cancel()

    def stop_after_the_second(done, total):  # Ctrl-C once two exchanges are read
        if len(conv.transcript.turns) >= 4:
            cancel.set()

    assert "then stopped: 1 more exchange not read" in conv.resume("d", stop_after_the_second, cancel)
    assert [(t.role, t.text) for t in conv.transcript.turns] == said[:4]
    conv.rewind(1)
    assert [(t.role, t.text) for t in conv.transcript.turns] == said[:2]
    conv.close()
    assert files(store) == before  # quitting now: all three exchanges still saved
    conv = conversation(model, store)
    assert "note: read 3 exchanges again" in conv.resume("d")
    assert [(t.role, t.text) for t in conv.transcript.turns] == said
    conv.close()
    conv, cancel = conversation(model, store), Cancel()
    conv.resume("d", stop_after_the_second, cancel)
    conv.rewind(1)
    conv.ask("Go on")  # the answer saves the conversation as it is now
    conv.close()
    doc, _ = saved(store, "d")
    assert [t["text"] for t in doc["turns"] if t["role"] == "user"] == [QUESTIONS[0], "Go on"]


def test_ctrl_c_while_reading_again_at_start_keeps_what_was_read_and_says_so(model, tmp_path, colichat_home,
                                                                               monkeypatch, capsys):
    """`colichat --session NAME` reading damaged exchanges again: Ctrl-C stops the reading as /resume's
    does (the exchanges read are kept, the warning says how many were not), then, in pipe mode, ends
    colichat (130) with nothing written."""
    from colichat.conversation import chat
    from colichat.terminal import cli

    store = Store()
    _, before = saved_then_damaged(model, store, QUESTIONS, 0)
    prefill, reads = chat.prefill, []

    def ctrl_c_after_the_first_exchange(*args, **kwargs):  # a turn read again is one prefill of its text
        prefill(*args, **kwargs)  # (a stop inside one drops it: not kept)
        reads.append(1)
        if len(reads) == 2:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(chat, "prefill", ctrl_c_after_the_first_exchange)
    assert cli.main([*TINY_ARGS, "--ctx", "512", "--session", "d", "-p", "Go on"]) == 130
    err = capsys.readouterr().err
    assert "then stopped: 2 more exchanges not read; they stay on disk until the next answer" in err
    assert files(store) == before


@pytest.mark.parametrize("broken", ["deleted", "emptied", "another model's"])
def test_a_kv_file_gone_or_broken_beside_its_sidecar_costs_no_exchange(broken, colichat_home):
    """The KV file deleted, emptied (`: > FILE`), or replaced by another conversation's: its records are
    lost, not its text. `--session NAME` reads every exchange again and goes on, the answer writes a
    new KV file, and the conversation reopens whole with no warning; --export prints it meanwhile.
    And a --ctx too small for what reading again takes is refused before the model loads, as for
    any conversation (not opened with some of its exchanges left out)."""
    from cli_helpers import chat_here, lines, saved_users, session_files

    chat_here(colichat_home, [*TINY_ARGS, "--session", "t"], lines(*QUESTIONS[:2])).ok()
    if broken == "another model's":
        other = ["--model", str(TINY / "ds-dense.gguf"), "--session", "other"]
        chat_here(colichat_home, [*TINY_ARGS, *other], "Hi\n").ok()
    kv = next(p for p in session_files(colichat_home) if p.name == "t.coli_kv")
    if broken == "deleted":
        kv.unlink()
    elif broken == "emptied":
        kv.write_bytes(b"")
    else:
        kv.write_bytes(next(p for p in session_files(colichat_home) if p.name == "other.coli_kv").read_bytes())
    why = {"deleted": "is not there", "emptied": "is damaged (empty KV file)",
           "another model's": "is damaged (its header disagrees with the sidecar"}[broken]
    exported = chat_here(colichat_home, ["--export", "t"]).ok()
    assert f"warning: the KV file t.coli_kv {why}" in exported.err if broken != "deleted" else exported.err == ""
    assert exported.out.decode().count("## User") == 2
    small = chat_here(colichat_home, [*TINY_ARGS, "--ctx", "16", "--session", "t"], lines("Hi")).failed()
    assert small.errors() == [small.errors()[0]] and "more than the context of 16: start colichat with --ctx" \
        in small.errors()[0] and "loaded" not in small.err
    run = chat_here(colichat_home, [*TINY_ARGS, "--session", "t"], lines(QUESTIONS[2])).ok()
    if broken == "deleted":  # nothing damaged: one plain line
        assert "t: its KV file is not there; reading its 2 exchanges again (" in run.err and "warning" not in run.err
    else:
        assert f"warning: the KV file t.coli_kv {why}" in run.err and "note: read 2 exchanges again" in run.err
    assert saved_users(colichat_home, "t") == QUESTIONS
    again = chat_here(colichat_home, [*TINY_ARGS, "--session", "t"], lines("/history")).ok()
    assert "warning" not in again.err and "read" not in again.err.split("\n", 3)[-1]
