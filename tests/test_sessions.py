"""Finding and managing conversations, in pipe mode: names from the first message, /rename, /save,
/export, what /sessions and the start notice say, --session NAME reopening, --sessions and --export."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from cli_helpers import (
    TINY_ARGS,
    TINY_LLAMA,
    answers_bytes,
    chat,
    chat_here,
    copy_gguf,
    lines,
    saved_answers,
    saved_turns,
    saved_users,
    session_files,
    session_names,
)
from persist_helpers import snapshot

from colichat.conversation.reopen import model_to_reopen
from colichat.persist import SessionError, Store, slug
from colichat.persist.sidecar import doc_check

Q = ["Hello there.", "What is two plus two?", "And three plus three?"]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The answers of one uninterrupted greedy conversation of the three questions."""
    home = tmp_path_factory.mktemp("ref")
    chat_here(home, [*TINY_ARGS, "--session", "a"], lines(*Q)).ok()
    return saved_answers(home, "a")


def names_on_disk(home) -> list[str]:
    return sorted(p.stem for p in session_files(home) if p.suffix == ".coli_kv")


def test_slug():
    assert slug("What is the capital of France?") == "what-is-the-capital-of-france"
    assert slug("  Écris un poème, s'il te plaît  ") == "ecris-un-poeme-s-il-te-plait"
    assert slug("a" * 50) == "a" * 32 and slug("?!") == ""
    assert slug("one two " * 10) == "one-two-one-two-one-two-one-two"


def test_a_new_conversation_is_named_from_its_first_message(colichat_home):
    run = chat_here(colichat_home, [*TINY_ARGS, "--session", "first"],
               lines(Q[0], "/new", Q[1], "/new", Q[1], "/new", "???")).ok()
    names = session_names(run)
    assert names[:3] == ["first", "what-is-two-plus-two", "what-is-two-plus-two-2"]
    assert re.fullmatch(r"\d{8}-\d{6}", names[3])  # nothing to make a name of: the time


def test_rename_and_save_a_copy_without_prefill(ref, colichat_home):
    run = chat_here(colichat_home, [*TINY_ARGS, "--session", "a"],
               lines(Q[0], "/rename greetings", Q[1], "/save copy", "/rename copy", "/stats")).failed()
    err = run.err.splitlines()
    assert "renamed session a to greetings" in err
    assert "saved a copy as session copy (the conversation goes on in greetings)" in err
    assert run.errors() == ["colichat: session copy already exists: choose another name"]
    assert [f.rsplit(" ", 1)[1] for f in run.footers()] == ["a]", "greetings]"]
    assert names_on_disk(colichat_home) == ["copy", "greetings"]
    assert saved_turns(colichat_home, "copy") == saved_turns(colichat_home, "greetings")
    kv = {p.stem: p.read_bytes() for p in session_files(colichat_home) if p.suffix == ".coli_kv"}
    assert kv["copy"] == kv["greetings"]  # the same records: written from the cache
    # The copy goes on exactly like the uninterrupted conversation.
    again = chat_here(colichat_home, [*TINY_ARGS, "--session", "copy"], lines(Q[2])).ok()
    assert again.resumed()[1:] == (4, "copy") and again.out == answers_bytes(ref[2:])


def test_rename_or_save_to_its_own_name_says_it_is_this_conversation(colichat_home):
    run = chat_here(colichat_home, [*TINY_ARGS, "--session", "rn"], lines(Q[0], "/rename rn", "/save rn")).failed()
    assert run.errors() == ["colichat: this conversation is already called rn",
                            "colichat: session rn is this conversation, saved after every answer (/save NAME "
                            "keeps a copy under another name)"]
    assert names_on_disk(colichat_home) == ["rn"] and saved_users(colichat_home, "rn") == [Q[0]]


@pytest.mark.process
@pytest.mark.parametrize("limit", [20, 8000], ids=["header", "records"])
def test_a_save_that_cannot_be_written_says_to_give_it_again(limit, colichat_home):
    """/save NAME on a full disk (a file size limit: no room for the copy's header, or for its
    records): the copy is not retried by the next answer's save, which is the conversation's own."""
    chat(colichat_home, [*TINY_ARGS, "--session", "s"], lines(Q[0])).ok()

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    full = chat(colichat_home, [*TINY_ARGS, "--session", "s"], lines("/save cp"), preexec_fn=small_files).failed()
    [error] = full.errors()
    assert re.fullmatch(r"colichat: could not (create|save) session cp: File too large; nothing was written "
                        r"\(free some space, then /save cp again\)", error), error
    assert names_on_disk(colichat_home) == ["s"]
    chat(colichat_home, [*TINY_ARGS, "--session", "s"], lines(Q[1], "/save cp")).ok()
    assert saved_users(colichat_home, "cp") == Q[:2]


def test_save_keeps_an_unsaved_conversation(ref, colichat_home):
    run = chat_here(colichat_home, TINY_ARGS, lines(Q[0], "/rename x", "/save kept", Q[1])).failed()
    assert run.errors() == ["colichat: this conversation is not saved yet: /save NAME saves it under that name"]
    assert "saved to session kept; the conversation goes on in it" in run.err.splitlines()
    assert run.footers()[-1].endswith("; saved to kept]")
    assert saved_users(colichat_home, "kept") == Q[:2] and saved_answers(colichat_home, "kept") == ref[:2]


def test_sessions_and_the_start_notice_show_the_first_line(colichat_home):
    story = lines('"""', "", "  Tell me a story", "about a cat", '"""')
    chat_here(colichat_home, [*TINY_ARGS, "--session", "s"], story).ok()
    run = chat_here(colichat_home, [*TINY_ARGS, "--session", "t"], lines(Q[0], "/sessions")).ok()
    notice = re.compile(r'latest saved conversation: s: 2 turns, \d+ tokens, \d+\.\d (KiB|MiB), \d+ s ago, '
                        r'"Tell me a story" \(/resume to continue it\)$', re.M)
    assert notice.search(run.err), run.err
    listed = [line for line in run.err.splitlines() if line.startswith(("* ", "  "))]
    assert len(listed) == 2
    assert listed[0].startswith("* t: 2 turns, ") and listed[0].endswith(f', "{Q[0]}"')
    assert listed[1].startswith("  s: 2 turns, ") and listed[1].endswith(', "Tell me a story"')


