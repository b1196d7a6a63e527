"""/fork [N]: a new conversation made of this one's first N exchanges, their records copied from the
parent's KV file (or written from memory), no re-prefill; the parent stays saved as it was. Exactness:
a fork continued with a message is, answer and KV file bytes, the conversation that had only those
exchanges and that message (greedy), also once reopened."""

from __future__ import annotations

import errno
import json
import os

import pytest
from app_helpers import Recorder, run
from cli_helpers import TINY_LLAMA

from colichat.conversation.chat import Conversation, Settings
from colichat.conversation.report import turn_line
from colichat.conversation.saved import listing
from colichat.engine import load
from colichat.errors import ChatError
from colichat.persist import Store
from colichat.persist.kvfile import HEADER_SIZE, NREC_OFFSET
from colichat.persist.sidecar import doc_check

Q = ["Hello there", "And again", "Once more", "What next?"]
M = "Tell me a story"


@pytest.fixture(scope="module")
def model():
    return load(TINY_LLAMA, n_ctx=512)


def conversation(model, store: Store, name: str | None = "trip", **kw) -> Conversation:
    model.reset()
    return Conversation(model, Settings(temperature=0, max_tokens=6), store=store, session_name=name, **kw)


def talked(model, store: Store, n: int, name: str | None = "trip") -> Conversation:
    """A conversation of session NAME that has asked the first n questions (Q), each answered and saved."""
    conv = conversation(model, store, name)
    for q in Q[:n]:
        conv.ask(q)
    return conv


def files(store: Store, name: str):
    [kv] = store.root.glob(f"*/{name}.coli_kv")
    return kv, kv.with_suffix(".json")


def sidecar(store: Store, name: str) -> dict:
    return json.loads(files(store, name)[1].read_text("utf-8"))


def snapshot(store: Store, name: str) -> list:
    return [(p.read_bytes(), p.stat().st_mtime_ns) for p in files(store, name)]


def only(model, store: Store, questions: list[str], name: str) -> tuple[str, bytes]:
    """The conversation that had only these messages: its last answer and its KV file's bytes."""
    conv = conversation(model, store, name)
    for q in questions:
        answer, _ = conv.ask(q)
    conv.close()
    return answer, files(store, name)[0].read_bytes()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_a_fork_continued_is_the_conversation_that_had_only_those_exchanges(model, tmp_path, n):
    store = Store(tmp_path / "s")
    conv = conversation(model, store)
    for q in Q:
        conv.ask(q)
    before = snapshot(store, "trip")
    said = conv.fork(n if n < len(Q) else None)
    assert said.startswith(f"forked trip after exchange {n}: the conversation goes on in trip-fork (")
    assert "copied from trip's file, no re-prefill" in said
    assert conv.name == "trip-fork" and len(conv.transcript.starts()) == n
    tokens = conv.transcript.turns[-1].last
    assert model.cache.length == tokens
    parent, fork = files(store, "trip")[0].read_bytes(), files(store, "trip-fork")[0].read_bytes()
    rows = HEADER_SIZE + tokens * model.cache.record_bytes
    assert len(fork) == rows and fork[HEADER_SIZE:] == parent[HEADER_SIZE:rows]  # the parent's first records
    assert fork[:NREC_OFFSET] == parent[:NREC_OFFSET] and int.from_bytes(fork[NREC_OFFSET:NREC_OFFSET + 4],
                                                                           "little") == tokens
    doc = sidecar(store, "trip-fork")
    assert (doc["parent"], doc["branch"]) == ("trip", n) and doc["check"] == doc_check(doc)
    assert doc["turns"] == sidecar(store, "trip")["turns"][: 2 * n]  # the same turns, CRCs and checks
    answer, _ = conv.ask(M)
    forked = files(store, "trip-fork")[0].read_bytes()
    conv.close()
    assert snapshot(store, "trip") == before  # the parent's files, bytes and times, as they were
    assert "parent" not in sidecar(store, "trip")
    assert only(model, Store(tmp_path / "c"), Q[:n] + [M], "ctl") == (answer, forked)


