"""An I/O error at every single I/O call of a save: the session is either as before or complete.

`Faults` counts the calls colichat.persist makes to the operating system (open, write, fsync,
fchmod, ftruncate, rename, unlink, mkdir, flock, ...) and makes the k-th one fail. For each
operation (create, append, truncate, and the sidecar's rename inside each) a clean run counts its
calls; then every k from 1 to that count fails once, with ENOSPC, EIO or EPERM in turn, and the test
checks that the error is one line, that the lock is released or still ours, that the files on disk
load to the state before or after the operation, and that the next attempt succeeds.
"""

from __future__ import annotations

import errno
import fcntl
import os

import pytest
from persist_helpers import IDENT, build, layout_of, make_cache

from colichat.persist import SessionError, Store

OS_CALLS = ("open", "pwrite", "write", "fsync", "fchmod", "ftruncate", "rename", "replace", "unlink", "link",
            "mkdir", "close", "fstat", "lstat")
ERRORS = (errno.ENOSPC, errno.EIO, errno.EPERM)


class Faults:
    """Count I/O calls; make call number `fail_at` (1-based) raise OSError(err). Undone on exit."""

    def __init__(self, fail_at: int | None = None, err: int = errno.ENOSPC):
        self.mp, self.fail_at, self.err, self.calls, self.failed = pytest.MonkeyPatch(), fail_at, err, 0, None

    def _wrap(self, module, name):
        real = getattr(module, name)

        def call(*args, **kw):
            self.calls += 1
            if self.calls == self.fail_at:
                self.failed = name
                if name == "close":  # the descriptor is gone even when close reports an error
                    real(*args, **kw)
                raise OSError(self.err, os.strerror(self.err))
            return real(*args, **kw)

        self.mp.setattr(module, name, call)

    def __enter__(self) -> Faults:
        for name in OS_CALLS:
            self._wrap(os, name)
        self._wrap(fcntl, "flock")
        return self

    def __exit__(self, *exc) -> None:
        self.mp.undo()


def count_calls(op) -> int:
    with Faults() as f:
        op()
    assert f.failed is None
    return f.calls


def session_files(store) -> set[str]:
    d = store.model_dir(IDENT)
    return {p for p in os.listdir(d) if p != "s.lock"} if d.exists() else set()


def load_turns(store, name="s"):
    cache = make_cache()
    with store.open(IDENT, name, layout_of(cache)) as sess:
        res = sess.load(cache)
    return res, cache


def check_one_line(e: SessionError) -> None:
    assert str(e) and "\n" not in str(e)


def test_error_at_every_call_of_a_create_leaves_nothing_and_the_name_usable(colichat_home):
    cache = make_cache()
    turns = build(cache, 2)
    store = Store()
    store.create(IDENT, layout_of(cache), name="s").close()  # directories and s.lock exist from here on
    store.delete(IDENT, "s")
    made = []
    n = count_calls(lambda: made.append(store.create(IDENT, layout_of(cache), name="s")))
    made[0].close()
    store.delete(IDENT, "s")
    assert n >= 10
    failures, tolerated = [], []
    for k in range(1, n + 1):
        sess = None
        with Faults(k, ERRORS[k % 3]) as f:
            try:
                sess = store.create(IDENT, layout_of(cache), name="s")
            except SessionError as e:
                check_one_line(e)
        assert f.failed, k
        if sess is None:  # failed: nothing on disk, the lock released, the name free
            failures.append(f.failed)
            assert session_files(store) == set(), (k, f.failed)
            sess = store.create(IDENT, layout_of(cache), name="s")
        else:  # the failed call did not matter (the lock's pid, say): a complete session
            assert session_files(store) == {"s.coli_kv", "s.json"}, (k, f.failed)
            tolerated.append(f.failed)
        sess.append(cache, turns)
        sess.close()
        res, loaded = load_turns(store)
        assert res.turns == turns and res.warnings == [], (k, f.failed)
        store.delete(IDENT, "s")
    # Harmless failures: the lock file's mode and pid (informational), a check for leftovers of an
    # interrupted create (an error reads as "none": the exclusive create that follows would refuse).
    assert set(tolerated) <= {"fchmod", "ftruncate", "pwrite", "lstat"}, tolerated
    assert len(failures) == n - len(tolerated)


def saved_session(store, cache, turns):
    with store.create(IDENT, layout_of(cache), name="s") as sess:
        sess.append(cache, turns)