def test_session_name_of_a_saved_conversation_reopens_it(ref, colichat_home):
    chat_here(colichat_home, [*TINY_ARGS, "--session", "s"], lines(Q[0], Q[1])).ok()
    run = chat_here(colichat_home, [*TINY_ARGS, "--session", "s"], lines(Q[2])).ok()
    assert run.resumed()[1:] == (4, "s") and run.out == answers_bytes(ref[2:])
    assert saved_users(colichat_home, "s") == Q


def test_no_save_opens_a_saved_conversation_and_writes_nothing(ref, colichat_home):
    """--no-save with --session NAME of a saved conversation, --resume, or /resume: it opens and goes on
    unsaved, the footers say so; what would write is refused; a new name is a new unsaved conversation."""
    chat_here(colichat_home, [*TINY_ARGS, "--session", "s"], lines(Q[0], Q[1])).ok()
    [directory] = {p.parent for p in session_files(colichat_home)}
    before = snapshot(directory)
    for args, inputs in ((["--session", "s"], []), (["--resume"], []), ([], ["/resume s"])):
        run = chat_here(colichat_home, [*TINY_ARGS, "--no-save", *args], lines(*inputs, Q[2], "/history")).ok()
        assert run.resumed()[1:] == (4, "s") and run.out == answers_bytes(ref[2:])
        assert f"user> {Q[0]}" in run.err.splitlines() and f"user> {Q[2]}" in run.err.splitlines()
        assert [f.rsplit(";", 1)[1] for f in run.footers()] == [" not saved (--no-save)]"]
        assert snapshot(directory) == before, args
    run = chat_here(colichat_home, [*TINY_ARGS, "--no-save", "--session", "s"],
               lines("/rewind", "/save t", "/rename t", "/delete s")).failed()
    assert run.errors() == ["colichat: saving is off (--no-save): nothing can be saved",
                            "colichat: saving is off (--no-save): nothing is renamed",
                            "colichat: saving is off (--no-save): no session is deleted"]
    new = chat_here(colichat_home, [*TINY_ARGS, "--no-save", "--session", "n"], lines(Q[0], "/history")).ok()
    assert "resumed" not in new.err and f"user> {Q[0]}" in new.err.splitlines()
    assert snapshot(directory) == before and names_on_disk(colichat_home) == ["s"]
    missing = chat_here(colichat_home, [*TINY_ARGS, "--no-save", "--resume", "--session", "n"], lines(Q[0])).failed()
    assert missing.err == "colichat: no session named n for this model (colichat --sessions lists them)\n"


def test_a_conversation_reopens_with_the_model_that_saved_it(ref, colichat_home, tmp_path):
    # A conversation with a model given by --model, reopened a week later by its name alone.
    (tmp_path / "models").mkdir()
    model = shutil.copy(TINY_LLAMA, tmp_path / "models" / "llama.gguf")
    settings = TINY_ARGS[2:]  # no --model
    chat_here(colichat_home, ["--model", model, *settings, "--session", "trip"], lines(Q[0], Q[1])).ok()
    run = chat_here(colichat_home, [*settings, "--session", "trip"], lines(Q[2])).ok()
    assert run.err.splitlines()[0] == f"session trip was saved with llama: loading {model}"
    assert run.resumed()[1:] == (4, "trip") and run.out == answers_bytes(ref[2:])
    # --resume alone: the newest conversation, whichever model saved it
    run = chat_here(colichat_home, [*settings, "--resume"], lines("/history")).ok()
    assert run.err.splitlines()[0] == f"session trip was saved with llama: loading {model}"
    assert run.resumed()[1:] == (6, "trip")
    # The model's file moved: the name is refused, not taken for a new conversation of the default model.
    moved = tmp_path / "moved"
    os.rename(tmp_path / "models", moved)
    for args in (["--session", "trip"], ["--resume", "--session", "trip"]):
        assert chat_here(colichat_home, [*settings, *args], lines(Q[0])).failed().errors() == [
            f"colichat: session trip belongs to another model (llama.gguf, last run from {model}, not there "
            "now); start colichat with --model PATH of that model to reopen it, or choose another name"]
    assert names_on_disk(colichat_home) == ["trip"]
    # Continued once from its new place (the answer's save records it), the session finds it there
    # from then on.
    chat_here(colichat_home, ["--model", moved / "llama.gguf", *settings, "--resume", "--session", "trip"],
         lines(Q[0])).ok()
    run = chat_here(colichat_home, [*settings, "--session", "trip"], lines("/history")).ok()
    assert run.err.splitlines()[0] == f"session trip was saved with llama: loading {moved / 'llama.gguf'}"


@pytest.mark.process
def test_a_model_whose_path_is_not_utf8_loads_and_reopens(colichat_home, tmp_path):
    # A directory name in another encoding (bytes that are not UTF-8): loaded, saved, found again.
    directory = os.path.join(os.fsencode(tmp_path), b"mod\xe9les")
    os.mkdir(directory)
    model = os.fsdecode(shutil.copy(os.fsencode(TINY_LLAMA), os.path.join(directory, b"llama.gguf")))
    chat(colichat_home, ["--model", model, *TINY_ARGS[2:], "--session", "latin"], lines(Q[0])).ok()
    run = chat(colichat_home, [*TINY_ARGS[2:], "--session", "latin"], lines(Q[1])).ok()
    assert run.resumed()[1:] == (2, "latin") and saved_users(colichat_home, "latin") == Q[:2]
    assert run.err.startswith("session latin was saved with llama: loading ")


