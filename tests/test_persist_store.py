"""Session names, file modes, listing, the writer lock, and the weights fingerprint."""

from __future__ import annotations

import os
import shutil
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY
from persist_helpers import IDENT, OTHER_IDENT, TESTS, Ticks, build, layout_of, make_cache

from colichat.engine.gguf.header import read_header
from colichat.persist import SessionError, Store, model_identity, weights_fingerprint
from colichat.persist.names import NAME_RE


@pytest.mark.parametrize("name", ["../x", "a/b", "", "x" * 65, ".hidden", "a..b", "a b", "caf\u00e9", "..",
                                  "a\\b", "a\0b"])
def test_bad_names_are_refused(colichat_home, name):
    cache = make_cache()
    with pytest.raises(SessionError, match="invalid session name .*: use 1 to 64 ASCII letters, digits"):
        Store().create(IDENT, layout_of(cache), name=name)
    with pytest.raises(SessionError, match="invalid session name"):
        Store().open(IDENT, name, layout_of(cache))
    assert not list(colichat_home.rglob("*.coli_kv"))


def test_open_needs_a_name(colichat_home):
    with pytest.raises(SessionError, match="invalid session name"):
        Store().open(IDENT, None, layout_of(make_cache()))


@pytest.mark.parametrize("name", ["a", "A-1_b.c", "x" * 64, "_x", "-"])
def test_good_names(colichat_home, name):
    cache = make_cache()
    with Store().create(IDENT, layout_of(cache), name=name) as sess:
        assert sess.name == name


