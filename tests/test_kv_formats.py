"""--kv fp8 / int4: compact KV files (COLIKV2, COLIKV3 and colichat's GQA counterparts). Each row is
rounded through its codec as it enters the cache, so memory holds exactly what the file gives back:
a conversation resumed, rewound or forked is, answer and file bytes, the one that never stopped. A
conversation keeps the format it was saved in; a file of a codec or bit width colichat does not read
is refused and left as it is."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from app_helpers import Recorder, run
from cli_helpers import GREEDY, TINY_LLAMA, chat
from conftest import TINY

from colichat.conversation.chat import Conversation, Settings
from colichat.engine import kvcodec, load
from colichat.persist import SessionError, Store
from colichat.persist.kvfile import HEADER, HEADER_SIZE

Q = ["Hello there", "And again", "Once more"]
MAGIC = {("llama", "fp8"): b"COLIGQ2\0", ("llama", "int4"): b"COLIGQ3\0", ("ds-v3", "fp8"): b"COLIKV2\0",
         ("ds-v3", "int4"): b"COLIKV3\0", ("ds-v32", "fp8"): b"COLIKV2\0", ("ds-v32", "int4"): b"COLIKV3\0"}
CASES = sorted(MAGIC)


@pytest.fixture(scope="module")
def models():
    return {}


def model_of(models, name: str):
    if name not in models:
        models[name] = load(str(TINY / f"{name}.gguf"), n_ctx=256)
    return models[name]


def conversation(model, store: Store, name: str = "c", kv: str = "f32") -> Conversation:
    model.reset()
    return Conversation(model, Settings(temperature=0, max_tokens=5, draft=0), store=store, session_name=name,
                        kv=kv)


def kv_file(store: Store, name: str):
    [p] = store.root.glob(f"*/{name}.coli_kv")
    return p


def header(data: bytes) -> tuple:
    return HEADER.unpack(data[:HEADER_SIZE])


@pytest.mark.parametrize("arch,codec", CASES)
def test_the_file_has_colibris_layout_and_the_cache_holds_what_it_gives_back(models, tmp_path, arch, codec):
    model = model_of(models, arch)
    store = Store(tmp_path / "s")
    conv = conversation(model, store, kv=codec)
    conv.ask(Q[0])
    cache, n = model.cache, model.cache.length
    data = kv_file(store, "c").read_bytes()
    magic, n_layer, a, b, fourth, nic, _vocab, nrec, mode = header(data)
    assert magic == MAGIC[arch, codec] and nrec == n
    assert mode == {"fp8": 1, "int4": 0x104}[codec]  # colibri's h[7]: KV8, or codec 1 << 8 | 4 bits
    rows = [(a, 1), (b, 1)] if cache.kind == "mla" else [(cache.row_width, a // cache.row_width)] * 2
    per_layer = sum(k * (w + 4 if codec == "fp8" else w // 2 + 4) for w, k in rows)
    record = 4 + n_layer * per_layer + 4 * nic * cache.index_hd
    if arch == "ds-v3" and codec == "fp8":  # the formula: 4 + n_layers*(kv_lora+qk_rope+8)
        assert record == 4 + n_layer * (a + b + 8)
    if cache.kind == "gqa":
        assert fourth == cache.row_width  # a compact GQA file names its row width where index_hd is
    assert len(data) == HEADER_SIZE + n * record
    recs = np.frombuffer(data[HEADER_SIZE:], np.uint8).reshape(n, record)
    assert recs[:, :4].copy().view("<i4")[:, 0].tolist() == cache.token_ids()
    off = 4
    for l in range(n_layer):
        for dest, (w, k) in zip((cache.a[l], cache.b[l]), rows, strict=True):
            size = k * kvcodec.row_bytes(w, codec)
            got = kvcodec.decode_rows(recs[:, off:off + size].reshape(n * k, -1), w, codec).reshape(n, -1)
            assert np.array_equal(got.view(np.uint32), dest[:n].view(np.uint32))  # memory = what the file gives
            if codec == "fp8":  # fp8 codes are a fixed point: encoding the rows again gives the same bytes
                again = kvcodec.encode_rows(got.reshape(n * k, w), codec).reshape(n, -1)
                assert np.array_equal(again, recs[:, off:off + size])
            off += size
    for j in range(nic):  # the indexer keys stay f32
        ic = recs[:, off:off + 4 * cache.index_hd].copy().view("<f4")
        assert np.array_equal(ic, cache.ic[j][:n])
        off += 4 * cache.index_hd
    assert off == record
    conv.close()


@pytest.mark.parametrize("arch,codec", CASES)
def test_a_resumed_compact_conversation_is_the_one_that_never_stopped(models, tmp_path, arch, codec):
    model = model_of(models, arch)
    whole = conversation(model, Store(tmp_path / "a"), kv=codec)
    for q in Q:
        answer, _ = whole.ask(q)
    whole.close()
    stopped = conversation(model, Store(tmp_path / "b"), kv=codec)
    for q in Q[:2]:
        stopped.ask(q)
    stopped.close()
    model.reset()
    model.cache.set_codec("f32")  # a new process: the cache as it loads, whatever --kv says
    again = Conversation(model, Settings(temperature=0, max_tokens=5, draft=0), store=Store(tmp_path / "b"),
                         kv=codec)
    again.resume("c")
    assert model.cache.codec == codec
    resumed, _ = again.ask(Q[2])
    again.close()
    assert resumed == answer
    assert kv_file(Store(tmp_path / "b"), "c").read_bytes() == kv_file(Store(tmp_path / "a"), "c").read_bytes()


@pytest.mark.parametrize("codec", ["fp8", "int4"])
def test_rewound_and_forked_compact_conversations_are_those_that_had_only_those_exchanges(models, tmp_path, codec):
    model = model_of(models, "ds-v3")
    only = conversation(model, Store(tmp_path / "o"), "c", kv=codec)
    for q in [Q[0], Q[2]]:
        want, _ = only.ask(q)
    only.close()
    wanted = kv_file(Store(tmp_path / "o"), "c").read_bytes()
    rew = conversation(model, Store(tmp_path / "r"), "c", kv=codec)
    for q in Q[:2]:
        rew.ask(q)
    rew.rewind(1)
    got, _ = rew.ask(Q[2])
    rew.close()
    assert got == want and kv_file(Store(tmp_path / "r"), "c").read_bytes() == wanted
    store = Store(tmp_path / "f")
    fork = conversation(model, store, "c", kv=codec)
    for q in Q[:2]:
        fork.ask(q)
    fork.fork(1)
    got, _ = fork.ask(Q[2])
    fork.close()
    assert got == want and kv_file(store, "c-fork").read_bytes()[HEADER_SIZE:] == wanted[HEADER_SIZE:]


def test_a_conversation_keeps_the_format_it_was_saved_in(models, tmp_path):
    """Saved as f32, reopened under --kv fp8: it stays f32 (and exact), saying so once; /new starts an
    fp8 one."""
    model = model_of(models, "llama")
    store = Store(tmp_path / "s")
    conv = conversation(model, store, "old")
    conv.ask(Q[0])
    conv.close()
    model.reset()
    app = Recorder(Conversation(model, Settings(temperature=0, max_tokens=5, draft=0), store=store, kv="fp8"))
    said = "\n".join(run(app, "/resume old"))
    assert "note: old is kept as f32, as it was saved; --kv fp8 is for new conversations" in said
    run(app, Q[1])
    assert header(kv_file(store, "old").read_bytes())[0] == b"COLIGQA\0"
    assert "kv             fp8" in run(app, "/show")  # new conversations'
    assert any(line.endswith("saved as f32 (COLIGQA, 2,052 bytes a token)") for line in run(app, "/stats"))
    assert run(app, "/set kv int4") == ["kv = int4 (for new conversations: this one stays f32, as it was saved)"]
    run(app, "/new")
    assert model.cache.codec == "int4"
    assert any(line.endswith("saved as int4 (COLIGQ3, 324 bytes a token)") for line in run(app, "/stats"))
    app.conv.close()


def test_a_file_of_a_codec_colichat_does_not_read_is_refused_and_left_as_it_is(models, tmp_path):
    """colibri's PolarQuant (COLIKV3 codec 0): one line, the file untouched, the conversation in use kept."""
    model = model_of(models, "ds-v3")
    store = Store(tmp_path / "s")
    conv = conversation(model, store, "polar", kv="int4")
    conv.ask(Q[0])
    conv.close()
    path = kv_file(store, "polar")
    data = bytearray(path.read_bytes())
    struct.pack_into("<i", data, 36, 4)  # h[7] = codec 0 << 8 | 4 bits
    path.write_bytes(bytes(data))
    other = conversation(model, store, "other", kv="int4")
    other.ask(Q[1])
    length = model.cache.length
    with pytest.raises(SessionError, match=r"COLIKV3 PolarQuant \(codec 0\) at 4 bits, which colichat does not read"):
        other.resume("polar")
    assert path.read_bytes() == bytes(data)
    assert model.cache.length == length and other.name == "other"
    [row] = [i for i in store.list(other.shelf.ident) if i.name == "polar"]  # the listing says why too
    assert "which colichat does not read" in row.describe()
    other.close()


