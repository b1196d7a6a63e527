"""A conversation's saves that fail (a full disk, an I/O error) and /reset, in process: what the disk
keeps, what the user is told, and that nothing a user removed comes back nor anything unsaved is
dropped silently (/forget, /new, /resume after failed saves; a /rewind whose cut fails)."""

from __future__ import annotations

import contextlib
import errno
import json
import os

import pytest
from cli_helpers import TINY_LLAMA
from persist_helpers import Ticks

from colichat.conversation.chat import Conversation, Settings
from colichat.engine import load
from colichat.errors import ChatError
from colichat.persist import SessionError, Store
from colichat.persist.kvfile import HEADER_SIZE

Q = ["Hello there", "And again", "Once more"]


@pytest.fixture(scope="module")
def model():
    return load(TINY_LLAMA, n_ctx=512)


def conversation(model, store: Store, name: str | None = "s") -> Conversation:
    model.reset()
    return Conversation(model, Settings(temperature=0, max_tokens=6), store=store, session_name=name)


def talked(model, store: Store, n: int, name: str | None = "s") -> Conversation:
    """A conversation of session NAME that has asked the first n questions (Q), each answered and saved."""
    conv = conversation(model, store, name)
    for q in Q[:n]:
        conv.ask(q)
    return conv


@contextlib.contextmanager
def failing(monkeypatch, *calls: str, err: int = errno.ENOSPC):
    """Every os call named in `calls` fails with `err` (a full disk: ENOSPC on every write)."""
    with monkeypatch.context() as mp:
        for name in calls:
            mp.setattr(os, name, lambda *a, **k: (_ for _ in ()).throw(OSError(err, os.strerror(err))))
        yield


def saved_texts(store: Store, name: str = "s") -> list[str]:
    """The turns' texts the sidecar of NAME lists ([] when there is none)."""
    found = list(store.root.glob(f"*/{name}.json"))
    return [t["text"] for t in json.loads(found[0].read_text("utf-8"))["turns"]] if found else []


def kv_file(store: Store, name: str = "s"):
    [path] = store.root.glob(f"*/{name}.coli_kv")
    return path


def test_forget_after_failed_saves_is_refused_until_the_conversation_is_saved(model, tmp_path, monkeypatch):
    """A full disk at the first two answers: /forget (and /new) would leave a conversation never saved;
    they refuse, saying so, and once there is room they save it first."""
    store = Store(tmp_path / "s")
    conv = conversation(model, store)
    with failing(monkeypatch, "pwrite", "write"):
        for q in Q[:2]:
            _, stats = conv.ask(q)
            assert stats.saved is False
        for leave in (lambda: conv.forget(1), conv.new):
            with pytest.raises(ChatError, match="not saved .*No space left on device.* would lose it"):
                leave()
        assert len(conv.transcript.starts()) == 2  # nothing was dropped
    said = conv.forget(1)
    assert "of s (still saved as it was)" in said
    assert saved_texts(store, "s")[0::2] == Q[:2]  # saved before it was left, both exchanges
    conv.close()


def test_a_failed_rewind_is_made_by_the_next_save_and_the_next_answer_is_saved(model, tmp_path, monkeypatch):
    store = Store(tmp_path / "s")
    conv = talked(model, store, 2)
    with failing(monkeypatch, "fsync", err=errno.EIO):
        dropped = conv.rewind(1)
    assert [t.text for t in dropped][0] == Q[1] and "Input/output error" in conv.transcript.cut_failed
    assert saved_texts(store)[0::2] == Q[:2]  # the disk as before: the rewind waits for the next save
    _, stats = conv.ask(Q[2])
    assert stats.saved is True
    assert saved_texts(store)[0::2] == [Q[0], Q[2]]
    conv.close()
    model.reset()
    again = conversation(model, store, None)
    again.resume("s")
    assert [t.text for t in again.transcript.turns][0::2] == [Q[0], Q[2]]
    again.close()


def test_quitting_after_a_failed_rewind_tries_the_cut_again(model, tmp_path, monkeypatch):
    store = Store(tmp_path / "s")
    conv = talked(model, store, 2)
    with failing(monkeypatch, "replace", err=errno.EIO):
        conv.rewind(1)
    assert conv.transcript.cut_failed and saved_texts(store)[0::2] == Q[:2]
    conv.close()
    assert saved_texts(store)[0::2] == Q[:1]  # the text rewound is not on disk any more