def test_a_fork_is_written_from_memory_where_the_parent_file_does_not_hold_it(model, tmp_path):
    """A parent KV file cut short by another program: the fork's records come from the cache (the same
    bytes), and the parent is left as it is found."""
    store = Store(tmp_path / "s")
    conv = talked(model, store, 3)
    os.truncate(files(store, "trip")[0], HEADER_SIZE + 3)
    before = snapshot(store, "trip")
    assert "written from memory, no re-prefill" in conv.fork(2)
    answer, _ = conv.ask(M)
    forked = files(store, "trip-fork")[0].read_bytes()
    conv.close()
    assert snapshot(store, "trip") == before
    assert only(model, Store(tmp_path / "c"), Q[:2] + [M], "ctl") == (answer, forked)


@pytest.mark.parametrize("how", ["no copy_file_range", "EXDEV"])
def test_without_copy_file_range_the_fork_is_copied_by_reads_and_writes(model, tmp_path, monkeypatch, how):
    store = Store(tmp_path / "s")
    conv = talked(model, store, 3)
    if how == "EXDEV":
        monkeypatch.setattr(os, "copy_file_range", lambda *a: (_ for _ in ()).throw(OSError(errno.EXDEV, "x")))
    else:
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    assert "copied from trip's file" in conv.fork(2)
    monkeypatch.undo()
    tokens = conv.transcript.turns[-1].last
    conv.close()
    parent, fork = files(store, "trip")[0].read_bytes(), files(store, "trip-fork")[0].read_bytes()
    rows = HEADER_SIZE + tokens * model.cache.record_bytes
    assert len(fork) == rows and fork[HEADER_SIZE:] == parent[HEADER_SIZE:rows]