def test_int4_refuses_a_model_whose_rows_are_not_a_power_of_two_wide(models):
    model = model_of(models, "ds-dense")  # kv_lora 160
    with pytest.raises(ValueError, match=r"^the int4 KV format needs rows whose width is a power of two "
                                         r"\(2 to 2048\); this model has rows of 160: use fp8 or f32$"):
        conversation(model, None, kv="int4")
    assert model.cache.codec == "f32"
    conversation(model, None, kv="fp8")  # fp8 takes any width


def test_compact_files_are_smaller_by_their_codecs_ratio(models, tmp_path):
    model = model_of(models, "ds-v3")
    sizes = {}
    for codec in ("f32", "fp8", "int4"):
        store = Store(tmp_path / codec)
        conv = conversation(model, store, kv=codec)
        conv.ask(Q[0])
        conv.close()
        sizes[codec] = (kv_file(store, "c").stat().st_size - HEADER_SIZE) // model.cache.length
    assert sizes == {"f32": 4 + 3 * (128 + 16) * 4, "fp8": 4 + 3 * (128 + 16 + 8), "int4": 4 + 3 * (64 + 8 + 8)}


@pytest.mark.process
def test_kv_from_the_command_line_a_whole_run_and_a_refusal(colichat_home):
    """--kv fp8 from the shell: the session file is COLIGQ2, and resumed in a second process it ends as
    the one process that had both messages; --kv int4 on a model whose rows it cannot take is one
    line, exit 1."""
    args = ["--model", TINY_LLAMA, *GREEDY, "--max-tokens", "4"]
    chat(colichat_home, [*args, "--kv", "fp8", "--session", "k", "-p", "Hello"]).ok()
    [path] = colichat_home.glob("**/k.coli_kv")
    assert path.read_bytes()[:8] == b"COLIGQ2\0"
    assert chat(colichat_home, [*args, "--session", "k", "--resume", "-p", "Again"]).ok().resumed()[2] == "k"
    assert path.read_bytes()[:8] == b"COLIGQ2\0"  # (no --kv: it keeps its own)
    chat(colichat_home, [*args, "--kv", "fp8", "--session", "whole"], "Hello\nAgain\n").ok()  # one process
    [whole] = colichat_home.glob("**/whole.coli_kv")
    assert whole.read_bytes() == path.read_bytes()
    r = chat(colichat_home, ["--model", str(TINY / "ds-dense.gguf"), "--kv", "int4", "-p", "Hi"]).failed()
    assert r.errors() == ["colichat: --kv int4: the int4 KV format needs rows whose width is a power of two "
                          "(2 to 2048); this model has rows of 160: use fp8 or f32"]