def test_which_model_reopens_a_conversation(colichat_home, tmp_path):
    # Two models of the same shapes and file name, other weights; `a` stands for the default model.
    for d in "ab":
        (tmp_path / d).mkdir()
    a = shutil.copy(TINY_LLAMA, tmp_path / "a" / "llama.gguf")
    b = copy_gguf(TINY_LLAMA, tmp_path / "b" / "llama.gguf", scale={"blk.0.ffn_up.weight": 1.5})
    for model, name in ((a, "both"), (b, "both"), (b, "only-b")):
        chat_here(colichat_home, ["--model", model, *TINY_ARGS[2:], "--session", name], lines(Q[0])).ok()
    store = Store(colichat_home / "data" / "sessions")
    assert model_to_reopen(store, a, "both", False) is None  # a name the default model has is its own
    assert model_to_reopen(store, a, "only-b", False) == ("only-b", b, "llama")
    assert model_to_reopen(store, a, "only-b", True) == ("only-b", b, "llama")
    assert model_to_reopen(store, a, None, True) == ("only-b", b, "llama")  # the newest of any model
    assert model_to_reopen(store, a, None, False) is None  # a new conversation
    assert model_to_reopen(store, a, "new", False) is None
    assert model_to_reopen(store, None, "both", False) == ("both", b, "llama")  # no default model: the newest
    chat_here(colichat_home, ["--model", a, *TINY_ARGS[2:], "--session", "newer"], lines(Q[1])).ok()
    assert model_to_reopen(store, a, None, True) is None  # the default model's is the newest now
    # b's file now holds other weights: b's conversations are not opened with it
    copy_gguf(TINY_LLAMA, b, scale={"blk.0.ffn_up.weight": 2.0})
    with pytest.raises(SessionError, match=f"^session only-b belongs to another model \\(llama.gguf, last run "
                                           f"from {re.escape(b)}\\); {re.escape(b)} holds another model now: "
                                           "start colichat with --model PATH"):
        model_to_reopen(store, a, "only-b", False)
    # A sidecar naming a FIFO (damage, or a hand edit): not read (it would hang), the name refused
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    [side] = [p for p in session_files(colichat_home) if p.name == "only-b.json"]
    doc = json.loads(side.read_text("utf-8"))
    doc["model"]["path"] = doc["model"]["real_path"] = str(fifo)
    side.write_text(json.dumps(doc), "utf-8")
    with pytest.raises(SessionError, match=f"last run from {re.escape(str(fifo))}, not there now\\); start colichat"):
        model_to_reopen(store, a, "only-b", False)


def test_resume_alone_refuses_the_newest_conversation_when_its_model_is_gone(colichat_home, tmp_path):
    """--resume means the newest conversation: when its model's file is gone, it is refused with the
    way out, never an older conversation (of another model) continued in its place."""
    for d in "ab":
        (tmp_path / d).mkdir()
    a = shutil.copy(TINY_LLAMA, tmp_path / "a" / "llama.gguf")
    b = copy_gguf(TINY_LLAMA, tmp_path / "b" / "llama.gguf", scale={"blk.0.ffn_up.weight": 1.5})
    chat_here(colichat_home, ["--model", a, *TINY_ARGS[2:], "--session", "older"], lines(Q[0])).ok()
    chat_here(colichat_home, ["--model", b, *TINY_ARGS[2:], "--session", "newest"], lines(Q[0])).ok()
    os.remove(b)
    run = chat_here(colichat_home, [*TINY_ARGS[2:], "--resume"], lines(Q[1])).failed()
    assert run.errors() == [
        f"colichat: the newest conversation, newest, belongs to llama.gguf, last run from {b}, not there now: "
        "start colichat with --model PATH of that model to reopen it, or --session NAME for another "
        "conversation (colichat --sessions lists them)"]
    assert saved_users(colichat_home, "older") == Q[:1]  # not continued instead
    store = Store(colichat_home / "data" / "sessions")
    with pytest.raises(SessionError, match="^the newest conversation, newest, belongs to"):
        model_to_reopen(store, a, None, True)
    assert model_to_reopen(store, a, "older", True) is None  # by its name, the older one still reopens


def test_a_name_only_another_model_has_is_a_new_conversation_with_a_note(colichat_home, tmp_path):
    """--model given: the name does not choose the model; the other model's conversation stays as it
    is, and the start says so."""
    for d in "ab":
        (tmp_path / d).mkdir()
    a = shutil.copy(TINY_LLAMA, tmp_path / "a" / "llama.gguf")
    b = copy_gguf(TINY_LLAMA, tmp_path / "b" / "llama.gguf", scale={"blk.0.ffn_up.weight": 1.5})
    chat_here(colichat_home, ["--model", a, *TINY_ARGS[2:], "--session", "trip"], lines(Q[0], Q[1])).ok()
    run = chat_here(colichat_home, ["--model", b, *TINY_ARGS[2:], "--session", "trip"], lines(Q[2])).ok()
    assert run.err.splitlines()[0] == (f"note: session trip of another model (llama.gguf, last run from {a}) stays "
                                       "as it is; this is a new conversation trip with this model")
    assert "resumed" not in run.err and names_on_disk(colichat_home) == ["trip", "trip"]
    run = chat_here(colichat_home, ["--model", a, *TINY_ARGS[2:], "--session", "trip"], lines("/history")).ok()
    assert run.resumed()[1:] == (4, "trip")  # a's, as it was
    run = chat_here(colichat_home, ["--model", b, *TINY_ARGS[2:], "--session", "trip"], lines("/history")).ok()
    assert run.resumed()[1:] == (2, "trip") and "note:" not in run.err  # b's own now


def test_export_from_the_chat_and_from_the_shell(colichat_home):
    run = chat_here(colichat_home, [*TINY_ARGS, "--session", "ex", "--system", "Be brief."],
               lines(Q[0], Q[1], "/export", "/export", "/export other.md")).ok()
    assert "exported 4 turns to ex-2.md" in run.err.splitlines()  # the name it chose was taken: numbered
    answers = saved_answers(colichat_home, "ex")
    text = (colichat_home / "ex.md").read_text("utf-8")
    assert text.startswith("# ex\n\nModel: llama. Exported ")  # the model as the banner names it
    body = text.split("\n", 4)[4]
    assert body == "".join(f"## {h}\n\n{t.strip()}\n\n" for h, t in [
        ("System", "Be brief."), ("User", Q[0]), ("Assistant", answers[0]), ("User", Q[1]),
        ("Assistant", answers[1])])[:-1]
    assert (colichat_home / "other.md").read_text("utf-8") == text
    assert (colichat_home / "ex-2.md").read_text("utf-8").split("\n", 4)[4] == body
    shell = chat_here(colichat_home, ["--export", "ex"]).ok()
    assert shell.out.decode().startswith("# ex\n\nModel: llama. Exported ")
    assert shell.out.decode().split("\n", 4)[4] == body
    assert chat_here(colichat_home, ["--export", "nosuch"]).failed().errors() == [
        "colichat: no session named nosuch (colichat --sessions lists them)"]


