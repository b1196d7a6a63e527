"""Crashes and write errors while saving: the session on disk always loads to a complete turn.

A child process appends and truncates turns of deterministic records (seeded by turn index) and is
SIGKILLed before its K-th I/O call (every point of the save sequence: record write, its fsync, nrec
write, its fsync, sidecar temp write, its fsync, rename, directory fsync; a rewind's sidecar, nrec and
cut of the file), halfway through a write, or at a random time. No crash leaves turns a rewind removed
listed to be read again from their text. Write errors come from RLIMIT_FSIZE in a child and from failing os calls.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from persist_helpers import IDENT, TESTS, build, expected_records, fill_turn, layout_of, make_cache, plan

from colichat.persist import SessionError, Store, Turn
from colichat.persist.kvfile import HEADER_SIZE

MAX_TURNS = 30
EXPECTED = expected_records("mla", MAX_TURNS + 1)

CHILD = """
import os, random, signal, sys
sys.path.insert(0, {tests!r})
from persist_helpers import IDENT, fill_turn, layout_of, make_cache, plan
from colichat.persist import SessionError, Store

mode, kill_at, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def say(word, n):  # one write per line: a kill cannot leave half a line (print writes in pieces)
    sys.stdout.write(f"{{word}} {{n}}\\n")
    sys.stdout.flush()
cache = make_cache("mla", 8192)
store = Store()
try:
    sess = store.open(IDENT, "crash", layout_of(cache))
    m = len(sess.load(cache).turns)
except SessionError:
    sess = store.create(IDENT, layout_of(cache), name="crash")
    m = 0
say("loaded", m)

calls = [0]
def deadly(fn, name):
    def call(*args):
        calls[0] += 1
        if calls[0] == kill_at:
            if mode == "half" and name == "pwrite" and len(args[1]) > 8:
                fn(args[0], args[1][: len(args[1]) // 2], args[2])
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*args)
    return call
if mode in ("before", "half"):
    for name in ("pwrite", "fsync", "write", "replace", "ftruncate"):
        setattr(os, name, deadly(getattr(os, name), name))

rng = random.Random(seed)
for _ in range(100000):
    if m and (m >= {max_turns} or rng.random() < 0.25):
        target = rng.randrange(m)
        say("begin", target)
        sess.truncate(target)
        cache.truncate(plan(target)[-1].last if target else 0)
    else:
        target = m + 1
        turns = plan(target)
        fill_turn(cache, m, turns[m])
        say("begin", target)
        sess.append(cache, turns)
    m = target
    say("saved", m)
"""


def run_child(mode: str, kill_at: int, seed: int) -> tuple[int, int | None, int]:
    """Run one crash trial; return (committed turns, turns of the save in flight or None, returncode)."""
    script = CHILD.format(tests=str(TESTS), max_turns=MAX_TURNS)
    child = subprocess.Popen([sys.executable, "-c", script, mode, str(kill_at), str(seed)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if mode == "free":
        first = child.stdout.readline()
        assert first.startswith("loaded")
        time.sleep(random.Random(seed).uniform(0, 0.04))
        child.send_signal(signal.SIGKILL)
        out, err = first + child.stdout.read(), child.stderr.read()  # same buffered reader as readline
        child.wait(60)
    else:
        out, err = child.communicate(timeout=60)
    assert "Traceback" not in err, err
    committed, inflight = None, None
    lines = out.splitlines()
    if out and not out.endswith("\n"):
        lines.pop()  # cut by the kill before the step it announces: it says nothing about the disk
    for line in lines:
        word, n = line.split()
        if word in ("loaded", "saved"):
            committed, inflight = int(n), None
        else:
            inflight = int(n)
    return committed, inflight, child.returncode


def check_session(possible: set[int]) -> int:
    """Load the crash session in this process: a complete prefix of the plan, one of `possible`. A
    session cut to no turns has no files (Session.truncate), so 0 turns may be no session at all."""
    cache = make_cache("mla", 8192)
    if 0 in possible and not (Store().model_dir(IDENT) / "crash.coli_kv").exists():
        return 0
    with Store().open(IDENT, "crash", layout_of(cache)) as sess:
        res = sess.load(cache)
    m = len(res.turns)
    assert m in possible, (m, possible, res.warnings)
    assert res.turns == plan(m)
    assert not res.unread, "turns a rewind removed are listed to be read again"
    n = res.tokens
    assert cache.raw(0, n).tobytes() == memoryview(EXPECTED[:n]).cast("B").tobytes()
    return m


@pytest.mark.process
def test_sigkill_at_every_step_and_at_random_times(colichat_home):
    trials = [("before", k) for k in range(1, 27)] + [("half", k) for k in (1, 3, 9, 11)]
    trials += [("free", 0)] * 30
    seen_codes = set()
    for seed, (mode, kill_at) in enumerate(trials):
        committed, inflight, code = run_child(mode, kill_at, seed)
        seen_codes.add(code)
        assert committed is not None, "the child died before loading the session"
        check_session({committed} | ({inflight} if inflight is not None else set()))
    assert seen_codes == {-signal.SIGKILL}
    # The next save repairs whatever the last crash left; afterwards the session loads cleanly. A last
    # trial killed after a truncate to no turns leaves no files (check_session): created again, as the child does.
    cache = make_cache("mla", 8192)
    store = Store()
    if (store.model_dir(IDENT) / "crash.coli_kv").exists():
        sess = store.open(IDENT, "crash", layout_of(cache))
        m = len(sess.load(cache).turns)
    else:
        sess, m = store.create(IDENT, layout_of(cache), name="crash"), 0
    with sess:
        turns = plan(m + 1)
        fill_turn(cache, m, turns[m])
        sess.append(cache, turns)
    with Store().open(IDENT, "crash", layout_of(cache)) as sess:
        res = sess.load(make_cache("mla", 8192))
    assert res.turns == turns and res.warnings == []


FSIZE_CHILD = """
import os, resource, signal, sys
sys.path.insert(0, {tests!r})
import numpy as np
from persist_helpers import IDENT, build, layout_of, make_cache
from colichat.persist import SessionError, Store, Turn
from colichat.persist.kvfile import HEADER_SIZE

big_text = sys.argv[1] == "sidecar"
cache = make_cache("mla")
turns = build(cache, 3)
if big_text:
    turns[2] = Turn(turns[2].role, "x" * 200000, turns[2].first, turns[2].last)
sess = Store().create(IDENT, layout_of(cache), name="full")
sess.append(cache, turns[:2])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
room = 100000 if big_text else cache.record_bytes  # sidecar case: the records fit, the sidecar not
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(sess.kv_path) + room, hard))
before = cache.records.copy(), cache.length
try:
    sess.append(cache, turns)
    print("saved")