@pytest.mark.parametrize("op", ["append", "truncate", "save_sampler", "rewrite", "text only"])
def test_error_at_every_call_of_a_save(colichat_home, op):
    """append writes records, nrec and the sidecar (its rename included); truncate nrec and the
    sidecar; save_sampler only the sidecar; rewrite is an append after another program removed the
    KV file (a new KV file renamed into place, then the append); text only is the first append of a
    session opened from its sidecar alone (its KV file deleted before): an empty KV file renamed into
    place, then the append. Every call fails once, then the same session retries."""
    cache = make_cache()
    turns = build(cache, 4)
    store = Store()
    before = turns[:2]
    after = {"append": turns, "truncate": turns[:1], "save_sampler": turns[:2], "rewrite": turns,
             "text only": turns}[op]

    def run(sess):
        if op in ("append", "rewrite", "text only"):
            sess.append(cache, turns)
        elif op == "truncate":
            sess.truncate(1)
        else:
            sess.save_sampler({"temperature": 0.25})

    saved_session(store, cache, before)
    if op == "text only":
        os.unlink(store.model_dir(IDENT) / "s.coli_kv")
    with store.open(IDENT, "s", layout_of(cache)) as sess:
        sess.load(make_cache())
        if op == "rewrite":
            os.unlink(sess.kv_path)
        n = count_calls(lambda: run(sess))
    assert n >= 4
    for k in range(1, n + 1):
        for retry in (False, True):
            store.delete(IDENT, "s")
            saved_session(store, cache, before)
            if op == "text only":
                os.unlink(store.model_dir(IDENT) / "s.coli_kv")
            sess = store.open(IDENT, "s", layout_of(cache))
            sess.load(make_cache())
            if op == "rewrite":
                os.unlink(sess.kv_path)
            with Faults(k, ERRORS[k % 3]) as f:
                try:
                    run(sess)
                    ok = True
                except SessionError as e:
                    check_one_line(e)
                    ok = False
            assert f.failed, k
            assert not any(p.endswith(".tmp") for p in session_files(store)), (k, f.failed)
            if retry and not ok:
                run(sess)  # the same session, kept open after the error, retries and succeeds
            sess.close()
            if op in ("rewrite", "text only") and not (retry or ok) and not os.path.exists(sess.kv_path):
                # still as the other program left it: the sidecar alone, whose text opening reads again
                res, _ = load_turns(store)
                assert res.turns == [] and [(t.role, t.text) for t in res.unread] == \
                    [(t.role, t.text) for t in before], (k, f.failed)
                continue
            res, loaded = load_turns(store)
            assert loaded.raw(0, res.tokens).tobytes() == cache.raw(0, res.tokens).tobytes()
            if retry or ok:
                assert res.turns == after and res.warnings == [], (k, f.failed, res.warnings)
            elif op == "text only":  # or a new KV file without the records yet: the text is read again
                assert res.turns in (before, after) or (res.turns == [] and [(t.role, t.text) for t in res.unread] ==
                                                        [(t.role, t.text) for t in before]), (k, f.failed, res.turns)
            else:  # what a crash right after the error would leave: the state before or after
                assert res.turns in (before, after), (k, f.failed, res.turns)
            if op == "save_sampler" and (retry or ok):
                assert res.sampler == {"temperature": 0.25}


def test_a_failed_first_save_is_retried_by_the_next_answer(colichat_home, monkeypatch):
    """D1: the disk is full at the first answer of `--session s`; the next answer saves both."""
    from conftest import TINY

    from colichat.conversation.chat import Conversation, Settings
    from colichat.engine import load

    model = load(str(TINY / "llama.gguf"), n_ctx=512)
    conv = Conversation(model, Settings(temperature=0, max_tokens=4), session_name="s")
    real = os.pwrite
    with monkeypatch.context() as mp:
        mp.setattr(os, "pwrite", lambda fd, data, off: (_ for _ in ()).throw(
            OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))) if len(data) == 40 else real(fd, data, off))
        _, stats = conv.ask("hello")
    assert stats.saved is False and "No space left on device" in stats.save_error
    assert "next save retries" in stats.save_error
    _, stats = conv.ask("and again")
    assert stats.saved is True and conv.name == "s"
    conv.close()
    model.reset()
    with conv.shelf.store.open(conv.shelf.ident, "s", conv.shelf.layout) as sess:
        res = sess.load(model.cache)
    assert [t.role for t in res.turns] == ["user", "assistant"] * 2 and res.warnings == []


def test_error_at_every_call_of_a_rename(colichat_home):
    """Store.rename links the files under the new name, then removes the old names: an error at any
    call leaves the conversation loadable under a name, the locks free, and the retry succeeds."""
    cache = make_cache()
    turns = build(cache, 2)
    store = Store()

    def fresh():
        for name in ("s", "t"):
            if any(os.path.lexists(store.model_dir(IDENT) / (name + e)) for e in (".coli_kv", ".json")):
                store.delete(IDENT, name)
        saved_session(store, cache, turns)
        sess = store.open(IDENT, "s", layout_of(cache))
        sess.load(make_cache())
        return sess

    sess = fresh()
    n = count_calls(lambda: store.rename(sess, "t"))
    sess.close()
    assert n >= 6
    for k in range(1, n + 1):
        sess = fresh()
        with Faults(k, ERRORS[k % 3]) as f:
            try:
                store.rename(sess, "t")
            except SessionError as e:
                check_one_line(e)
        assert f.failed, k
        if sess.name == "s":  # failed: the session keeps its old name; the retry moves it
            assert {"s.coli_kv", "s.json"} <= session_files(store), (k, f.failed)
            store.rename(sess, "t")
        sess.append(cache, turns)  # the session goes on under its new name
        sess.close()
        res, _ = load_turns(store, "t")
        assert res.turns == turns and res.warnings == [], (k, f.failed)
        left = {p for p in session_files(store) if p.startswith("s.") and p != "s.lock"}
        # gone, or a copy (a KV file alone, as after a crash inside /delete, loads as one imported turn)
        assert left in (set(), {"s.coli_kv", "s.json"}, {"s.coli_kv"}), (k, f.failed, left)
        if left:
            res, copy = load_turns(store, "s")
            assert res.tokens == turns[-1].last and copy.raw(0, res.tokens).tobytes() == \
                cache.raw(0, res.tokens).tobytes()