@pytest.mark.parametrize("damage", [b"{not json", b'{"turns": [{"role": "user"}]}', b'["turns"]', b"\xff"])
def test_export_of_a_damaged_sidecar_is_one_line(damage, colichat_home):
    chat_here(colichat_home, [*TINY_ARGS, "--session", "dmg"], lines(Q[0])).ok()
    [side] = [p for p in session_files(colichat_home) if p.suffix == ".json"]
    side.write_bytes(damage)
    [line] = chat_here(colichat_home, ["--export", "dmg"]).failed().errors()
    assert line == "colichat: session dmg: damaged (the sidecar is not a colichat sidecar); /delete dmg removes it"


def saved_turns_last(home, name: str) -> int:
    """The record after the last saved turn of session NAME, as its sidecar lists it."""
    [side] = [p for p in session_files(home) if p.name == f"{name}.json"]
    return json.loads(side.read_text("utf-8"))["turns"][-1]["last"]


def _warnings(run) -> list[str]:
    return [line for line in run.err.splitlines() if line.startswith("warning: ")]


def test_export_shows_the_turns_opening_keeps_and_says_what_it_dropped(colichat_home):
    """--export checks a saved conversation as opening does (no model: the checks are over the
    files' bytes): a forged answer is dropped with its message, the same warnings; an answer whose
    records are cut short but whose text is intact is printed, as opening reads it again, with a
    warning more that says so."""
    for name in ("forged", "cut"):
        chat_here(colichat_home, [*TINY_ARGS, "--session", name], lines(Q[0], Q[1])).ok()
    directory = next(p.parent for p in session_files(colichat_home) if p.name == "forged.json")
    doc = json.loads((directory / "forged.json").read_text("utf-8"))
    doc["turns"][3]["text"] = "FORGED"
    (directory / "forged.json").write_text(json.dumps(doc), "utf-8")
    os.truncate(directory / "cut.coli_kv", (directory / "cut.coli_kv").stat().st_size - 100)
    for name, exchanges in (("forged", 1), ("cut", 2)):
        export = chat_here(colichat_home, ["--export", name]).ok()
        assert b"FORGED" not in export.out
        opened = chat_here(colichat_home, [*TINY_ARGS, "--session", name], lines("/history")).ok()
        printed = [w for w in _warnings(export) if "printed all the same: their saved text is intact" in w]
        assert [w for w in _warnings(export) if w not in printed] == _warnings(opened) and _warnings(opened)
        assert len(printed) == exchanges - 1 and ("note: read 1 exchange again" in opened.err) == (exchanges == 2)
        answers = saved_answers(colichat_home, name)
        kept = [x for i in range(exchanges) for x in (("User", Q[i]), ("Assistant", answers[i]))]
        assert export.out.decode().split("\n", 4)[4] == "".join(f"## {h}\n\n{t.strip()}\n\n" for h, t in kept)[:-1]
        assert opened.resumed()[1] == 2
        assert opened.err.count("user> ") == exchanges  # /history: what was read again too


def test_export_refuses_what_opening_refuses(colichat_home):
    """A foreign KV file, no sidecar: one line each, as opening gives (or, with no sidecar to read the
    text from, what does it), never the sidecar's text unchecked. No KV file (deleted to free its
    space): the text, as opening reads it again, with no warning (nothing is lost)."""
    for name in ("nokv", "foreign", "bare"):
        chat_here(colichat_home, [*TINY_ARGS, "--session", name], lines(Q[0])).ok()
    directory = next(p.parent for p in session_files(colichat_home) if p.name == "nokv.json")
    (directory / "nokv.coli_kv").unlink()
    (directory / "foreign.coli_kv").write_bytes(b"GGUF" + bytes(100))
    (directory / "foreign.json").unlink()
    (directory / "bare.json").unlink()
    [line] = chat_here(colichat_home, ["--export", "foreign"]).failed().errors()
    assert chat_here(colichat_home, [*TINY_ARGS, "--session", "foreign"], "").failed().errors() == [line]
    assert line.startswith("colichat: session foreign: damaged (") and line.endswith("/delete foreign removes it")
    export = chat_here(colichat_home, ["--export", "nokv"]).ok()
    assert _warnings(export) == [] and export.err == ""  # nothing is damaged, nothing is left out
    assert export.out.decode().split("\n", 4)[4] == \
        f"## User\n\n{Q[0]}\n\n## Assistant\n\n{saved_answers(colichat_home, 'nokv')[0].strip()}\n"
    opened = chat_here(colichat_home, [*TINY_ARGS, "--session", "nokv"], lines("/history")).ok()
    assert _warnings(opened) == [] and "nokv: its KV file is not there; reading its 1 exchange again (" in opened.err
    assert chat_here(colichat_home, ["--export", "bare"]).failed().errors() == [
        "colichat: session bare has no sidecar, so no text to export: colichat --session bare with its model "
        "loads its cache as one imported turn, which /export writes"]


def test_sessions_from_the_shell(colichat_home):
    assert chat_here(colichat_home, ["--sessions"]).ok().out == b"no saved conversations\n"
    first = chat_here(colichat_home, [*TINY_ARGS, "--session", "one"], lines(Q[0])).ok()
    chat_here(colichat_home, [*TINY_ARGS, "--session", "two"], lines(Q[1])).ok()
    out = chat_here(colichat_home, ["--sessions"]).ok().out.decode().splitlines()
    title = first.err.splitlines()[0].split(" (")[0]  # the model as the banner names it
    assert title == "llama" and re.fullmatch(r"llama \(llama-[0-9a-f]{12}\):", out[0]), out
    assert out[1].startswith("  two: 2 turns, ") and out[2].startswith("  one: 2 turns, ") and len(out) == 4
    assert out[3].startswith("2 conversations, ") and out[3].endswith(" KiB on disk")  # the total