def test_a_reset_conversation_keeps_its_format_and_the_reopen_note_names_kv_only_when_given(models, tmp_path):
    """The third attack's N7: an fp8 conversation emptied by /reset and reopened without --kv stays fp8 (its
    next answer is saved as COLIGQ2, not in f32); reopening it without --kv says nothing of --kv, and with
    --kv f32 the note names that --kv."""
    model = model_of(models, "llama")
    store = Store(tmp_path / "s")
    conv = conversation(model, store, "e", kv="fp8")
    conv.ask(Q[0])
    conv.reset()
    conv.close()
    model.reset()
    again = Conversation(model, Settings(temperature=0, max_tokens=5, draft=0), store=store)  # no --kv
    said = again.resume("e")
    assert "--kv" not in said and "kv" not in said.split("resumed", 1)[0] and model.cache.codec == "fp8"
    again.ask(Q[1])
    again.close()
    assert header(kv_file(store, "e").read_bytes())[0] == b"COLIGQ2\0"
    model.reset()
    plain = Conversation(model, Settings(temperature=0, max_tokens=5, draft=0), store=store)
    assert "kv" not in plain.resume("e")
    plain.close()
    given = conversation(model, store, None, kv="f32")
    assert "note: e is kept as fp8, as it was saved; --kv f32 is for new conversations" in given.resume("e")
    given.close()