def test_a_copy_that_fails_leaves_no_fork_and_the_conversation_as_it_was(model, tmp_path, monkeypatch):
    store = Store(tmp_path / "s")
    conv = talked(model, store, 2)
    rows = model.cache.length
    with monkeypatch.context() as mp:
        mp.setattr(os, "copy_file_range", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space")))
        with pytest.raises(ChatError, match=r"^could not create session trip-fork: No space; nothing was written "
                                            r"\(free some space, then /fork again\)$"):
            conv.fork(1)
    assert [p.name for p in store.root.glob("*/trip-fork*")] == []  # (its lock file too)
    assert conv.name == "trip" and len(conv.transcript.starts()) == 2 and model.cache.length == rows
    conv.ask(Q[2])  # goes on in trip
    assert [t["text"] for t in sidecar(store, "trip")["turns"]][0::2] == Q[:3]
    conv.close()


def test_a_reopened_fork_goes_on_as_the_live_one(model, tmp_path):
    store = Store(tmp_path / "s")
    conv = talked(model, store, 3)
    conv.fork(2)
    conv.close()
    again = conversation(model, store, None)
    assert "resumed" in again.resume("trip-fork") and (again.session.parent, again.session.branch) == ("trip", 2)
    answer, _ = again.ask(M)
    again.close()
    doc = sidecar(store, "trip-fork")
    assert (doc["parent"], doc["branch"]) == ("trip", 2) and doc["check"] == doc_check(doc)
    assert only(model, Store(tmp_path / "c"), Q[:2] + [M], "ctl") == (answer, files(store, "trip-fork")[0].read_bytes())


def test_the_parent_is_free_once_forked_and_a_second_fork_takes_the_next_name(model, tmp_path):
    store = Store(tmp_path / "s")
    conv = talked(model, store, 2)
    conv.fork(1)
    other = conversation(model, store, None)
    assert "resumed" in other.resume("trip")  # its lock went with the fork
    assert "goes on in trip-fork-2" in other.fork()
    other.close()
    conv.close()
    assert {i.name: (i.parent, i.branch) for i in store.list()} == {
        "trip": (None, None), "trip-fork": ("trip", 1), "trip-fork-2": ("trip", 2)}


def test_forks_that_are_cut_below_their_branch_point_say_so_and_cut_to_nothing_are_no_forks(model, tmp_path):
    store = Store(tmp_path / "s")
    conv = talked(model, store, 3)
    conv.fork(2)
    conv.ask(M)
    conv.rewind(2)
    assert (conv.session.parent, conv.session.branch) == ("trip", 1) and sidecar(store, "trip-fork")["branch"] == 1
    conv.reset()
    assert conv.session.parent is None and "parent" not in sidecar(store, "trip-fork")
    conv.close()


def test_a_sidecar_whose_check_fails_is_no_fork(model, tmp_path):
    store = Store(tmp_path / "s")
    conv = conversation(model, store)
    conv.ask(Q[0])
    conv.fork()
    conv.close()
    path = files(store, "trip-fork")[1]
    doc = json.loads(path.read_text("utf-8"))
    doc["branch"] = 7
    path.write_text(json.dumps(doc))
    info = next(i for i in store.list() if i.name == "trip-fork")
    assert (info.parent, info.branch) == (None, None)


# ---- the commands ----------------------------------------------------------------------------------




@pytest.fixture
def app(model, tmp_path):
    conv = conversation(model, Store(tmp_path / "s"), None)
    yield Recorder(conv)
    conv.close()




def test_fork_refusals_are_one_line(app):
    assert run(app, "/fork") == ["colichat: nothing to fork: the conversation is empty"]
    run(app, "Hello there")
    run(app, "And again")
    for arg in ("0", "3", "-1"):
        assert run(app, f"/fork {arg}") == ["colichat: /fork takes 1 to 2: the conversation has 2 exchanges"]
    assert run(app, "/fork two") == ["colichat: /fork takes a whole number, not 'two'"]
    assert len(app.conv.transcript.starts()) == 2 and app.conv.name == "hello-there"


def test_fork_of_a_conversation_not_saved_is_refused(model, tmp_path):
    for conv, why in ((conversation(model, Store(tmp_path / "a"), None, save_new=False),
                       "this conversation is not saved: /save NAME saves it, then /fork forks it"),
                      (conversation(model, Store(tmp_path / "b"), None, no_save=True),
                       "saving is off (--no-save): nothing can be forked")):
        conv.ask(Q[0])
        with pytest.raises(ChatError, match=f"^{why.replace('(', '.').replace(')', '.')}$"):
            conv.fork()
        conv.close()


def test_fork_after_failed_saves_saves_the_parent_first_or_is_refused(model, tmp_path, monkeypatch):
    store = Store(tmp_path / "s")
    conv = conversation(model, store)
    conv.ask(Q[0])
    with monkeypatch.context() as mp:
        for name in ("pwrite", "write"):
            mp.setattr(os, name, lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
        _, stats = conv.ask(Q[1])
        assert stats.saved is False
        with pytest.raises(ChatError, match="not saved .*No space left on device.* /fork would lose it"):
            conv.fork(1)
    assert "goes on in trip-fork" in conv.fork(1)
    assert [t["text"] for t in sidecar(store, "trip")["turns"]][0::2] == Q[:2]  # saved before it was left
    conv.close()


def test_forks_are_listed_under_their_parents_and_history_says_where_they_branched(app, tmp_path):
    for q in Q[:2]:
        run(app, q)
    assert run(app, "/fork 1")[0].startswith("forked hello-there after exchange 1: the conversation goes on in "
                                             "hello-there-fork (")
    run(app, "Something else")
    history = run(app, "/history")
    assert history[0] == "forked from hello-there after exchange 1" and history[1:] == [
        turn_line(t) for t in app.conv.transcript.turns]
    run(app, "/fork")  # a fork of the fork
    run(app, "/resume hello-there")
    assert not run(app, "/history")[0].startswith("forked")
    run(app, "/fork")
    rows = [row.split(": ")[0] for row in run(app, "/sessions")]
    assert rows[:-1] == ["  hello-there", "*   hello-there-fork-2", "    hello-there-fork",
                         "      hello-there-fork-fork"]
    assert rows[-1].startswith("4 conversations, ")  # the total
    said = run(app, "/sessions")
    assert said[1].endswith("(fork of hello-there at exchange 2)")
    assert said[2].endswith("(fork of hello-there at exchange 1)")
    assert said[3].endswith("(fork of hello-there-fork at exchange 2)")
    everything = listing(app.conv.shelf.store)  # colichat --sessions
    assert any(line.strip().startswith("hello-there-fork: ") and line.endswith("(fork of hello-there at exchange 1)")
               for line in everything), everything
    assert run(app, "/rename plan") == ["renamed session hello-there-fork-2 to plan"]
    assert run(app, "/history")[0] == "forked from hello-there after exchange 2"