def test_reset_empties_the_conversation_in_place_and_the_next_message_starts_it_anew(model, tmp_path):
    """/reset: same name, the KV file cut to its header, the sidecar listing no turn, the settings kept;
    after a message the KV file is byte for byte a new conversation of that name with that message."""
    store = Store(tmp_path / "a")
    conv = conversation(model, store)
    conv.set_option("temperature", 0.0)
    for q in Q[:2]:
        conv.ask(q)
    said = conv.reset()
    assert "removed 2 exchanges" in said and "session s is empty" in said
    assert os.path.getsize(kv_file(store)) == HEADER_SIZE
    [sidecar] = store.root.glob("*/s.json")
    doc = json.loads(sidecar.read_text("utf-8"))
    assert doc["turns"] == [] and doc["sampler"]["temperature"] == 0.0
    assert conv.transcript.turns == [] and model.cache.length == 0 and conv.name == "s"
    conv.ask(Q[2])
    after_reset = kv_file(store).read_bytes()
    conv.close()

    fresh = Store(tmp_path / "b")
    conv = conversation(model, fresh)
    conv.ask(Q[2])
    conv.close()
    assert kv_file(fresh).read_bytes() == after_reset


def test_reset_of_an_empty_conversation_is_refused(model, tmp_path):
    conv = conversation(model, Store(tmp_path / "s"))
    with pytest.raises(ChatError, match="nothing to reset"):
        conv.reset()


def test_a_sidecar_with_a_huge_integer_is_listed_as_damaged(model, tmp_path):
    """json.loads refuses integers of more than 4,300 digits (ValueError): such a sidecar is damaged,
    and the model's other conversations are listed and opened as ever."""
    store = Store(tmp_path / "s")
    for name in ("good", "huge"):
        conv = conversation(model, store, name)
        conv.ask(Q[0])
        conv.close()
    [sidecar] = store.root.glob("*/huge.json")
    sidecar.write_text(sidecar.read_text("utf-8").replace('"nrec": ', '"nrec": ' + "9" * 5000 + ", \"x\": "))
    infos = {i.name: i for i in store.list()}
    assert infos["huge"].damage and not infos["good"].damage
    conv = conversation(model, store, None)
    assert "resumed" in conv.resume("good")
    conv.close()


def test_a_kv_file_cut_short_in_place_by_another_program_is_written_again(model, tmp_path):
    """`truncate -s 100 s.coli_kv` between two answers: the next save notices (the file is shorter than
    its records) and writes the session again from memory, instead of saying `saved` over zeros."""
    store = Store(tmp_path / "s")
    conv = talked(model, store, 2)
    os.truncate(kv_file(store), 100)
    _, stats = conv.ask(Q[2])
    assert stats.saved is True and "was cut short by another program" in stats.save_note
    rows = model.cache.raw(0, model.cache.length).tobytes()
    conv.close()
    model.reset()
    again = conversation(model, store, None)
    said = again.resume("s")
    assert "warning" not in said and len(again.transcript.starts()) == 3
    assert model.cache.raw(0, model.cache.length).tobytes() == rows
    again.close()


def test_an_answer_that_fills_the_context_uses_every_slot_and_the_note_counts_them(tmp_path):
    """The note before an answer says how many tokens it can have, exactly; an answer cut by the context
    ends with none left (the footer said `1 left` with `context full`: the last slot was never used)."""
    small = load(TINY_LLAMA, n_ctx=64)
    conv = Conversation(small, Settings(temperature=0, max_tokens=200), store=Store(tmp_path / "s"))
    notes = []
    _, stats = conv.ask("hello", on_note=notes.append)
    [note] = notes
    room = int(note.split()[1])
    assert stats.stopped == "context" and small.cache.length == 64 and stats.generated == room
    conv.close()


def test_a_damaged_token_count_in_a_sidecar_is_not_listed(model, tmp_path):
    """--sessions and /sessions show the tokens of the turns whose checks hold, at most what the KV file
    has: a sidecar whose last turn says `last: 10**12` no longer lists a conversation of 10^12 tokens."""
    store = Store(tmp_path / "s")
    conv = conversation(model, store)
    conv.ask(Q[0])
    tokens = model.cache.length
    conv.close()
    [sidecar] = store.root.glob("*/s.json")
    doc = json.loads(sidecar.read_text("utf-8"))
    doc["turns"][-1]["last"] = 10**12
    sidecar.write_text(json.dumps(doc))
    [info] = store.list()
    assert info.tokens <= tokens and "1,000,000,000,000" not in info.describe()
    os.unlink(kv_file(store))  # the sidecar alone: the count is its checked turns'
    [info] = store.list()
    assert info.tokens < tokens