def test_a_conversation_rewound_to_no_exchange_is_not_a_saved_conversation(ref, colichat_home):
    """/rewind of every exchange (at once or one by one) leaves no saved conversation: its files go
    (the name stays taken while it is open), so --sessions, --resume, --export and --session NAME all
    see none, and the next answer saves it again under its name."""
    chat_here(colichat_home, [*TINY_ARGS, "--session", "old"], lines(Q[0])).ok()
    for name, rewinds, last in (("e", ["/rewind 2"], "2 exchanges"), ("f", ["/rewind", "/rewind"], "1 exchange")):
        run = chat_here(colichat_home, [*TINY_ARGS, "--session", name], lines(Q[0], Q[1], *rewinds)).ok()
        assert run.err.splitlines()[-1] == (f"rewound {last}; 0 tokens in context; session {name} is empty, "
                                            "off the disk until its next answer")
        assert [p.name for p in session_files(colichat_home) if p.stem == name] == []  # (its lock went with it)
    listed = chat_here(colichat_home, ["--sessions"]).ok().out.decode().splitlines()
    assert [row.split(":")[0] for row in listed[1:-1]] == ["  old"] and listed[-1].startswith("1 conversation, ")
    assert chat_here(colichat_home, [*TINY_ARGS, "--resume"], "").ok().resumed()[2] == "old"
    assert chat_here(colichat_home, ["--export", "e"]).failed().errors() == [
        "colichat: no session named e (colichat --sessions lists them)"]
    assert chat_here(colichat_home, [*TINY_ARGS, "--resume", "--session", "e"], "").failed().errors() == [
        "colichat: no session named e for this model (colichat --sessions lists them)"]
    again = chat_here(colichat_home, [*TINY_ARGS, "--session", "e"], lines(Q[0])).ok()
    assert "resumed" not in again.err and saved_answers(colichat_home, "e") == ref[:1]


def test_an_empty_session_left_on_disk_is_not_listed_nor_reopened(colichat_home):
    """What an older colichat left after rewinding every exchange (the files, no records, no turns):
    no listing shows it, it is not the latest, /resume NAME refuses it, a new conversation takes the name."""
    chat_here(colichat_home, [*TINY_ARGS, "--session", "old"], lines(Q[0])).ok()
    chat_here(colichat_home, [*TINY_ARGS, "--session", "e"], lines(Q[0])).ok()
    [kv] = [p for p in session_files(colichat_home) if p.name == "e.coli_kv"]
    side = kv.with_suffix(".json")
    with open(kv, "r+b") as f:  # nrec 0, the sidecar's turns [] (with its check: not damage)
        f.seek(32)
        f.write((0).to_bytes(8, "little"))
    doc = json.loads(side.read_text())
    doc["nrec"], doc["turns"] = 0, []
    doc["check"] = doc_check(doc)
    side.write_text(json.dumps(doc))
    os.utime(kv, None)
    assert [i.name for i in Store().list()] == ["old"]
    listed = chat_here(colichat_home, ["--sessions"]).ok().out.decode().splitlines()
    assert [row.split(":")[0] for row in listed[1:-1]] == ["  old"] and listed[-1].startswith("1 conversation, ")
    run = chat_here(colichat_home, [*TINY_ARGS, "--session", "x"], lines("/resume e", "/sessions", "/resume")).failed()
    assert run.errors() == ["colichat: no session named e for this model (/sessions lists them)"]
    assert [row.split(":")[0] for row in run.err.splitlines() if row.startswith("  ")] == ["  old"]
    assert run.resumed()[2] == "old"
    new = chat_here(colichat_home, [*TINY_ARGS, "--session", "e"], lines(Q[1])).ok()
    assert "resumed" not in new.err and saved_users(colichat_home, "e") == [Q[1]]


def test_a_name_two_models_have_reopens_and_exports_the_newest_and_names_the_other(colichat_home, tmp_path):
    """Conversation q2 saved with model A, then another q2 with model B: --session q2 (no --model) and
    --export q2 both take B's, the newest, each with one line naming A's and the command that takes it."""
    for d in "ab":
        (tmp_path / d).mkdir()
    a = shutil.copy(TINY_LLAMA, tmp_path / "a" / "llama.gguf")
    b = copy_gguf(TINY_LLAMA, tmp_path / "b" / "llama.gguf", scale={"blk.0.ffn_up.weight": 1.5})
    chat_here(colichat_home, ["--model", a, *TINY_ARGS[2:], "--session", "q2"], lines(Q[0])).ok()
    chat_here(colichat_home, ["--model", b, *TINY_ARGS[2:], "--session", "q2"], lines(Q[1])).ok()
    other = f"another model has a conversation q2 too (llama.gguf, last run from {a})"
    run = chat_here(colichat_home, [*TINY_ARGS[2:], "--session", "q2"], lines("/history")).ok()
    assert run.err.splitlines()[:2] == [f"session q2 was saved with llama: loading {b}",
                                        f"note: {other}: colichat --model {a} --session q2 opens it"]
    assert f"user> {Q[1]}" in run.err.splitlines() and f"user> {Q[0]}" not in run.err
    shell = chat_here(colichat_home, ["--export", "q2"]).ok()
    assert Q[1] in shell.out.decode() and Q[0] not in shell.out.decode()
    assert shell.err == f"note: {other}: colichat --export q2 --model {a} prints it\n"
    theirs = chat_here(colichat_home, ["--export", "q2", "--model", a]).ok()  # as the note says
    assert Q[0] in theirs.out.decode() and Q[1] not in theirs.out.decode()
    assert theirs.err == (f"note: another model has a conversation q2 too (llama.gguf, last run from {b}): "
                          f"colichat --export q2 --model {b} prints it\n")