def test_files_0600_dirs_0700(colichat_home):
    os.umask(0o022)
    cache = make_cache()
    with Store().create(IDENT, layout_of(cache), name="m") as sess:
        sess.append(cache, build(cache, 2))
        directory = sess.directory
    for p in os.listdir(directory):
        assert stat.S_IMODE(os.stat(os.path.join(directory, p)).st_mode) == 0o600, p
    for d in (directory, colichat_home / "data" / "sessions", colichat_home / "data"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d


def test_existing_name_is_refused_and_reset_keeps_the_old_session(colichat_home):
    cache = make_cache()
    store = Store()
    with store.create(IDENT, layout_of(cache), name="a") as sess:
        sess.append(cache, build(cache, 2))
    with pytest.raises(SessionError, match="already exists"):
        store.create(IDENT, layout_of(cache), name="a")
    with store.create(IDENT, layout_of(cache)) as fresh:  # /new: a new empty session
        assert fresh.name != "a" and fresh.nrec == 0
    with store.open(IDENT, "a", layout_of(cache)) as sess:
        assert sess.load(make_cache()).tokens == build(make_cache(), 2)[-1].last


@pytest.mark.parametrize("damage", [
    b"{not json", b"\xff", b"[1]", b'{"turns": 3}', b'{"turns": [1, 2]}',
    b'{"turns": [{"last": "x", "role": "user", "text": 5}], "model": 1, "updated": "?"}',
    b'{"turns": [{"last": 7, "role": "user", "text": "hi\\nthere"}], "updated": 3}', b'{"foo": 1}'])
def test_a_sidecar_that_is_not_colichats_is_listed_as_damaged(damage, colichat_home):
    """Opening refuses it: the listing says so (with the command that clears it) and never offers it
    as the latest conversation; a listing never fails on a sidecar."""
    store, cache = Store(), make_cache()
    with store.create(IDENT, layout_of(cache), name="d") as sess:
        sess.append(cache, build(cache, 2))
        side = Path(sess.json_path)
    side.write_bytes(damage)
    [info] = store.list(IDENT)
    assert info.describe() == "d: damaged (the sidecar is not a colichat sidecar); /delete d removes it"
    assert store.latest(IDENT) is None
    with pytest.raises(SessionError, match="not a colichat sidecar"):
        store.open(IDENT, "d", layout_of(cache)).load(make_cache())


@pytest.mark.parametrize("turns", [b"3", b"[1, 2]", b'[{"last": "x", "role": "user", "text": 5}]',
                                   b'[{"last": 7, "role": "user", "text": "hi\\nthere"}]'])
def test_a_colichat_sidecar_with_damaged_turns_is_listed_from_the_header(turns, colichat_home):
    """Opening loads what it can of it (with warnings): the listing counts what opening keeps (no turn:
    empty, whatever the KV header says) and takes what it cannot read (the model, the time) from the
    KV file."""
    store, cache = Store(), make_cache()
    with store.create(IDENT, layout_of(cache), name="d") as sess:
        sess.append(cache, build(cache, 2))
        side = Path(sess.json_path)
    fp = IDENT["fingerprint"]
    side.write_bytes(b'{"format": 2, "model": {"fingerprint": "%s"}, "updated": 3, "turns": %s}' % (fp.encode(), turns))
    [info] = store.list(IDENT)
    readable = b'"last": 7' in turns
    assert info.damage is None and info.model == store.model_dir(IDENT).name  # no readable model name
    assert info.tokens == 0 and info.turns == 0 and info.first == ""  # (no unchecked turn is believed)
    assert info.describe().startswith("d: empty, ") and readable in (True, False)
    assert info.last_used == os.path.getmtime(info.path.with_suffix(".coli_kv"))


def test_auto_names_are_unique(colichat_home):
    cache = make_cache()
    names = set()
    for _ in range(4):
        with Store().create(IDENT, layout_of(cache)) as sess:
            names.add(sess.name)
    assert len(names) == 4 and all(NAME_RE.fullmatch(n) for n in names)


def test_listing_newest_first_per_model(colichat_home):
    store = Store(clock=Ticks())
    cache = make_cache()
    for name, ident, n in [("old", IDENT, 1), ("other", OTHER_IDENT, 2), ("new", IDENT, 3)]:
        with store.create(ident, layout_of(cache), name=name) as sess:
            sess.append(cache, build(cache, n))
    junk = store.model_dir(IDENT) / "junk.coli_kv"
    junk.write_bytes(b"not a session")
    [bad] = [i for i in store.list(IDENT) if i.damage]  # listed, with the command that clears it
    assert bad.describe() == "junk: damaged (truncated header: 13 bytes, a header needs 40); /delete junk removes it"
    infos = [i for i in store.list(IDENT) if not i.damage]
    assert [i.name for i in infos] == ["new", "old"]
    new = infos[0]
    # what opening keeps: whole exchanges (the third turn, a message alone, is not)
    assert (new.turns, new.tokens, new.model) == (2, build(make_cache(), 2)[-1].last, IDENT["name"])
    assert new.size == sum(os.path.getsize(new.path.with_suffix(e)) for e in (".coli_kv", ".json"))
    assert new.last_used >= infos[1].last_used
    assert "new: 2 turns" in new.describe()
    assert [i.name for i in store.list() if not i.damage] == ["new", "other", "old"]
    assert store.latest(IDENT).name == "new" and store.latest(OTHER_IDENT).name == "other"
    assert store.latest({**IDENT, "fingerprint": "f" * 32}) is None
    with pytest.raises(SessionError, match="belongs to another model"):
        store.open(IDENT, "other", layout_of(cache))


LOCK_HOLDER = """
import sys
sys.path.insert(0, {tests!r})
from persist_helpers import IDENT, layout_of, make_cache
from colichat.persist import Store
sess = Store().open(IDENT, "shared", layout_of(make_cache()))
print("locked", flush=True)
sys.stdin.read()
"""


@pytest.mark.process
def test_second_writer_is_refused(colichat_home):
    cache = make_cache()
    store = Store()
    store.create(IDENT, layout_of(cache), name="shared").close()
    child = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER.format(tests=str(TESTS))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(SessionError) as e:
            store.open(IDENT, "shared", layout_of(cache))
        assert str(e.value) == f"session shared is open in another colichat (pid {child.pid})"
    finally:
        child.stdin.close()
        child.wait(10)
    store.open(IDENT, "shared", layout_of(cache)).close()  # free again once the holder is gone


READER = """
import json, sys
sys.path.insert(0, {tests!r})
from persist_helpers import IDENT, layout_of, make_cache
from colichat.persist import Store
from colichat.persist.loading import read_saved
store = Store()
if {export!r}:
    res = read_saved(store.model_dir(IDENT), "busy")
else:
    with store.open(IDENT, "busy", layout_of(make_cache()), read_only=True) as sess:
        res = sess.load(make_cache())
print(json.dumps({{"turns": len(res.turns), "warnings": res.warnings}}))
"""


def _waits_for_a_lock(pid: int) -> bool:
    """Whether process `pid` is blocked on a file lock (a '->' line of /proc/locks)."""
    return any(line.split()[1] == "->" and line.split()[5] == str(pid)
               for line in Path("/proc/locks").read_text().splitlines())


@pytest.mark.process
@pytest.mark.skipif(not Path("/proc/locks").exists(),
                    reason="needs Linux's /proc/locks to see a process wait on a lock (the read's wait is seen "
                    "nowhere else)")
@pytest.mark.parametrize("export", [False, True], ids=["no-save", "export"])
def test_a_read_without_the_lock_waits_for_a_save_under_way(colichat_home, export, monkeypatch):
    """--no-save (a read-only open) and --export read a session another colichat is saving: the read
    waits for the save to end and sees it whole (it read the records before the sidecar listed them,
    and dropped them as an interrupted save's)."""
    import json
    import threading

    cache = make_cache()
    turns = build(cache, 4)
    sess = Store().create(IDENT, layout_of(cache), name="busy")
    sess.append(cache, turns[:2])
    paused, go = threading.Event(), threading.Event()
    replace = os.replace

    def held(src, dst, *args, **kwargs):  # the records and nrec are written; the sidecar waits to go in place
        if str(dst).endswith(os.sep + "busy.json"):
            paused.set()
            go.wait(60)
        return replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", held)
    saving = threading.Thread(target=sess.append, args=(cache, turns))
    saving.start()
    try:
        assert paused.wait(60)
        reader = subprocess.Popen([sys.executable, "-c", READER.format(tests=str(TESTS), export=export)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while reader.poll() is None and not _waits_for_a_lock(reader.pid):
            time.sleep(0.01)
    finally:
        go.set()
        saving.join(60)
    out, err = reader.communicate(timeout=60)
    sess.close()
    assert reader.returncode == 0, err
    assert json.loads(out) == {"turns": 4, "warnings": []}


def test_a_save_does_not_wait_for_ever_on_a_read_that_does_not_end(colichat_home, monkeypatch):
    """A reader stopped mid-read (Ctrl-Z) holds its shared lock: the save waits a while, then goes on."""
    import fcntl

    import colichat.persist.locks as locks

    monkeypatch.setattr(locks, "SAVE_WAITS_FOR_A_READ", 0.05)
    cache = make_cache()
    turns = build(cache, 4)
    with Store().create(IDENT, layout_of(cache), name="busy") as sess:
        sess.append(cache, turns[:2])
        with open(sess.kv_path, "rb") as reader:
            fcntl.flock(reader.fileno(), fcntl.LOCK_SH)
            sess.append(cache, turns)
    with Store().open(IDENT, "busy", layout_of(cache)) as sess:
        assert sess.load(make_cache()).turns == turns


def test_lock_is_per_session_within_a_process(colichat_home):
    cache = make_cache()
    store = Store()
    with store.create(IDENT, layout_of(cache), name="one"):
        with pytest.raises(SessionError, match="open in another colichat"):
            store.open(IDENT, "one", layout_of(cache))
        store.create(IDENT, layout_of(cache), name="two").close()


# ---- fingerprint ------------------------------------------------------------------------------


def write_gguf(path, seed, n_tensors=6, shape=(64, 96), vocab=0):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("fp-test")
    if vocab:
        w.add_token_list([f"tok{i}" for i in range(vocab)])
        w.add_token_scores([float(i) for i in range(vocab)])
    rng = np.random.default_rng(seed)
    for i in range(n_tensors):
        w.add_tensor(f"blk.{i}.w", rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_fingerprint_tells_weights_apart(tmp_path):
    a, b, a2 = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "copy.gguf"
    write_gguf(a, seed=1)
    write_gguf(b, seed=2)  # same metadata and shapes, other weights
    shutil.copy(a, a2)
    assert os.path.getsize(a) == os.path.getsize(b)
    assert weights_fingerprint(a) != weights_fingerprint(b)
    assert weights_fingerprint(a) == weights_fingerprint(a2)
    data = bytearray(a.read_bytes())  # one tensor fine-tuned, the others unchanged
    start = len(data) - 3 * 64 * 96 * 4
    tuned = np.random.default_rng(3).standard_normal(64 * 96).astype("<f4")
    data[start : start + tuned.nbytes] = tuned.tobytes()
    a2.write_bytes(bytes(data))
    assert weights_fingerprint(a) != weights_fingerprint(a2)
    ident = model_identity(a, "llama", "fp-test")
    assert ident == {"arch": "llama", "name": "fp-test", "fingerprint": weights_fingerprint(a), "file": a.name,
                     "path": os.path.abspath(a), "real_path": os.path.realpath(a)}


def test_fingerprint_of_a_file_it_cannot_walk_is_a_hash_of_its_bytes(tmp_path):
    """Not a GGUF, or a GGUF without tensors: no tensor to sample, the start and the spread are hashed."""
    text, other = tmp_path / "notes.gguf", tmp_path / "other.gguf"
    text.write_text("hello, world\n" * 100)
    other.write_text("hello, world\n" * 99 + "hello, moon!\n")
    vocab_only = Path(__file__).parent / "data" / "vocab" / "ggml-vocab-llama-bpe.gguf"
    prints = {weights_fingerprint(p) for p in (text, other, vocab_only)}
    assert len(prints) == 3 and weights_fingerprint(text) == weights_fingerprint(text)


def test_fingerprint_reads_little_of_a_big_file(tmp_path, monkeypatch):
    path = tmp_path / "big.gguf"
    write_gguf(path, seed=1, n_tensors=300, shape=(8, 8))
    with open(path, "r+b") as f:
        f.truncate(8 << 30)  # sparse: 8 GiB on paper
    before = read_bytes()
    weights_fingerprint(path)
    assert read_bytes() - before < 4 << 20


def read_bytes() -> int:
    """The bytes this process has read so far, as the kernel counts them (/proc/self/io's rchar)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_header_walk_agrees_with_gguf_py(tmp_path):
    import gguf

    path = tmp_path / "vocab.gguf"
    write_gguf(path, seed=4, n_tensors=5, vocab=5000)
    reader = gguf.GGUFReader(str(path))
    head = read_header(path.read_bytes())  # the walker the fingerprint hashes the header and samples by
    assert head.data_start == reader.data_offset
    assert sorted(t.offset for t in head.tensors) == sorted(int(t.data_offset) - reader.data_offset
                                                            for t in reader.tensors)
    with pytest.raises(struct.error):  # a header cut short asks for more bytes
        read_header(path.read_bytes()[: head.data_start // 2])


def test_fingerprint_of_the_tiny_models():
    fps = {p.name: weights_fingerprint(p) for p in sorted(TINY.glob("*.gguf"))}
    assert len(set(fps.values())) == len(fps) >= 2
    assert all(len(f) == 32 for f in fps.values())


def test_delete_takes_the_lock_and_removes_both_files(colichat_home):
    from persist_helpers import IDENT, build, layout_of, make_cache

    from colichat.persist import SessionError, Store

    cache = make_cache()
    turns = build(cache, 3)
    store = Store()
    with store.create(IDENT, layout_of(cache), name="gone") as s:
        s.append(cache, turns)
        with pytest.raises(SessionError, match="open in another colichat"):
            store.delete(IDENT, "gone")  # held: refused
    freed = store.delete(IDENT, "gone")
    assert freed > 0 and store.list(IDENT) == []
    with pytest.raises(SessionError, match="no session named gone"):
        store.delete(IDENT, "gone")
    with pytest.raises(SessionError, match="invalid session name"):
        store.delete(IDENT, "../x")


def test_a_claimed_name_is_locked_and_its_files_come_with_the_first_save(colichat_home):
    from colichat.persist import SessionBusy, SessionExists

    cache = make_cache()
    turns = build(cache, 2)
    store = Store()
    d = store.model_dir(IDENT)
    with store.claim(IDENT, "c", layout_of(cache), {"temperature": 0.5}) as sess:
        assert sorted(os.listdir(d)) == ["c.lock"] and not sess.on_disk
        with pytest.raises(SessionBusy, match="open in another colichat"):
            store.claim(IDENT, "c", layout_of(cache))
        with pytest.raises(SessionBusy):
            store.create(IDENT, layout_of(cache), name="c")
        sess.save_sampler({"temperature": 0.25})  # nothing on disk yet: kept for the first save
        sess.truncate(0)
        assert sorted(os.listdir(d)) == ["c.lock"]
    with store.claim(IDENT, "c", layout_of(cache)) as sess:  # quitting before an answer left no session
        sess.save_sampler({"temperature": 0.25})
        sess.append(cache, turns)
    with pytest.raises(SessionExists, match="already exists"):
        store.claim(IDENT, "c", layout_of(cache))
    with store.open(IDENT, "c", layout_of(cache)) as sess:
        res = sess.load(make_cache())
    assert res.turns == turns and res.sampler == {"temperature": 0.25}


def test_the_look_at_a_lock_names_its_holder_and_takes_nothing(colichat_home):
    """lock_holder: the pid of a colichat holding the session's lock; None for a free one, also
    when a holder killed outright left its pid in the file. The look keeps no lock."""
    from colichat.persist.locks import lock_holder, release_lock, take_lock

    path = str(colichat_home / "s.lock")
    assert lock_holder(path) is None  # no lock file: none is made
    assert not os.path.exists(path)
    fd = take_lock(path, "s")
    assert lock_holder(path) == str(os.getpid())
    release_lock(fd)
    assert lock_holder(path) is None
    Path(path).write_text("4242\n")  # what a holder killed with SIGKILL leaves
    assert lock_holder(path) is None
    release_lock(take_lock(path, "s"))  # the look took nothing


def test_a_claimed_session_whose_directory_was_removed_is_saved_there_again(colichat_home):
    """The sessions directory removed (a clean-up) before a claimed name's first answer: the first
    save makes it again, with the lock, and the name is still held."""
    from colichat.persist import SessionBusy

    cache = make_cache()
    turns = build(cache, 2)
    store = Store()
    with store.claim(IDENT, "c", layout_of(cache)) as sess:
        shutil.rmtree(store.root)
        sess.append(cache, turns)
        assert sorted(os.listdir(store.model_dir(IDENT))) == ["c.coli_kv", "c.json", "c.lock"]
        assert stat.S_IMODE(os.stat(store.root).st_mode) == 0o700
        with pytest.raises(SessionBusy, match="open in another colichat"):
            store.open(IDENT, "c", layout_of(cache))
    with store.open(IDENT, "c", layout_of(cache)) as sess:
        assert sess.load(make_cache()).turns == turns


def test_the_leftover_of_an_interrupted_create_is_replaced(colichat_home):
    """A crash between the KV file's rename and the sidecar leaves a header-only KV file: no
    conversation, so the name is free (an empty sidecar beside it too)."""
    cache = make_cache()
    store = Store()
    for with_sidecar in (False, True):
        with store.create(IDENT, layout_of(cache), name="x") as sess:
            pass
        if not with_sidecar:
            os.unlink(sess.json_path)
        with store.create(IDENT, layout_of(cache), name="x") as sess:
            sess.append(cache, build(cache, 1))
        with pytest.raises(SessionError, match="already exists"):
            store.create(IDENT, layout_of(cache), name="x")
        store.delete(IDENT, "x")


def test_rename_takes_a_name_that_holds_only_an_empty_session_left_on_disk(colichat_home):
    """A name whose files hold no conversation (an empty session, an interrupted create's leftover)
    is free for a rename as for a new session: the leftovers are replaced; a real one is refused."""
    cache = make_cache()
    store = Store()
    kept_turns = build(cache, 1)
    with store.create(IDENT, layout_of(cache), name="kept") as kept:
        kept.append(cache, kept_turns)
    with store.create(IDENT, layout_of(cache), name="a") as sess:
        turns = build(cache, 2)
        sess.append(cache, turns)
        for leftover in ("empty", "interrupted"):
            with store.create(IDENT, layout_of(cache), name=leftover) as left:
                pass  # a KV file with no records and a sidecar with no turns
            if leftover == "interrupted":
                os.rename(left.kv_path, left.kv_path + ".tmp")
            store.rename(sess, leftover)
            assert sess.name == leftover
        with pytest.raises(SessionError, match="session kept already exists: choose another name"):
            store.rename(sess, "kept")
    d = store.model_dir(IDENT)
    assert sorted(p.name for p in d.iterdir() if not p.name.endswith(".lock")) == [
        "interrupted.coli_kv", "interrupted.json", "kept.coli_kv", "kept.json"]
    assert [i.name for i in store.list(IDENT)] == ["interrupted", "kept"]
    with store.open(IDENT, "interrupted", layout_of(cache)) as sess:
        assert sess.load(make_cache()).turns == turns
    with store.open(IDENT, "kept", layout_of(cache)) as sess:
        assert sess.load(make_cache()).turns == kept_turns


# ---- files planted or removed behind colichat's back ------------------------------------------


def test_a_hard_link_planted_at_the_sidecar_temp_or_lock_never_changes_its_target(colichat_home, tmp_path):
    cache = make_cache()
    turns = build(cache, 2)
    store = Store()
    with store.create(IDENT, layout_of(cache), name="h") as sess:
        sess.append(cache, turns[:1])
    d = store.model_dir(IDENT)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    os.chmod(victim, 0o644)
    os.link(victim, d / "h.json.tmp")
    with store.open(IDENT, "h", layout_of(cache)) as sess:  # the temp name is replaced, not written through
        sess.load(make_cache())
        sess.append(cache, turns)
    assert victim.read_bytes() == b"precious\n" and stat.S_IMODE(victim.stat().st_mode) == 0o644
    os.unlink(d / "h.lock")
    os.link(victim, d / "h.lock")
    with pytest.raises(SessionError) as e:
        store.open(IDENT, "h", layout_of(cache))
    assert str(e.value) == (f"lock file {d / 'h.lock'} has 2 hard links; colichat does not write through a "
                            f"hard link (another file would change): remove it (rm '{d / 'h.lock'}'); "
                            "colichat makes a new one")
    assert victim.read_bytes() == b"precious\n" and stat.S_IMODE(victim.stat().st_mode) == 0o644
    os.unlink(d / "h.lock")
    os.mkfifo(d / "h.lock")
    with pytest.raises(SessionError, match="h.lock is not a regular file"):
        store.open(IDENT, "h", layout_of(cache))
    os.unlink(d / "h.lock")
    with store.open(IDENT, "h", layout_of(cache)) as sess:
        assert sess.load(make_cache()).turns == turns


def test_a_hard_linked_kv_file_is_refused(colichat_home, tmp_path):
    cache = make_cache()
    store = Store()
    with store.create(IDENT, layout_of(cache), name="h") as sess:
        sess.append(cache, build(cache, 2))
    kv = store.model_dir(IDENT) / "h.coli_kv"
    os.link(kv, tmp_path / "backup.coli_kv")
    before = kv.read_bytes()
    with pytest.raises(SessionError, match=r"has 2 hard links; .*: cp '.*h.coli_kv' '.*h.coli_kv.copy' && mv"):
        store.open(IDENT, "h", layout_of(cache))
    assert kv.read_bytes() == before


@pytest.mark.parametrize("how", ["removed", "replaced", "hard-linked", "lock removed", "directory removed"])
def test_files_removed_or_replaced_while_open_are_written_again(colichat_home, tmp_path, how):
    """Another program removes or replaces the open session's KV file (or its whole directory): the
    next save notices (the inode or the link count) and writes the whole session again from the
    cache, saying so."""
    cache = make_cache()
    turns = build(cache, 4)
    store = Store()
    sess = store.create(IDENT, layout_of(cache), name="r")
    sess.append(cache, turns[:2])
    kv = sess.kv_path
    if how == "removed":
        os.unlink(kv)
        os.unlink(sess.json_path)
    elif how == "replaced":
        with open(kv + ".other", "wb") as f:
            f.write(b"someone else's file")
        os.replace(kv + ".other", kv)
    elif how == "hard-linked":
        os.link(kv, tmp_path / "other-name")
    elif how == "directory removed":
        shutil.rmtree(store.root)  # every model's sessions
    else:
        os.unlink(os.path.join(sess.directory, "r.lock"))
    sess.append(cache, turns[:3])
    if how == "lock removed":
        assert sess.notes == []
        with pytest.raises(SessionError, match="open in another colichat"):  # the new lock file is held
            store.open(IDENT, "r", layout_of(cache))
    else:
        word = {"removed": "removed", "replaced": "replaced", "hard-linked": "given another name (a hard link)",
                "directory removed": "removed with its directory"}[how]
        assert sess.notes == [f"the KV file of session r was {word} by another program: wrote the session "
                              f"again from memory ({turns[1].last} tokens)"]
    sess.truncate(2)  # a rewind after the rewrite works on the new file
    sess.append(cache, turns)
    sess.close()
    with store.open(IDENT, "r", layout_of(cache)) as again:
        res = again.load(loaded := make_cache())
    assert res.turns == turns and res.warnings == []
    assert loaded.raw(0, res.tokens).tobytes() == cache.raw(0, res.tokens).tobytes()
    if how == "hard-linked":  # the other name kept the two turns it had
        assert os.path.getsize(tmp_path / "other-name") == 40 + turns[1].last * cache.record_bytes


def test_a_sidecar_whose_kv_file_was_deleted_is_a_conversation_whose_text_is_read_again(colichat_home):
    """The KV file is the large one: deleting it to free its space leaves a conversation listed as
    any other (from its sidecar), which opening returns to be read again from its text (no turn kept,
    every exchange in `unread`); the next save writes a new KV file, then the sidecar."""
    cache = make_cache()
    store = Store()
    turns = build(cache, 4)
    with store.create(IDENT, layout_of(cache), name="z") as sess:
        sess.append(cache, turns)
    d = store.model_dir(IDENT)
    os.unlink(d / "z.coli_kv")
    [info] = store.list(IDENT)
    assert info.damage is None and (info.turns, info.tokens) == (4, turns[-1].last)
    assert store.latest(IDENT).name == "z"
    with pytest.raises(SessionError, match="already exists"):
        store.claim(IDENT, "z", layout_of(cache))
    with store.open(IDENT, "z", layout_of(cache)) as sess:
        res = sess.load(make_cache())
        assert res.turns == [] and res.unread == turns and res.tokens == 0
        assert res.warnings == [] and res.kv_gone == "is not there"  # nothing lost: nothing to warn of
        assert sorted(os.listdir(d)) == ["z.json", "z.lock"]  # opening wrote nothing
        sess.append(cache, turns)  # (the chat program read them again into the cache)
    with store.open(IDENT, "z", layout_of(cache)) as sess:
        res = sess.load(make_cache())
    assert res.turns == turns and res.warnings == [] and res.unread == []
    store.delete(IDENT, "z")
    assert sorted(os.listdir(d)) == [] and store.list(IDENT) == []  # its lock file too


def test_an_empty_kv_file_is_read_again_from_its_sidecar_and_replaced_by_the_next_save(colichat_home):
    """An empty KV file (a disk that lost its data, a hand's `: > FILE`) beside an intact sidecar: a
    conversation as when the file was deleted, its text read again; the next save writes a new KV
    file in place of the empty one. Without the sidecar nothing can be read: damaged, /delete."""
    cache = make_cache()
    store = Store()
    turns = build(cache, 4)
    with store.create(IDENT, layout_of(cache), name="z") as sess:
        sess.append(cache, turns)
    d = store.model_dir(IDENT)
    os.truncate(d / "z.coli_kv", 0)
    [info] = store.list(IDENT)
    assert info.damage is None and info.turns == 4 and store.latest(IDENT).name == "z"
    with pytest.raises(SessionError, match="already exists"):
        store.claim(IDENT, "z", layout_of(cache))
    with store.open(IDENT, "z", layout_of(cache)) as sess:
        res = sess.load(make_cache())
        assert res.turns == [] and res.unread == turns
        assert res.warnings == ["the KV file z.coli_kv is damaged (empty KV file): none of the 4 turns listed "
                                "has its records"]
        assert os.path.getsize(d / "z.coli_kv") == 0  # opening wrote nothing
        sess.append(cache, turns)  # (the chat program read them again into the cache)
    with store.open(IDENT, "z", layout_of(cache)) as sess:
        res = sess.load(make_cache())
    assert res.turns == turns and res.warnings == [] and res.unread == []
    os.truncate(d / "z.coli_kv", 0)
    os.unlink(d / "z.json")
    line = "z: damaged (empty KV file); /delete z removes it"
    [info] = store.list(IDENT)
    assert info.describe() == line and store.latest(IDENT) is None
    for attempt in (lambda: store.open(IDENT, "z", layout_of(cache)),
                    lambda: store.claim(IDENT, "z", layout_of(cache)),
                    lambda: store.create(IDENT, layout_of(cache), name="z")):
        with pytest.raises(SessionError) as e:
            attempt()
        assert str(e.value) == "session " + line
    store.delete(IDENT, "z")
    assert sorted(os.listdir(d)) == [] and store.list(IDENT) == []  # its lock file too
    store.create(IDENT, layout_of(cache), name="z").close()


def test_paths_follow_colichat_home(colichat_home, monkeypatch):
    from pathlib import Path

    from colichat.persist import paths

    p = paths()
    h = colichat_home
    assert (p.data, p.state, p.cache) == (h / "data", h / "state", h / "cache")
    monkeypatch.delenv("COLICHAT_HOME")
    import platformdirs

    p = paths()
    assert p.data == Path(platformdirs.user_data_dir("colichat"))
    assert p.state == Path(platformdirs.user_state_dir("colichat"))
    assert p.cache == Path(platformdirs.user_cache_dir("colichat"))


def test_lock_files_go_with_their_conversation(colichat_home):
    """/delete, /rename (the old name), a conversation never saved and one emptied leave no NAME.lock; a
    lock taken on a lock file removed meanwhile is taken again on the file at that name, so that the
    name's next writers exclude each other."""
    from colichat.persist.locks import release_lock, remove_lock, take_lock

    cache = make_cache()
    store = Store()
    turns = build(cache, 2)
    d = store.model_dir(IDENT)
    with store.create(IDENT, layout_of(cache), name="a") as sess:
        sess.append(cache, turns)
        store.rename(sess, "b")
        assert sorted(os.listdir(d)) == ["b.coli_kv", "b.json", "b.lock"]
    assert sorted(os.listdir(d)) == ["b.coli_kv", "b.json", "b.lock"]  # (kept beside its conversation)
    store.delete(IDENT, "b")
    store.claim(IDENT, "never", layout_of(cache)).close()
    with store.create(IDENT, layout_of(cache), name="emptied") as sess:
        sess.append(cache, turns)
        sess.truncate(0)
    assert os.listdir(d) == []
    path = str(d / "x.lock")
    early = take_lock(path, "x")  # a colichat that opened the file and locked it ...
    release_lock(early)
    held = take_lock(path, "x")
    late = os.open(path, os.O_RDWR)  # ... and one that opens it now, to lock it once it is free
    remove_lock(held, path)
    assert not os.path.exists(path)  # what `late` would lock guards no name: take_lock takes it again
    again = take_lock(path, "x")  # a new file: not the one `late` holds open
    assert os.fstat(again).st_ino != os.fstat(late).st_ino
    os.close(late)
    with pytest.raises(SessionError, match="open in another colichat"):
        take_lock(path, "x")
    release_lock(again)


def test_the_session_folder_is_named_as_the_screen_names_the_model_and_an_older_one_is_still_found(colichat_home):
    """The folder is named after the model as the banner names it (a long general.name such as SmolLM2's
    'Smollm2 135M 8k Lc100K Mix1 Ep2' gives way to the file's name), and the folder an older colichat
    named from general.name alone is still this model's: found by its weights' suffix, not orphaned."""
    from colichat.models.default import model_title
    from colichat.persist.identity import model_dirname

    ident = {**IDENT, "name": "Smollm2 135M 8k Lc100K Mix1 Ep2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    assert model_title(ident["name"], ident["file"]) == "SmolLM2-135M-Instruct.Q4_1"
    assert model_dirname(ident) == "SmolLM2-135M-Instruct.Q4_1-0123456789ab"
    assert model_dirname({**ident, "name": "DeepSeek-V2-Lite-Chat"}) == "DeepSeek-V2-Lite-Chat-0123456789ab"
    cache = make_cache()
    store = Store()
    old = store.root / "Smollm2-135M-8k-Lc100K-Mix1-Ep2-0123456789ab"  # as an older colichat named it
    old.mkdir(parents=True)
    assert store.model_dir(ident) == old
    with store.create(ident, layout_of(cache), name="kept") as sess:
        sess.append(cache, build(cache, 2))
    assert [i.name for i in store.list(ident)] == ["kept"] and (old / "kept.json").exists()
    assert not (store.root / model_dirname(ident)).exists()