def test_delete_refuses_a_directory_in_place_of_a_kv_file_and_deletes_nothing(model, tmp_path):
    store = Store(tmp_path / "s")
    conv = conversation(model, store, "x")
    conv.ask(Q[0])
    conv.close()
    kv = kv_file(store, "x")
    os.unlink(kv)
    os.mkdir(kv)
    [sidecar] = store.root.glob("*/x.json")
    conv = conversation(model, store, None)
    with pytest.raises(SessionError, match="x.coli_kv is a directory.* nothing was deleted"):
        conv.shelf.delete("x", conv.name)
    assert sidecar.exists() and kv.is_dir()
    conv.close()


def test_an_io_error_at_start_is_said_as_one(model, tmp_path, monkeypatch):
    """EIO on the sessions directory's stat said it 'is not a directory', and EIO while listing a
    model's conversations made a saved name look new (then 'already exists'): each now says what failed."""
    from pathlib import Path

    from colichat.terminal.start import sessions_dir_problem

    store = Store(tmp_path / "s")
    conv = conversation(model, store, "x")
    conv.ask(Q[0])
    conv.close()
    real_stat = os.stat
    with monkeypatch.context() as mp:
        mp.setattr(os, "stat", lambda p, *a, **k: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error"))
                   if str(p) == str(store.root) else real_stat(p, *a, **k))
        assert sessions_dir_problem(store.root) == f"cannot examine {store.root}: Input/output error"
    with monkeypatch.context() as mp:
        mp.setattr(Path, "iterdir", lambda self: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error")))
        with pytest.raises(SessionError, match="cannot list the conversations in .*: Input/output error"):
            store.list(conv.shelf.ident)


def test_forget_names_its_new_conversation_after_the_one_it_came_from(model, tmp_path):
    store = Store(tmp_path / "s")
    conv = talked(model, store, 2, "trip")
    assert "saved as trip-cont" in conv.forget(1)
    conv.forget(1)  # its only exchange: a new empty conversation, whose first message names it
    conv.ask(Q[2])
    assert conv.name == "once-more"
    conv.close()


def test_auto_forget_goes_on_without_the_oldest_exchanges_instead_of_refusing(tmp_path):
    from app_helpers import Recorder, run

    small = load(TINY_LLAMA, n_ctx=128)
    said = {}
    for auto in (False, True):
        small.reset()
        conv = Conversation(small, Settings(temperature=0, max_tokens=8), store=Store(tmp_path / str(auto)),
                            session_name="long")
        app = Recorder(conv)
        app.auto_forget = auto
        said[auto] = [line for k in range(8) for line in run(app, f"Message number {k}, a few words long.")]
        conv.close()
    assert any("it was not sent" in line for line in said[False])
    assert not any("it was not sent" in line for line in said[True])
    assert any(line.startswith("new conversation without the") and "saved as long-cont" in line for line in said[True])


def test_an_answer_cut_by_the_context_says_what_lets_it_go_on(tmp_path):
    from app_helpers import Recorder, run

    small = load(TINY_LLAMA, n_ctx=64)
    conv = Conversation(small, Settings(temperature=0, max_tokens=200), store=Store(tmp_path / "s"))
    said = run(Recorder(conv), "hello")
    assert "context full" in said[-2] and said[-1] == (
        "note: the answer was cut: the context is full: /rewind 1 drops the last exchange; /new starts a new "
        "conversation; a larger --ctx at the next start (this model takes up to 2048)")
    conv.close()


def test_the_latest_conversation_is_the_one_last_used_not_only_the_last_saved(model, tmp_path):
    store = Store(tmp_path / "s", clock=Ticks())
    for name in ("older", "newer"):
        conv = conversation(model, store, name)
        conv.ask(Q[0])
        conv.close()
    ident = conversation(model, store, None).shelf.ident
    assert store.latest(ident).name == "newer"
    conv = conversation(model, store, None)
    conv.resume("older")  # reopened: the last used, though "newer" was saved after it
    conv.close()
    assert store.latest(ident).name == "older"
    conv = conversation(model, store, "third")
    conv.ask(Q[1])  # a save after that reopening: the newest again
    conv.close()
    assert store.latest(ident).name == "third"


class Crash(BaseException):
    """A kill, in process: the save stops at this call, and nothing of it runs after."""


@contextlib.contextmanager
def crash_at(monkeypatch, k: int):
    """The k-th of the os calls that write (pwrite, write, fsync, replace, ftruncate, unlink) raises Crash;
    yields the count of calls made."""
    calls = [0]

    def deadly(real):
        def call(*a, **kw):
            calls[0] += 1
            if calls[0] == k:
                raise Crash
            return real(*a, **kw)
        return call
    with monkeypatch.context() as mp:
        for name in ("pwrite", "write", "fsync", "replace", "ftruncate", "unlink"):
            mp.setattr(os, name, deadly(getattr(os, name)))
        yield calls


@pytest.mark.parametrize("edit", ["/regen", "an answer after a failed /rewind"])
def test_an_edit_s_save_cut_short_at_any_call_keeps_the_old_conversation_or_the_new(model, tmp_path, monkeypatch,
                                                                                     edit):
    """The save after an edit that defers its cut (a /regen, a /rewind whose cut failed) is one commit: stopped
    at any of its calls, the conversation on disk (as --export reads it) is the one before the edit or the one
    after it, never the cut without the new exchange (which lost a message)."""
    from colichat.persist.loading import read_saved

    finished = False
    for k in range(1, 60):
        store = Store(tmp_path / str(k))
        conv = talked(model, store, 2)
        old = [t.text for t in conv.transcript.turns]
        if edit == "/regen":
            conv.set_option("temperature", 1.0)  # (another answer)
        else:
            with failing(monkeypatch, "replace", err=errno.EIO):
                conv.rewind(1)
            assert conv.transcript.cut_failed
        with crash_at(monkeypatch, k) as calls:
            try:
                conv.ask(None) if edit == "/regen" else conv.ask(Q[2])
                finished = True
            except Crash:
                pass
        new = [t.text for t in conv.transcript.turns]
        conv.close()  # (killed: nothing more is written)
        res = read_saved(next(store.root.iterdir()), "s")
        got = [t.text for t in res.turns]
        assert res.warnings == [] and not res.unread, (k, res.warnings)
        if edit == "/regen":  # (its answer is drawn anew each time: the old one or another)
            assert got[:3] == old[:3] and len(got) == 4, (k, got)
        else:
            assert got in (old, [Q[0], old[1], Q[2], got[3]]), (k, got)
        if finished:
            assert got == new and new[2] == (Q[1] if edit == "/regen" else Q[2])
            assert calls[0] < k
            break
    assert finished


@pytest.mark.parametrize("edit", ["an answer after reading again", "/forget"])
def test_reading_again_then_a_save_cut_short_at_any_call_loses_no_exchange(model, tmp_path, monkeypatch, edit):
    """A resume that read a damaged exchange again from its text, then an answer; /forget, which reads what it
    keeps into a new conversation: stopped at any call of their save, the conversation on disk keeps every
    exchange (the damaged one's text, read again at the next opening) or is the new one whole, and /forget's
    new conversation is there whole or not at all, the old one as it was."""
    from colichat.persist.loading import read_saved

    finished = False
    for k in range(1, 60):
        store = Store(tmp_path / str(k))
        conv = talked(model, store, 2)
        old = [t.text for t in conv.transcript.turns]
        if edit != "/forget":
            conv.close()
            kv = kv_file(store)
            data = bytearray(kv.read_bytes())
            data[-5] ^= 0xFF  # the last answer's records: it is read again from its text
            kv.write_bytes(bytes(data))
            conv = conversation(model, store, None)
            assert "read 1 exchange again" in conv.resume("s")
        with crash_at(monkeypatch, k) as calls:
            try:
                conv.forget(1) if edit == "/forget" else conv.ask(Q[2])
                finished = True
            except Crash:
                pass
        conv.close()  # (killed: nothing more is written)
        directory = next(store.root.iterdir())
        res = read_saved(directory, "s")
        got = [t.text for t in res.turns + res.unread]
        if edit == "/forget":
            assert got == old and res.warnings == [], (k, got)
            cont = read_saved(directory, "s-cont") if (directory / "s-cont.coli_kv").exists() else None
            assert cont is None or [t.text for t in cont.turns] == old[2:] and cont.warnings == [], k
            done = cont is not None
        else:
            assert got[:4] == old and len(got) in (4, 6), (k, got)
            done = len(got) == 6
            assert not done or got[4] == Q[2] and res.warnings == [] and not res.unread
        if finished:
            assert done and calls[0] < k
            break
    assert finished


@pytest.mark.parametrize("edit", ["/reset", "/rewind of every exchange"])
def test_an_interrupted_reset_or_rewind_to_nothing_shows_as_a_finished_one(model, tmp_path, monkeypatch, edit):
    """The third attack's N6: /reset (or /rewind of every exchange) stopped at each of its calls is, once its
    sidecar is written, what a finished one is: /reset's conversation listed as `s: empty` (a reset keeps it
    listed, as a newcomer expects), exported with no warning, and reopened for writing its cut is finished
    (nrec 0, the file cut to its header: no removed token id lingers); a rewind of everything is no
    conversation (not listed), and the next claim of its name removes its files. Before, it is as it was."""
    from colichat.persist.loading import read_saved

    clean = Store(tmp_path / "clean")
    conv = talked(model, clean, 2)
    conv.reset() if edit == "/reset" else conv.rewind(2)
    conv.close()
    rows = [i.describe().split(", ")[0] for i in clean.list()]
    assert rows == (["s: empty"] if edit == "/reset" else [])
    finished = False
    for k in range(1, 30):
        store = Store(tmp_path / str(k))
        conv = talked(model, store, 2)
        old, ident, layout = [t.text for t in conv.transcript.turns], conv.shelf.ident, conv.shelf.layout
        with crash_at(monkeypatch, k) as calls:
            try:
                conv.reset() if edit == "/reset" else conv.rewind(2)
                finished = True
            except Crash:
                pass
        conv.close()  # (killed: nothing more is written)
        directory = next(store.root.iterdir())
        listed = [i.describe().split(", ")[0] for i in store.list()]
        if listed == ["s: 4 turns"]:  # not committed: as it was
            assert [t.text for t in read_saved(directory, "s").turns] == old
        elif edit == "/reset":
            assert listed == rows
            res = read_saved(directory, "s")
            assert res.turns == [] and res.warnings == [], (k, res.warnings)
            again = conversation(model, store, None)
            again.resume("s")
            again.close()
            data = kv_file(store).read_bytes()
            assert len(data) == HEADER_SIZE and data[32:36] == bytes(4), k
        else:
            assert listed == rows, k
            store.claim(ident, "s", layout).close()
            assert sorted(p.name for p in directory.iterdir()) == [], k  # (no file, not even its lock)
        if finished:
            assert calls[0] < k
            break
    assert finished


def test_listings_count_only_what_opening_keeps(model, tmp_path):
    """K6: --sessions and /sessions count the turns opening keeps: a sidecar whose second turn is malformed
    is `empty` (its first message has no answer left), not `2 turns` that then open as none; one whose
    fourth turn is malformed is 2 turns."""
    store = Store(tmp_path / "s")
    talked(model, store, 2).close()
    [sidecar] = store.root.glob("*/s.json")
    doc = json.loads(sidecar.read_text("utf-8"))
    for bad, row in ((3, "s: 2 turns"), (1, "s: empty")):
        damaged = json.loads(json.dumps(doc))
        damaged["turns"][bad]["first"] = "x"
        sidecar.write_text(json.dumps(damaged))
        [info] = store.list()
        opened = conversation(model, store, None)
        opened.resume("s")
        assert info.describe().split(", ")[0] == row, (bad, info.describe())
        assert info.turns == len(opened.transcript.turns), (bad, info.describe())
        assert info.tokens == model.cache.length
        opened.close()


def test_a_reset_whose_cut_failed_is_made_by_quitting_and_keeps_the_conversation_listed(model, tmp_path, monkeypatch):
    """/reset on a full disk: said, and quitting makes it as /reset does (the conversation listed as empty, not
    gone as after a /rewind of every exchange)."""
    store = Store(tmp_path / "s")
    conv = talked(model, store, 2)
    with failing(monkeypatch, "replace", err=errno.EIO):
        said = conv.reset()
    assert "Input/output error" in said and saved_texts(store)[0::2] == Q[:2]
    conv.close()
    assert saved_texts(store) == [] and [i.describe().split(", ")[0] for i in store.list()] == ["s: empty"]