def test_a_conversation_reopens_with_the_context_it_was_saved_with(colichat_home):
    """Without --ctx, --session NAME and --resume reopen a conversation with the context size it was
    last saved with; one it cannot have is refused saying where it came from and what chooses another."""
    chat_here(colichat_home, [*TINY_ARGS, "--ctx", "160", "--session", "c"], lines(Q[0])).ok()
    for args in (["--session", "c"], ["--resume"]):
        run = chat_here(colichat_home, [*TINY_ARGS, *args], lines(Q[1])).ok()
        assert run.resumed()[2] == "c" and "KV 2.0 KiB/token x 160 = " in run.err
        assert [n for _, n in run.contexts()] == [160]
    [side] = [p for p in session_files(colichat_home) if p.name == "c.json"]
    doc = json.loads(side.read_text())
    doc["model"]["n_ctx"] = 4096  # more than the tiny llama's 2048 (a hand edit, checked)
    doc["check"] = doc_check({k: v for k, v in doc.items() if k not in ("turns", "check")})
    side.write_text(json.dumps(doc))
    assert chat_here(colichat_home, [*TINY_ARGS, "--session", "c"], lines(Q[1])).failed().errors() == [
        "colichat: context size 4,096 is above the 2,048 tokens this model was trained for; use at most 2,048 "
        "(the context size session c was saved with: --ctx N reopens it with another)"]
    reopened = chat_here(colichat_home, [*TINY_ARGS, "--ctx", "256", "--session", "c"], lines(Q[1])).ok()
    assert reopened.resumed()[2] == "c"
    long = " ".join(["Answer in the voice of a patient teacher."] * 40)  # some 300 tokens: more than 256
    refused = chat_here(colichat_home, [*TINY_ARGS, "--session", "c", "--system", long], lines(Q[1])).failed()
    assert refused.errors()[0].startswith("colichat: the system prompt needs ")
    assert refused.errors()[0].endswith("(the context size session c was saved with: --ctx N reopens it with another)")


def test_a_new_conversation_after_a_reopened_one_runs_and_reopens_with_the_loaded_context(colichat_home):
    """**Decided:** the context size is the loaded model's (its cache and rope tables are made for it):
    /new after reopening a conversation saved with --ctx 160 goes on at 160, says so in its footer,
    records it, and reopens with it (a later start without --ctx does not change it behind the user's back)."""
    chat_here(colichat_home, [*TINY_ARGS, "--ctx", "160", "--session", "c"], lines(Q[0])).ok()
    run = chat_here(colichat_home, [*TINY_ARGS, "--session", "c"], lines("/new", Q[1], "/rename d")).ok()
    assert run.contexts()[-1][1] == 160
    [side] = [p for p in session_files(colichat_home) if p.name == "d.json"]
    assert json.loads(side.read_text())["model"]["n_ctx"] == 160
    again = chat_here(colichat_home, [*TINY_ARGS, "--session", "d"], lines(Q[2])).ok()
    assert again.resumed()[2] == "d" and again.contexts()[-1][1] == 160


def test_only_a_context_error_is_said_to_come_from_the_saved_context_size(monkeypatch):
    """The note on where the context size came from follows a ContextError only, by its type: a model
    error whose text speaks of a context size for another reason (a chat template's) is shown as it is."""
    from colichat.conversation.settings import Settings
    from colichat.engine import ContextError, ModelError
    from colichat.terminal import start
    from colichat.terminal import streams as terminal

    plan = start.Plan(settings=Settings(), given=frozenset(), prompt=None, kv="f32", reuse=True, no_save=False,
                      auto_forget=False, expert_cache=None, verbose=False, numerics="fast", model="m.gguf",
                      session="c", resume=True, ctx=160, ctx_of="c", read_only=False, save_new=True,
                      interactive=False, kernels="numba")
    status = terminal.StatusLine()
    for error, suffixed in ((ContextError("context size 160 is too small"), True),
                            (ModelError("m.gguf: chat template: 'context size' is undefined"), False)):
        def failing_load(*a, error=error, **k):
            raise error

        monkeypatch.setattr(start, "load", failing_load)
        with pytest.raises(ModelError) as caught:
            start.load_model(plan, print, status)
        assert type(caught.value) is type(error)
        assert str(caught.value).endswith("(the context size session c was saved with: --ctx N reopens it "
                                          "with another)") is suffixed, caught.value


def test_a_context_too_small_for_the_saved_conversation_is_refused_before_the_model_loads(colichat_home):
    """--ctx smaller than a saved conversation is refused from its files, before the model loads, and
    the --ctx it names reopens the conversation with room for an exchange (its exact size would
    reopen it full, no message fitting)."""
    chat_here(colichat_home, [*TINY_ARGS, "--session", "c"], lines(Q[0])).ok()
    [side] = [p for p in session_files(colichat_home) if p.name == "c.json"]
    n = json.loads(side.read_text())["turns"][-1]["last"]
    assert n > 16
    for args in (["--session", "c"], ["--resume"], ["--resume", "--session", "c"], ["--no-save", "--resume"]):
        run = chat_here(colichat_home, [*TINY_ARGS, *args, "--ctx", "16"], lines(Q[1])).failed()
        assert run.err == (f"colichat: session c holds {n} tokens, more than the context of 16: start colichat "
                           f"with --ctx {n + 16} or more to reopen it with room for an exchange\n"), args
    run = chat_here(colichat_home, [*TINY_ARGS, "--session", "c", "--ctx", str(n + 16)], lines("Hi")).ok()
    assert run.resumed()[1:] == (2, "c") and "note: the context is" not in run.err
    assert [f.rsplit("; ", 1)[1] for f in run.footers()] == ["saved to c]"]


@dataclass
class LinkedModels:
    """m/llama.gguf (the tiny llama), m/other.gguf (another model of its shape), and m/cur.gguf: a link
    to llama.gguf, which `point_to` moves to another file."""

    llama: str
    link: Path

    def point_to(self, target: str) -> None:
        self.link.unlink()
        self.link.symlink_to(target)