except SessionError as e:
    print("error", e)
assert np.array_equal(cache.records, before[0]) and cache.length == before[1]
assert sess.turns == turns[:2]
"""


@pytest.mark.process
@pytest.mark.parametrize("where", ["records", "sidecar"])
def test_file_size_limit_is_reported_and_nothing_is_lost(colichat_home, where):
    out = subprocess.run([sys.executable, "-c", FSIZE_CHILD.format(tests=str(TESTS)), where],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("error could not save session full: File too large"), out.stdout
    cache = make_cache("mla")
    turns = build(cache, 3)
    store = Store()
    with store.open(IDENT, "full", layout_of(cache)) as sess:
        loaded = make_cache("mla")
        res = sess.load(loaded)
        assert res.turns == turns[:2]
        assert loaded.raw(0, res.tokens).tobytes() == cache.raw(0, res.tokens).tobytes()
        sess.append(cache, turns)  # space again: the conversation goes on
    with store.open(IDENT, "full", layout_of(cache)) as sess:
        res = sess.load(make_cache("mla"))
    assert res.turns == turns and res.warnings == []


FAIL_POINTS = [("pwrite", 1), ("pwrite", 2), ("fsync", 1), ("fsync", 2), ("write", 1), ("fsync", 3),
               ("replace", 1), ("fsync", 4)]


@pytest.mark.parametrize("name,nth", FAIL_POINTS)
@pytest.mark.parametrize("retry", ["same session", "reopened"])
def test_write_error_at_each_step(colichat_home, monkeypatch, name, nth, retry):
    cache = make_cache("mla")
    turns = build(cache, 3)
    store = Store()
    sess = store.create(IDENT, layout_of(cache), name="enospc")
    sess.append(cache, turns[:2])
    real, calls = getattr(os, name), [0]

    def failing(*args):
        calls[0] += 1
        if calls[0] == nth:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args)

    before = cache.records.copy()
    monkeypatch.setattr(os, name, failing)
    with pytest.raises(SessionError) as e:
        sess.append(cache, turns)
    monkeypatch.setattr(os, name, real)
    assert str(e.value).startswith("could not save session enospc: No space left on device")
    assert np.array_equal(cache.records, before) and cache.length == turns[-1].last
    assert sess.turns == turns[:2] and sess.nrec == turns[1].last
    assert not any(p.endswith(".tmp") for p in os.listdir(sess.directory))
    if retry == "reopened":
        sess.close()
        sess = store.open(IDENT, "enospc", layout_of(cache))
        res = sess.load(loaded := make_cache("mla"))
        if (name, nth) == ("fsync", 4):  # the rename was done, only its durability is in doubt
            assert res.turns in (turns[:2], turns)
        else:
            assert res.turns == turns[:2]
        assert loaded.raw(0, res.tokens).tobytes() == cache.raw(0, res.tokens).tobytes()
    sess.append(cache, turns)
    sess.close()
    with store.open(IDENT, "enospc", layout_of(cache)) as sess:
        res = sess.load(make_cache("mla"))
    assert res.turns == turns and res.warnings == []


def test_write_error_during_truncate(colichat_home, monkeypatch):
    """The sidecar is a rewind's commit: an error writing it leaves the disk at the previous save; an
    error after it (the nrec write, the cut of the file) is reported too, but leaves the rewound state,
    which is what the sidecar lists: it loads as a finished rewind (no warning), and opening it for
    writing finishes the cut (nrec and the file's size: the removed records do not linger)."""
    cache = make_cache("mla")
    turns = build(cache, 3)
    store = Store()
    with store.create(IDENT, layout_of(cache), name="tr") as sess:
        sess.append(cache, turns)
        monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
        with pytest.raises(SessionError, match="could not save session tr: I/O error"):
            sess.truncate(1)
        monkeypatch.undo()
        assert sess.turns == turns
    with store.open(IDENT, "tr", layout_of(cache)) as sess:
        assert sess.load(make_cache("mla")).turns == turns
        monkeypatch.setattr(os, "pwrite", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
        with pytest.raises(SessionError, match="could not save session tr: I/O error"):
            sess.truncate(1)
        monkeypatch.undo()
        assert sess.turns == turns[:1]
    with store.open(IDENT, "tr", layout_of(cache)) as sess:
        res = sess.load(make_cache("mla"))
        assert res.turns == turns[:1] and not res.unread and res.warnings == []
        with open(sess.kv_path, "rb") as f:
            data = f.read()
        assert int.from_bytes(data[32:36], "little") == turns[0].last
        assert len(data) == HEADER_SIZE + turns[0].last * cache.record_bytes
        sess.append(cache, turns[:2])
    with store.open(IDENT, "tr", layout_of(cache)) as sess:
        assert sess.load(make_cache("mla")).turns == turns[:2]


def test_a_rewind_cuts_the_kv_file_to_its_records(colichat_home):
    cache = make_cache("mla")
    turns = build(cache, 3)
    with Store().create(IDENT, layout_of(cache), name="cut") as sess:
        sess.append(cache, turns)
        full = os.path.getsize(sess.kv_path)
        sess.truncate(1)
        assert os.path.getsize(sess.kv_path) == HEADER_SIZE + turns[0].last * sess.layout.record_bytes < full
        sess.truncate(0, keep_files=True)  # /reset: emptied in place
        assert os.path.getsize(sess.kv_path) == HEADER_SIZE


def test_failing_append_of_new_turns_only(colichat_home, monkeypatch):
    """The new-turns form of append: after an error, passing the unsaved turns again retries them."""
    cache = make_cache("mla")
    turns = build(cache, 3)
    with Store().create(IDENT, layout_of(cache), name="n") as sess:
        sess.append(cache, turns[:1])
        monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space")))
        with pytest.raises(SessionError):
            sess.append(cache, turns[1:2])
        monkeypatch.undo()
        sess.append(cache, turns[1:2])
        sess.append(cache, [turns[2]])
        with pytest.raises(ValueError):
            sess.append(cache, [Turn("user", "gap", turns[2].last + 1, turns[2].last + 2)])
        assert sess.turns == turns


RENAME_CHILD = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from persist_helpers import IDENT, build, layout_of, make_cache
from colichat.persist import Store

cache = make_cache("mla")
store = Store()
sess = store.create(IDENT, layout_of(cache), name="a")
sess.append(cache, build(cache, 2))
real = os.unlink
def unlink(path, *a, **k):
    if path.endswith(".json"):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, *a, **k)
os.unlink = unlink
store.rename(sess, "b")
"""


@pytest.mark.process
def test_a_rename_killed_between_its_links_and_unlinks_is_finished_by_the_next_listing(colichat_home):
    """SIGKILL after both files are linked under the new name, while the old names are unlinked: the
    next listing finishes the rename (the conversation under the new name only, intact), where both
    names were refused for their two hard links."""
    child = subprocess.run([sys.executable, "-c", RENAME_CHILD.format(tests=str(TESTS))],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr
    directory = Store().model_dir(IDENT)
    assert (directory / "a.json").stat().st_nlink == 2  # the crash left both names
    infos = Store().list(IDENT)
    assert [(i.name, i.damage) for i in infos] == [("b", None)]
    assert not list(directory.glob("*.renaming")) and not (directory / "a.coli_kv").exists()
    cache = make_cache("mla")
    with Store().open(IDENT, "b", layout_of(cache)) as sess:
        res = sess.load(cache)
    assert len(res.turns) == 2 and res.warnings == []


REPLACE_CHILD = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from persist_helpers import IDENT, fill_turn, layout_of, make_cache, plan
from colichat.persist import Store, Turn

kill_at, longer = int(sys.argv[1]), sys.argv[2] == "longer"
cache = make_cache("mla", 8192)
old = plan(4)
for i, t in enumerate(old):
    fill_turn(cache, i, t)
sess = Store().create(IDENT, layout_of(cache), name="rp")
sess.append(cache, old)
first = old[2].first  # the second exchange is answered again: its message, a new answer
n = old[3].last - old[3].first + (9 if longer else -3)
new = old[:3] + [Turn("assistant", "another answer", old[3].first, old[3].first + n)]
fill_turn(cache, 99, new[3])
calls = [0]
def deadly(fn):
    def call(*args):
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*args)
    return call
for name in ("pwrite", "fsync", "write", "replace", "ftruncate", "rename", "unlink"):
    setattr(os, name, deadly(getattr(os, name)))
sess.append(cache, new, keep=2)
"""


@pytest.mark.process
@pytest.mark.parametrize("longer", ["longer", "shorter"])
def test_a_regen_s_save_killed_before_each_io_call_leaves_the_old_exchange_or_the_new(colichat_home, longer):
    """/regen's save (Session.append with `keep`: the last exchange replaced) is one commit: SIGKILL before
    each of its I/O calls leaves the old exchange or the new one, bit for bit and without a warning, read
    without the lock as with it; opening the new one for writing puts its staged records in place (nrec,
    size)."""
    from colichat.persist.sidecar import turn_crc

    old, done, outcomes = plan(4), False, set()
    for k in range(1, 60):
        subprocess.run([sys.executable, "-c", REPLACE_CHILD.format(tests=str(TESTS)), str(k), longer],
                       capture_output=True, timeout=60)
        ref = make_cache("mla", 8192)
        for i, t in enumerate(old):
            fill_turn(ref, i, t)
        n_old = old[3].last
        crc_old = turn_crc(ref, old[3])
        for read_only in (True, False):
            with Store().open(IDENT, "rp", layout_of(ref), read_only=read_only) as sess:
                res = sess.load(loaded := make_cache("mla", 8192))
            assert res.warnings == [] and not res.unread, (k, res.warnings)
            assert res.turns[:3] == old[:3] and len(res.turns) == 4, (k, res.turns)
            assert loaded.raw(0, old[2].last).tobytes() == ref.raw(0, old[2].last).tobytes()
            is_new = res.turns[3].text == "another answer"
            if not is_new:
                assert res.turns[3] == old[3] and turn_crc(loaded, old[3]) == crc_old
            outcomes.add(is_new)
        kv = Store().model_dir(IDENT) / "rp.coli_kv"
        data = kv.read_bytes()
        end = res.turns[3].last
        assert int.from_bytes(data[32:36], "little") == end  # (the old one: dead space past nrec may stay)
        assert len(data) == HEADER_SIZE + end * ref.record_bytes if is_new else len(data) >= HEADER_SIZE + end
        assert "staged" not in json.loads(kv.with_suffix(".json").read_text())
        if is_new and end != n_old:
            ref.truncate(old[3].first)
            fill_turn(ref, 99, res.turns[3])
            assert loaded.raw(0, end).tobytes() == ref.raw(0, end).tobytes()
        for p in Store().model_dir(IDENT).iterdir():
            p.unlink()
        if is_new and k > 1 and not done:
            done = k >= 3 and outcomes == {True, False}
        if done and is_new:
            break
    assert outcomes == {True, False}, outcomes