@pytest.fixture
def linked(tmp_path) -> LinkedModels:
    (tmp_path / "m").mkdir()
    llama = shutil.copy(TINY_LLAMA, tmp_path / "m" / "llama.gguf")
    copy_gguf(TINY_LLAMA, tmp_path / "m" / "other.gguf", scale={"blk.0.ffn_up.weight": 1.5})
    link = tmp_path / "m" / "cur.gguf"
    link.symlink_to("llama.gguf")
    return LinkedModels(llama, link)


def test_a_session_of_a_model_given_through_a_link_follows_the_file_not_the_link(colichat_home, linked):
    """A conversation made with --model cur.gguf, a link to llama.gguf: once the link points to another
    model, --session NAME reopens it from llama.gguf (the file the link led to), and --model cur.gguf
    --session NAME is refused with the --model that reopens it, never a second NAME beside it."""
    llama, link = linked.llama, linked.link
    settings = TINY_ARGS[2:]
    chat_here(colichat_home, ["--model", link, *settings, "--session", "sym"], lines(Q[0])).ok()
    linked.point_to("other.gguf")
    run = chat_here(colichat_home, ["--model", link, *settings, "--session", "sym"], lines(Q[1])).failed()
    assert run.err == (f"colichat: session sym was saved with {llama}, which {link} led to then ({link} holds "
                       f"another model now): colichat --model {llama} --session sym reopens it, or choose another "
                       "name\n")
    assert names_on_disk(colichat_home) == ["sym"]
    run = chat_here(colichat_home, [*settings, "--session", "sym"], lines(Q[1])).ok()
    assert run.err.splitlines()[0] == f"session sym was saved with cur: loading {llama}"
    assert run.resumed()[1:] == (2, "sym") and saved_users(colichat_home, "sym") == Q[:2]
    assert names_on_disk(colichat_home) == ["sym"]


def _saved_tokens(home, name: str) -> int:
    [side] = [p for p in session_files(home) if p.name == f"{name}.json"]
    return json.loads(side.read_text())["turns"][-1]["last"]


def test_the_context_a_refusal_suggests_is_one_the_model_takes(colichat_home, tmp_path):
    """A conversation too long for --ctx, on a model whose trained context (its metadata, read before
    the load) is below the saved tokens plus the room for an exchange: the refusal names the model's
    maximum, which reopens it (never a --ctx the load would refuse), before the model loads; /resume
    in a running colichat says the same."""
    model = copy_gguf(TINY_LLAMA, tmp_path / "short.gguf", set_keys={"llama.context_length": 28})
    args = ["--model", model, *TINY_ARGS[2:]]
    chat_here(colichat_home, [*args, "--session", "c"], lines(Q[0])).ok()
    n = _saved_tokens(colichat_home, "c")
    assert n <= 28 < n + 16
    refusal = (f"session c holds {n} tokens, more than the context of 16: start colichat with --ctx 28, this "
               f"model's maximum, to reopen it with room for {28 - n} tokens more")
    for how in (["--session", "c"], ["--resume"]):
        run = chat_here(colichat_home, [*args, *how, "--ctx", "16"], lines(Q[1])).failed()
        assert run.err == f"colichat: {refusal}\n", how
    run = chat_here(colichat_home, [*args, "--ctx", "16"], lines("/resume c")).failed()
    assert run.errors() == [f"colichat: {refusal}"]
    run = chat_here(colichat_home, [*args, "--session", "c", "--ctx", "28"], lines("/history")).ok()
    assert run.resumed()[1:] == (2, "c")


def test_a_conversation_longer_than_the_model_can_hold_is_refused_with_what_reads_it():
    from colichat.persist.loading import more_context

    assert more_context("c", 120, 64, 100) == (
        "session c holds 120 tokens, more than this model's maximum context of 100: it cannot be reopened with "
        "this model; colichat --export c prints it, and a new conversation goes on without it")
    assert more_context("c", 100, 64, 100) == (
        "session c holds 100 tokens, more than the context of 64: start colichat with --ctx 100, this model's "
        "maximum, to reopen it full (/rewind makes room)")
    assert more_context("c", 84, 64, 100) == more_context("c", 84, 64) == (
        "session c holds 84 tokens, more than the context of 64: start colichat with --ctx 100 or more to reopen "
        "it with room for an exchange")


def test_an_older_conversation_too_long_for_the_default_context_is_refused_before_the_model_loads(
        colichat_home, tmp_path):
    """A conversation saved by an older colichat (no context size in its sidecar) holding more tokens
    than the model's default context (8192 here, of a model trained for 16384): opened without --ctx
    it is refused before the model loads, with the --ctx that reopens it."""
    model = copy_gguf(TINY_LLAMA, tmp_path / "long.gguf", set_keys={"llama.context_length": 16384})
    args = ["--model", model, *TINY_ARGS[2:], "--max-tokens", "1"]
    chat_here(colichat_home, [*args, "--ctx", "9000", "--session", "c"], lines("ab " * 4200)).ok()
    n = _saved_tokens(colichat_home, "c")
    assert n > 8192
    [side] = [p for p in session_files(colichat_home) if p.name == "c.json"]
    doc = json.loads(side.read_text())
    del doc["model"]["n_ctx"]  # as an older colichat wrote it
    doc["check"] = doc_check({k: v for k, v in doc.items() if k not in ("turns", "check")})
    side.write_text(json.dumps(doc))
    for how in (["--session", "c"], ["--resume"]):
        run = chat_here(colichat_home, [*args, *how], lines("Hi")).failed()
        assert run.err == (f"colichat: session c holds {n} tokens, more than the context of 8192: start colichat "
                           f"with --ctx {n + 16} or more to reopen it with room for an exchange\n"), how
    run = chat_here(colichat_home, [*args, "--session", "c", "--ctx", str(n + 16)], lines("/history")).ok()
    assert run.resumed()[:2] == (n, 2)


def test_resume_through_a_link_pointed_elsewhere_names_the_conversations_of_the_file_it_led_to(
        colichat_home, linked):
    """--model LINK --resume, LINK made to point to another model after conversations were saved
    through it: the refusal (no conversation of this model) comes after one note naming the file LINK
    led to and the command that reopens them, which does."""
    llama, link = linked.llama, linked.link
    settings = TINY_ARGS[2:]
    chat_here(colichat_home, ["--model", link, *settings, "--session", "one"], lines(Q[0])).ok()
    linked.point_to("other.gguf")
    run = chat_here(colichat_home, ["--model", link, *settings, "--resume"], lines(Q[1])).failed()
    assert run.err == (f"note: conversation one was saved with {link} when it led to {llama}: colichat --model "
                       f"{llama} --resume reopens it\ncolichat: no saved conversation for this model yet\n")
    linked.point_to("llama.gguf")
    chat_here(colichat_home, ["--model", link, *settings, "--session", "two"], lines(Q[0])).ok()
    linked.point_to("other.gguf")
    run = chat_here(colichat_home, ["--model", link, *settings, "--resume"], lines(Q[1])).failed()
    assert run.err.splitlines() == [
        f"note: 2 conversations were saved with {link} when it led to {llama} (the newest: two): colichat --model "
        f"{llama} --resume reopens the newest, with --session NAME another",
        "colichat: no saved conversation for this model yet"]
    run = chat_here(colichat_home, ["--model", llama, *settings, "--resume"], lines(Q[1])).ok()
    assert run.resumed()[1:] == (2, "two")


def test_a_model_without_a_name_keeps_its_conversations_under_another_file_name(colichat_home, tmp_path):
    """A GGUF without general.name is named after its file: moved to another name (same weights), its
    conversation reopens with --model NEWPATH --session NAME and --resume (it was 'session s belongs
    to another model (llama, ... not there now)' and 'no saved conversation for this model yet': the
    sessions were looked for in a directory named after the new file)."""
    (tmp_path / "m").mkdir()
    old = shutil.copy(TINY_LLAMA, tmp_path / "m" / "old.gguf")
    settings = TINY_ARGS[2:]
    chat_here(colichat_home, ["--model", old, *settings, "--session", "s"], lines(Q[0])).ok()
    new = tmp_path / "m" / "new.gguf"
    os.rename(old, new)
    run = chat_here(colichat_home, ["--model", new, *settings, "--session", "s"], lines(Q[1])).ok()
    assert run.resumed()[1:] == (2, "s")
    run = chat_here(colichat_home, ["--model", new, *settings, "--resume"], lines("/sessions", Q[2])).ok()
    assert run.resumed()[1:] == (4, "s") and "* s: 4 turns" in run.err
    assert saved_users(colichat_home, "s") == Q


def test_a_model_without_a_name_is_named_after_the_path_given_also_from_the_cache(colichat_home, linked):
    """A GGUF without general.name is named after the path it is given by (load_config): so too when
    its weights come from the cache a start through another path made (it kept that path's name:
    'llama.gguf (llama, ...' through cur.gguf), and a general.name is kept whatever the path."""
    settings = TINY_ARGS[2:]
    first = chat_here(colichat_home, ["--model", linked.llama, *settings, "--session", "a"], lines(Q[0])).ok()
    assert first.err.startswith("llama (llama, 4 layers), loaded in ")
    run = chat_here(colichat_home, ["--model", linked.link, *settings, "--session", "b"], lines(Q[0])).ok()
    assert "kept the dequantized weights" not in run.err  # (mapped from the cache)
    assert run.err.startswith("cur (llama, 4 layers), loaded in ")
    assert names_on_disk(colichat_home) == ["a", "b"]
    assert len({p.parent for p in session_files(colichat_home)}) == 1  # one model: its conversations in one place
    named = copy_gguf(TINY_LLAMA, linked.link.parent / "named.gguf", set_keys={"general.name": "Tiny Named"})
    (linked.link.parent / "nl.gguf").symlink_to("named.gguf")
    for path in (named, linked.link.parent / "nl.gguf"):
        run = chat_here(colichat_home, ["--model", path, *settings, "--session", "n"], lines(Q[0])).ok()
        assert run.err.startswith("Tiny Named (llama, 4 layers), loaded in ")


def test_a_link_is_recorded_as_given_when_the_weights_come_from_the_cache(colichat_home, linked):
    """The second start through a link maps the dequantized weights kept by the first: the session
    still records the link's path (it recorded the file the link led to, so once the link pointed to
    another model --model LINK --session NAME started a second conversation NAME beside it)."""
    llama, link = linked.llama, linked.link
    settings = TINY_ARGS[2:]
    chat_here(colichat_home, ["--model", link, *settings, "--session", "first"], lines(Q[0])).ok()
    run = chat_here(colichat_home, ["--model", link, *settings, "--session", "sym"], lines(Q[0])).ok()
    assert "kept the dequantized weights" not in run.err  # (mapped from the cache)
    [side] = [p for p in session_files(colichat_home) if p.name == "sym.json"]
    model = json.loads(side.read_text("utf-8"))["model"]
    assert (model["path"], model["real_path"]) == (str(link), str(llama))
    linked.point_to("other.gguf")
    run = chat_here(colichat_home, ["--model", link, *settings, "--session", "sym"], lines(Q[1])).failed()
    assert run.err == (f"colichat: session sym was saved with {llama}, which {link} led to then ({link} holds "
                       f"another model now): colichat --model {llama} --session sym reopens it, or choose another "
                       "name\n")
    assert names_on_disk(colichat_home) == ["first", "sym"]


def test_no_save_adds_nothing_typed_to_the_input_history(colichat_home):
    """--no-save writes no typed line: Up still recalls the lines of earlier runs, none is added, and
    a history file that is not there is not created."""
    from colichat.terminal.repl import input_history

    state = colichat_home / "state"
    history = input_history(no_save=True)
    history.append_string("my secret message")
    assert not (state / "history").exists()
    input_history().append_string("an earlier line")  # a run with saving on
    before = (state / "history").read_bytes()
    history = input_history(no_save=True)
    assert list(history.load_history_strings()) == ["an earlier line"]
    history.append_string("my secret message")
    assert (state / "history").read_bytes() == before
